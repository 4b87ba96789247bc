"""Offload keys: raw bytes of a chained block hash followed by a 4-byte group index.

Keys are bytes rather than tuples so millions of them stay cheap to hash and hold. Managers
treat them as opaque; only workers and movers decode the group to size a chunk.
"""

from __future__ import annotations

from typing import NewType

OffloadKey = NewType("OffloadKey", bytes)

GROUP_INDEX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an :data:`OffloadKey`."""
    if not 0 <= group_idx < 2**32:
        raise ValueError(f"group index must be in [0, 2**32), got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_INDEX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of a key."""
    return key[:-GROUP_INDEX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of a key."""
    return int.from_bytes(key[-GROUP_INDEX_BYTES:], "big")
