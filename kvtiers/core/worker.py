"""The worker contract: GPU KV blocks ⇄ the primary tier's medium.

A worker runs in the engine's worker process. Each job moves one or more groups, one
:class:`~kvtiers.core.specs.GroupTransfer` per group; the method name gives the direction.
Submission returns at once; completions are collected with :meth:`get_finished`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtiers.core.specs import GroupTransfer

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVTensorRef:
    """One layer of a group: which engine tensor holds it, and its un-padded page bytes."""

    tensor_idx: int
    page_bytes: int


@dataclass(frozen=True)
class KVCacheTensors:
    """The engine's KV cache as a worker sees it.

    ``tensors`` are byte views of shape ``(num_blocks, padded_page_bytes)`` (uint8 or int8,
    on CPU or CUDA); ``groups[g]`` lists group ``g``'s layers in order. A group's bytes per
    block is the sum of its refs' ``page_bytes``; within a chunk its layout is tensor-major
    (see :mod:`kvtiers.core.geometry`).
    """

    tensors: Sequence[torch.Tensor]
    groups: Sequence[Sequence[KVTensorRef]]

    def group_bytes_per_block(self, group_idx: int) -> int:
        return sum(ref.page_bytes for ref in self.groups[group_idx])


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one worker job: success, bytes moved and seconds it took."""

    job_id: int
    success: bool
    transfer_bytes: int = 0
    transfer_s: float = 0.0


class OffloadingWorker(ABC):
    """Asynchronous GPU ⇄ primary copies."""

    @abstractmethod
    def submit_store(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        """Start copying GPU blocks into the primary medium. False: not accepted."""

    @abstractmethod
    def submit_load(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        """Start copying from the primary medium into GPU blocks. False: not accepted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs finished since the last call."""

    @abstractmethod
    def wait(self, job_ids: Collection[int]) -> None:
        """Block until every listed job has finished (results stay for ``get_finished``)."""

    def shutdown(self) -> None:
        """Finish or abandon outstanding work and release resources. Idempotent."""
