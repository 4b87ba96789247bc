"""`JobDriver`: the one place that runs copy jobs between the primary's host memory and one
lower tier, through that tier's mover, and gives back what each job held.

A *store* copies primary memory into the tier: the tier reserves the keys
(``prepare_store``) and the primary, when the driver has one, pins their slots
(``prepare_load``). A *load* copies the tier's chunks into primary memory: the primary
reserves a slot for each key (``prepare_store``) and the tier pins the chunk
(``prepare_load``). The driver then asks both sides for their specs (``get_spec``) and
submits one mover job. The job ends when :meth:`JobDriver.poll` collects the mover's
result, or at once, as failed, when building the specs or ``Mover.submit`` raises or
``submit`` refuses the job (returns False). Then the receiving side completes the keys that
arrived (``complete_store``) and frees the others (``complete_store(..., success=False)``),
and the sending side drops its pins (``complete_load``).

Without a primary manager (vLLM's own CPU tier, a test's bytearray) the caller owns the
primary memory: it names each key's slot, and the driver holds and releases the tier's
side only. A store may name slots with a primary manager too: slots the caller holds
outside the primary's bookkeeping (a demotion's, see ``CpuTierManager.evict_held``); the
primary is then neither pinned nor released for that job. A load may read chunks the
tier no longer indexes but keeps for the caller (:meth:`JobDriver.load_evicted`, a
second-hop demotion's staging read): neither manager takes part in that job.

Invariants: every reservation and pin a job took is released exactly once, however the job
ends; ``on_finished`` is called exactly once per job, after the release; a key counts as
arrived only when the mover reported it among ``succeeded_keys``. Every method runs on the
caller's (scheduler) thread; only the mover's copies run elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Generic, TypeVar

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import OffloadingManager, ReqContext
from kvtiers.core.mover import Mover, MoverResult
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.errors import UnknownKeyError

T = TypeVar("T")


class LoadHold(Enum):
    """What :meth:`JobDriver.hold_for_load` did with a key."""

    #: Pinned in the tier (and a primary slot reserved): the next load job copies it.
    HELD = auto()
    #: The primary cannot reserve a slot now; nothing is held.
    REFUSED = auto()
    #: The tier no longer holds the chunk (evicted, or found corrupt); nothing is held.
    GONE = auto()


@dataclass(frozen=True)
class FinishedJob(Generic[T]):
    """A job that ended, after its reservations and pins were released.

    ``keys`` are the keys the job copied, in job order; ``succeeded`` and ``failed`` split
    them, in the same order, but for ``detached``: the keys of a load the caller took away
    from the primary while it ran (:meth:`JobDriver.detach`), whose bytes landed nowhere
    the primary knows of. ``result`` is the mover's (for a job that failed at submission,
    one with every key failed). ``tag`` is what the caller handed in with the job.
    """

    job_id: int
    load: bool
    keys: tuple[OffloadKey, ...]
    succeeded: tuple[OffloadKey, ...]
    failed: tuple[OffloadKey, ...]
    result: MoverResult
    tag: T
    detached: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True)
class _Job(Generic[T]):
    job_id: int
    load: bool
    keys: list[OffloadKey]
    tag: T
    #: Whether the primary manager holds the job's primary side (not the caller's slots).
    pinned: bool = True
    #: Whether the tier holds the job's tier side (not chunks it handed to the caller).
    indexed: bool = True


class JobDriver(Generic[T]):
    """Copy jobs between primary memory and ``tier`` through ``mover``; see the module
    docstring.

    ``on_finished`` is called once per job that ends. ``primary`` is the manager of the
    memory the mover copies through, or ``None`` when the caller owns that memory. ``ctx``
    is the context the driver completes jobs with (a job outlives the request that started
    it).
    """

    def __init__(
        self,
        tier: OffloadingManager,
        mover: Mover,
        on_finished: Callable[[FinishedJob[T]], None],
        *,
        primary: OffloadingManager | None = None,
        ctx: ReqContext | None = None,
    ) -> None:
        self.tier = tier
        self.mover = mover
        self.primary = primary
        self._on_finished = on_finished
        self._ctx = ctx or ReqContext(req_id="kvtiers-jobs")
        self._jobs: dict[int, _Job[T]] = {}
        # Keys held for the next load job and, when the caller owns the primary memory,
        # the slot of each.
        self._held: list[OffloadKey] = []
        self._held_slots: list[int] = []
        # Load job id → keys the caller detached from the primary while the job runs.
        self._detached: dict[int, set[OffloadKey]] = {}

    # -- state ------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Jobs submitted to the mover whose result has not been polled yet."""
        return len(self._jobs)

    @property
    def held_for_load(self) -> int:
        """Keys held by :meth:`hold_for_load` that no job copies yet."""
        return len(self._held)

    @property
    def busy(self) -> bool:
        """Whether a job is in flight or keys wait for :meth:`load_held`."""
        return bool(self._jobs or self._held)

    # -- stores: primary memory → tier ----------------------------------------------
    def store(
        self,
        job_id: int,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        tag: T,
        *,
        slots: Mapping[OffloadKey, int] | None = None,
    ) -> list[OffloadKey] | None:
        """Copy the keys the tier accepts into it, as job ``job_id``.

        ``slots`` gives the primary slot of every key: required when the driver has no
        primary manager; with one, slots the caller holds itself (the primary is left
        alone). Returns the accepted keys, in the tier's order: an empty list submits no
        job; ``None`` means the tier refused the keys and nothing is held.
        """
        if slots is None:
            self._check_slots(False, "store")
        self._check_new(job_id)
        accepted = self.tier.prepare_store(keys, ctx)
        if not accepted:
            return accepted
        if self.primary is not None and slots is None:
            try:
                self.primary.prepare_load(accepted, ctx)
            except Exception:
                self.tier.complete_store(accepted, ctx, success=False)
                raise

        def specs() -> tuple[LoadStoreSpec, LoadStoreSpec]:
            rows = None if slots is None else [slots[key] for key in accepted]
            return self._primary_spec(accepted, rows), self.tier.get_spec(accepted)

        self._submit(_Job(job_id, False, accepted, tag, pinned=slots is None), specs)
        return accepted

    # -- loads: tier → primary memory -----------------------------------------------
    def hold_for_load(
        self, key: OffloadKey, ctx: ReqContext, *, slot: int | None = None
    ) -> LoadHold:
        """Hold ``key`` for the next :meth:`load_held`: reserve its primary slot (with a
        primary manager) and pin the tier's chunk. ``slot`` is the primary slot the chunk
        lands in when the caller owns the primary memory. A key held twice is copied
        twice (into each of its slots) and pinned twice."""
        self._check_slots(slot is not None, "hold_for_load")
        if self.primary is not None and self.primary.prepare_store([key], ctx) is None:
            return LoadHold.REFUSED
        try:
            self.tier.prepare_load([key], ctx)
        except UnknownKeyError:
            # The chunk left the tier between the caller's lookup and this pin.
            if self.primary is not None:
                self.primary.complete_store([key], ctx, success=False)
            return LoadHold.GONE
        self._held.append(key)
        if slot is not None:
            self._held_slots.append(slot)
        return LoadHold.HELD

    def load_held(self, job_id: int, tag: T) -> list[OffloadKey]:
        """Copy every held key into primary memory as job ``job_id``; the keys it copies,
        in hold order (an empty list: nothing was held, no job was submitted)."""
        self._check_new(job_id)
        keys, self._held = self._held, []
        held_slots, self._held_slots = self._held_slots, []
        if not keys:
            return keys
        rows = held_slots if self.primary is None else None

        def specs() -> tuple[LoadStoreSpec, LoadStoreSpec]:
            return self.tier.get_spec(keys), self._primary_spec(keys, rows)

        self._submit(_Job(job_id, True, keys, tag), specs)
        return keys

    def load_evicted(
        self, job_id: int, keys: Sequence[OffloadKey], src: LoadStoreSpec,
        slots: Sequence[int], tag: T,
    ) -> None:
        """Copy chunks the tier evicted but keeps for the caller, addressed by ``src``
        (``HandingTier.evicted_spec``), into primary ``slots`` the caller holds (one per
        key), as job ``job_id``. Neither manager is prepared or completed for it; the job
        ends, like any other, in ``on_finished`` (at once, failed, when the mover refuses
        it)."""
        if len(slots) != len(keys):
            raise ValueError(f"load_evicted: {len(keys)} keys but {len(slots)} slots")
        self._check_new(job_id)
        rows = list(slots)
        self._submit(_Job(job_id, True, list(keys), tag, pinned=False, indexed=False),
                     lambda: (src, CPULoadStoreSpec(rows)))

    def detach(self, job_id: int, keys: Collection[OffloadKey]) -> None:
        """The caller took ``keys`` of load job ``job_id`` (in flight) away from the
        primary: their reservations are no longer the primary's (the caller holds their
        slots, e.g. ``CpuTierManager.detach_writing``), so when the job ends they are
        neither completed nor freed there, only reported in ``FinishedJob.detached``; the
        tier's pins are released as for any key. Raises ``ValueError`` for a job that is
        not a load in flight."""
        job = self._jobs.get(job_id)
        if job is None or not job.load or not job.pinned:
            raise ValueError(f"detach: job {job_id} is not a promotion in flight")
        self._detached.setdefault(job_id, set()).update(keys)

    # -- completion -------------------------------------------------------------------
    def poll(self) -> None:
        """Finish every job whose result the mover has (see the module docstring)."""
        for result in self.mover.get_finished():
            job = self._jobs.pop(result.job_id, None)
            if job is None:
                raise RuntimeError(
                    f"the mover of tier {type(self.tier).__name__} reported job "
                    f"{result.job_id}, which is not in flight; a mover reports each job once"
                )
            self._finish(job, result)

    def drain(self) -> None:
        """Block until every job in flight has finished and been polled."""
        while self._jobs:
            self.mover.drain()
            self.poll()

    # -- internals --------------------------------------------------------------------
    def _check_slots(self, given: bool, method: str) -> None:
        if given and self.primary is not None:
            raise ValueError(
                f"{method}: slots are the primary manager's to give; pass none when the "
                "driver has a primary"
            )
        if not given and self.primary is None:
            raise ValueError(
                f"{method}: without a primary manager the caller owns the primary memory "
                "and must name each key's slot"
            )

    def _check_new(self, job_id: int) -> None:
        if job_id in self._jobs:
            raise ValueError(f"job {job_id} is already in flight; give each job its own id")

    def _primary_spec(
        self, keys: list[OffloadKey], rows: Sequence[int] | None
    ) -> LoadStoreSpec:
        """The primary side of a job over ``keys``: the caller's slots ``rows`` (one per
        key) when given, else the primary manager's spec."""
        if rows is not None:
            return CPULoadStoreSpec(rows)
        assert self.primary is not None
        return self.primary.get_spec(keys)

    def _submit(
        self, job: _Job[T], specs: Callable[[], tuple[LoadStoreSpec, LoadStoreSpec]]
    ) -> None:
        """Hand ``job`` to the mover. A job whose specs or submission raise, or that the
        mover refuses, ends at once as failed; the exception, if any, then propagates."""
        self._jobs[job.job_id] = job
        accepted = False
        try:
            src, dst = specs()
            accepted = self.mover.submit(job.job_id, src, dst)
        finally:
            if not accepted:
                del self._jobs[job.job_id]
                self._finish(job, MoverResult(job.job_id, (), failed_keys=tuple(job.keys)))

    def _finish(self, job: _Job[T], result: MoverResult) -> None:
        arrived = set(result.succeeded_keys)
        gone = self._detached.pop(job.job_id, None)
        if gone:
            detached = [key for key in job.keys if key in gone]
            kept = [key for key in job.keys if key not in gone]
        else:
            detached, kept = [], job.keys
        succeeded = [key for key in kept if key in arrived]
        failed = [key for key in kept if key not in arrived]
        primary = self.primary if job.pinned else None
        tier = self.tier if job.indexed else None
        receiver, sender = (primary, tier) if job.load else (tier, primary)
        if receiver is not None:
            receiver.complete_store(succeeded, self._ctx, success=True)
            receiver.complete_store(failed, self._ctx, success=False)
        if sender is not None:
            sender.complete_load(job.keys, self._ctx)
        self._on_finished(
            FinishedJob(job.job_id, job.load, tuple(job.keys), tuple(succeeded),
                        tuple(failed), result, job.tag, tuple(detached))
        )
