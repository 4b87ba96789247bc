"""`TieredManager`: the group-unaware composite of an ordered list of tiers.

The first tier is the primary: the only one the GPU worker talks to, and the staging area
every lower tier copies through. The composite implements ``OffloadingManager`` itself,
so the scheduler sees one manager. It keeps lookup and promotion, store and cascade,
events, reset and stats; its rooms keep the rest: which chunks each lower tier is written
(:mod:`kvtiers.stack.admission`), demotions to ``write: back`` tiers
(:mod:`kvtiers.stack.demotion`), and promotions in flight with the requests waiting for
them (:mod:`kvtiers.stack.arrivals`). What it asks of the tiers beyond the manager contract
is core's (:mod:`kvtiers.core.primary`).

* **Lookup** asks the primary, then each lower tier the request's ``load_tier_filter``
  allows, in order. The first lower-tier ``HIT`` starts a *promotion*: a primary slot is
  reserved and the lower tier's chunk pinned (``HIT_PENDING``); the copy is submitted to
  the lower tier's mover at the end of the step. If the primary cannot reserve a slot the
  answer is ``MISS`` (recompute rather than stall). ``RETRY`` from a lower tier propagates
  unless a later tier hits. With a cost model (``promotion:`` in the stack file) a
  lower-tier hit is promoted only when the request's plan says it pays
  (:mod:`kvtiers.stack.cost`), and a request that waited past its bound gives up
  (:mod:`kvtiers.stack.arrivals`).
* **Store** goes to the primary. On ``complete_store(success=True)`` each chunk is
  *cascaded* to every ``through`` lower tier that admits it; the primary slot stays
  pinned while the mover reads it. A promotion that lands is cascaded into the
  ``through`` tiers above its source that take promoted chunks. **Demotion** (``back``
  tiers) happens at the end of each step.
* Every tier-to-tier copy goes through one :class:`~kvtiers.tiers.jobs.JobDriver` per
  lower tier (the tiers' own ``prepare_* / get_spec / complete_*`` and movers); mover
  completions are collected in ``on_schedule_end``.
* **The door.** Every call that names keys checks them and its context first
  (:class:`~kvtiers.core.keys.KeyFormat`, a :class:`~kvtiers.core.manager.ReqContext`): a
  bad batch raises :class:`~kvtiers.errors.InvalidKeyError` before any tier sees it; after
  :meth:`TieredManager.shutdown` every call raises :class:`~kvtiers.errors.ClosedError`.
  An adapter calling a one-tier stack's primary itself keeps the door with
  :attr:`TieredManager.key_format`.
* **A request's own prefix.** Keys a request's lookups found in the primary or promoted
  into it go into ``ctx.keep`` until it loads them (``prepare_load``) or finishes: the
  primary never evicts them for that request's own promotions or stores, so a prefix
  larger than the primary stops at what fits (the rest is a ``MISS``, recomputed) instead
  of evicting its own head every step.
* **Retention** (``retention:``, :mod:`kvtiers.policies.retention`): the keys a request
  stores or loads take the priority, pin and TTL its hint asks for; a key past its TTL
  is a ``MISS`` asked of no tier. The cpu primary's policy orders evictions by them.

Invariants: a promoted key is ``HIT`` in the primary only after its bytes arrived intact,
and an abandoned one never (a new store of it takes another slot); a cascaded chunk's
primary slot is never evicted or freed while a mover reads it, nor a demoted chunk's slot
reused before every copy of it ended (a failed demotion leaves nothing in the lower tier);
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
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

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
from kvtiers.core.primary import SlotState, holding
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ClosedError, ConfigError
from kvtiers.policies.retention import RetentionBook, RetentionHint, parse_hint
from kvtiers.stack.admission import TABLE_CHUNKS_PER_SLOT, Admission
from kvtiers.stack.arrivals import Arrivals
from kvtiers.stack.cost import CostModel
from kvtiers.stack.demotion import demotion_for
from kvtiers.stack.lower import INTERNAL, JobTag, Lower
from kvtiers.stack.metrics_latency import LatencyHistograms
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold

_COUNTERS = (
    "hits", "misses",
    "promotions", "promotion_failures", "promotions_refused", "promotions_abandoned",
    "promotion_waits_abandoned", "promoted_bytes", "promote_s",
    "cascades", "cascade_failures", "cascades_refused", "cascaded_bytes", "cascade_s",
    "demotions", "demotion_failures", "demotions_refused", "demotions_dropped",
    "demoted_bytes", "demote_s",
    "corrupt_chunks", "torn_chunks",
)

# Per direction: the counters of chunks done, chunks failed, bytes and seconds, and the
# per-tier counter's name.
_PROMOTE, _CASCADE, _DEMOTE = "promote", "cascade", "demote"
_JOB_STATS = {
    _PROMOTE: ("promotions", "promotion_failures", "promoted_bytes", "promote_s", "promoted"),
    _CASCADE: ("cascades", "cascade_failures", "cascaded_bytes", "cascade_s", "cascaded"),
    _DEMOTE: ("demotions", "demotion_failures", "demoted_bytes", "demote_s", "demoted"),
}


class TieredManager(OffloadingManager):
    """An ordered stack of tiers behind one ``OffloadingManager``. See the module docstring.

    ``keys`` is the format of this cache's keys (the stack builder derives it from the
    identity); without it, keys are checked to be ``bytes`` of one length, any group."""

    def __init__(self, tiers: Sequence[BuiltTier], *, keys: KeyFormat | None = None) -> None:
        if not tiers:
            raise ConfigError("a stack needs at least one tier", path="tiers")
        self.tiers = list(tiers)
        self._primary = tiers[0].manager
        self._lower: list[Lower] = []
        for index, tier in enumerate(tiers[1:], start=1):
            if tier.mover is None:
                raise ConfigError(f"tier {tier.name!r} has no mover", path=f"tiers[{index}]")
            jobs: JobDriver[JobTag] = JobDriver(
                tier.manager, tier.mover, functools.partial(self._finished, index),
                primary=self._primary, ctx=INTERNAL,
            )
            self._lower.append(Lower(tier, jobs, index))
        region = tiers[0].region
        if self._lower and region is None:
            raise ConfigError(
                f"primary tier {tiers[0].name!r} has no host memory for lower tiers to copy "
                "through; put a cpu tier first",
                path="tiers[0]",
            )
        self._stats: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._job_ids = itertools.count()
        #: Requests (by id: an adapter may hand a new context object per call) whose
        #: ``ctx.keep`` names keys: demotions never evict those.
        self._keepers: dict[str, ReqContext] = {}
        # Placement (docs/architecture.md, "Placement"): admission, then demotion.
        self._holder = holder = holding(self._primary)
        table = TABLE_CHUNKS_PER_SLOT * (region.num_slots if region is not None else 1)
        self._admission = Admission(self._lower, table)
        self._demotion = demotion_for(
            self._admission, self._lower, holder, tiers[0].name, stats=self._stats,
            job_ids=self._job_ids, keepers=self._keepers,
        )
        #: The primary's events taken out of turn (to see which chunks a store evicted),
        #: handed out first by take_events.
        self._primary_events: list[OffloadingEvent] = []
        self.medium = self._primary.medium
        self.locality = self._primary.locality
        self._closed = False
        self._keys = keys if keys is not None else KeyFormat(2**32)
        # The door's numbers, read on every lookup.
        self._group_limit = self._keys.group_limit
        self._key_bytes = self._keys.key_bytes
        # Between reset_cache and on_reset_flushed a completion that names no generation
        # may name a key whose fenced slot it releases: only keys the primary then holds
        # are cascaded, asked without counting a hit where the primary can say so.
        self._fence = False
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
        #: Retention (``retention:`` in the stack file): the hints and pins the primary's
        #: policy honours; ``None`` without one. See :mod:`kvtiers.policies.retention`.
        self.retention: RetentionBook | None = None
        #: Whether requests' ``kv_hints`` are read (``retention.hints``).
        self.retention_hints = True
        #: The scope of a request's pins (its tenant, set by a ``tenants:`` section's
        #: :class:`~kvtiers.stack.tenants.TenantStack`); ``None``: every pin is the
        #: stack's, under the one cap.
        self.retention_scope: Callable[[ReqContext], str] | None = None
        self._arrivals = Arrivals(holder, self._lower, lambda: self.clock(), self._stats)

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
        if self.retention is not None and self.retention.is_expired(key):
            # Past its TTL: never served again (the primary evicts it first); asked of no
            # tier, so no promotion starts for it.
            self.retention.count_expired_miss()
            result = LookupResult.MISS
        else:
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
                result is LookupResult.HIT_PENDING and self.cost is not None
                and key in self._arrivals and self._arrivals.waited_out(ctx, self.cost)
            ):
                self._arrivals.abandon(key)
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
                if self._arrivals.gave_up(ctx):
                    return LookupResult.MISS
                # Promote only what arrives before recomputing it would finish.
                held = self.cost.hold(key, lower.tier.name, ctx)
                if held is not None:
                    return held
                result = self._start_promotion(lower, key, ctx)
                if result is LookupResult.HIT_PENDING:
                    self._arrivals.start_wait(ctx)
                return result
            if result is LookupResult.HIT_PENDING:
                return result
            retry = retry or result is LookupResult.RETRY
        return LookupResult.RETRY if retry else LookupResult.MISS

    def _start_promotion(self, lower: Lower, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        hold = lower.jobs.hold_for_load(key, ctx)
        if hold is LoadHold.REFUSED:
            self._stats["promotions_refused"] += 1
            return LookupResult.MISS
        if hold is LoadHold.HELD:
            ctx.keep.add(key)
            self._keepers[ctx.req_id] = ctx
            self._reserved(1)
            self._promoting = (key, lower.tier)
            self._arrivals.held(key, lower)
            lower.holding.append(key)
            return LookupResult.HIT_PENDING
        # GONE: the chunk vanished between lookup and pin (e.g. found corrupt meanwhile).
        return LookupResult.MISS

    def promotion_source(self, key: OffloadKey) -> BuiltTier | None:
        """The lower tier the latest promotion-starting lookup promotes ``key`` from, when
        that lookup was of ``key``; else ``None``. Ask right after the lookup."""
        promoting = self._promoting
        return promoting[1] if promoting is not None and promoting[0] == key else None

    def _flush_promotions(self) -> None:
        for lower in self._lower:
            if lower.jobs.held_for_load:
                job_id = next(self._job_ids)
                self._arrivals.submitted(lower, job_id)
                lower.holding = []
                lower.jobs.load_held(job_id, None)
        self._arrivals.detach_abandoned()

    def _reserved(self, count: int) -> None:
        """The primary reserved ``count`` slots in this step (its headroom's demand)."""
        if self._demotion is not None:
            self._demotion.headroom.reserved(count)

    # -- store and cascade ----------------------------------------------------------
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        self._door(keys, ctx, "prepare_store")
        if self.retention is not None:
            self._retain(keys, ctx)
        demotion = self._demotion
        if demotion is not None and demotion.first:
            accepted = demotion.prepare_store(self._primary, keys, ctx, self._primary_events)
        else:
            accepted = self._primary.prepare_store(keys, ctx)
        if accepted:
            self._reserved(len(accepted))
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
        counts = self._admission.stored(keys)
        for lower in self._admission.through:
            self._cascade(lower, keys, ctx)
        if self._demotion is not None and self._demotion.wanting:
            self._demotion.want(keys, counts)

    def _cascade(self, lower: Lower, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Write the keys ``lower`` admits from their primary slots (pinned meanwhile)."""
        admitted = [key for key in keys if self._admission.admits(lower, key)]
        if admitted and lower.jobs.store(next(self._job_ids), admitted, ctx, None) is None:
            self._stats["cascades_refused"] += len(admitted)

    def _stored(self, keys: list[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """The ``keys`` the primary holds ready; asked without counting a lookup when the
        primary tells a slot's state (a slotted primary)."""
        states = self._holder
        if states is not None:
            return [k for k in keys if states.slot_state(k) is SlotState.READY]
        return [k for k in keys if self._primary.lookup(k, ctx) is LookupResult.HIT]

    # -- completions ----------------------------------------------------------------
    def _finished(self, index: int, job: FinishedJob[JobTag]) -> None:
        """Count a finished promotion, cascade or demotion (the driver released what it
        held); a demotion's held slots are released, a landed promotion written into the
        tiers above its source that take promoted chunks."""
        lower = self._lower[index - 1]
        tier_name = lower.tier.name
        result = job.result
        self._stats["corrupt_chunks"] += len(result.corrupt_keys)
        tag = job.tag
        if tag is not None:
            assert self._demotion is not None, "only a stack with back tiers demotes"
            if job.load:  # a second hop's staging read
                self._demotion.staged(job)
                return
            if tag.slots is not None:
                # A demotion from held slots ended: release those no other copy reads.
                self._demotion.unhold([tag.slots[key] for key in job.keys])
        kind = _PROMOTE if job.load else _CASCADE if tag is None else _DEMOTE
        if kind == _PROMOTE:
            self._arrivals.ended(job)
            if job.succeeded:
                landed = list(job.succeeded)
                self._admission.promoted(landed, index)
                for above in self._admission.through:
                    if above.index < index and above.write.promoted:
                        self._cascade(above, landed, INTERNAL)
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
            if self._demotion is not None and self._demotion.second_hop():
                continue
            if not any(lower.jobs.in_flight for lower in self._lower):
                return

    # -- the rest of the contract ---------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._door(keys, ctx, "prepare_load")
        if self.retention is not None:
            self._retain(keys, ctx)
        self._primary.prepare_load(keys, ctx)
        # Pinned now: the request's prefix no longer needs protecting by name.
        ctx.keep.clear()
        self._keepers.pop(ctx.req_id, None)
        admission = self._admission
        if not admission.counting:
            return
        keys = list(dict.fromkeys(keys))
        counts = admission.loaded(keys)
        for lower in admission.counted:
            # Written at the load that reaches the tier's count (pinned now, so ready).
            due = admission.due(lower.write.after_hits, keys, counts, exact=True)
            if due:
                self._cascade(lower, due, ctx)
        if self._demotion is not None and self._demotion.wanting:
            self._demotion.want(keys, counts)

    def _retain(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Record the retention ``ctx``'s request asked for (parsed once per request) for
        the ``keys`` it stores or loads, its pins in the request's scope (its tenant)."""
        book = self.retention
        assert book is not None
        parsed = ctx.get_state(_Hint)
        if parsed is None:
            parsed = _Hint(parse_hint(ctx, book) if self.retention_hints else None)
            ctx.set_state(parsed)
        scope = None if self.retention_scope is None else self.retention_scope(ctx)
        book.record(keys, parsed.hint, scope)

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
            self._arrivals.forget(ctx)
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
        for lower in self._lower:
            lower.jobs.poll()
        if self.cost is not None:
            self._arrivals.observe(self.cost)
        if self._demotion is not None:
            self._demotion.end_step()
            self._demotion.second_hop()
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

    def keep_free(self, slots: int) -> None:
        """With ``write: back`` tiers: keep at least ``slots`` primary slots free at each
        step's end (demoting to make room), beside what the recent steps reserved. For a
        primary other writers take slots from too (the node service's pool, whose
        engines store without this manager), so that their stores find free room instead
        of evicting chunks not yet written back. Without ``back`` tiers: nothing."""
        if self._demotion is not None:
            self._demotion.headroom.floor = slots

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
        self._arrivals.reset()
        self._fence = True
        self._admission.reset()

    def on_reset_flushed(self) -> None:
        """The engine's workers finished every job from before the last reset."""
        self._fence = False
        for tier in self.tiers:
            tier.manager.on_reset_flushed()

    def count_torn(self, chunks: int) -> None:
        """Count ``chunks`` stored chunks an adapter found incomplete (a rank's shard
        missing or stale) and freed instead of completing them (``torn_chunks``)."""
        self._stats["torn_chunks"] += chunks

    def get_stats(self) -> Mapping[str, float]:
        stats = dict(self._stats)
        if self.cost is not None:
            stats.update(self.cost.stats)
        if self.retention is not None:
            stats.update(self.retention.get_stats())
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


@dataclass(frozen=True)
class _Hint:
    """A request's retention hint, parsed once (``None``: it asks for none)."""

    hint: RetentionHint | None


def request_hint(ctx: ReqContext) -> RetentionHint | None:
    """The retention hint the composite read for ``ctx``'s request when it stored or
    loaded keys (``None``: it asks for none, or nothing was read yet): what a ``kind:
    service`` primary sends on to the service."""
    parsed = ctx.get_state(_Hint)
    return None if parsed is None else parsed.hint
