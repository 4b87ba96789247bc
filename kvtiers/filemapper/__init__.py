"""Cache identity and persistence layout: :class:`NamespaceIdentity` and its digest, the
namespace manifest (written once, checked on every open, fail closed on any difference)
and :class:`FileMapper` (key → chunk path or object key inside the namespace), and the
one walk over a namespace directory (:func:`scan_namespace`)."""

from kvtiers.filemapper.identity import (
    SCHEMA_VERSION,
    GroupIdentity,
    NamespaceIdentity,
    ParallelIdentity,
)
from kvtiers.filemapper.manifest import (
    MANIFEST_FORMAT_VERSION,
    MANIFEST_NAME,
    check_manifest,
    manifest_bytes,
    open_namespace,
)
from kvtiers.filemapper.mapper import (
    CHUNK_SUFFIX,
    QUARANTINE_DIR,
    FileMapper,
    key_from_chunk_name,
)
from kvtiers.filemapper.scan import (
    ScannedEntry,
    remove_stale_temps,
    remove_temp,
    scan_namespace,
)

__all__ = [
    "CHUNK_SUFFIX",
    "MANIFEST_FORMAT_VERSION",
    "MANIFEST_NAME",
    "QUARANTINE_DIR",
    "SCHEMA_VERSION",
    "FileMapper",
    "GroupIdentity",
    "NamespaceIdentity",
    "ParallelIdentity",
    "ScannedEntry",
    "check_manifest",
    "key_from_chunk_name",
    "manifest_bytes",
    "open_namespace",
    "remove_stale_temps",
    "remove_temp",
    "scan_namespace",
]
