"""Chunk geometry shared by workers and movers: how many bytes a chunk of a group holds.

Within a chunk, a group's bytes are laid out tensor-major: for each of the group's layer
tensors in order, ``blocks_per_chunk`` pages of that tensor back to back. Every worker
that writes chunks (GPU ⇄ CPU, GPU ⇄ file) uses this layout so any tier can read any
chunk. A CPU slot is sized for the largest group's chunk, rounded up to 4096 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtiers.core.config import OffloadingConfig
from kvtiers.core.keys import OffloadKey, get_offload_group_idx

ALIGNMENT = 4096


def round_up(value: int, multiple: int = ALIGNMENT) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ChunkGeometry:
    """Chunk sizes per group; built from the configuration, shared by worker and movers."""

    blocks_per_chunk: int
    group_bytes_per_block: tuple[int, ...]

    @classmethod
    def from_config(cls, config: OffloadingConfig) -> ChunkGeometry:
        return cls(
            blocks_per_chunk=config.blocks_per_chunk,
            group_bytes_per_block=tuple(g.bytes_per_block for g in config.groups),
        )

    @property
    def num_groups(self) -> int:
        return len(self.group_bytes_per_block)

    def chunk_bytes(self, group_idx: int) -> int:
        """Payload bytes of one chunk of ``group_idx``."""
        return self.group_bytes_per_block[group_idx] * self.blocks_per_chunk

    def key_chunk_bytes(self, key: OffloadKey) -> int:
        """Payload bytes of the chunk ``key`` names (decodes the key's group)."""
        return self.chunk_bytes(get_offload_group_idx(key))

    @property
    def max_chunk_bytes(self) -> int:
        return max(self.chunk_bytes(g) for g in range(self.num_groups))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one CPU slot: the largest chunk rounded up to 4096."""
        return round_up(self.max_chunk_bytes)
