"""Core contracts of kvtiers: keys, specs, the manager / worker / mover contracts,
configuration values, chunk geometry. This package imports nothing else of kvtiers
except the leaf modules :mod:`kvtiers.errors` and :mod:`kvtiers.optional`."""

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadScope,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
    TierFilter,
    TierMatcher,
)
from kvtiers.core.mover import HostRegion, Mover, MoverResult
from kvtiers.core.specs import (
    BlockIDsLoadStoreSpec,
    CPULoadStoreSpec,
    FileLoadStoreSpec,
    GPULoadStoreSpec,
    GroupTransfer,
    LoadStoreSpec,
    ObjectLoadStoreSpec,
)
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, OffloadingWorker, TransferResult

__all__ = [
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "ChunkGeometry",
    "FileLoadStoreSpec",
    "GPULoadStoreSpec",
    "GroupTransfer",
    "HostRegion",
    "KVCacheTensors",
    "KVTensorRef",
    "LoadStoreSpec",
    "Locality",
    "LookupResult",
    "Medium",
    "Mover",
    "MoverResult",
    "ObjectLoadStoreSpec",
    "OffloadKey",
    "OffloadScope",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingEvent",
    "OffloadingGroupConfig",
    "OffloadingManager",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "OffloadingWorker",
    "ReqContext",
    "RequestOffloadingContext",
    "ScheduleEndContext",
    "TierCapabilities",
    "TierFilter",
    "TierMatcher",
    "TransferResult",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
