"""kvtiers inside vLLM 0.32, 0.33 and 0.34 (imports vLLM; load it only where vLLM is installed).

* :class:`KVTiersOffloadingSpec` — a whole kvtiers stack as vLLM's offloading spec
  (``spec_name: KVTiersOffloadingSpec``, ``spec_module_path: kvtiers.integrations.vllm``).
* :class:`KVTiersFileTier`, :class:`KVTiersS3Tier` — kvtiers' file and S3 tiers as
  secondary tiers of vLLM's ``TieringOffloadingSpec`` (``module_path:
  kvtiers.integrations.vllm``); :class:`KVTiersServiceTier` the pool of ``kvtiers serve``
  the same way (loaded at first use: it needs the ``service`` extra).
* :class:`KVTiersConnector` — vLLM's ``OffloadingConnector`` that hands the engine's
  configs to either route (``kv_connector: KVTiersConnector``,
  ``kv_connector_module_path: kvtiers.integrations.vllm``).

Loading this package checks the installed vLLM first
(:func:`~kvtiers.integrations.vllm.version.check_vllm_version`): outside the supported
releases it raises a one-line :class:`~kvtiers.errors.UnsupportedVersionError`, for both
routes, since vLLM imports this package for either. Then, when vLLM imports it while checking its
configuration, the stack's start-time checks run
(:mod:`~kvtiers.integrations.vllm.preflight`). See ``docs/vllm.md``.
"""

from kvtiers.integrations.vllm.version import check_vllm_version

check_vllm_version()

# kvtiers' records in the server's log, at vLLM's level (see kvtiers.logs): vLLM's
# processes configure their logging before they load a connector.
from kvtiers.logs import join_engine_log  # noqa: E402

join_engine_log("vllm")

# While vLLM checks its configuration (before any model loads), a stack that could not
# start fails here, in one line: see kvtiers.integrations.vllm.preflight.
from kvtiers.integrations.vllm.preflight import check_while_configuring  # noqa: E402

check_while_configuring()

# The check runs before anything imports vLLM's offloading modules.
from kvtiers.integrations.vllm.connector import KVTiersConnector  # noqa: E402
from kvtiers.integrations.vllm.direct import KVTiersDirectManager  # noqa: E402
from kvtiers.integrations.vllm.manager import KVTiersManager  # noqa: E402
from kvtiers.integrations.vllm.spec import KVTiersOffloadingSpec  # noqa: E402
from kvtiers.integrations.vllm.tiers import (  # noqa: E402
    KVTiersFileTier,
    KVTiersS3Tier,
    MemoryviewRegion,
)
from kvtiers.integrations.vllm.worker import KVTiersLoadStoreSpec, KVTiersWorker  # noqa: E402


def __getattr__(name: str) -> object:
    """``KVTiersServiceTier``, imported when vLLM's tier factory first asks for it (the
    service's wire format, msgspec, is an optional extra the other classes do not need)."""
    if name == "KVTiersServiceTier":
        from kvtiers.integrations.vllm.service_tier import KVTiersServiceTier

        return KVTiersServiceTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KVTiersConnector",
    "KVTiersDirectManager",
    "KVTiersFileTier",
    "KVTiersLoadStoreSpec",
    "KVTiersManager",
    "KVTiersOffloadingSpec",
    "KVTiersS3Tier",
    "KVTiersServiceTier",
    "KVTiersWorker",
    "MemoryviewRegion",
]
