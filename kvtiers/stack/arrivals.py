"""Promotions in flight and the requests waiting for them (docs/architecture.md,
"Cost-aware promotion").

Owns: which key arrives in the primary by which lower tier's job, since when each
promotion job runs (the cost model floors a tier's estimate by its oldest job in flight),
how long each request has waited for promotions, and giving up past its bound: with a
cost model a request waits at most its *wait bound*
(:meth:`~kvtiers.stack.cost.CostModel.wait_budget_s`), counted from its first lookup
answered ``HIT_PENDING`` for a promotion; past it the request gives up and every chunk
still arriving that it looks up is *abandoned*: the key leaves the primary at once
(``MISS``; a new store of it takes another slot) through the primary's
``detach_writing`` (:class:`~kvtiers.core.primary.HoldingPrimary`), its slot held until
the copy ends and then freed, the late bytes discarded. A primary that cannot hold slots
keeps the key: it lands as usual. All on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import ReqContext
from kvtiers.core.primary import HoldingPrimary
from kvtiers.stack.cost import CostModel
from kvtiers.stack.lower import JobTag, Lower
from kvtiers.tiers.jobs import FinishedJob


@dataclass
class _Arrival:
    """A promotion in the primary's slot of a key: the lower tier it comes from (its
    position) and its job (``None`` until the job is submitted at the end of the step)."""

    index: int
    job_id: int | None = None


@dataclass
class _Wait:
    """A request waiting for promotions: since when (the composite's clock), and whether
    it gave up (then its promotions are ``MISS`` until it finishes)."""

    since: float
    gave_up: bool = False


class Arrivals:
    """The promotions in flight of one stack (see the module docstring).

    ``holder``: the primary, when it can hold slots (else nothing is abandoned);
    ``lowers``: the stack's lower tiers; ``clock``: the composite's; ``stats``: its
    counters."""

    def __init__(
        self,
        holder: HoldingPrimary | None,
        lowers: Sequence[Lower],
        clock: Callable[[], float],
        stats: dict[str, float],
    ) -> None:
        self._holder = holder
        self._lowers = lowers
        self._clock = clock
        self._stats = stats
        #: Key → its promotion into the primary, from hold to the job's end.
        self._arriving: dict[OffloadKey, _Arrival] = {}
        #: Promotion job id → (lower tier position, when it was submitted).
        self._started: dict[int, tuple[int, float]] = {}
        #: Requests (by id) waiting for promotions, with a cost model.
        self._waits: dict[str, _Wait] = {}
        #: Promotion job id → the primary slots of the keys abandoned from it, held until
        #: the job ends.
        self._detached: dict[int, dict[OffloadKey, int]] = {}
        #: Keys abandoned before their job was submitted: detached once it is.
        self._detach_later: list[OffloadKey] = []

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is arriving in the primary."""
        return key in self._arriving

    def held(self, key: OffloadKey, lower: Lower) -> None:
        """A promotion of ``key`` from ``lower`` was held (its job not submitted yet)."""
        self._arriving[key] = _Arrival(lower.index)

    def submitted(self, lower: Lower, job_id: int) -> None:
        """``lower``'s held promotions went out as job ``job_id``."""
        for key in lower.holding:
            arrival = self._arriving.get(key)
            if arrival is not None and arrival.index == lower.index:
                arrival.job_id = job_id
        self._started[job_id] = (lower.index, self._clock())

    def detach_abandoned(self) -> None:
        """Detach the keys abandoned before their jobs went out (they are out now)."""
        if self._detach_later:
            later, self._detach_later = self._detach_later, []
            for key in later:
                arrival = self._arriving.get(key)
                if arrival is not None and arrival.job_id is not None:
                    self._detach(key, arrival)

    # -- waits ----------------------------------------------------------------------
    def gave_up(self, ctx: ReqContext) -> bool:
        """Whether ``ctx``'s request gave up waiting."""
        wait = self._waits.get(ctx.req_id)
        return wait is not None and wait.gave_up

    def start_wait(self, ctx: ReqContext) -> None:
        """``ctx``'s request met a promotion it waits for: its wait starts now, unless it
        started before."""
        if ctx.req_id not in self._waits:
            self._waits[ctx.req_id] = _Wait(self._clock())

    def waited_out(self, ctx: ReqContext, cost: CostModel) -> bool:
        """Whether ``ctx``'s request, looking up a chunk still arriving, has waited its
        bound and gives up; its wait starts at its first such lookup if none started
        before."""
        wait = self._waits.get(ctx.req_id)
        now = self._clock()
        if wait is None:
            wait = self._waits[ctx.req_id] = _Wait(now)
        if not wait.gave_up:
            if now - wait.since <= cost.wait_budget_s(ctx):
                return False
            wait.gave_up = True
            self._stats["promotion_waits_abandoned"] += 1
        return True

    def forget(self, ctx: ReqContext) -> None:
        """``ctx``'s request finished."""
        self._waits.pop(ctx.req_id, None)

    def reset(self) -> None:
        """The stack was reset: no request waits any more."""
        self._waits.clear()

    # -- abandonment ----------------------------------------------------------------
    def abandon(self, key: OffloadKey) -> None:
        """Give up ``key``'s promotion in flight (see the module docstring); a key whose
        job is not submitted yet is detached when it is, at the end of this step."""
        if self._holder is None:
            return
        arrival = self._arriving[key]
        self._stats["promotions_abandoned"] += 1
        if arrival.job_id is None:
            self._detach_later.append(key)
            return
        self._detach(key, arrival)

    def _detach(self, key: OffloadKey, arrival: _Arrival) -> None:
        """Take ``key`` (arriving by ``arrival``'s submitted job) out of the primary and
        hold its slot until the job ends."""
        holder = self._holder
        assert holder is not None and arrival.job_id is not None
        del self._arriving[key]
        slots = holder.detach_writing([key])
        if slots:
            self._lowers[arrival.index - 1].jobs.detach(arrival.job_id, slots)
            self._detached.setdefault(arrival.job_id, {}).update(slots)

    def ended(self, job: FinishedJob[JobTag]) -> None:
        """A promotion job ended: its keys no longer arrive, and the slots of those
        abandoned in flight are freed (their late bytes discarded)."""
        self._started.pop(job.job_id, None)
        arriving = self._arriving
        for key in job.keys:
            arrival = arriving.get(key)
            if arrival is not None and arrival.job_id == job.job_id:
                del arriving[key]
        slots = self._detached.pop(job.job_id, None)
        if slots:
            assert self._holder is not None
            self._holder.release_held(slots.values())

    def observe(self, cost: CostModel) -> None:
        """Tell the cost model, per lower tier, how long its oldest promotion job in
        flight has run (0: none runs)."""
        oldest: dict[int, float] = {}
        for index, since in self._started.values():
            oldest[index] = min(since, oldest.get(index, since))
        now = self._clock()
        for lower in self._lowers:
            first = oldest.get(lower.index)
            cost.in_flight(lower.tier.name, 0.0 if first is None else now - first)
