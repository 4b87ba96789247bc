"""``KVTiersOffloadingSpec``: a kvtiers stack as vLLM's offloading spec.

vLLM (0.33.0) loads it through ``OffloadingSpecFactory`` from ``spec_name`` +
``spec_module_path`` in ``kv_connector_extra_config``, once in the scheduler process
(:meth:`KVTiersOffloadingSpec.get_manager`) and once per worker
(:meth:`KVTiersOffloadingSpec.get_worker`).

* The manager adapter answers vLLM's manager calls with the stack's composite. vLLM makes
  ONE call for the keys of every group; the adapter splits the keys by group and asks the
  composite for one ``get_spec`` per group, so the spec it returns
  (:class:`KVTiersLoadStoreSpec`) addresses each group's keys in the order given.
  A ``PrepareStoreOutput``'s evicted keys are the keys the primary has removed since the
  previous output and not stored again (evictions raised in ``on_schedule_end``,
  ``reset_cache`` or ``take_events`` wait for the next output), none of them among its
  keys to store; each removal is reported once. Every event is kept for ``take_events``
  when vLLM publishes KV events, else dropped; a reservation freed after a failed store or
  promotion is a ``metadata_only`` removal (never an eviction). ``take_events`` hands vLLM
  at most :data:`MAX_EVENT_KEYS_PER_CALL` keys per call, in order, so what a persistent
  tier announces at start-up goes out over several steps; stores are self-describing
  (vLLM's ``self_describing_kv_events``) unless the extra config turns that off
  (docs/vllm.md, "What a router sees").
* vLLM's contract, as its own CPU manager keeps it: a job's keys (handed back as a set)
  enter recency tail first by the end-token positions vLLM records in the request context,
  and an announced request's keys are refreshed, tail first, when it finishes, so a
  prefix's tail is evicted before its head; ``get_load_source`` names the tier a promotion
  copied a hit from (``DISK`` for a local file tier), ``HOST`` otherwise; ``config_info``
  fills the labels :meth:`KVTiersOffloadingSpec.config_info_keys` declares.
* Cost: the kvtiers context of a request is translated once (``on_new_request``); when
  every KV-cache group is offloaded vLLM's keys are kvtiers' keys (no translation), and a
  one-tier ``cpu`` stack answers ``lookup`` from the primary in one call (which keeps the
  composite's door for keys it finds and lists them for the request's ``ctx.keep``, as the
  composite keeps them; a key it does not hold is a ``MISS`` unchecked: every key is
  checked where it enters, at ``prepare_store`` and ``prepare_load``). Such a stack (with
  no shard ledger) is also called directly for loads, stores and finishes, the door's key
  tests inlined (:meth:`KVTiersManager._go_direct`), and when vLLM publishes no events the
  primary builds none: it forwards the keys it removes.
* Resets follow vLLM's fence. vLLM drops the completions of jobs in flight at
  ``reset_cache`` (0.32 and 0.33, by job id), so the stack forgets those keys at once
  (``MISS``, a new store accepted) and fences their primary slots, and every completion
  vLLM hands over afterwards is of a job planned since: it reaches the stack with the
  stack's current generation, so it never frees fenced memory. vLLM 0.33 calls
  ``on_reset_flushed`` once its workers finished those jobs: the slots come back then.
  vLLM 0.32 has no such call but sends the flush with the first step it schedules after
  the reset, and its workers run it before anything else of that step; it keeps up to
  ``max_concurrent_batches`` steps in flight, so the slots come back at the end of that
  many steps after the reset (:func:`reset_grace_steps`), when the flush step has run
  (meanwhile the engine is kept stepping).
* The worker adapter splits each packed ``GPULoadStoreSpec(block_ids, group_sizes,
  block_indices)`` into one :class:`~kvtiers.core.specs.GroupTransfer` per group, the
  group's offloaded spec carrying ``block_indices[g]`` as its ``gpu_block_offset``, and
  drives the primary tier's kvtiers worker over the engine's KV tensors viewed as bytes.

Scheduler and worker may run in different processes. Both must see the same primary
memory, so a ``cpu`` primary without ``shared_memory_name`` is given a ``/dev/shm`` file
both processes map, named after the user and the engine id (:func:`shared_memory_name`).
A worker process builds only the primary tier.

Tensor and pipeline parallelism on one node (``world_size`` > 1, a ``cpu`` primary): every
rank's worker maps the same primary region and copies its own pages into the same slots,
rank innermost (:mod:`kvtiers.tiers.cpu.worker`), so one slot holds the whole chunk and
the scheduler's one stack (its manager, movers, cascade and promotion) handles every
rank's shard at once: a file or object holds one blob per chunk with every shard. The
cache identity counts a block's bytes over all ranks. vLLM completes a job once every
rank reported it; before the manager publishes a stored chunk it checks the shard ledger
(:mod:`kvtiers.tiers.cpu.shards`), where each rank stamped the slots it wrote for that
job: a chunk with a shard missing or stale is freed, never published, for every rank. A
rank's failed store is therefore reported to vLLM as finished (vLLM stops the engine on
a failed job) and refused by the scheduler instead. Ranks on other nodes cannot map the
region: such an engine is refused at start-up.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import OffloadingConfig as VllmOffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtiers.config import (
    CPUTierConfig,
    StackConfig,
    get_kind,
    load_stack_config,
    resolve_factory,
)
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey, get_offload_group_idx
from kvtiers.core.manager import Locality, LookupResult, Medium, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer, LoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, OffloadingWorker, TransferResult
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.engine import EngineConfigs, find_engine_configs
from kvtiers.integrations.vllm.translate import (
    EXTRA_CONFIG,
    KeyMap,
    block_hash_algorithm,
    derived_group_bytes,
    kvtiers_context,
    translate_config,
    vllm_event,
    vllm_lookup,
    vllm_request_context,
    warn_unstable_hashes,
)
from kvtiers.stack.builder import Stack, build_primary_worker, load_stack
from kvtiers.tiers.cpu.manager import CpuTierManager
from kvtiers.tiers.cpu.region import SlotRegion, remove_left_overs
from kvtiers.tiers.cpu.shards import ShardLedger, ledger_name
from kvtiers.tiers.cpu.worker import CpuWorker

logger = logging.getLogger(__name__)

_CONFIG_INFO_KEYS = (
    "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes", "kvtiers_tiers"
)
#: Whether this vLLM tells its manager when a reset's jobs have finished (0.33 does).
_FLUSH_SIGNAL = hasattr(vbase.OffloadingManager, "on_reset_flushed")
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


class KVTiersLoadStoreSpec(vbase.LoadStoreSpec):
    """The primary tier's addressing of one job: one kvtiers spec per offloaded group,
    by position, each addressing that group's keys in the order vLLM gave them.
    ``stamp``: a sharded engine's store job's stamp in the shard ledger (0 otherwise)."""

    def __init__(self, groups: Sequence[LoadStoreSpec], stamp: int = 0) -> None:
        self.groups: tuple[LoadStoreSpec, ...] = tuple(groups)
        self.stamp = stamp

    def __len__(self) -> int:
        return sum(len(spec) for spec in self.groups)

    def __repr__(self) -> str:
        return f"KVTiersLoadStoreSpec({list(self.groups)!r})"


@dataclass(slots=True)
class _Request:
    """The adapter's state of one request: its kvtiers context (translated once), the
    load source of each key a promotion serves it, and the keys the one-call lookup found
    that are not yet in ``ctx.keep`` (moved there before a store reads it)."""

    ctx: ReqContext
    sources: dict[Any, CacheHitSource] = field(default_factory=dict)
    found: list[OffloadKey] = field(default_factory=list)


#: The calls the direct mode answers itself (see KVTiersManager._go_direct).
_DIRECT_CALLS = (
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
    "take_events",
)


def _no_events() -> list[Any]:
    """``take_events`` of the direct mode when vLLM publishes none: the primary builds
    none (it forwards its removals), so there is nothing to drain."""
    return []


_HIT, _MISS, _PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
_VHIT, _VMISS = vbase.LookupResult.HIT, vbase.LookupResult.MISS


def _keep_found(request: _Request) -> None:
    """Move the keys the one-call lookup found for ``request`` into its ``ctx.keep``."""
    request.ctx.keep.update(request.found)
    request.found.clear()


def _tail_first(keys: Collection[Any], req_context: Any) -> list[Any]:
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
        self._tiered = stack.manager
        self._door = stack.manager.door
        # The door's numbers (the direct calls test keys themselves; see _refuse).
        self._key_format = stack.manager.key_format
        self._key_bytes = self._key_format.key_bytes
        self._group_limit = self._key_format.group_limit
        # A sharded engine's ledger, and the stamp of every key stored and not completed.
        self._ledger = ledger
        self._stamps: dict[OffloadKey, int] = {}
        self._keys = keys
        # vLLM's keys are kvtiers' keys when every KV-cache group is offloaded.
        self._same_keys = keys.identity
        self._num_groups = len(stack.offloading.groups)
        self._events_enabled = events_enabled
        self._events: deque[Any] = deque()
        # vLLM keys the primary removed since the last PrepareStoreOutput, in order.
        self._evicted: dict[Any, None] = {}
        # Steps left before a reset's fenced slots come back (vLLM without a flush signal),
        # and how many a reset starts with.
        self._fence_steps: int | None = None
        self._reset_grace_steps = reset_grace_steps
        self._requests: dict[str, _Request] = {}
        self._primary = primary = stack.manager.tiers[0].manager
        # Each announced request's keys found by the one-call lookup, by request id.
        self._found: dict[str, list[OffloadKey]] = {}
        self._one_call = (
            self._same_keys and len(stack.manager.tiers) == 1
            and isinstance(primary, CpuTierManager) and stack.manager.cost is None
        )
        # The keys the primary removed, forwarded instead of events (the direct mode when
        # vLLM publishes no events).
        self._removed: list[OffloadKey] | None = None
        if self._one_call:
            # Nothing to translate and nowhere to promote from: the primary answers, with
            # the composite's door and keep set (kept as the request's found list).
            self.lookup = primary.lookup_as(  # type: ignore[method-assign]
                _VHIT,
                _VMISS,
                vbase.LookupResult.HIT_PENDING,
                keys=stack.manager.key_format,
                found=self._found,
            )
            if ledger is None:
                self._go_direct(primary)

    def _go_direct(self, primary: CpuTierManager) -> None:
        """Call the one-tier stack's primary itself for the calls that load, store and
        finish, with the composite's door inlined (the composite adds nothing else to a
        stack of one cpu tier); with no events to publish, the primary forwards the keys it
        removes instead of building events. The primary's shutdown undoes it."""
        primary.on_shutdown(self._leave_direct)
        self.prepare_load = self._prepare_load_direct  # type: ignore[method-assign]
        self.complete_load = self._complete_load_direct  # type: ignore[method-assign]
        self.complete_store = self._complete_store_direct  # type: ignore[method-assign]
        self.on_request_finished = self._finished_direct  # type: ignore[method-assign]
        if not self._events_enabled:
            self._removed = primary.forward_removals()
            self.prepare_store = self._prepare_store_direct  # type: ignore[method-assign]
            self.take_events = _no_events  # type: ignore[method-assign]

    def _ctx(self, ctx: Any) -> ReqContext:
        known = self._requests.get(ctx.req_id)
        return known.ctx if known is not None else kvtiers_context(ctx, self._keys)

    def _spec(self, keys: Collection[OffloadKey], stamp: int = 0) -> KVTiersLoadStoreSpec:
        """The spec of ``keys``, just reserved or pinned by a call that passed the stack's
        door: the primary's addressing, which is what the composite's ``get_spec`` gives."""
        get_spec = self._primary.get_spec
        if self._num_groups == 1:
            return KVTiersLoadStoreSpec((get_spec(keys),), stamp)
        by_group: list[list[OffloadKey]] = [[] for _ in range(self._num_groups)]
        for key in keys:
            by_group[get_offload_group_idx(key)].append(key)
        return KVTiersLoadStoreSpec([get_spec(group) for group in by_group], stamp)

    def _drain_events(self) -> None:
        """Move the stack's events into the buffer and track the primary's evictions."""
        evicted = self._evicted
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
                if translated is not None:
                    self._events.append(translated)

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
        return self._spec(ours)

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
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
                _keep_found(request)
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
            self._stamps.update(dict.fromkeys(accepted, stamp))
        return vbase.PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=self._spec(accepted, stamp),
            evicted_keys=list(evicted),
        )

    def _leave_direct(self) -> None:
        """The primary was shut down: back to the composite's calls, whose door refuses
        every call from now on (so the direct calls never test for it)."""
        for name in _DIRECT_CALLS:
            self.__dict__.pop(name, None)

    def _refuse(self, keys: Collection[Any], ctx: ReqContext, where: str) -> None:
        """A direct call's key failed the door's tests (inlined in each direct call: the
        context is the adapter's own, so its keys are all the door checks): the door
        raises why, or learns the key length from the first key."""
        self._door(keys, ctx, where)
        self._key_bytes = self._key_format.key_bytes

    # -- the direct mode (see _go_direct): the composite's calls, for a stack of one cpu tier
    def _prepare_load_direct(
        self, keys: Collection[Any], req_context: Any
    ) -> KVTiersLoadStoreSpec:
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        size = self._key_bytes  # the door, inlined (see _refuse)
        limit = self._group_limit
        for key in keys:
            if type(key) is not bytes or len(key) != size or (
                limit is not None and key[-GROUP_INDEX_BYTES:] >= limit
            ):
                self._refuse(keys, ctx, "prepare_load")
                break
        if self._num_groups == 1:
            spec = KVTiersLoadStoreSpec((self._primary.prepare_load_spec(keys, ctx),))
        else:
            self._primary.prepare_load(keys, ctx)
            spec = self._spec(keys)
        # Pinned now: the request's prefix no longer needs protecting by name.
        ctx.keep.clear()
        if request is not None:
            request.found.clear()
        return spec

    def _complete_load_direct(self, keys: Collection[Any], req_context: Any) -> None:
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        size = self._key_bytes  # the door, inlined (see _refuse)
        limit = self._group_limit
        for key in keys:
            if type(key) is not bytes or len(key) != size or (
                limit is not None and key[-GROUP_INDEX_BYTES:] >= limit
            ):
                self._refuse(keys, ctx, "complete_load")
                break
        primary = self._primary
        primary.complete_load(keys, ctx, generation=primary.generation)

    def _prepare_store_direct(self, keys: Collection[Any], req_context: Any) -> Any:
        request = self._requests.get(req_context.req_id)
        if request is None:
            ctx = kvtiers_context(req_context)
        else:
            ctx = request.ctx
            if request.found:  # the store must not evict what the request's lookups found
                _keep_found(request)
        size = self._key_bytes  # the door, inlined (see _refuse)
        limit = self._group_limit
        for key in keys:
            if type(key) is not bytes or len(key) != size or (
                limit is not None and key[-GROUP_INDEX_BYTES:] >= limit
            ):
                self._refuse(keys, ctx, "prepare_store")
                break
        removed = self._removed
        assert removed is not None
        # Removals before this call (a reset's) may name keys it stores again.
        earlier = len(removed)
        accepted = self._primary.prepare_store(keys, ctx)
        if accepted is None:
            return None
        evicted: list[OffloadKey] = []
        if removed:
            if earlier:
                stored = set(accepted)
                evicted = [key for key in removed[:earlier] if key not in stored]
                evicted += removed[earlier:]
            else:
                evicted = removed[:]
            removed.clear()
        return vbase.PrepareStoreOutput(
            keys_to_store=accepted, store_spec=self._spec(accepted), evicted_keys=evicted
        )

    def _complete_store_direct(
        self, keys: Collection[Any], req_context: Any, success: bool = True
    ) -> None:
        ordered = _tail_first(keys, req_context)
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        size = self._key_bytes  # the door, inlined (see _refuse)
        limit = self._group_limit
        for key in ordered:
            if type(key) is not bytes or len(key) != size or (
                limit is not None and key[-GROUP_INDEX_BYTES:] >= limit
            ):
                self._refuse(ordered, ctx, "complete_store")
                break
        primary = self._primary
        # vLLM completes no job from before a reset: this one is of the current generation.
        primary.complete_store(ordered, ctx, success, generation=primary.generation)

    def _finished_direct(self, req_context: Any) -> None:
        req_id = req_context.req_id
        request = self._requests.get(req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        ctx.keep.clear()
        self._primary.on_request_finished(ctx)
        self._requests.pop(req_id, None)
        self._found.pop(req_id, None)

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        """vLLM hands a job's keys as a set: they enter recency tail first by the positions
        vLLM recorded, so the prefix head is the last to be evicted. A sharded engine's
        chunk is published only if every rank stamped its slot for this store; the others
        are freed (see the module docstring)."""
        ordered = _tail_first(keys, req_context)
        ours = ordered if self._same_keys else self._keys.all_to_kvtiers(ordered)
        request = self._requests.get(req_context.req_id)
        ctx = request.ctx if request is not None else kvtiers_context(req_context)
        # vLLM completes no job from before a reset: this one is of the current generation.
        generation = self._tiered.generation
        if self._ledger is None:
            self._tiered.complete_store(ours, ctx, success, generation=generation)
            return
        if not success:
            for key in ours:
                self._stamps.pop(key, None)
            self._tiered.complete_store(ours, ctx, False, generation=generation)
            return
        whole, torn = self._check_shards(ours)
        if whole:
            self._tiered.complete_store(whole, ctx, generation=generation)
        if torn:
            self._tiered.complete_store(torn, ctx, False, generation=generation)

    def _check_shards(
        self, keys: Collection[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """``keys`` split into the chunks every rank wrote for their store and the torn
        ones. A key without a stamp passes as whole, for the stack to judge (vLLM completes
        only keys it reserved since the last reset, and each of those has one)."""
        assert self._ledger is not None
        primary = self._tiered.tiers[0].manager
        assert isinstance(primary, CpuTierManager)
        checked: list[OffloadKey] = []
        slots: list[int] = []
        stamps: list[int] = []
        for key in keys:
            stamp = self._stamps.pop(key, None)
            slot = primary.slot_of(key)
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
        request = self._requests[req_context.req_id] = _Request(ctx)
        if self._one_call:
            self._found[req_context.req_id] = request.found
        return vllm_request_context(self._tiered.on_new_request(ctx))

    def on_request_finished(self, req_context: Any) -> None:
        self._tiered.on_request_finished(self._ctx(req_context))
        self._requests.pop(req_context.req_id, None)
        self._found.pop(req_context.req_id, None)

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
        if self._one_call:
            # A request that waits is looked up again next step: its list holds one step's
            # finds at most, the set keeps each key once.
            for request in self._requests.values():
                if request.found:
                    _keep_found(request)
        self._drain_events()

    def has_pending_work(self) -> bool:
        """Also while a reset's grace steps run: an idle engine steps on, so the flush
        reaches its workers and the fenced slots come back."""
        return self._fence_steps is not None or self._tiered.has_pending_work()

    def reset_cache(self) -> None:
        """vLLM drops the completions of jobs in flight now: their keys are forgotten and
        their slots fenced (see the module docstring)."""
        self._tiered.reset_cache()
        self._stamps.clear()
        if not _FLUSH_SIGNAL:
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


def _events_config(config: VllmOffloadingConfig, extra_config: Any) -> Any:
    """vLLM's event settings for this spec: as vLLM's own, except that stores are
    self-describing (block hashes, tokens, block size) unless ``self_describing_kv_events``
    in the extra config is ``false``."""
    described = extra_config.get("self_describing_kv_events", True)
    if not isinstance(described, bool):
        raise ConfigError(
            f"expected true or false, got {described!r}",
            path=f"{EXTRA_CONFIG}.self_describing_kv_events",
        )
    return vbase.OffloadingKVEventsConfig(
        enable_kv_cache_events=config.enable_kv_cache_events,
        self_describing_kv_events=described,
    )


def _byte_rows(tensor: Any, index: int) -> Any:
    """``tensor`` as a ``(num_blocks, row_bytes)`` uint8 view (never a copy)."""
    import torch

    try:
        rows = tensor if tensor.dim() == 2 else tensor.view(tensor.shape[0], -1)
        return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)
    except RuntimeError as exc:
        raise ConfigError(
            f"KV tensor {index} of shape {tuple(tensor.shape)} cannot be viewed as "
            f"(num_blocks, bytes) without a copy: {exc}",
            path="kv_caches",
        ) from None


def kv_cache_tensors(kv_caches: Any) -> KVCacheTensors:
    """kvtiers' description of vLLM's ``CanonicalKVCaches`` (byte views, no copies)."""
    return KVCacheTensors(
        tensors=[_byte_rows(t.tensor, i) for i, t in enumerate(kv_caches.tensors)],
        groups=[
            [KVTensorRef(tensor_idx=ref.tensor_idx, page_bytes=ref.page_size_bytes) for ref in refs]
            for refs in kv_caches.group_data_refs
        ],
    )


class KVTiersWorker(vbase.OffloadingWorker):
    """vLLM's worker API over a kvtiers worker (see the module docstring).

    Jobs run in submission order; an ``expedited`` load is not reordered.
    """

    def __init__(
        self,
        worker: OffloadingWorker,
        num_groups: int,
        on_shutdown: Callable[[], None] | None = None,
        *,
        shard: tuple[int, ShardLedger] | None = None,
    ) -> None:
        self.worker = worker
        self._num_groups = num_groups
        self._on_shutdown = on_shutdown
        self._closed = False
        # A sharded engine's rank and ledger, and each store job's (stamp, slots) in flight.
        self._shard = shard
        self._stores: dict[int, tuple[int, np.ndarray[Any, np.dtype[np.int64]]]] = {}

    def split(self, gpu: Any, offloaded: Any) -> list[GroupTransfer]:
        """One transfer per group from a packed GPU spec and the manager's spec."""
        if not isinstance(offloaded, KVTiersLoadStoreSpec):
            raise TypeError(f"expected a KVTiersLoadStoreSpec, got {offloaded!r}")
        sizes = list(gpu.group_sizes)
        indices = list(gpu.block_indices)
        if not len(sizes) == len(offloaded.groups) == self._num_groups:
            raise ValueError(
                f"{len(sizes)} GPU groups and {len(offloaded.groups)} offloaded groups for "
                f"{self._num_groups} KV-cache groups"
            )
        block_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        transfers = []
        start = 0
        for size, index, spec in zip(sizes, indices, offloaded.groups, strict=True):
            group_spec = copy.copy(spec).set_gpu_block_offset(index)
            transfers.append(
                GroupTransfer(GPULoadStoreSpec(block_ids[start : start + size]), group_spec)
            )
            start += size
        return transfers

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        transfers = self.split(src_spec, dst_spec)
        if self._shard is not None:
            self._stores[job_id] = (dst_spec.stamp, _store_slots(dst_spec))
        return self.worker.submit_store(job_id, transfers)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self.worker.submit_load(job_id, self.split(dst_spec, src_spec))

    def get_finished(self) -> list[Any]:
        results = self.worker.get_finished()
        if self._shard is not None:
            results = [self._stamped(r) for r in results]
        return [
            vbase.TransferResult(
                job_id=r.job_id,
                success=r.success,
                transfer_size=r.transfer_bytes,
                transfer_time=r.transfer_s,
            )
            for r in results
        ]

    def _stamped(self, result: TransferResult) -> TransferResult:
        """A sharded rank's result: a store that completed stamps its slots in the
        ledger; one that failed stamps nothing and is reported finished, so the scheduler
        (which checks every rank's stamps) frees its chunks for every rank instead of vLLM
        stopping the engine."""
        store = self._stores.pop(result.job_id, None)
        if store is None:
            return result
        assert self._shard is not None
        rank, ledger = self._shard
        if result.success:
            stamp, slots = store
            ledger.stamp(rank, slots, stamp)
            return result
        logger.warning(
            "kvtiers: rank %d failed store job %d; its chunks will not be published",
            rank,
            result.job_id,
        )
        return dataclasses.replace(result, success=True, transfer_bytes=0)

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.worker.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown()


def _store_slots(spec: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Every primary slot a sharded store job writes (its stamp must be set)."""
    if not isinstance(spec, KVTiersLoadStoreSpec) or spec.stamp <= 0:
        raise ValueError(
            f"a sharded engine's store needs a stamped KVTiersLoadStoreSpec, got {spec!r}"
        )
    slots = []
    for group in spec.groups:
        if not isinstance(group, CPULoadStoreSpec):
            raise TypeError(f"a sharded engine's primary is a cpu tier, got {group!r}")
        slots.append(np.asarray(group.slot_ids, dtype=np.int64))
    return np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)


def _read_stack(extra_config: Any) -> StackConfig:
    path = extra_config.get("kvtiers_config")
    inline = extra_config.get("kvtiers")
    if (path is None) == (inline is None):
        raise ConfigError(
            "give exactly one of kvtiers_config (the path of a stack YAML file) or kvtiers "
            "(the stack as an inline mapping)",
            path=EXTRA_CONFIG,
        )
    return load_stack_config(path if path is not None else inline)


def _shared_memory_prefix() -> str:
    return f"kvtiers-{os.geteuid()}-"


def shared_memory_name(engine_id: str) -> str:
    """The ``/dev/shm`` name both of an engine's processes derive for its cpu primary:
    ``kvtiers-<uid>-<sha256 of the engine id, 16 hex digits>``. Scoped to the user and the
    engine (vLLM's default engine id is a random UUID, so the name is not guessable), and
    short whatever the id; the region itself refuses a file it did not make."""
    digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{_shared_memory_prefix()}{digest[:16]}"


def _check_one_node(engine: Any, ranks: int) -> None:
    """Refuse an engine whose ranks span nodes: they cannot map one primary region."""
    if engine is None:
        return
    nodes = int(getattr(engine.vllm.parallel_config, "nnodes_within_dp", 1) or 1)
    if nodes > 1:
        raise ConfigError(
            f"kvtiers' vLLM spec shares its cpu tier between the ranks of one node, and this "
            f"engine's {ranks} ranks span {nodes} nodes; use route 2 (vLLM's "
            "TieringOffloadingSpec with KVTiersFileTier / KVTiersS3Tier) instead",
            path="parallel",
        )


def _slot_region(tier: BuiltTier) -> SlotRegion:
    if not isinstance(tier.region, SlotRegion):
        raise ConfigError(
            f"tier {tier.name!r}: a sharded engine's primary must be a cpu tier",
            path="tiers[0].kind",
        )
    return tier.region


def _share_primary(stack: StackConfig, engine_id: str) -> StackConfig:
    """``stack`` with a cpu primary placed in ``/dev/shm`` under a per-engine name."""
    primary = stack.tiers[0]
    if not isinstance(primary, CPUTierConfig) or primary.shared_memory_name is not None:
        return stack
    # A killed engine leaves its region (and ledger) behind under a name no later engine
    # derives: remove this user's that no process maps before adding another.
    remove_left_overs(_shared_memory_prefix())
    name = shared_memory_name(engine_id)
    shared = dataclasses.replace(primary, shared_memory_name=name)
    return dataclasses.replace(stack, tiers=(shared, *stack.tiers[1:]))


class KVTiersOffloadingSpec(vbase.OffloadingSpec):
    """vLLM's offloading spec for a kvtiers stack.

    ``kv_connector_extra_config`` keys: ``kvtiers_config`` (a stack YAML path) or
    ``kvtiers`` (the stack inline); optional ``model_revision``, ``kvtiers_salt``,
    ``kvtiers_parallel_agnostic``, ``prefix_caching_hash_algo`` (when the engine's config
    cannot be read; it must agree when it can), ``kvtiers_identity`` (see
    :func:`~kvtiers.integrations.vllm.translate.identity_source`),
    ``kvtiers_group_bytes_per_block`` (see
    :func:`~kvtiers.integrations.vllm.translate.derived_group_bytes`) and
    ``self_describing_kv_events`` (default true here). Every other identity
    input is read from the configs of the vLLM connector building the spec (see
    :mod:`kvtiers.integrations.vllm.engine`).
    """

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels :meth:`KVTiersManager.config_info` fills (vLLM's info metric)."""
        return _CONFIG_INFO_KEYS

    def __init__(self, config: VllmOffloadingConfig) -> None:
        super().__init__(config)
        self.kv_events_config = _events_config(config, self.extra_config)
        if config.canonical_layout:
            raise ConfigError(
                "canonical_layout is not supported by kvtiers' vLLM spec; remove it",
                path=f"{EXTRA_CONFIG}.canonical_layout",
            )
        # Read here, while vLLM's connector is building this spec (never stored: the spec
        # is pickled to workers).
        engine = find_engine_configs()
        par = config.parallel
        #: Ranks whose workers share the primary's slots (1: one worker per engine).
        self.ranks = par.world_size
        if self.ranks > 1:
            _check_one_node(engine, self.ranks)
        self.hash_algorithm = block_hash_algorithm(self.extra_config, engine)
        #: One rank's bytes per block of each group (what its KV tensors hold).
        self.rank_group_bytes = derived_group_bytes(config)
        stack_config = _read_stack(self.extra_config)
        persistent = any(get_kind(tier.kind).persistent for tier in stack_config.tiers)
        self.offloading: OffloadingConfig = translate_config(
            config,
            engine=engine,
            # A chunk holds every rank's pages; pipeline stages hold different layers, so
            # their chunks are never those of another layout.
            group_bytes_per_block=[n * self.ranks for n in self.rank_group_bytes],
            hash_algorithm=self.hash_algorithm,
            layout_agnostic=par.is_parallelism_agnostic and par.pp_size == 1,
            persistent=persistent,
        )
        self.stack_config = _share_primary(stack_config, config.engine_id)
        if self.ranks > 1 and not isinstance(self.stack_config.tiers[0], CPUTierConfig):
            raise ConfigError(
                f"with {self.ranks} ranks (tensor / pipeline parallel) the first tier must be "
                f"a cpu tier, which every rank shares; got kind "
                f"{self.stack_config.tiers[0].kind!r}",
                path="tiers[0].kind",
            )
        if persistent:
            warn_unstable_hashes(self.hash_algorithm)
        self.keys = KeyMap([group.group_id for group in config.groups])
        #: What a reset's fence waits for on vLLM 0.32 (see :func:`reset_grace_steps`).
        self.reset_grace_steps = reset_grace_steps(engine, par.pp_size)
        self._manager: KVTiersManager | None = None

    def get_manager(self) -> KVTiersManager:
        """The scheduler's manager; builds the whole stack on first call."""
        if self._manager is None:
            stack = load_stack(self.stack_config, self.offloading)
            ledger = None
            if self.ranks > 1:
                try:
                    ledger = self._ledger(_slot_region(stack.tiers[0]))
                except BaseException:
                    stack.shutdown()
                    raise
            self._manager = KVTiersManager(
                stack,
                self.keys,
                events_enabled=self.config.enable_kv_cache_events,
                ledger=ledger,
                reset_grace_steps=self.reset_grace_steps,
            )
        return self._manager

    def get_worker(self, kv_caches: Any) -> KVTiersWorker:
        """A worker over ``kv_caches``; in a process without the manager it builds only
        the primary tier (attached to the shared primary memory)."""
        kv = kv_cache_tensors(kv_caches)
        self._check_geometry(kv)
        num_groups = len(self.offloading.groups)
        if self.ranks > 1:
            return self._rank_worker(kv)
        if self._manager is not None:
            return KVTiersWorker(self._manager.stack.make_worker(kv), num_groups)
        worker, primary = build_primary_worker(self.stack_config, self.offloading, kv)
        return KVTiersWorker(worker, num_groups, primary.shutdown)

    def _ledger(self, region: SlotRegion) -> ShardLedger:
        """The shard ledger beside the shared primary ``region`` (see the module docstring)."""
        primary = self.stack_config.tiers[0]
        # __init__ made sure of both for a sharded engine.
        assert isinstance(primary, CPUTierConfig) and primary.shared_memory_name is not None
        return ShardLedger(region.num_slots, self.ranks, ledger_name(primary.shared_memory_name))

    def _rank_worker(self, kv: KVCacheTensors) -> KVTiersWorker:
        """This rank's worker: its pages go to its place in the shared primary's slots
        (see the module docstring)."""
        rank = self.config.parallel.rank
        geometry = ChunkGeometry(self.offloading.cache.blocks_per_chunk, self.rank_group_bytes)
        owned: BuiltTier | None = None
        if self._manager is not None:
            region = _slot_region(self._manager.stack.tiers[0])
        else:
            tier_config = self.stack_config.tiers[0]
            factory = resolve_factory(tier_config.kind, path="tiers[0].kind")
            owned = factory(tier_config, self.offloading, primary_region=None,
                            name=tier_config.name)
            region = _slot_region(owned)
        ledger: ShardLedger | None = None
        try:
            ledger = self._ledger(region)
            worker = CpuWorker(kv, region, geometry, shard=(rank, self.ranks))
        except BaseException:
            if ledger is not None:
                ledger.close()
            if owned is not None:
                owned.shutdown()
            raise
        closing = ledger

        def close() -> None:
            closing.close()
            if owned is not None:
                owned.shutdown()

        return KVTiersWorker(worker, len(self.offloading.groups), close, shard=(rank, ledger))

    def _check_geometry(self, kv: KVCacheTensors) -> None:
        expected = list(self.rank_group_bytes)
        actual = [kv.group_bytes_per_block(g) for g in range(len(kv.groups))]
        if actual != expected:
            raise ConfigError(
                f"the engine's KV tensors hold {actual} bytes per block per group but the "
                f"scheduler derived {expected}; set kvtiers_group_bytes_per_block: {actual}",
                path=f"{EXTRA_CONFIG}.kvtiers_group_bytes_per_block",
            )
