"""Addressing of data on each medium, and the per-group transfer descriptor.

A transfer between the GPU and a tier is described per KV-cache group: one
:class:`GroupTransfer` pairs that group's GPU blocks with the offloaded side's addressing.
The alignment offset (``gpu_block_offset``) lives on the offloaded side, the side it
describes: with ``blocks_per_chunk = F``, the worker skips ``gpu_block_offset % F`` leading
sub-blocks of the first chunk. Direction is not part of the descriptor; it is the method
the caller picks (``submit_store`` / ``submit_load``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtiers.core.keys import OffloadKey


class LoadStoreSpec:
    """Base of every medium's addressing. Carries the group's GPU-block alignment offset."""

    # The default offset, a class attribute: a spec made per scheduler call sets nothing
    # until an offset is given.
    _gpu_block_offset = 0

    def set_gpu_block_offset(self, offset: int) -> LoadStoreSpec:
        """Record the logical index of this group's first GPU block; returns ``self``."""
        if offset < 0:
            raise ValueError(f"gpu_block_offset must be >= 0, got {offset}")
        self._gpu_block_offset = int(offset)
        return self

    @property
    def gpu_block_offset(self) -> int:
        """Logical index, within the request, of the group's first GPU block (default 0)."""
        return self._gpu_block_offset

    def __len__(self) -> int:
        raise NotImplementedError


class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """Addressing by integer block (or slot) ids, held as an ``np.int64`` array."""

    def __init__(self, block_ids: Iterable[int] | npt.NDArray[np.int64]) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        # A reshape makes a new view even of a flat array: on the scheduler's path per call.
        self.block_ids: npt.NDArray[np.int64] = ids if ids.ndim == 1 else ids.reshape(-1)

    def __len__(self) -> int:
        return int(self.block_ids.shape[0])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.block_ids.tolist()}, "
            f"gpu_block_offset={self.gpu_block_offset})"
        )


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """ONE group's GPU block ids, in logical order. No group sizes, no block indices."""


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU-tier slot ids, one per chunk, in key order.

    A manager makes one per scheduler call, and the worker reads it: slot ids given as
    anything but an array are copied into a list and become the ``np.int64`` array on
    first read (``block_ids`` / ``slot_ids``, by the worker), so the scheduler's thread
    builds no array per call (converting a short list costs more than the rest of a
    one-chunk load)."""

    def __init__(self, slot_ids: Iterable[int] | npt.NDArray[np.int64]) -> None:
        if isinstance(slot_ids, np.ndarray):
            super().__init__(slot_ids)
        else:
            self._listed = list(slot_ids)

    # The array once made (BlockIDsLoadStoreSpec's attribute, behind the property), and
    # the slot ids given until then.
    _array: npt.NDArray[np.int64] | None = None
    _listed: list[int] | None = None

    @property
    def block_ids(self) -> npt.NDArray[np.int64]:
        array = self._array
        if array is None:
            array = self._array = np.array(self._listed, dtype=np.int64)
            self._listed = None
        return array

    @block_ids.setter
    def block_ids(self, ids: npt.NDArray[np.int64]) -> None:
        self._array = ids
        self._listed = None

    def __len__(self) -> int:
        listed = self._listed
        return len(listed) if listed is not None else int(self.block_ids.shape[0])

    @property
    def slot_ids(self) -> npt.NDArray[np.int64]:
        return self.block_ids


class FileLoadStoreSpec(LoadStoreSpec):
    """Chunk files, one per key: ``paths[i]`` holds the chunk of ``keys[i]``."""

    def __init__(self, paths: Sequence[str], keys: Sequence[OffloadKey]) -> None:
        super().__init__()
        if len(paths) != len(keys):
            raise ValueError(f"{len(paths)} paths for {len(keys)} keys")
        self.paths: tuple[str, ...] = tuple(paths)
        self.keys: tuple[OffloadKey, ...] = tuple(keys)

    def __len__(self) -> int:
        return len(self.paths)

    def __repr__(self) -> str:
        return f"FileLoadStoreSpec({list(self.paths)}, gpu_block_offset={self.gpu_block_offset})"


class ObjectLoadStoreSpec(LoadStoreSpec):
    """Objects in a bucket (or fsspec filesystem), one per key, in key order."""

    def __init__(
        self, bucket: str, object_keys: Sequence[str], keys: Sequence[OffloadKey]
    ) -> None:
        super().__init__()
        if len(object_keys) != len(keys):
            raise ValueError(f"{len(object_keys)} object keys for {len(keys)} keys")
        self.bucket = bucket
        self.object_keys: tuple[str, ...] = tuple(object_keys)
        self.keys: tuple[OffloadKey, ...] = tuple(keys)

    def __len__(self) -> int:
        return len(self.object_keys)

    def __repr__(self) -> str:
        return (
            f"ObjectLoadStoreSpec({self.bucket!r}, {list(self.object_keys)}, "
            f"gpu_block_offset={self.gpu_block_offset})"
        )


@dataclass(frozen=True)
class GroupTransfer:
    """One KV-cache group's part of a transfer; direction-neutral.

    ``gpu_spec`` lists the group's GPU blocks in logical order; ``offload_spec`` addresses
    the chunks on the offloaded medium and carries ``gpu_block_offset``.
    """

    gpu_spec: GPULoadStoreSpec
    offload_spec: LoadStoreSpec
