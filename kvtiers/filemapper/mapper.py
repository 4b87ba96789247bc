"""Where a chunk lives: key → file path under a root, or object key under a prefix.

Layout: ``<root>/<namespace>/<hh>/<hh>/<hash hex>_g<group>.kvc`` — two levels of fan-out
by the first two bytes of the block hash keep directories small. The same relative string
is the object key on object stores, under an optional prefix.

Invariants: a path is built only from the namespace name, lowercase hex and a decimal
integer, so no key can escape its namespace directory; :meth:`FileMapper.key_from_name`
inverts :meth:`FileMapper.relative_path`'s file name exactly and recognises nothing else
(temp files, the manifest, stray files map to ``None``).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvtiers.core.keys import (
    GROUP_INDEX_BYTES,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvtiers.filemapper.identity import NamespaceIdentity
from kvtiers.filemapper.manifest import MANIFEST_NAME

CHUNK_SUFFIX = ".kvc"
#: The directory inside a namespace where corrupt chunks are moved (never indexed).
QUARANTINE_DIR = "quarantine"
#: A file tier's index snapshot and its openings count, beside the manifest
#: (kvtiers/tiers/file/snapshot.py); neither is a chunk.
SNAPSHOT_NAME = "index.snapshot"
GENERATION_NAME = "index.generation"
#: The fan-out directories take the first two bytes of the block hash.
MIN_BLOCK_HASH_BYTES = 2

# Canonical names only (lowercase hex of whole bytes, group without leading zeros), so
# exactly one name maps to each key; ten digits bound the group below int's parse limit.
CHUNK_NAME = re.compile(
    r"((?:[0-9a-f]{2}){2,})_g(0|[1-9][0-9]{0,9})" + re.escape(CHUNK_SUFFIX)
)


class FileMapper:
    """Maps offload keys to chunk locations in one namespace under ``root``."""

    def __init__(self, root: str | Path, identity: NamespaceIdentity) -> None:
        self.root = Path(root)
        self.identity = identity
        self.namespace = identity.namespace
        self.namespace_dir = self.root / self.namespace
        self.manifest_path = self.namespace_dir / MANIFEST_NAME

    def relative_path(self, key: OffloadKey) -> str:
        """``<namespace>/<hh>/<hh>/<hash hex>_g<group>.kvc`` (``/``-separated)."""
        block_hash = get_offload_block_hash(key)
        if len(block_hash) < MIN_BLOCK_HASH_BYTES:
            raise ValueError(
                f"key {bytes(key).hex()} holds a {len(block_hash)}-byte block hash; "
                f"a chunk key needs at least {MIN_BLOCK_HASH_BYTES} bytes of hash "
                f"followed by the {GROUP_INDEX_BYTES}-byte group index"
            )
        h = block_hash.hex()
        group = get_offload_group_idx(key)
        return f"{self.namespace}/{h[0:2]}/{h[2:4]}/{h}_g{group}{CHUNK_SUFFIX}"

    def path(self, key: OffloadKey) -> Path:
        """The chunk file of ``key``."""
        return self.root / self.relative_path(key)

    def object_key(self, key: OffloadKey, prefix: str = "") -> str:
        """The object key of ``key``: :meth:`relative_path` under ``prefix`` (its leading
        and trailing slashes ignored)."""
        stripped = prefix.strip("/")
        relative = self.relative_path(key)
        return f"{stripped}/{relative}" if stripped else relative

    def key_from_name(self, name: str) -> OffloadKey | None:
        """The key whose chunk file is named ``name``; ``None`` for any other name."""
        return key_from_chunk_name(name)


def key_from_chunk_name(name: str) -> OffloadKey | None:
    """The key a chunk file or object base name stands for; ``None`` for any other name.

    Names carry the whole key, so this needs no identity (the offline tools use it)."""
    match = CHUNK_NAME.fullmatch(name)
    if match is None:
        return None
    group = int(match.group(2))
    if group >= 2 ** (8 * GROUP_INDEX_BYTES):
        return None
    return make_offload_key(bytes.fromhex(match.group(1)), group)
