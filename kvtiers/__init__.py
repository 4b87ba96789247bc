"""kvtiers: tiered KV-cache storage for LLM serving engines.

The public API is the names in ``__all__``; everything else is internal and may change
between minor releases (see the versioning note in CHANGELOG.md). Importing this package
stays light: each public name is resolved on first use (module ``__getattr__``), so
``import kvtiers`` pulls numpy, xxhash and the standard library at most; torch, boto3,
kvikio, moto and matplotlib are imported only by the modules that use them.

* Configuration: :class:`StackConfig` and the tier sections (:class:`CPUTierConfig`,
  :class:`FileTierConfig`, :class:`S3TierConfig`, :class:`FsspecTierConfig`,
  :class:`MetricsConfig`, :class:`ModelSection`), :func:`load_stack_config`, and the
  engine's cache identity, :class:`OffloadingConfig` with its parts.
* A running stack: :func:`load_stack` → :class:`Stack` (``manager``, ``make_worker``).
* Scheduler glue: :class:`OffloadScheduler` (per-request keys, prefix matching, load and
  store plans) with :class:`PrefixMatch` and :class:`TransferPlan`.
* Tensor wrappers: :class:`KVCacheTensors` and :class:`KVTensorRef`, the KV cache as a
  worker sees it.
* Errors: :class:`KVTiersError` and its subclasses.

``examples/store_restart_load.py`` in the source tree puts them together.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtiers.release import __version__

_PUBLIC: dict[str, str] = {
    # configuration
    "StackConfig": "kvtiers.config",
    "TierConfig": "kvtiers.config",
    "CPUTierConfig": "kvtiers.config",
    "FileTierConfig": "kvtiers.config",
    "S3TierConfig": "kvtiers.config",
    "FsspecTierConfig": "kvtiers.config",
    "MetricsConfig": "kvtiers.config",
    "ModelSection": "kvtiers.config",
    "GroupSection": "kvtiers.config",
    "ParallelSection": "kvtiers.config",
    "load_stack_config": "kvtiers.config",
    "parse_size": "kvtiers.config",
    "format_size": "kvtiers.config",
    "OffloadingConfig": "kvtiers.core.config",
    "OffloadingGroupConfig": "kvtiers.core.config",
    "OffloadingModelConfig": "kvtiers.core.config",
    "OffloadingCacheConfig": "kvtiers.core.config",
    "OffloadingParallelConfig": "kvtiers.core.config",
    # a running stack
    "load_stack": "kvtiers.stack.builder",
    "Stack": "kvtiers.stack.builder",
    # scheduler glue and the manager contract's values
    "OffloadScheduler": "kvtiers.engine.scheduler",
    "PrefixMatch": "kvtiers.engine.scheduler",
    "TransferPlan": "kvtiers.engine.scheduler",
    "LookupResult": "kvtiers.core.manager",
    "ReqContext": "kvtiers.core.manager",
    # tensor wrappers and the worker contract
    "KVCacheTensors": "kvtiers.core.worker",
    "KVTensorRef": "kvtiers.core.worker",
    "TransferResult": "kvtiers.core.worker",
    # errors
    "KVTiersError": "kvtiers.errors",
    "ConfigError": "kvtiers.errors",
    "NamespaceMismatchError": "kvtiers.errors",
    "CorruptChunkError": "kvtiers.errors",
}

__all__ = [
    "CPUTierConfig",
    "ConfigError",
    "CorruptChunkError",
    "FileTierConfig",
    "FsspecTierConfig",
    "GroupSection",
    "KVCacheTensors",
    "KVTensorRef",
    "KVTiersError",
    "LookupResult",
    "MetricsConfig",
    "ModelSection",
    "NamespaceMismatchError",
    "OffloadScheduler",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "ParallelSection",
    "PrefixMatch",
    "ReqContext",
    "S3TierConfig",
    "Stack",
    "StackConfig",
    "TierConfig",
    "TransferPlan",
    "TransferResult",
    "__version__",
    "format_size",
    "load_stack",
    "load_stack_config",
    "parse_size",
]

if TYPE_CHECKING:
    from kvtiers.config import (
        CPUTierConfig,
        FileTierConfig,
        FsspecTierConfig,
        GroupSection,
        MetricsConfig,
        ModelSection,
        ParallelSection,
        StackConfig,
        TierConfig,
        format_size,
        load_stack_config,
        parse_size,
    )
    from kvtiers.core.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from kvtiers.core.manager import LookupResult, ReqContext
    from kvtiers.core.worker import KVCacheTensors, KVTensorRef, TransferResult
    from kvtiers.engine.scheduler import OffloadScheduler, PrefixMatch, TransferPlan
    from kvtiers.errors import (
        ConfigError,
        CorruptChunkError,
        KVTiersError,
        NamespaceMismatchError,
    )
    from kvtiers.stack.builder import Stack, load_stack


assert set(__all__) == {"__version__", *_PUBLIC}, "__all__ lists exactly the public names"


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtiers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
