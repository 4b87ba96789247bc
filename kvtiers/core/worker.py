"""The worker contract: GPU KV blocks ⇄ the primary tier's medium.

A worker runs in the engine's worker process. Each job moves one or more groups, one
:class:`~kvtiers.core.specs.GroupTransfer` per group; the method name gives the direction.
Submission returns at once; completions are collected with :meth:`get_finished`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvtiers.core.specs import GroupTransfer


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
