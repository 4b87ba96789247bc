"""kvtiers inside vLLM 0.33.0 (imports vLLM; load it only where vLLM is installed).

* :class:`KVTiersOffloadingSpec` — a whole kvtiers stack as vLLM's offloading spec
  (``spec_name: KVTiersOffloadingSpec``, ``spec_module_path: kvtiers.integrations.vllm``).
* :class:`KVTiersFileTier`, :class:`KVTiersS3Tier` — kvtiers' file and S3 tiers as
  secondary tiers of vLLM's ``TieringOffloadingSpec`` (``module_path:
  kvtiers.integrations.vllm``).

See ``docs/vllm.md``.
"""

from kvtiers.integrations.vllm.spec import (
    KVTiersLoadStoreSpec,
    KVTiersManager,
    KVTiersOffloadingSpec,
    KVTiersWorker,
)
from kvtiers.integrations.vllm.tiers import KVTiersFileTier, KVTiersS3Tier, MemoryviewRegion

__all__ = [
    "KVTiersFileTier",
    "KVTiersLoadStoreSpec",
    "KVTiersManager",
    "KVTiersOffloadingSpec",
    "KVTiersS3Tier",
    "KVTiersWorker",
    "MemoryviewRegion",
]
