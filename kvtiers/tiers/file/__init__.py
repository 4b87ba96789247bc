"""The file tier: chunk files in one namespace directory on local or shared storage
(see docs/architecture.md and docs/on-disk-format.md).

``manager`` keeps the index (rebuilt from a directory scan at start, LRU capacity,
shared-directory probes), ``mover`` copies chunks between CPU slots and files, ``io``
holds the ``posix`` and ``kvikio`` backends, ``gds_worker`` makes the tier a primary
(``gds: true``) and ``factory`` builds it from the YAML config. Importing this package
imports neither torch nor kvikio.
"""

from kvtiers.tiers.file.factory import build_tier
from kvtiers.tiers.file.io import IOBackend, KvikioBackend, PosixBackend, select_backend
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import BadChunkHandler, FileMover

__all__ = [
    "BadChunkHandler",
    "FileMover",
    "FileTierManager",
    "IOBackend",
    "KvikioBackend",
    "PosixBackend",
    "build_tier",
    "select_backend",
]
