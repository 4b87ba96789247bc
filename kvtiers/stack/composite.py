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
  and the answer past it is ``MISS``.
* **Store** goes to the primary. On ``complete_store(success=True)`` each chunk is
  *cascaded* to every lower tier whose admission accepts it; the primary slot stays pinned
  while the mover reads it.
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

Invariants: a promoted key is ``HIT`` in the primary only after its bytes arrived intact; a
cascaded chunk's primary slot is never evicted or freed while a mover reads it;
``reset_cache`` drains movers before freeing primary slots, and a completion of a job from
before a reset (which releases a fenced slot, see ``OffloadingManager.reset_cache``)
cascades nothing. All methods run on the scheduler thread; movers touch only memory the
composite pinned or reserved for them.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
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
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ClosedError, ConfigError
from kvtiers.stack.cost import CostModel
from kvtiers.stack.metrics_latency import LatencyHistograms
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold

_INTERNAL = ReqContext(req_id="kvtiers-internal")

_COUNTERS = (
    "hits",
    "misses",
    "promotions",
    "promotion_failures",
    "promotions_refused",
    "promoted_bytes",
    "promote_s",
    "cascades",
    "cascade_failures",
    "cascades_refused",
    "cascaded_bytes",
    "cascade_s",
    "corrupt_chunks",
)


# Per direction (a promotion is a load from the lower tier, a cascade a store into it): the
# composite's counters for chunks done, chunks failed, bytes and seconds, and the per-tier
# counter's name.
_JOB_STATS = {
    True: ("promotions", "promotion_failures", "promoted_bytes", "promote_s", "promoted"),
    False: ("cascades", "cascade_failures", "cascaded_bytes", "cascade_s", "cascaded"),
}


@dataclass
class _Lower:
    tier: BuiltTier
    jobs: JobDriver[None]

    @property
    def manager(self) -> OffloadingManager:
        return self.tier.manager


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
            jobs: JobDriver[None] = JobDriver(
                tier.manager, tier.mover, functools.partial(self._finished, tier.name),
                primary=self._primary, ctx=_INTERNAL,
            )
            self._lower.append(_Lower(tier, jobs))
        if self._lower and tiers[0].region is None:
            raise ConfigError(
                f"primary tier {tiers[0].name!r} has no host memory for lower tiers to copy "
                "through; put a cpu tier first",
                path="tiers[0]",
            )
        self.medium = self._primary.medium
        self.locality = self._primary.locality
        self._job_ids = itertools.count()
        self._stats: dict[str, float] = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        self._keys = keys if keys is not None else KeyFormat(2**32)
        # The door's numbers, read on every lookup.
        self._group_limit = self._keys.group_limit
        self._key_bytes = self._keys.key_bytes
        # Between reset_cache and on_reset_flushed a completion may name a key whose
        # fenced slot it releases: only keys the primary then holds are cascaded.
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
            ctx.keep.add(key)
            return result
        retry = False
        for lower in self._lower:
            manager = lower.manager
            if not ctx.load_tier_filter.allows(manager.medium, manager.locality):
                continue
            result = manager.lookup(key, ctx)
            if result is LookupResult.HIT:
                if self.cost is not None:
                    # Promote only what arrives before recomputing it would finish.
                    held = self.cost.hold(key, lower.tier.name, ctx)
                    if held is not None:
                        return held
                return self._start_promotion(lower, key, ctx)
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
            self._promoting = (key, lower.tier)
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
                lower.jobs.load_held(next(self._job_ids), None)

    # -- store and cascade ----------------------------------------------------------
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        self._door(keys, ctx, "prepare_store")
        return self._primary.prepare_store(keys, ctx)

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        """Finish a primary store; on success cascade ``keys`` to admitting lower tiers.

        ``keys`` must be keys this manager's ``prepare_store`` returned (else
        :class:`~kvtiers.errors.UnknownKeyError`, before anything changed)."""
        self._door(keys, ctx, "complete_store")
        keys = list(keys)
        self._primary.complete_store(keys, ctx, success)
        if not success or not keys:
            return
        if self._fence:
            # A completion of a job from before the reset released a fenced slot: that
            # key is not stored, so it cascades nowhere.
            keys = [k for k in keys if self._primary.lookup(k, ctx) is LookupResult.HIT]
        for lower in self._lower:
            if lower.tier.admission == "never":
                continue
            if lower.jobs.store(next(self._job_ids), keys, ctx, None) is None:
                self._stats["cascades_refused"] += len(keys)

    # -- completions ----------------------------------------------------------------
    def _poll(self) -> None:
        for lower in self._lower:
            lower.jobs.poll()

    def _finished(self, tier_name: str, job: FinishedJob[None]) -> None:
        """Count a finished promotion or cascade (the driver released what it held)."""
        result = job.result
        self._stats["corrupt_chunks"] += len(result.corrupt_keys)
        done, failures, moved, seconds, per_tier = _JOB_STATS[job.load]
        self._stats[done] += len(job.succeeded)
        self._stats[failures] += len(job.failed)
        self._stats[moved] += result.transfer_bytes
        self._stats[seconds] += result.transfer_s
        self._add(f"{tier_name}.{per_tier}", len(job.succeeded), result)
        if job.load and self.cost is not None and job.succeeded:
            self.cost.observe_load(tier_name, result.transfer_bytes, result.transfer_s)
        if self.latency is not None:
            self.latency.observe("promote" if job.load else "cascade", tier_name,
                                 result.transfer_s)

    def _add(self, prefix: str, chunks: int, result: MoverResult) -> None:
        """Per-lower-tier traffic: ``<tier>.promoted`` / ``<tier>.cascaded`` (chunks),
        with ``_bytes`` and ``_s`` companions."""
        for suffix, value in (("", chunks), ("_bytes", result.transfer_bytes),
                              ("_s", result.transfer_s)):
            self._stats[prefix + suffix] = self._stats.get(prefix + suffix, 0) + value

    def wait_idle(self) -> None:
        """Submit pending promotions and block until every mover job has completed.

        For tests, the demo and shutdown: the scheduler itself never blocks."""
        self._flush_promotions()
        for lower in self._lower:
            lower.jobs.drain()

    # -- the rest of the contract ---------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._door(keys, ctx, "prepare_load")
        self._primary.prepare_load(keys, ctx)
        # Pinned now: the request's prefix no longer needs protecting by name.
        ctx.keep.clear()

    def get_spec(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        if self._closed:
            raise ClosedError("get_spec: this stack was shut down; build a new one")
        return self._primary.get_spec(keys)

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._door(keys, ctx, "touch")
        for tier in self.tiers:
            tier.manager.touch(keys, ctx)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._door(keys, ctx, "complete_load")
        self._primary.complete_load(keys, ctx)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        self._door((), ctx, "on_new_request")
        result = self._primary.on_new_request(ctx)
        for lower in self._lower:
            lower.manager.on_new_request(ctx)
        return result

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._door((), ctx, "on_request_finished")
        ctx.keep.clear()
        if self.cost is not None:
            self.cost.forget(ctx)
        for tier in self.tiers:
            tier.manager.on_request_finished(ctx)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events: list[OffloadingEvent] = list(self._primary.take_events())
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
        self._fence = True

    def on_reset_flushed(self) -> None:
        """The engine's workers finished every job from before the last reset."""
        self._fence = False
        for tier in self.tiers:
            tier.manager.on_reset_flushed()

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
