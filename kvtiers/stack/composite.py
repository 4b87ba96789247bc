"""`TieredManager`: the group-unaware composite of an ordered list of tiers.

The first tier is the primary: the only one the GPU worker talks to, and the staging area
every lower tier copies through. The composite implements ``OffloadingManager`` itself,
so the scheduler sees one manager.

* **Lookup** asks the primary, then each lower tier the request's ``load_tier_filter``
  allows, in order. The first lower-tier ``HIT`` starts a *promotion*: a primary slot is
  reserved and the lower tier's chunk pinned (``HIT_PENDING``); the copy is submitted to
  the lower tier's mover at the end of the step. If the primary cannot reserve a slot the
  answer is ``MISS`` (recompute rather than stall). ``RETRY`` from a lower tier propagates
  unless a later tier hits. With a cost model (``promotion:`` in the stack file) a
  lower-tier hit is promoted only when the request's plan says it pays
  (:mod:`kvtiers.stack.cost`): in the step a request first meets one the answer is
  ``HIT_PENDING`` without promoting; in later steps chunks before the cut are promoted
  and the answer past it is ``MISS``. A request waits for promotions at most its *wait
  bound* (:meth:`CostModel.wait_budget_s`: recomputing its prefix, or its deadline when
  shorter), counted from its first lookup answered ``HIT_PENDING`` for a promotion: past
  it the request *gives up* — every chunk still arriving that it looks up is *abandoned*
  (``MISS`` at once, the chunk leaves the primary, whose slot stays held until the copy
  ends and is then freed: the late bytes are discarded) and its lower-tier hits are
  ``MISS``, so the engine recomputes from the first chunk that had not landed.
* **Store** goes to the primary. On ``complete_store(success=True)`` each chunk is
  *cascaded* to every lower tier whose write policy (``BuiltTier.write``) says
  ``through`` and whose frequency admission it passes; the primary slot stays pinned
  while the mover reads it. ``after_hits`` N admits a chunk once it was referenced N
  times: loaded (``prepare_load``), or stored again after the primary lost it; a
  ``through`` tier gets it at the reference that makes the count N. A ``back`` tier below
  a handing tier is decided for then too: the handing tier keeps the mark with the chunk
  (``want_evictions``) and hands over only marked chunks; one it no longer holds is
  written down at once, from the primary.
* **Demotion** (``back`` tiers): at the end of each step the composite keeps as many
  primary slots free as the primary reserved in its busiest recent step, by evicting
  chunks through ``evict_held``: the evicted chunks' slots stay held, and readable, while
  the ``back`` tiers' movers copy them out; a slot is released once every copy of it
  ended, succeeded or failed. A chunk the primary evicts by itself (a step that needed
  more than the free room) is not written back: it is simply gone (``demotions_dropped``
  when a ``back`` tier would have taken it and does not hold it). That is the first
  hop, for ``back`` tiers whose nearest writing tier above is the primary (or a tier that
  cannot hand evictions over); below a tier that can (the file tier, a
  :class:`~kvtiers.stack.placement.HandingTier`) the *second hop* writes what that tier
  evicts: from the chunk's primary slot while the primary holds it, else read from the
  evicted file into a held primary slot and stored from there; the file is deleted once
  nothing reads it. No slot: dropped (``demotions_dropped``).
* **Promotions** land in the primary; a lower tier above the source with
  ``write.promoted`` also receives the chunk (``through``: when it lands; ``back``: when
  it is demoted). Without it a tier never receives chunks promoted from below it.
* Every tier-to-tier copy uses the tiers' own ``prepare_* / get_spec / complete_*`` and
  their movers, through one :class:`~kvtiers.tiers.jobs.JobDriver` per lower tier, which
  takes and gives back each job's reservations and pins. Mover completions are collected
  in ``on_schedule_end``.

* **The door.** Every call that names keys checks them first (``bytes`` of this cache's
  length, a group in range: :class:`~kvtiers.core.keys.KeyFormat`) and its context (a
  :class:`~kvtiers.core.manager.ReqContext`); a bad batch raises
  :class:`~kvtiers.errors.InvalidKeyError` naming the bad key before any tier sees it.
  After :meth:`TieredManager.shutdown` every such call raises
  :class:`~kvtiers.errors.ClosedError`.
* **A request's own prefix.** Keys a request's lookups found in the primary or promoted
  into it go into ``ctx.keep`` until it loads them (``prepare_load``) or finishes: the
  primary never evicts them for that request's own promotions or stores, so a prefix
  larger than the primary stops at what fits (the rest is a ``MISS``, recomputed) instead
  of evicting its own head every step.

Invariants: a promoted key is ``HIT`` in the primary only after its bytes arrived intact,
and an abandoned one never (a new store of it takes another slot); a
cascaded chunk's primary slot is never evicted or freed while a mover reads it, nor a
demoted chunk's slot reused before every copy of it ended (a failed demotion leaves
nothing in the lower tier: its reservation is freed);
``reset_cache`` drains movers before freeing primary slots, and a completion of a job from
before a reset (which releases a fenced slot, see ``OffloadingManager.reset_cache``)
cascades nothing and completes no newer reservation: the composite's ``generation`` is the
primary's, handed down with every completion. All methods run on the scheduler thread;
movers touch only memory the composite pinned or reserved for them.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvtiers.core.keys import GROUP_INDEX_BYTES, KeyFormat, OffloadKey
from kvtiers.core.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.mover import MoverResult
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.core.tier import BuiltTier, WriteRules
from kvtiers.errors import ClosedError, ConfigError
from kvtiers.stack.cost import CostModel
from kvtiers.stack.metrics_latency import LatencyHistograms
from kvtiers.stack.placement import (
    BoundedTable,
    HandingTier,
    Headroom,
    HoldingPrimary,
    handing,
    holding,
    holds,
)
from kvtiers.tiers.cpu.manager import CpuTierManager, SlotState
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold

_INTERNAL = ReqContext(req_id="kvtiers-internal")

_COUNTERS = (
    "hits",
    "misses",
    "promotions",
    "promotion_failures",
    "promotions_refused",
    "promotions_abandoned",
    "promotion_waits_abandoned",
    "promoted_bytes",
    "promote_s",
    "cascades",
    "cascade_failures",
    "cascades_refused",
    "cascaded_bytes",
    "cascade_s",
    "demotions",
    "demotion_failures",
    "demotions_refused",
    "demotions_dropped",
    "demoted_bytes",
    "demote_s",
    "corrupt_chunks",
    "torn_chunks",
)

#: How many chunks per primary slot the placement tables remember (load counts, where a
#: promoted chunk came from).
TABLE_CHUNKS_PER_SLOT = 4


# Per direction (a promotion is a load from the lower tier, a cascade a store into it): the
# composite's counters for chunks done, chunks failed, bytes and seconds, and the per-tier
# counter's name.
_PROMOTE, _CASCADE, _DEMOTE = "promote", "cascade", "demote"
_JOB_STATS = {
    _PROMOTE: ("promotions", "promotion_failures", "promoted_bytes", "promote_s", "promoted"),
    _CASCADE: ("cascades", "cascade_failures", "cascaded_bytes", "cascade_s", "cascaded"),
    _DEMOTE: ("demotions", "demotion_failures", "demoted_bytes", "demote_s", "demoted"),
}



@dataclass(frozen=True)
class _Demotion:
    """A demotion job's tag (promotions and cascades carry ``None``).

    ``slots``: the primary slot of each key, held by the composite (``None``: the chunks'
    own slots in the primary, pinned by the job driver). ``hop``: for a second hop, the
    handing tier above and the ``back`` tier below; a load job with a hop is the staging
    read of chunks that tier evicted, a store job the copy into the tier below."""

    slots: Mapping[OffloadKey, int] | None
    hop: _Hop | None = None


_Tag = _Demotion | None


@dataclass
class _Lower:
    tier: BuiltTier
    jobs: JobDriver[_Tag]
    #: Position in the stack (1 for the first lower tier).
    index: int
    #: Keys held for this tier's next promotion job, in hold order.
    holding: list[OffloadKey] = field(default_factory=list)

    @property
    def manager(self) -> OffloadingManager:
        return self.tier.manager

    @property
    def write(self) -> WriteRules:
        return self.tier.write

    @property
    def writes(self) -> bool:
        return self.tier.admission != "never"


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


@dataclass(frozen=True)
class _Hop:
    """A second hop: ``target`` (a ``back`` tier) receives what ``above``, the nearest
    writing tier above it, evicts; ``source`` is ``above``'s manager handing them over."""

    above: _Lower
    target: _Lower
    source: HandingTier


class TieredManager(OffloadingManager):
    """An ordered stack of tiers behind one ``OffloadingManager``. See the module docstring.

    ``keys`` is the format of this cache's keys (the stack builder derives it from the
    identity); without it, keys are checked to be ``bytes`` of one length, any group."""

    def __init__(self, tiers: Sequence[BuiltTier], *, keys: KeyFormat | None = None) -> None:
        if not tiers:
            raise ConfigError("a stack needs at least one tier", path="tiers")
        self.tiers = list(tiers)
        self._primary = tiers[0].manager
        self._lower: list[_Lower] = []
        for index, tier in enumerate(tiers[1:], start=1):
            if tier.mover is None:
                raise ConfigError(f"tier {tier.name!r} has no mover", path=f"tiers[{index}]")
            jobs: JobDriver[_Tag] = JobDriver(
                tier.manager, tier.mover, functools.partial(self._finished, index),
                primary=self._primary, ctx=_INTERNAL,
            )
            self._lower.append(_Lower(tier, jobs, index))
        region = tiers[0].region
        if self._lower and region is None:
            raise ConfigError(
                f"primary tier {tiers[0].name!r} has no host memory for lower tiers to copy "
                "through; put a cpu tier first",
                path="tiers[0]",
            )
        # Placement (docs/architecture.md, "Placement").
        self._through = [lo for lo in self._lower if lo.writes and lo.write.mode == "through"]
        if isinstance(self._primary, CpuTierManager) and any(
            lo.write.after_hits == 0 for lo in self._through
        ):
            # Every chunk the primary stores is copied below: what it evicts lives on there,
            # so a store that does not fit whole may evict for its head, which then reaches
            # the tiers below ("Prefixes larger than the primary" in docs/architecture.md).
            self._primary.staging = True
        back = [lo for lo in self._lower if lo.writes and lo.write.mode == "back"]
        #: ``back`` tiers written when the primary evicts (the first hop) ...
        self._back: list[_Lower] = []
        #: ... and those written when a lower tier above them evicts (the second hop).
        self._hops: list[_Hop] = []
        for lower in back:
            above = next((a for a in reversed(self._lower[: lower.index - 1]) if a.writes),
                         None)
            source = None if above is None else handing(above.manager)
            if above is None or source is None:
                self._back.append(lower)
            else:
                self._hops.append(_Hop(above, lower, source))
        self._counted = [lo for lo in self._through if lo.write.after_hits > 0]
        # Whether any tier admits by frequency: only then are references counted (a stack
        # of write-through tiers pays nothing for it on the scheduler path).
        self._counting = any(lo.write.after_hits > 0 for lo in self._lower if lo.writes)
        self._holder: HoldingPrimary | None = None
        if back:
            self._holder = holding(self._primary)
            if self._holder is None:
                raise ConfigError(
                    f"tier {back[0].tier.name!r} has write: back, which needs a primary "
                    "that can hold an evicted chunk's slot while it is copied (a cpu tier); "
                    f"{tiers[0].name!r} cannot: use write: through",
                    path=f"tiers[{back[0].index}].write",
                )
        #: Hops whose ``back`` tier admits by count: the tier above keeps the decision
        #: with the chunk (``want_evictions``) and hands over only the chunks it names.
        self._wanting = [hop for hop in self._hops if hop.target.write.after_hits > 0]
        for hop in self._hops:
            hop.source.hand_over_evictions(wanted_only=hop in self._wanting)
        table = TABLE_CHUNKS_PER_SLOT * (region.num_slots if region is not None else 1)
        holder = self._holder
        # A first-hop back tier that admits by count reads a chunk's count when the
        # primary evicts it, however long it stayed: the primary's chunks keep theirs.
        keeps = None
        if holder is not None and any(lo.write.after_hits > 0 for lo in self._back):
            def keeps(key: OffloadKey) -> bool:
                return holder.slot_state(key) is not SlotState.FREE
        #: References per key (frequency admission): loads from the primary, and stores
        #: of a key stored before.
        self._loads = BoundedTable(table, keeps)
        #: Key in the primary → position of the lower tier it was promoted from.
        self._promoted = BoundedTable(table)
        self._headroom = Headroom()
        #: Held slot → demotion copies of it not yet ended.
        self._held: dict[int, int] = {}
        #: The primary's events taken out of turn (to see which chunks a store evicted),
        #: handed out first by take_events.
        self._primary_events: list[OffloadingEvent] = []
        #: Requests (by id: an adapter may hand a new context object per call) whose
        #: ``ctx.keep`` names keys: demotions never evict those.
        self._keepers: dict[str, ReqContext] = {}
        self.medium = self._primary.medium
        self.locality = self._primary.locality
        self._job_ids = itertools.count()
        self._stats: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._keys = keys if keys is not None else KeyFormat(2**32)
        # The door's numbers, read on every lookup.
        self._group_limit = self._keys.group_limit
        self._key_bytes = self._keys.key_bytes
        # Between reset_cache and on_reset_flushed a completion that names no generation
        # may name a key whose fenced slot it releases: only keys the primary then holds
        # are cascaded, asked without counting a hit where the primary can say so.
        self._fence = False
        self._slot_states = holding(self._primary)
        # (key, lower tier) of the latest promotion a lookup started: who serves that key.
        self._promoting: tuple[OffloadKey, BuiltTier] | None = None
        #: ``get_stats()`` as taken at the end of a step, for readers on other threads (the
        #: metrics exporter): tiers' state belongs to the scheduler thread alone. Refreshed
        #: at most every ``stats_refresh_s`` seconds, and only when that is set (counting a
        #: large tier's chunks is not free, so a stack without metrics never does it).
        self.stats_snapshot: Mapping[str, float] = {}
        self.stats_refresh_s: float | None = None
        #: Promotion and cascade job latencies, counted only when metrics are exported.
        self.latency: LatencyHistograms | None = None
        self._snapshot_at = -math.inf
        #: Cost-aware promotion (``promotion:`` in the stack file): ``None`` promotes every
        #: lower-tier hit; see :mod:`kvtiers.stack.cost`.
        self.cost: CostModel | None = None
        #: The clock of promotion waits and jobs in flight, seconds (a test sets its own).
        self.clock: Callable[[], float] = time.monotonic
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

    @property
    def key_format(self) -> KeyFormat:
        """The format of the keys this stack's door accepts."""
        return self._keys

    @property
    def capabilities(self) -> TierCapabilities:  # type: ignore[override]
        primary = self._primary.capabilities
        return TierCapabilities(
            persistent=any(t.manager.capabilities.persistent for t in self.tiers),
            evicts=primary.evicts,
            recency=primary.recency,
            events=primary.events,
        )

    # -- lookup and promotion -------------------------------------------------------
    def _door(self, keys: Collection[OffloadKey], ctx: ReqContext, where: str) -> None:
        """Refuse a call before it changes anything: after shutdown, a context that is
        not a ``ReqContext``, or a key that is not one of this cache's."""
        if self._closed:
            raise ClosedError(f"{where}: this stack was shut down; build a new one")
        if type(ctx) is not ReqContext and not isinstance(ctx, ReqContext):
            raise TypeError(f"{where}: expected a ReqContext, got {type(ctx).__name__}")
        self._keys.check_all(keys, where)

    #: The door, for a caller that reaches a one-tier stack's primary itself (the vLLM
    #: adapter's one-call mode): it raises as the composite's own call would.
    door = _door

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        # The door, inlined: this is called once per chunk of every waiting request.
        limit = self._group_limit
        if (
            self._closed or type(ctx) is not ReqContext or type(key) is not bytes
            or len(key) != self._key_bytes
            or (limit is not None and key[-GROUP_INDEX_BYTES:] >= limit)
        ):
            # The slow path: raises with the reason, or learns the key length (first key)
            # or accepts a ReqContext subclass.
            self._door((key,), ctx, "lookup")
            self._key_bytes = self._keys.key_bytes
        result = self._lookup(key, ctx)
        if self.cost is not None:
            self.cost.looked_up(key, ctx, result)
        if result is LookupResult.HIT:
            self._stats["hits"] += 1
        elif result is LookupResult.MISS:
            self._stats["misses"] += 1
        return result

    def _lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        result = self._primary.lookup(key, ctx)
        if result is not LookupResult.MISS:
            if (
                result is LookupResult.HIT_PENDING and key in self._arriving
                and self.cost is not None and self._waited_out(ctx)
            ):
                self._abandon(key)
                return LookupResult.MISS
            ctx.keep.add(key)
            self._keepers[ctx.req_id] = ctx
            return result
        retry = False
        for lower in self._lower:
            manager = lower.manager
            if not ctx.load_tier_filter.allows(manager.medium, manager.locality):
                continue
            result = manager.lookup(key, ctx)
            if result is LookupResult.HIT:
                if self.cost is None:
                    return self._start_promotion(lower, key, ctx)
                wait = self._waits.get(ctx.req_id)
                if wait is not None and wait.gave_up:
                    return LookupResult.MISS
                # Promote only what arrives before recomputing it would finish.
                held = self.cost.hold(key, lower.tier.name, ctx)
                if held is not None:
                    return held
                result = self._start_promotion(lower, key, ctx)
                if result is LookupResult.HIT_PENDING and wait is None:
                    self._waits[ctx.req_id] = _Wait(self.clock())
                return result
            if result is LookupResult.HIT_PENDING:
                return result
            retry = retry or result is LookupResult.RETRY
        return LookupResult.RETRY if retry else LookupResult.MISS

    def _start_promotion(self, lower: _Lower, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        hold = lower.jobs.hold_for_load(key, ctx)
        if hold is LoadHold.REFUSED:
            self._stats["promotions_refused"] += 1
            return LookupResult.MISS
        if hold is LoadHold.HELD:
            ctx.keep.add(key)
            self._keepers[ctx.req_id] = ctx
            self._headroom.reserved(1)
            self._promoting = (key, lower.tier)
            self._arriving[key] = _Arrival(lower.index)
            lower.holding.append(key)
            return LookupResult.HIT_PENDING
        # GONE: the chunk vanished between lookup and pin (e.g. found corrupt meanwhile).
        return LookupResult.MISS

    def promotion_source(self, key: OffloadKey) -> BuiltTier | None:
        """The lower tier the latest promotion-starting lookup promotes ``key`` from, when
        that lookup was of ``key``; else ``None``. Ask right after the lookup."""
        promoting = self._promoting
        return promoting[1] if promoting is not None and promoting[0] == key else None

    def _waited_out(self, ctx: ReqContext) -> bool:
        """Whether ``ctx``'s request, looking up a chunk still arriving, has waited its
        bound (a cost model's :meth:`~kvtiers.stack.cost.CostModel.wait_budget_s`) and
        gives up; its wait starts at its first such lookup if none started before."""
        wait = self._waits.get(ctx.req_id)
        now = self.clock()
        if wait is None:
            wait = self._waits[ctx.req_id] = _Wait(now)
        if not wait.gave_up:
            assert self.cost is not None
            if now - wait.since <= self.cost.wait_budget_s(ctx):
                return False
            wait.gave_up = True
            self._stats["promotion_waits_abandoned"] += 1
        return True

    def _abandon(self, key: OffloadKey) -> None:
        """Give up ``key``'s promotion in flight: the key leaves the primary now (a new
        store of it takes another slot) and its slot stays held until the copy ends
        (:meth:`_finished` frees it). A key whose job is not submitted yet is detached when
        it is, at the end of this step. A primary that cannot hold slots keeps the key:
        it lands as usual."""
        holder = self._slot_states
        if holder is None:
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
        holder = self._slot_states
        assert holder is not None and arrival.job_id is not None
        del self._arriving[key]
        slots = holder.detach_writing([key])
        if slots:
            self._lower[arrival.index - 1].jobs.detach(arrival.job_id, slots)
            self._detached.setdefault(arrival.job_id, {}).update(slots)

    def _flush_promotions(self) -> None:
        for lower in self._lower:
            if lower.jobs.held_for_load:
                job_id = next(self._job_ids)
                for key in lower.holding:
                    arrival = self._arriving.get(key)
                    if arrival is not None and arrival.index == lower.index:
                        arrival.job_id = job_id
                lower.holding = []
                self._started[job_id] = (lower.index, self.clock())
                lower.jobs.load_held(job_id, None)
        if self._detach_later:
            later, self._detach_later = self._detach_later, []
            for key in later:
                arrival = self._arriving.get(key)
                if arrival is not None and arrival.job_id is not None:
                    self._detach(key, arrival)

    def _observe_in_flight(self) -> None:
        """Tell the cost model, per lower tier, how long its oldest promotion job in
        flight has run (0: none runs)."""
        assert self.cost is not None
        oldest: dict[int, float] = {}
        for index, since in self._started.values():
            oldest[index] = min(since, oldest.get(index, since))
        now = self.clock()
        for lower in self._lower:
            first = oldest.get(lower.index)
            self.cost.in_flight(lower.tier.name, 0.0 if first is None else now - first)

    # -- store and cascade ----------------------------------------------------------
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        self._door(keys, ctx, "prepare_store")
        if self._back:
            # The primary evicting by itself drops chunks a back tier never receives: its
            # events name them (those from before this call are set aside first).
            assert self._holder is not None
            before = self._holder.evictions
            self._primary_events.extend(self._primary.take_events())
            accepted = self._primary.prepare_store(keys, ctx)
            if self._holder.evictions != before:
                events = list(self._primary.take_events())
                self._primary_events.extend(events)
                self._count_dropped(
                    [k for e in events if e.removed and not e.metadata_only for k in e.keys]
                )
        else:
            accepted = self._primary.prepare_store(keys, ctx)
        if accepted:
            self._headroom.reserved(len(accepted))
        return accepted

    @property
    def generation(self) -> int:
        """The primary's: the only tier whose memory an engine's jobs touch."""
        return self._primary.generation

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        """Finish a primary store; on success cascade ``keys`` to admitting lower tiers.

        ``keys`` must be keys this manager's ``prepare_store`` returned (else
        :class:`~kvtiers.errors.UnknownKeyError`, before anything changed). A completion
        of an older ``generation`` (see ``OffloadingManager.complete_store``) only frees the
        primary's fenced slots and cascades nothing."""
        self._door(keys, ctx, "complete_store")
        keys = list(keys)
        stale = generation is not None and generation != self._primary.generation
        self._primary.complete_store(keys, ctx, success, generation=generation)
        if stale or not success or not keys:
            return
        if self._fence and generation is None:
            # This completion may be of a job from before the reset that released a fenced
            # slot: such a key is not stored, so it cascades nowhere.
            keys = self._stored(keys, ctx)
        loads = self._loads
        counts = []
        for key in keys:
            # Stored anew: no longer a promoted copy; and stored again after the primary
            # lost it (it was computed anew): one more reference.
            self._promoted.pop(key)
            if self._counting:
                count = loads.get(key) + 1 if key in loads else 0
                loads.set(key, count)
                counts.append(count)
        for lower in self._through:
            self._cascade(lower, keys, ctx)
        if self._wanting:
            self._want(keys, counts)

    def _admits(self, lower: _Lower, key: OffloadKey) -> bool:
        """Whether ``lower``'s write policy takes ``key`` (in the primary) now: referenced
        often enough, and not promoted from below ``lower`` unless it takes those."""
        after_hits = lower.write.after_hits
        if after_hits and self._loads.get(key) < after_hits:
            return False
        return self._takes_from_source(lower, key)

    def _takes_from_source(self, lower: _Lower, key: OffloadKey) -> bool:
        """Whether ``lower`` takes ``key`` as far as the tier it was promoted from goes."""
        write = lower.write
        source = self._promoted.get(key, 0)
        if source == lower.index:
            # Promoted from this very tier, which may have evicted it since: a demotion
            # writes it back (the tier skips a chunk it still holds); a cascade never.
            return write.mode == "back"
        return source == 0 or source < lower.index or (write.promoted and source > lower.index)

    def _cascade(self, lower: _Lower, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Write the keys ``lower`` admits from their primary slots (pinned meanwhile)."""
        admitted = [key for key in keys if self._admits(lower, key)]
        if admitted and lower.jobs.store(next(self._job_ids), admitted, ctx, None) is None:
            self._stats["cascades_refused"] += len(admitted)

    def _want(self, keys: list[OffloadKey], counts: list[int]) -> None:
        """``keys`` (in the primary, ready) were referenced ``counts`` times: those that
        reach a counting hop's threshold are wanted below. The tier above keeps that with
        the chunk and hands it over when it evicts it; a chunk it no longer holds (it
        evicted it before it was wanted, or never took it) is written down now, from the
        primary, its last copy."""
        for hop in self._wanting:
            after_hits = hop.target.write.after_hits
            due = [key for key, count in zip(keys, counts, strict=True) if count >= after_hits]
            if not due:
                continue
            target = hop.target
            down = [key for key in hop.source.want_evictions(due)
                    if self._takes_from_source(target, key) and not holds(target.manager, key)]
            if down:
                self._store_down(hop, down)

    def _store_down(self, hop: _Hop, keys: list[OffloadKey]) -> None:
        """Demote ``keys`` to ``hop``'s ``back`` tier from their own primary slots (pinned
        while the copy reads them); a refusal is counted."""
        accepted: list[OffloadKey] | None = None
        try:
            accepted = hop.target.jobs.store(next(self._job_ids), keys, _INTERNAL,
                                             _Demotion(None, hop))
        finally:
            if accepted is None:
                self._stats["demotions_refused"] += len(keys)

    def _count_dropped(self, victims: list[OffloadKey]) -> None:
        """The primary evicted ``victims`` by itself: count those a first-hop ``back``
        tier would have been written and does not hold (``demotions_dropped``)."""
        self._stats["demotions_dropped"] += sum(
            1 for key in victims
            if any(self._admits(lower, key) and not holds(lower.manager, key)
                   for lower in self._back)
        )

    # -- demotion -------------------------------------------------------------------
    def _demote(self) -> None:
        """Keep the primary's free room (see the module docstring): evict with held slots
        and copy each victim to the ``back`` tiers that admit it."""
        holder = self._holder
        target = self._headroom.end_step()
        if holder is None or not self._back:
            return
        want = target - holder.free_slots - len(self._held)
        if want <= 0:
            return
        keep = [ctx.keep for ctx in self._keepers.values()]
        victims = holder.evict_held(want, _Union(keep))
        if not victims:
            return
        held = self._held
        # This pass holds every victim's slot itself until it is done, and counts a tier's
        # copy before submitting it: a job the mover refuses ends (and gives its count
        # back) inside the submit, and must not free a slot another tier's copy reads.
        for slot in victims.values():
            held[slot] = held.get(slot, 0) + 1
        try:
            for lower in self._back:
                admitted = [key for key in victims if self._admits(lower, key)
                            and not holds(lower.manager, key)]
                if not admitted:
                    continue
                slots = {key: victims[key] for key in admitted}
                for slot in slots.values():
                    held[slot] += 1
                accepted: list[OffloadKey] | None = None
                try:
                    accepted = lower.jobs.store(next(self._job_ids), admitted, _INTERNAL,
                                                _Demotion(slots), slots=slots)
                finally:
                    if accepted is None:
                        self._stats["demotions_refused"] += len(admitted)
                    taken = set(accepted or ())
                    self._unhold([slots[key] for key in admitted if key not in taken])
        finally:
            for key in victims:
                self._promoted.pop(key)
            self._unhold(list(victims.values()))

    def _unhold(self, slots: Sequence[int]) -> None:
        """Give back one count of each of ``slots`` (a slot named twice, two); release
        the slots no copy reads any more."""
        assert self._holder is not None
        released = []
        for slot in slots:
            left = self._held[slot] - 1
            if left:
                self._held[slot] = left
            else:
                del self._held[slot]
                released.append(slot)
        if released:
            self._holder.release_held(released)

    # -- the second hop: what a handing tier evicts, to the back tier below it --------
    def _second_hop(self) -> bool:
        """Copy the chunks each handing tier evicted since the last call to the ``back``
        tier below it (docs/architecture.md, "Placement"); whether there were any."""
        took = False
        for hop in self._hops:
            evicted = hop.source.take_evicted()
            if evicted:
                took = True
                self._hand_down(hop, evicted)
        return took

    def _hand_down(self, hop: _Hop, evicted: list[OffloadKey]) -> None:
        """One hop's evicted chunks: those the tier below admits are copied from their
        primary slot when the primary holds them ready, else read from the tier above into
        a held primary slot (staged) and stored from there; with no slot to stage through,
        dropped. Every file is released once nothing reads it any more."""
        holder = self._holder
        assert holder is not None, "a stack with a back tier holds primary slots"
        target = hop.target
        # A counting tier's admission was decided when the count was reached: the tier
        # above hands over only the chunks wanted then (see _want).
        admitted = [key for key in evicted if self._takes_from_source(target, key)
                    and not holds(target.manager, key)]
        ready = [key for key in admitted if holder.slot_state(key) is SlotState.READY]
        in_primary = set(ready)
        staged = [key for key in admitted if key not in in_primary]
        reading: list[OffloadKey] = []
        try:
            if ready:
                self._store_down(hop, ready)
            if staged:
                slots = self._stage_slots(len(staged))
                self._stats["demotions_dropped"] += len(staged) - len(slots)
                staged = staged[: len(slots)]
                if slots:
                    rows = dict(zip(staged, slots, strict=True))
                    for slot in slots:
                        self._held[slot] = 1
                    try:
                        spec = hop.source.evicted_spec(staged)
                    except BaseException:
                        self._unhold(slots)
                        raise
                    # From here the read job owns these keys' files and slots: it releases
                    # them when it ends, even when it ends at once, failed.
                    reading = staged
                    hop.above.jobs.load_evicted(next(self._job_ids), staged, spec, slots,
                                                _Demotion(rows, hop))
        finally:
            being_read = set(reading)
            hop.source.release_evicted([key for key in evicted if key not in being_read])

    def _stage_slots(self, count: int) -> list[int]:
        """Up to ``count`` primary slots held for staging: free ones, and, when no tier
        takes the primary's own evictions, those of its next victims (evicted a little
        early: they would go at its next store that needs room)."""
        holder = self._holder
        assert holder is not None
        slots = holder.hold_free(count)
        short = count - len(slots)
        if short and not self._back:
            victims = holder.evict_held(short, _Union([c.keep for c in self._keepers.values()]))
            for key in victims:
                self._promoted.pop(key)
            slots.extend(victims.values())
        return slots

    def _staged(self, hop: _Hop, job: FinishedJob[_Tag], slots: Mapping[OffloadKey, int]) -> None:
        """A staging read ended: its files are released, the chunks that arrived intact
        are stored from their slots into the tier below, the others' slots released."""
        hop.source.release_evicted(job.keys)
        self._stats["demotion_failures"] += len(job.failed)
        self._unhold([slots[key] for key in job.failed])
        arrived = list(job.succeeded)
        if not arrived:
            return
        rows = {key: slots[key] for key in arrived}
        accepted: list[OffloadKey] | None = None
        try:
            accepted = hop.target.jobs.store(next(self._job_ids), arrived, _INTERNAL,
                                             _Demotion(rows, hop), slots=rows)
        finally:
            if accepted is None:
                self._stats["demotions_refused"] += len(arrived)
            taken = set(accepted or ())
            self._unhold([rows[key] for key in arrived if key not in taken])

    # -- completions ----------------------------------------------------------------
    def _poll(self) -> None:
        for lower in self._lower:
            lower.jobs.poll()

    def _finished(self, index: int, job: FinishedJob[_Tag]) -> None:
        """Count a finished promotion, cascade or demotion (the driver released what it
        held); a demotion's held slots are released, a landed promotion written into the
        tiers above its source that take promoted chunks."""
        lower = self._lower[index - 1]
        tier_name = lower.tier.name
        result = job.result
        self._stats["corrupt_chunks"] += len(result.corrupt_keys)
        tag = job.tag
        if tag is not None and job.load:
            assert tag.hop is not None and tag.slots is not None
            self._staged(tag.hop, job, tag.slots)
            return
        kind = _PROMOTE if job.load else _CASCADE if tag is None else _DEMOTE
        if kind == _PROMOTE:
            self._promotion_ended(job)
        if tag is not None and tag.slots is not None:
            # A demotion from held slots ended: release those no other copy reads.
            self._unhold([tag.slots[key] for key in job.keys])
        if job.load and job.succeeded:
            landed = list(job.succeeded)
            for key in landed:
                self._promoted.set(key, index)
            for above in self._through:
                if above.index < index and above.write.promoted:
                    self._cascade(above, landed, _INTERNAL)
        done, failures, moved, seconds, per_tier = _JOB_STATS[kind]
        self._stats[done] += len(job.succeeded)
        self._stats[failures] += len(job.failed)
        self._stats[moved] += result.transfer_bytes
        self._stats[seconds] += result.transfer_s
        self._add(f"{tier_name}.{per_tier}", len(job.succeeded), result)
        if job.load and self.cost is not None and (job.succeeded or job.detached):
            self.cost.observe_load(tier_name, result.transfer_bytes, result.transfer_s)
        if self.latency is not None and kind != _DEMOTE:
            self.latency.observe(kind, tier_name, result.transfer_s)

    def _promotion_ended(self, job: FinishedJob[_Tag]) -> None:
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
            holder = self._slot_states
            assert holder is not None
            holder.release_held(slots.values())

    def _add(self, prefix: str, chunks: int, result: MoverResult) -> None:
        """Per-lower-tier traffic: ``<tier>.promoted`` / ``<tier>.cascaded`` /
        ``<tier>.demoted`` (chunks), with ``_bytes`` and ``_s`` companions."""
        for suffix, value in (("", chunks), ("_bytes", result.transfer_bytes),
                              ("_s", result.transfer_s)):
            self._stats[prefix + suffix] = self._stats.get(prefix + suffix, 0) + value

    def wait_idle(self) -> None:
        """Submit pending promotions and block until every mover job has completed.

        For tests, the demo and shutdown: the scheduler itself never blocks."""
        # A promotion landing while a lower tier drains may cascade into a tier above
        # that was drained already (``write_promoted``), a cascade may make a handing
        # tier evict, a staging read lands and stores: go round until none is busy.
        while True:
            self._flush_promotions()
            for lower in self._lower:
                lower.jobs.drain()
            # Bounded: a landed promotion cascades, a cascade evicts, an eviction is
            # copied one tier down; nothing starts more.
            if self._second_hop():
                continue
            if not any(lower.jobs.in_flight for lower in self._lower):
                return

    # -- the rest of the contract ---------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._door(keys, ctx, "prepare_load")
        self._primary.prepare_load(keys, ctx)
        # Pinned now: the request's prefix no longer needs protecting by name.
        ctx.keep.clear()
        self._keepers.pop(ctx.req_id, None)
        if not self._counting:
            return
        keys = list(dict.fromkeys(keys))
        counts = self._loads.add(keys)
        for lower in self._counted:
            # Written at the load that reaches the tier's count (pinned now, so ready).
            due = [key for key, count in zip(keys, counts, strict=True)
                   if count == lower.write.after_hits]
            if due:
                self._cascade(lower, due, ctx)
        if self._wanting:
            self._want(keys, counts)

    def get_spec(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        if self._closed:
            raise ClosedError("get_spec: this stack was shut down; build a new one")
        return self._primary.get_spec(keys)

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._door(keys, ctx, "touch")
        for tier in self.tiers:
            tier.manager.touch(keys, ctx)

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        self._door(keys, ctx, "complete_load")
        self._primary.complete_load(keys, ctx, generation=generation)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        self._door((), ctx, "on_new_request")
        result = self._primary.on_new_request(ctx)
        for lower in self._lower:
            lower.manager.on_new_request(ctx)
        return result

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._door((), ctx, "on_request_finished")
        ctx.keep.clear()
        self._keepers.pop(ctx.req_id, None)
        if self.cost is not None:
            self.cost.forget(ctx)
            self._waits.pop(ctx.req_id, None)
        for tier in self.tiers:
            tier.manager.on_request_finished(ctx)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._primary_events = self._primary_events, []
        events.extend(self._primary.take_events())
        for lower in self._lower:
            for event in lower.manager.take_events():
                if event.ownership is None:
                    event = replace(event, ownership=lower.tier.name)
                events.append(event)
        return events

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        if self.cost is not None:
            self.cost.end_step()
        self._flush_promotions()
        self._poll()
        if self.cost is not None:
            self._observe_in_flight()
        self._demote()
        self._second_hop()
        for tier in self.tiers:
            tier.manager.on_schedule_end(ctx)
        if self.stats_refresh_s is not None:
            now = time.monotonic()
            if now - self._snapshot_at >= self.stats_refresh_s:
                self.refresh_stats_snapshot(now)

    def refresh_stats_snapshot(self, now: float | None = None) -> None:
        """Take ``stats_snapshot`` now (on the scheduler thread)."""
        self.stats_snapshot = dict(self.get_stats())
        self._snapshot_at = time.monotonic() if now is None else now

    def has_pending_work(self) -> bool:
        return any(lower.jobs.busy for lower in self._lower) or any(
            tier.manager.has_pending_work() for tier in self.tiers
        )

    def reset_cache(self) -> None:
        """Drain movers, then drop the primary's chunks; persistent tiers keep theirs.

        Keys being stored or loaded by the engine's workers are ``MISS`` at once and may be
        stored anew; their primary slots are fenced until the jobs end or
        :meth:`on_reset_flushed` (see ``OffloadingManager.reset_cache``)."""
        if self._closed:
            raise ClosedError("reset_cache: this stack was shut down; build a new one")
        self.wait_idle()
        for tier in self.tiers:
            tier.manager.reset_cache()
        if self.cost is not None:
            self.cost.reset()
        self._waits.clear()
        self._fence = True
        self._promoted.clear()

    def on_reset_flushed(self) -> None:
        """The engine's workers finished every job from before the last reset."""
        self._fence = False
        for tier in self.tiers:
            tier.manager.on_reset_flushed()

    def _stored(self, keys: list[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """The ``keys`` the primary holds ready; asked without counting a lookup when the
        primary tells a slot's state (a cpu tier)."""
        states = self._slot_states
        if states is not None:
            return [k for k in keys if states.slot_state(k) is SlotState.READY]
        return [k for k in keys if self._primary.lookup(k, ctx) is LookupResult.HIT]

    def count_torn(self, chunks: int) -> None:
        """Count ``chunks`` stored chunks an adapter found incomplete (a rank's shard
        missing or stale) and freed instead of completing them (``torn_chunks``)."""
        self._stats["torn_chunks"] += chunks

    def get_stats(self) -> Mapping[str, float]:
        stats = dict(self._stats)
        if self.cost is not None:
            stats.update(self.cost.stats)
        for tier in self.tiers:
            for name, value in tier.manager.get_stats().items():
                stats[f"{tier.name}.{name}"] = value
        if not self._lower:
            # A one-tier stack's hits are its primary's, whose lookups an adapter may call
            # directly (the vLLM adapter does).
            primary = self.tiers[0].name
            for name in ("hits", "misses"):
                stats[name] = stats.get(f"{primary}.{name}", stats[name])
        return stats

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.wait_idle()
        for tier in reversed(self.tiers):
            tier.shutdown()


class _Union(Collection[OffloadKey]):
    """Several key collections seen as one, without building it (eviction asks
    membership; iteration yields each key once)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: Sequence[Collection[OffloadKey]]) -> None:
        self._parts = parts

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self._parts)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(set().union(*self._parts))

    def __len__(self) -> int:
        """An upper bound: a key in several parts counts once per part."""
        return sum(map(len, self._parts))
