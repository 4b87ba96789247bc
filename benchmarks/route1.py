"""The route-1 manager the vLLM comparisons measure: the scheduler-side manager of a
``KVTiersOffloadingSpec`` over one CPU tier, built through vLLM's own spec factory."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from functools import cache
from typing import Any

#: The CPU tier's slot in these benchmarks: one small chunk rounded up to a page.
SLOT_BYTES = 4096
#: The first vLLM release whose connector hands a job's keys back in prefix order.
ORDERED_JOB_KEYS = (0, 34, 0)


@cache
def vllm_release() -> tuple[int, int, int]:
    """The installed vLLM's ``(major, minor, patch)``; one that does not parse counts as
    the newest release kvtiers knows (its calls are the ones measured then)."""
    import vllm

    from kvtiers.integrations.vllm.version import SUPPORTED_HIGH, release

    return release(str(vllm.__version__)) or SUPPORTED_HIGH


def job_keys(keys: Sequence[Any]) -> Collection[Any]:
    """``keys`` as the installed vLLM's connector hands a finished job's keys to
    ``complete_load`` / ``complete_store``: a set up to 0.33, a tuple in prefix order
    (duplicates dropped) from 0.34. The order is what a policy sees: the manager marks
    the chunks of a completed store evictable in it."""
    if vllm_release() >= ORDERED_JOB_KEYS:
        return tuple(dict.fromkeys(keys))
    return set(keys)


def route1_manager(chunks: int, policy: str, *, blocks_per_chunk: int, label: str) -> Any:
    """The manager over ``chunks`` slots evicting by ``policy``; ``label`` starts the
    engine id (each call gets its own shared-memory region)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    stack = {"tiers": [{"kind": "cpu", "capacity": chunks * SLOT_BYTES, "policy": policy}]}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=64,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "KVTiersOffloadingSpec",
            "spec_module_path": "kvtiers.integrations.vllm",
            "kvtiers": stack,
            # Built without an engine: the identity holds what this config carries.
            "kvtiers_identity": "offloading-config-only",
        },
        engine_id=f"{label}-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return OffloadingSpecFactory.create_spec(config).get_manager()
