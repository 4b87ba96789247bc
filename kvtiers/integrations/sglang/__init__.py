"""kvtiers as SGLang HiCache's storage backend (imports SGLang; load it only where SGLang
0.5.23 is installed).

:class:`KVTiersHiCacheStorage` — kvtiers' file, S3 and fsspec tiers under SGLang's host
memory pool, loaded with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "kvtiers", "module_path": "kvtiers.integrations.sglang",
"class_name": "KVTiersHiCacheStorage", "interface_v1": 1, "kvtiers_config": ...}``.

Loading this package checks the installed SGLang first
(:func:`~kvtiers.integrations.sglang.version.check_sglang_version`). See ``docs/sglang.md``.
"""

from kvtiers.integrations.sglang.version import check_sglang_version

check_sglang_version()

# The check runs before anything imports SGLang's modules.
from kvtiers.integrations.sglang.storage import KVTiersHiCacheStorage  # noqa: E402

__all__ = ["KVTiersHiCacheStorage"]
