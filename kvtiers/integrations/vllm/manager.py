"""Route 1's scheduler side: vLLM's ``OffloadingManager`` over a kvtiers stack.

:class:`KVTiersManager` answers vLLM's manager calls with the stack's composite.
:class:`~kvtiers.integrations.vllm.direct.KVTiersDirectManager`, its subclass for a stack
of one cpu tier, calls that tier itself; ``KVTiersOffloadingSpec.get_manager`` picks the
class.

* vLLM makes ONE call for the keys of every group; the adapter splits the keys by group
  and asks the primary for one ``get_spec`` per group, so the spec it returns
  (:class:`~kvtiers.integrations.vllm.worker.KVTiersLoadStoreSpec`) addresses each group's
  keys in the order given.
* A ``PrepareStoreOutput``'s evicted keys are the keys the primary has removed since the
  previous output and not stored again (evictions raised in ``on_schedule_end``,
  ``reset_cache`` or ``take_events`` wait for the next output), none of them among its
  keys to store; each removal is reported once. Every event is kept for ``take_events``
  when vLLM publishes KV events, else dropped; a reservation freed after a failed store or
  promotion is a ``metadata_only`` removal (never an eviction). ``take_events`` hands vLLM
  at most :data:`MAX_EVENT_KEYS_PER_CALL` keys per call, in order, so what a persistent
  tier announces at start-up goes out over several steps.
* vLLM's contract, as its own CPU manager keeps it: a job's keys (handed back as a set)
  enter recency tail first by the end-token positions vLLM records in the request context,
  and an announced request's keys are refreshed, tail first, when it finishes, so a
  prefix's tail is evicted before its head; ``get_load_source`` names the tier a promotion
  copied a hit from (``DISK`` for a local file tier), ``HOST`` otherwise; ``config_info``
  fills the labels ``KVTiersOffloadingSpec.config_info_keys`` declares.
* Cost: the kvtiers context of a request is translated once (``on_new_request``); when
  every KV-cache group is offloaded vLLM's keys are kvtiers' keys (no translation).
* Resets follow vLLM's fence. vLLM drops the completions of jobs in flight at
  ``reset_cache`` (by job id), so the stack forgets those keys at once (``MISS``, a new
  store accepted) and fences their primary slots, and every completion vLLM hands over
  afterwards is of a job planned since: it reaches the stack with the stack's current
  generation, so it never frees fenced memory. vLLM 0.33 and later call
  ``on_reset_flushed`` once their workers finished those jobs: the slots come back then.
  vLLM 0.32 has no such call but sends the flush with the first step it schedules after
  the reset, and its workers run it before anything else of that step; it keeps up to
  ``max_concurrent_batches`` steps in flight, so the slots come back at the end of that
  many steps after the reset (:func:`reset_grace_steps`), when the flush step has run
  (meanwhile the engine is kept stepping).
* A sharded engine (tensor / pipeline parallel ranks sharing the primary): before the
  manager publishes a stored chunk it checks the shard ledger
  (:mod:`kvtiers.tiers.cpu.shards`), where each rank stamped the slots it wrote for that
  job: a chunk with a shard missing or stale is freed, never published, for every rank.
  The check goes by the key the primary holds (with tenants, the request's tenant-scoped
  key): each store's stamp is kept under it and its slot looked up by it, so two tenants
  storing the same vLLM key at once are checked each in its own slot, for its own store.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload import base as vbase
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtiers.core.keys import OffloadKey, get_offload_group_idx
from kvtiers.core.manager import Locality, LookupResult, Medium, ReqContext, ScheduleEndContext
from kvtiers.core.primary import SlottedPrimary
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm import compat
from kvtiers.integrations.vllm.engine import EngineConfigs
from kvtiers.integrations.vllm.tenants import route1_tenants
from kvtiers.integrations.vllm.translate import (
    KeyMap,
    kvtiers_context,
    vllm_event,
    vllm_lookup,
    vllm_request_context,
    with_request_contexts,
)
from kvtiers.integrations.vllm.worker import KVTiersLoadStoreSpec
from kvtiers.stack.builder import Stack
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.tenants import TenantStack
from kvtiers.tiers.cpu.shards import ShardLedger

logger = logging.getLogger(__name__)

#: Keys at most in the events one ``take_events`` hands vLLM (they go out in one batch):
#: a persistent tier's announcement of what it holds at start-up is spread over steps.
MAX_EVENT_KEYS_PER_CALL = 16384


def reset_grace_steps(engine: EngineConfigs | None, pp_size: int) -> int:
    """Steps after a reset at whose end the fenced slots come back when vLLM (0.32) never
    calls ``on_reset_flushed``: as many as the engine keeps in flight.

    The reset's flush travels with the first step scheduled after it (step ``N + 1``), and
    a worker runs it before anything else of that step. The engine schedules a step only
    while fewer than ``max_concurrent_batches`` steps are in flight (1 without a batch
    queue, 2 with asynchronous scheduling, the pipeline stages with pipeline parallelism,
    one more with both on vLLM's newer model runner), so with ``d`` that depth, step
    ``N + 1`` has run once step ``N + d + 1`` is scheduled. Slots freed at the end of step
    ``N + d`` are then written from the scheduler's side (a promotion) no earlier than
    step ``N + d + 1``, and by the workers (a store) only in a later step than the flush.
    Without the engine's config: ``pp_size + 1``, the most either version keeps in flight.
    """
    depth = getattr(engine.vllm, "max_concurrent_batches", None) if engine is not None else None
    if isinstance(depth, int) and depth >= 1:
        return depth
    return pp_size + 1


@dataclass(slots=True)
class _Request:
    """The adapter's state of one request: its kvtiers context (translated once), the
    load source of each key a promotion serves it, and the keys the one-call lookup found
    that are not yet in ``ctx.keep`` (moved there before a store reads it)."""

    ctx: ReqContext
    sources: dict[Any, CacheHitSource] = field(default_factory=dict)
    found: list[OffloadKey] = field(default_factory=list)
    #: Whether vLLM loaded any of its chunks from the stack (a request-level hit).
    loaded: bool = False


_HIT, _MISS, _PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
_VHIT, _VMISS = vbase.LookupResult.HIT, vbase.LookupResult.MISS


def keep_found(request: _Request) -> None:
    """Move the keys the one-call lookup found for ``request`` into its ``ctx.keep``."""
    request.ctx.keep.update(request.found)
    request.found.clear()


def tail_first(keys: Collection[Any], req_context: Any) -> list[Any]:
    """``keys`` ordered by the end-token positions vLLM records in ``req_context``, tail
    first (so the head enters recency last, the most recent); as given when a position is
    missing (vLLM before 0.33 records none)."""
    ordered = list(keys)
    position = getattr(req_context, "get_offload_key_position", None)
    if len(ordered) < 2 or position is None:
        return ordered
    positions = [position(key) for key in ordered]
    if None in positions:
        return ordered
    order = sorted(range(len(ordered)), key=positions.__getitem__, reverse=True)
    return [ordered[i] for i in order]


def _hit_source(tier: BuiltTier | None) -> CacheHitSource:
    """Where a hit served by ``tier`` (``None``: the primary) came from, in vLLM's terms."""
    if tier is None or tier.manager.medium is Medium.CPU:
        return CacheHitSource.HOST
    if tier.manager.locality is Locality.LOCAL:
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED


class KVTiersManager(vbase.OffloadingManager):
    """vLLM's manager API over a kvtiers stack's composite (see the module docstring)."""

    def __init__(
        self,
        stack: Stack,
        keys: KeyMap,
        *,
        events_enabled: bool,
        reset_grace_steps: int,
        ledger: ShardLedger | None = None,
    ) -> None:
        self.stack = stack
        # With a tenants: section, request calls go through the tenant layer (tenants.py).
        self._tenants = route1_tenants(stack)
        self._tiered: TieredManager | TenantStack = (
            stack.manager if self._tenants is None else self._tenants
        )
        # A sharded engine's ledger, and the stamp of every key stored and not completed,
        # by the key the primary holds (see _primary_keys).
        self._ledger = ledger
        self._stamps: dict[OffloadKey, int] = {}
        self._keys = keys
        # vLLM's keys are kvtiers' keys when every KV-cache group is offloaded.
        self._same_keys = keys.identity
        self._num_groups = len(stack.offloading.groups)
        self._events_enabled = events_enabled
        self._events: deque[Any] = deque()
        # The request context of each vLLM key a store completed since the last drain
        # (vLLM 0.34 reads a self-describing store's tokens and hashes from the event's).
        self._describe = events_enabled and compat.EVENT_CARRIES_REQ_CONTEXT
        self._contexts: dict[Any, Any] = {}
        # vLLM keys the primary removed since the last PrepareStoreOutput, in order.
        self._evicted: dict[Any, None] = {}
        # Steps left before a reset's fenced slots come back (vLLM without a flush signal),
        # and how many a reset starts with.
        self._fence_steps: int | None = None
        self._reset_grace_steps = reset_grace_steps
        self._requests: dict[str, _Request] = {}
        self._primary = stack.manager.tiers[0].manager
        # A sharded engine checks each stored chunk's slot in the shard ledger: its
        # primary keeps chunks in slots (core's primary contract; see spec).
        self._slotted: SlottedPrimary | None = None
        if ledger is not None:
            if not isinstance(self._primary, SlottedPrimary):
                raise ConfigError(
                    f"tier {stack.manager.tiers[0].name!r}: a sharded engine's primary must "
                    "keep its chunks in slots of shared memory (a cpu tier)",
                    path="tiers[0].kind",
                )
            self._slotted = self._primary
        #: Finished requests by whether the stack served part of their prefix (read by the
        #: exporter's thread: plain integers, written on the scheduler thread only).
        self.request_hits = 0
        self.request_misses = 0
        if stack.metrics is not None:
            stack.metrics.add_source(self.request_lookups)

    def request_lookups(self) -> dict[str, float]:
        """The request-level lookup counts (``kvtiers_stack_request_lookups_total``)."""
        return {"request_hits": self.request_hits, "request_misses": self.request_misses}

    def _count_finished(self, request: _Request | None) -> None:
        """Count a finished announced request once, as a hit when it loaded anything."""
        if request is None:
            return
        if request.loaded:
            self.request_hits += 1
        else:
            self.request_misses += 1

    def _ctx(self, ctx: Any) -> ReqContext:
        known = self._requests.get(ctx.req_id)
        return known.ctx if known is not None else kvtiers_context(ctx, self._keys)

    def _spec(self, keys: Collection[OffloadKey], stamp: int = 0) -> KVTiersLoadStoreSpec:
        """The spec of ``keys``, just reserved or pinned by a call that passed the stack's
        door: the primary's addressing, which is what the composite's ``get_spec`` gives."""
        get_spec = self._primary.get_spec if self._tenants is None else self._tenants.get_spec
        if self._num_groups == 1:
            return KVTiersLoadStoreSpec((get_spec(keys),), stamp)
        by_group: list[list[OffloadKey]] = [[] for _ in range(self._num_groups)]
        for key in keys:
            by_group[get_offload_group_idx(key)].append(key)
        return KVTiersLoadStoreSpec([get_spec(group) for group in by_group], stamp)

    def _drain_events(self) -> None:
        """Move the stack's events into the buffer and track the primary's evictions."""
        evicted = self._evicted
        contexts = self._contexts
        for event in self._tiered.take_events():
            if event.ownership is None and not event.metadata_only:
                keys = event.keys if self._same_keys else self._keys.all_to_vllm(event.keys)
                if event.removed:
                    evicted.update(dict.fromkeys(keys))
                elif evicted:  # a key stored again is no longer evicted
                    for key in keys:
                        evicted.pop(key, None)
            if self._events_enabled:
                translated = vllm_event(event, self._keys)
                if translated is None:
                    continue
                if contexts and event.ownership is None:
                    self._events.extend(with_request_contexts(translated, contexts))
                else:
                    self._events.append(translated)
        # A completed store's event is queued by the call that completed it: every context
        # kept has been used by now.
        contexts.clear()

    def lookup(self, key: Any, req_context: Any) -> Any:
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context, self._keys)
        ours = key if self._same_keys else self._keys.to_kvtiers(key)
        result = self._tiered.lookup(ours, ctx)
        if result is _HIT:
            return _VHIT
        if result is _MISS:
            return _VMISS
        if result is _PENDING and request is not None and key not in request.sources:
            request.sources[key] = _hit_source(self._tiered.promotion_source(ours))
        return vllm_lookup(result)

    def get_load_source(self, key: Any, req_context: Any) -> CacheHitSource:
        """The tier that served ``key``'s hit: the lower tier a promotion this request's
        lookup started copied it from, else the CPU primary (``HOST``)."""
        request = self._requests.get(req_context.req_id)
        if request is None:
            return CacheHitSource.HOST
        return request.sources.get(key, CacheHitSource.HOST)

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> KVTiersLoadStoreSpec:
        ours = keys if self._same_keys else self._keys.all_to_kvtiers(keys)
        request = self._requests.get(req_context.req_id)
        if request is None:
            self._tiered.prepare_load(ours, kvtiers_context(req_context))
        else:
            self._tiered.prepare_load(ours, request.ctx)
            # Pinned now, as the composite cleared ctx.keep for.
            request.found.clear()
            request.loaded = True
        return self._spec(ours)

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        """Refresh ``keys``' recency (vLLM before 0.34 calls it; 0.34 has no ``touch``)."""
        self._tiered.touch(self._keys.all_to_kvtiers(keys), self._ctx(req_context))

    def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
        request = self._requests.get(req_context.req_id)
        self._tiered.complete_load(
            keys if self._same_keys else self._keys.all_to_kvtiers(keys),
            request.ctx if request is not None else kvtiers_context(req_context),
            generation=self._tiered.generation,  # vLLM completes no job from before a reset
        )

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        request = self._requests.get(req_context.req_id)
        if request is None:
            ctx = kvtiers_context(req_context)
        else:
            ctx = request.ctx
            if request.found:  # the store must not evict what the request's lookups found
                keep_found(request)
        accepted = self._tiered.prepare_store(
            keys if self._same_keys else self._keys.all_to_kvtiers(keys), ctx
        )
        self._drain_events()
        if accepted is None:
            return None
        to_store = accepted if self._same_keys else self._keys.all_to_vllm(accepted)
        evicted = self._evicted
        if evicted:
            for key in to_store:
                evicted.pop(key, None)
            self._evicted = {}
        stamp = 0
        if self._ledger is not None:
            stamp = self._ledger.next_stamp()
            self._stamps.update(dict.fromkeys(self._primary_keys(accepted, ctx), stamp))
        return vbase.PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=self._spec(accepted, stamp),
            evicted_keys=list(evicted),
        )

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        """vLLM hands a job's keys as a set: they enter recency tail first by the positions
        vLLM recorded, so the prefix head is the last to be evicted. A sharded engine's
        chunk is published only if every rank stamped its slot for this store; the others
        are freed (see the module docstring)."""
        ordered = tail_first(keys, req_context)
        if self._describe and success:
            self._contexts.update(dict.fromkeys(ordered, req_context))
        ours = ordered if self._same_keys else self._keys.all_to_kvtiers(ordered)
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        # vLLM completes no job from before a reset: this one is of the current generation.
        generation = self._tiered.generation
        if self._ledger is None:
            self._tiered.complete_store(ours, ctx, success, generation=generation)
            return
        if not success:
            for key in self._primary_keys(ours, ctx):
                self._stamps.pop(key, None)
            self._tiered.complete_store(ours, ctx, False, generation=generation)
            return
        whole, torn = self._check_shards(ours, ctx)
        if whole:
            self._tiered.complete_store(whole, ctx, generation=generation)
        if torn:
            self._tiered.complete_store(torn, ctx, False, generation=generation)

    def _primary_keys(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> Collection[OffloadKey]:
        """``keys`` (kvtiers') as the primary holds them for ``ctx``'s request: scoped by
        its tenant with a ``tenants:`` section (what the tenant layer hands the tiers),
        else as given."""
        if self._tenants is None:
            return keys
        return self._tenants.scoped_keys(keys, ctx)

    def _check_shards(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """``keys`` split into the chunks every rank wrote for their store and the torn
        ones, each checked by the key the primary holds for ``ctx``'s request. A key
        without a stamp passes as whole, for the stack to judge (vLLM completes only keys
        it reserved since the last reset, and each of those has one)."""
        assert self._ledger is not None
        primary = self._slotted
        assert primary is not None  # a sharded engine's primary (see __init__)
        checked: list[OffloadKey] = []
        slots: list[int] = []
        stamps: list[int] = []
        for key, held in zip(keys, self._primary_keys(keys, ctx), strict=True):
            stamp = self._stamps.pop(held, None)
            slot = primary.slot_of(held)
            if stamp is not None and slot is not None:
                checked.append(key)
                slots.append(slot)
                stamps.append(stamp)
        ok = dict(zip(checked, self._ledger.whole(slots, stamps).tolist(), strict=True))
        whole = [key for key in keys if ok.get(key, True)]
        torn = [key for key in keys if not ok.get(key, True)]
        if torn:
            self._tiered.count_torn(len(torn))
            logger.warning(
                "kvtiers: %d stored chunk(s) lack a rank's shard (a rank's store failed or "
                "did not run); they are freed, not published (%d so far)",
                len(torn),
                self.torn_chunks,
            )
        return whole, torn

    @property
    def torn_chunks(self) -> int:
        """Stored chunks refused because a rank's shard was missing or stale (the stack's
        ``torn_chunks`` counter, ``kvtiers_stack_torn_chunks_total``)."""
        return int(self._tiered.get_stats()["torn_chunks"])

    def on_new_request(self, req_context: Any) -> Any:
        ctx = kvtiers_context(req_context, self._keys)
        self._requests[req_context.req_id] = _Request(ctx)
        return vllm_request_context(self._tiered.on_new_request(ctx))

    def on_request_finished(self, req_context: Any) -> None:
        self._tiered.on_request_finished(self._ctx(req_context))
        self._count_finished(self._requests.pop(req_context.req_id, None))

    def take_events(self) -> Iterable[Any]:
        """The events since the last call, oldest first, at most
        :data:`MAX_EVENT_KEYS_PER_CALL` keys of them (the rest, in order, at the next
        calls)."""
        self._drain_events()
        return _take_keys(self._events, MAX_EVENT_KEYS_PER_CALL)

    def on_schedule_end(self, context: Any) -> None:
        self._tiered.on_schedule_end(
            ScheduleEndContext(
                new_req_ids=context.new_req_ids, preempted_req_ids=context.preempted_req_ids
            )
        )
        if self._fence_steps is not None:
            # (vLLM 0.32 calls this first in a step, before the step's stores: those are
            # written by the workers after the flush, which an earlier step carried.)
            self._fence_steps -= 1
            if self._fence_steps <= 0:
                self._fence_steps = None
                self._tiered.on_reset_flushed()
        self._drain_events()

    def has_pending_work(self) -> bool:
        """Also while a reset's grace steps run: an idle engine steps on, so the flush
        reaches its workers and the fenced slots come back.

        vLLM asks only when no request is left (its connector's liveness check), and
        stops stepping on ``False``: the metrics snapshot, taken at most every
        ``refresh_s`` at a step's end, is then taken here one last time, so a scrape of
        an idle engine reads what the stack holds, not the last throttled snapshot
        (nothing changes the stack's state until the next step)."""
        pending = self._fence_steps is not None or self._tiered.has_pending_work()
        if not pending and self._tiered.stats_refresh_s is not None:
            self._tiered.refresh_stats_snapshot()
        return pending

    def reset_cache(self) -> None:
        """vLLM drops the completions of jobs in flight now: their keys are forgotten and
        their slots fenced (see the module docstring)."""
        self._tiered.reset_cache()
        self._stamps.clear()
        if not compat.FLUSH_SIGNAL:
            self._fence_steps = self._reset_grace_steps
        self._drain_events()

    def on_reset_flushed(self) -> None:
        """vLLM's workers finished every job from before the last reset."""
        self._fence_steps = None
        self._tiered.on_reset_flushed()

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """One series: the primary's capacity in chunks and bytes, the blocks per chunk
        and the stack's tiers (``name:kind``, top first); see :meth:`KVTiersOffloadingSpec.
        config_info_keys`."""
        primary = self._tiered.tiers[0].manager.get_stats()
        return [
            {
                "cpu_num_chunks": int(getattr(self._tiered.tiers[0].manager, "num_slots", 0)),
                "cpu_blocks_per_chunk": self.stack.offloading.cache.blocks_per_chunk,
                "cpu_kv_cache_size_bytes": int(primary.get("capacity_bytes", 0)),
                "kvtiers_tiers": ",".join(
                    f"{tier.name}:{tier.kind}" for tier in self.stack.config.tiers
                ),
            }
        ]

    def get_stats(self) -> None:
        """``None``: vLLM's stats type needs its full install; kvtiers' counters are served
        by the stack's ``metrics:`` section and ``stack.manager.get_stats()``."""
        return None

    def shutdown(self) -> None:
        self.stack.shutdown()
        if self._ledger is not None:
            self._ledger.close()


def _take_keys(events: deque[Any], limit: int) -> list[Any]:
    """The oldest of ``events`` (vLLM's) holding at most ``limit`` keys in all, taken off
    the queue; an event too large for what is left is split, its tail left at the head."""
    taken: list[Any] = []
    while events and limit > 0:
        event = events[0]
        if len(event.keys) <= limit:
            taken.append(events.popleft())
            limit -= len(event.keys)
            continue
        taken.append(dataclasses.replace(event, keys=event.keys[:limit]))
        events[0] = dataclasses.replace(event, keys=event.keys[limit:])
        break
    return taken


