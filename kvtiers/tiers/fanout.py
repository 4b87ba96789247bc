"""What every mover that fans a job out into one task per chunk shares: the jobs in flight,
each job's remaining count, the per-chunk outcomes assembled into one
:class:`~kvtiers.core.mover.MoverResult`, ``get_finished``, ``drain`` and ``shutdown``.

A subclass turns a job's specs into chunk copies when it is submitted
(:meth:`FanOutMover._plan`: bad specs raise in the caller, before anything starts), starts
each copy on its pool (:meth:`FanOutMover._start_task` for a load's,
:meth:`FanOutMover._start_store_task` for a store's: a mover with a background pool for
write-behind gives stores their own, see :mod:`kvtiers.tiers.iopool`) and copies one chunk
there (:meth:`FanOutMover._copy`, returning the bytes moved). A copy that raises
:class:`~kvtiers.errors.CorruptChunkError` fails its key as corrupt
(:meth:`FanOutMover._chunk_corrupt` deals with the stored chunk); any other exception fails
its key only (:meth:`FanOutMover._chunk_failed`). :meth:`FanOutMover._before_result` runs
once a job's last chunk is done, before the job counts as finished.

Invariants: a key is in ``succeeded_keys`` only when its copy returned; every other key of
the job is in ``failed_keys`` and, if its chunk was corrupt, in ``corrupt_keys`` — each in
job order, a key listed twice counted twice. Every accepted job is reported exactly once,
even when a copy or a hook raises. ``drain`` returns only once every accepted job is
reported; after ``shutdown`` begins no job is accepted, so shutdown waits for the copies
already running and nothing else, and for them at most ``shutdown_timeout_s``: copies
stuck in I/O past that are abandoned with a warning and their jobs never report
(docs/architecture.md, "Liveness").
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Generic, SupportsInt, TypeVar

from kvtiers.core.keys import OffloadKey
from kvtiers.core.mover import SHUTDOWN_TIMEOUT_S, Mover, MoverResult
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.errors import CorruptChunkError

logger = logging.getLogger(__name__)


class _Outcome(Enum):
    ARRIVED = auto()
    FAILED = auto()
    CORRUPT = auto()


@dataclass(frozen=True)
class ChunkCopy:
    """One chunk of a job: the primary ``slot``, the chunk's ``key`` and its ``address`` on
    the tier's medium (a path, an object name); ``index`` is its place in the job."""

    index: int
    slot: int
    key: OffloadKey
    address: str


@dataclass
class FanOutJob:
    """A job in flight. ``store``: primary slots → the tier's medium (else the reverse).
    Outcomes and ``moved`` change under the mover's lock only."""

    job_id: int
    store: bool
    chunks: tuple[ChunkCopy, ...]
    start: float = field(default_factory=time.perf_counter)
    moved: int = 0
    remaining: int = field(init=False)
    outcomes: list[_Outcome | None] = field(init=False)

    def __post_init__(self) -> None:
        self.remaining = len(self.chunks)
        self.outcomes = [None] * len(self.chunks)

    def revoke(self, index: int, moved: int) -> None:
        """Fail chunk ``index`` after its copy returned (its bytes did not become
        durable), taking back the ``moved`` bytes it counted. Only from
        :meth:`FanOutMover._before_result`, when no copy of the job runs any more."""
        if self.outcomes[index] is _Outcome.ARRIVED:
            self.outcomes[index] = _Outcome.FAILED
            self.moved -= moved

    def result(self) -> MoverResult:
        """The job's result, keys in job order."""
        pairs = list(zip(self.chunks, self.outcomes, strict=True))
        return MoverResult(
            self.job_id,
            tuple(c.key for c, o in pairs if o is _Outcome.ARRIVED),
            tuple(c.key for c, o in pairs if o is not _Outcome.ARRIVED),
            self.moved,
            time.perf_counter() - self.start,
            tuple(c.key for c, o in pairs if o is _Outcome.CORRUPT),
        )


def plan_chunks(
    slots: Iterable[SupportsInt], keys: Sequence[OffloadKey], addresses: Iterable[str]
) -> tuple[ChunkCopy, ...]:
    """One :class:`ChunkCopy` per key: ``slots[i]`` holds the chunk of ``keys[i]`` whose
    medium address is ``addresses[i]``. Raises ``ValueError`` when the lengths differ."""
    slot_list = [int(s) for s in slots]
    address_list = list(addresses)
    if not len(slot_list) == len(keys) == len(address_list):
        raise ValueError(
            f"a job pairs {len(slot_list)} primary slots with {len(keys)} keys and "
            f"{len(address_list)} medium addresses; give one of each per chunk"
        )
    return tuple(
        ChunkCopy(i, slot, key, address)
        for i, (slot, key, address) in enumerate(zip(slot_list, keys, address_list, strict=True))
    )


class FailureWarnings:
    """Warnings about failed copies, one episode at a time: the first failure is logged
    with its error, later ones are counted and summarised at most every ``summary_s``
    seconds, and a copy that succeeds ends the episode (with a last summary if any were
    counted). An outage that fails every chunk then writes a few lines, not one per chunk.
    Thread-safe: copies fail on pool threads."""

    def __init__(self, name: str, *, summary_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.summary_s = summary_s
        self._clock = clock
        self._lock = threading.Lock()
        self._summary_at: float | None = None
        self._unlogged = 0
        self._last = ""

    def failed(self, what: str, error: BaseException) -> None:
        """``what`` (e.g. ``storing <path>``) failed with ``error``."""
        now = self._clock()
        with self._lock:
            if self._summary_at is None:
                self._summary_at = now
                logger.warning("%s: %s failed: %s: %s (further failures are summarised "
                               "every %g s)", self.name, what, type(error).__name__, error,
                               self.summary_s)
                return
            self._unlogged += 1
            self._last = f"{what}: {type(error).__name__}: {error}"
            if now - self._summary_at >= self.summary_s:
                self._summarise(now)

    def succeeded(self) -> None:
        """A copy worked: the episode, if any, is over."""
        if self._summary_at is None:  # the usual case, without taking the lock
            return
        with self._lock:
            if self._summary_at is not None and self._unlogged:
                self._summarise(self._clock())
            self._summary_at = None

    def _summarise(self, now: float) -> None:
        logger.warning("%s: %d more copies failed in the last %.0f s; the latest: %s",
                       self.name, self._unlogged, now - (self._summary_at or now), self._last)
        self._unlogged = 0
        self._summary_at = now


_J = TypeVar("_J", bound=FanOutJob)


class FanOutMover(Mover, Generic[_J]):
    """A :class:`~kvtiers.core.mover.Mover` running one task per chunk; see the module
    docstring. ``name`` starts its log lines (e.g. ``"file tier"``); ``shutdown_timeout_s``
    bounds how long :meth:`shutdown` waits for running copies."""

    def __init__(self, name: str, shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        self.name = name
        self.shutdown_timeout_s = shutdown_timeout_s
        self.warnings = FailureWarnings(name)
        self._cond = threading.Condition()
        self._jobs: dict[int, _J] = {}
        self._done: list[MoverResult] = []
        self._closed = False

    # -- what a subclass provides ---------------------------------------------------
    @abstractmethod
    def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> _J:
        """The job copying ``src`` to ``dst``; raise ``TypeError`` / ``ValueError`` for a
        pair of specs this mover cannot copy."""

    @abstractmethod
    def _start_task(self, task: Callable[[], None]) -> None:
        """Run ``task`` (a load's copy) on the mover's pool. Raises ``RuntimeError`` once
        the pool is shut."""

    def _start_store_task(self, task: Callable[[], None]) -> None:
        """Run ``task`` (a store's copy) on the pool for write-behind. Default: the
        loads' pool (:meth:`_start_task`)."""
        self._start_task(task)

    @abstractmethod
    def _copy(self, job: _J, chunk: ChunkCopy) -> int:
        """Copy one chunk (on a pool thread); the bytes moved."""

    def _accepting(self) -> bool:
        """Whether new jobs may start (besides the mover not being shut down)."""
        return True

    def _chunk_corrupt(self, job: _J, chunk: ChunkCopy, error: CorruptChunkError) -> None:
        """The stored chunk failed verification: deal with it (quarantine, delete, tell
        the manager). Default: log it."""
        logger.warning("%s: chunk %s is corrupt: %s", self.name, chunk.address, error)

    def _chunk_failed(self, job: _J, chunk: ChunkCopy, error: Exception) -> None:
        """A copy failed for any other reason. Default: warn, aggregated per episode
        (:class:`FailureWarnings`)."""
        self.warnings.failed(f"{'storing' if job.store else 'loading'} {chunk.address}", error)

    def _before_result(self, job: _J) -> None:
        """Runs once every chunk of ``job`` is done, before its result is published; may
        :meth:`FanOutJob.revoke` chunks."""

    def _shutdown_wait_s(self) -> float:
        """How long :meth:`shutdown` waits for running copies. Default:
        ``shutdown_timeout_s``."""
        return self.shutdown_timeout_s

    def _release(self, idle: bool) -> None:
        """Release threads and clients; called once, by :meth:`shutdown`, after its wait.
        ``idle`` is False when copies were still running then: do not wait for them."""

    # -- the contract ---------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Accepted jobs not finished yet."""
        with self._cond:
            return len(self._jobs)

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        job = self._plan(job_id, src, dst)
        with self._cond:
            if self._closed or not self._accepting():
                return False
            if job_id in self._jobs:
                raise ValueError(f"{self.name}: job {job_id} is already in flight")
            self._jobs[job_id] = job
        if not job.chunks:
            self._finish(job)
            return True
        start = self._start_store_task if job.store else self._start_task
        for started, chunk in enumerate(job.chunks):
            try:
                start(functools.partial(self._run, job, chunk))
            except RuntimeError as exc:
                # The pool was shut under us (its owner is closing): the chunks that did
                # not start fail, so the job still finishes.
                logger.warning("%s: job %d: %s", self.name, job_id, exc)
                for rest in job.chunks[started:]:
                    self._record(job, rest, _Outcome.FAILED, 0)
                break
        return True

    def get_finished(self) -> list[MoverResult]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs)

    def wait_job(self, job_id: int, timeout_s: float | None = None) -> bool:
        """Block until job ``job_id`` is not in flight (finished, its result waiting for
        :meth:`get_finished` or taken already; or never accepted), at most ``timeout_s``
        seconds (``None``: as long as it takes). True once it is not in flight. Unlike
        :meth:`drain` it does not wait for other jobs: a caller that runs jobs from
        several threads waits for its own."""
        with self._cond:
            return self._cond.wait_for(lambda: job_id not in self._jobs, timeout=timeout_s)

    def shutdown(self) -> None:
        """Refuse new jobs, wait for the copies already running (at most
        :meth:`_shutdown_wait_s`), then release the pool. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            idle = self._cond.wait_for(lambda: not self._jobs, timeout=self._shutdown_wait_s())
            stuck = len(self._jobs)
        if not idle:
            logger.warning(
                "%s: %d job(s) still in I/O %g s after shutdown began; their threads are "
                "abandoned and the jobs never report", self.name, stuck, self.shutdown_timeout_s,
            )
        self._release(idle)

    # -- one chunk ------------------------------------------------------------------
    def _run(self, job: _J, chunk: ChunkCopy) -> None:
        outcome, moved = _Outcome.FAILED, 0
        try:
            moved = self._copy(job, chunk)
            outcome = _Outcome.ARRIVED
            self.warnings.succeeded()
        except CorruptChunkError as exc:
            outcome = _Outcome.CORRUPT
            self._chunk_corrupt(job, chunk, exc)
        except Exception as exc:  # a failed chunk fails its key, never the job
            self._chunk_failed(job, chunk, exc)
        finally:
            self._record(job, chunk, outcome, moved)

    def _record(self, job: _J, chunk: ChunkCopy, outcome: _Outcome, moved: int) -> None:
        with self._cond:
            job.outcomes[chunk.index] = outcome
            if outcome is _Outcome.ARRIVED:
                job.moved += moved
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _J) -> None:
        try:
            self._before_result(job)
        finally:
            result = job.result()
            with self._cond:
                del self._jobs[job.job_id]
                self._done.append(result)
                self._cond.notify_all()
