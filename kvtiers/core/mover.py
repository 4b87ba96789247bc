"""The mover contract: chunks between the primary's host memory and a lower tier's medium.

Every non-primary tier owns a mover: a bounded pool of I/O threads. One side of every job
is the primary's :class:`~kvtiers.core.specs.CPULoadStoreSpec` (slots of a
:class:`HostRegion`); the other is the tier's own addressing, whose ``keys`` say which
chunk each slot holds. Chunk sizes come from the shared
:class:`~kvtiers.core.geometry.ChunkGeometry`.

A mover never reports a chunk as succeeded unless its bytes are exactly right: a failed
or corrupt read lands in ``failed_keys``. A partly failed job keeps what arrived.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from kvtiers.core.keys import OffloadKey
from kvtiers.core.specs import LoadStoreSpec

#: How long a mover's ``shutdown`` waits for I/O in flight before abandoning it, seconds.
#: Above the object tiers' default operation deadline (30 s), so a stalled request
#: normally ends, and is reported, before shutdown gives up on it.
SHUTDOWN_TIMEOUT_S = 35.0


class HostRegion(Protocol):
    """Host memory of the primary tier, as fixed-size slots."""

    @property
    def num_slots(self) -> int: ...

    @property
    def slot_bytes(self) -> int: ...

    def view(self, slot_id: int) -> memoryview:
        """A writable, zero-copy view of one slot (``slot_bytes`` long)."""
        ...


class ChunkReporter(Protocol):
    """Where a mover reports chunks it found bad: its own tier's manager."""

    def forget(self, keys: Collection[OffloadKey], *, corrupt: bool) -> None:
        """Thread-safe: the chunks of ``keys`` are gone from the medium — ``corrupt``:
        they failed verification (quarantined or deleted); otherwise they vanished. The
        manager drops them from its index on its next scheduler-thread call."""
        ...

    def load_failed(self, key: OffloadKey, where: str, error: BaseException, *,
                    lasting: bool) -> None:
        """Thread-safe: loading ``key``'s chunk (at ``where``) failed with ``error`` —
        neither corrupt nor vanished. ``lasting``: the error says the chunk itself cannot
        be read (a directory in its place, no permission), so a retry fails the same way.
        The manager answers ``MISS`` for the key for a back-off period and forgets it after
        lasting failures (``kvtiers/tiers/backoff.py``)."""
        ...


@dataclass(frozen=True)
class MoverResult:
    """Outcome of one mover job."""

    job_id: int
    succeeded_keys: tuple[OffloadKey, ...]
    failed_keys: tuple[OffloadKey, ...] = ()
    transfer_bytes: int = 0
    transfer_s: float = 0.0
    # Keys whose stored chunk failed verification (a subset of failed_keys).
    corrupt_keys: tuple[OffloadKey, ...] = field(default=())

    @property
    def success(self) -> bool:
        return not self.failed_keys


class Mover(ABC):
    """Asynchronous tier-to-tier copies through a bounded thread pool."""

    @abstractmethod
    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        """Start copying ``src`` to ``dst`` (one of them a CPU spec). False: not accepted."""

    @abstractmethod
    def get_finished(self) -> list[MoverResult]:
        """Jobs finished since the last call."""

    @abstractmethod
    def drain(self) -> None:
        """Block until no submitted job touches primary memory; never aborts a copy."""

    def shutdown(self) -> None:
        """Drain, then release threads and clients. Idempotent.

        Bounded: an implementation that runs I/O on threads waits for it at most
        :data:`SHUTDOWN_TIMEOUT_S` (or its own configured bound), then abandons threads
        still stuck in I/O with a warning instead of blocking for ever (docs/architecture.md,
        "Liveness")."""
        self.drain()
