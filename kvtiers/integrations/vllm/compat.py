"""What differs between the vLLM releases kvtiers supports, one name per seam.

The adapter modules read these names instead of testing vLLM's version themselves, so a
new release's differences are adapted here (``make vllm-compat VLLM=<version>`` reports
which seams moved; docs/vllm.md, "Checking a new vLLM release"):

========================  =======  =======  =======================================
seam                      0.32     0.33     0.34
========================  =======  =======  =======================================
worker transfer address   GPU spec GPU spec ``DevicePointers`` (:data:`POINTERS`)
reset flushed signal      no       yes      yes (:data:`FLUSH_SIGNAL`)
``metadata_only`` events  no       yes      yes (:data:`HAS_METADATA_ONLY`)
parallel-agnostic pages   vLLM's   vLLM's   only with ``canonical_layout``
                          rule     rule     (:data:`AGNOSTIC_NEEDS_CANONICAL`)
hash lookahead tokens     never    never    with EAGLE / MTP (:func:`hash_lookahead`)
``touch()``               called   called   gone (kvtiers' ``touch`` is then unused)
events' request context   no       no       yes (:data:`EVENT_CARRIES_REQ_CONTEXT`)
deferred row release      no       no       yes (:data:`JOB_RESULT_DEFERS_RELEASE`)
========================  =======  =======  =======================================
"""

from __future__ import annotations

from typing import Any

import vllm
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.tiering.base import JobResult

from kvtiers.integrations.vllm.version import release

#: The installed release, ``(major, minor, patch)`` (the version gate has accepted it).
RELEASE = release(str(vllm.__version__)) or (0, 0, 0)

#: vLLM's ``DevicePointers`` (0.34): the connector resolves the engine's KV blocks to
#: device addresses and hands the worker those instead of a ``GPULoadStoreSpec``.
#: ``None`` on releases that hand the worker block ids.
POINTERS: type | None = getattr(vbase, "DevicePointers", None)

#: Whether vLLM tells its manager when a reset's jobs have finished (0.33 and later).
FLUSH_SIGNAL = hasattr(vbase.OffloadingManager, "on_reset_flushed")



def _has_field(cls: Any, name: str) -> bool:
    return name in getattr(cls, "__dataclass_fields__", {})


#: Whether vLLM's events carry ``metadata_only`` (0.33 and later).
HAS_METADATA_ONLY = _has_field(vbase.OffloadingEvent, "metadata_only")

#: Whether an event carries the request context of the store it announces (0.34): vLLM's
#: event tracker reads a self-describing store's tokens and block hashes from it.
EVENT_CARRIES_REQ_CONTEXT = _has_field(vbase.OffloadingEvent, "req_context")

#: Whether a secondary tier's failed promotion can defer the release of its primary rows
#: until its copies end (``JobResult.deferred_release``, 0.34).
JOB_RESULT_DEFERS_RELEASE = _has_field(JobResult, "deferred_release")

#: vLLM 0.34 reports pages parallelism-agnostic only when they are stored in its canonical
#: layout; kvtiers' route 1 refuses ``canonical_layout``, so there the parallel sizes
#: always stay in the identity.
AGNOSTIC_NEEDS_CANONICAL = RELEASE >= (0, 34, 0)


def hash_lookahead(vllm_config: Any) -> int:
    """Tokens after each block that vLLM's block hash also covers (vLLM 0.34 with an
    EAGLE-family or MTP drafter: the drafter's KV at a block's last position depends on
    them); 0 where keys hash their block's tokens only, as every earlier release does
    under a KV connector."""
    found = getattr(vllm_config, "num_hash_lookahead_tokens", 0)
    return found if isinstance(found, int) and found > 0 else 0
