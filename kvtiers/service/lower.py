"""The tiers below the service's pool: one composite stack per namespace, the pool its
primary.

The service's stack file may name tiers below its ``cpu`` pool (file, s3, fsspec). For
each namespace an engine attaches with a parseable cache identity, the service builds
those tiers with that identity (so each namespace's chunks land in the lower tiers under
the identity's own namespace, as in process) and puts them under a
:class:`~kvtiers.stack.composite.TieredManager` whose primary is :class:`PoolPrimary`:
the pool's slots of that namespace, kept by the service. Everything between the pool and
the lower tiers is then the composite's own machinery, unchanged: cascades to ``through``
tiers when a store is committed (the slot pinned while the mover reads it), promotions on
a lookup that misses the pool and hits below, the lower tiers' background index, their
movers' two classes of work (a promotion's read on the foreground pool, every store,
listing and deletion on the background one, below it: a read never queues behind a
write).

Owns: :class:`PoolPrimary`, :class:`LowerTiers` (one namespace's stack, its probes and
its status) and :func:`identity_config` (a namespace identity's JSON back to the
:class:`~kvtiers.core.config.OffloadingConfig` the tier factories take; refused unless it
gives back the very same identity).

Probe answers (:data:`~kvtiers.service.protocol.PROBE_HIT` and the others) are what the
engine's ``kind: service`` tier turns into ``HIT``/``RETRY``/``MISS``. A
:class:`LowerTiers` is built on a thread of its own (opening a medium may take requests)
and from then on used on the service's loop thread alone; only the movers' copies (and
the tiers' index builds and listings) run elsewhere.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Container, Iterable, Mapping
from typing import Any, Protocol

from kvtiers.config import StackConfig
from kvtiers.config.tiers import LowerTierConfig
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import KeyFormat, OffloadKey
from kvtiers.core.manager import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.mover import HostRegion
from kvtiers.core.primary import SlotState, holds
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError, UnknownKeyError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.service.protocol import PROBE_HIT, PROBE_MISS, PROBE_PENDING, PROBE_RETRY
from kvtiers.stack.builder import build_tier_at
from kvtiers.stack.composite import TieredManager

log = logging.getLogger("kvtiers.service")

_ANSWER = {
    LookupResult.HIT: PROBE_HIT,
    LookupResult.HIT_PENDING: PROBE_PENDING,
    LookupResult.MISS: PROBE_MISS,
    LookupResult.RETRY: PROBE_RETRY,
}
_STEP = ScheduleEndContext()


class PoolKeeper(Protocol):
    """What :class:`PoolPrimary` asks of the service that keeps the pool's bookkeeping
    (``ns`` is a namespace's index in the pool's table)."""

    def ready_slot(self, ns: int, key: bytes) -> int | None:
        """The slot holding ``key``'s chunk ready, or ``None``."""
        ...

    def writing_slot(self, ns: int, key: bytes) -> int | None:
        """The slot ``key`` is being written into (by an engine or a promotion)."""
        ...

    def reserve_promotion(self, ns: int, key: bytes) -> int | None:
        """A slot for ``key`` (marked being written, evicting the least recently used
        unpinned chunk if none is free), or ``None`` when none can be freed."""
        ...

    def end_promotion(self, ns: int, key: bytes, slot: int, length: int) -> None:
        """``key``'s promotion into ``slot`` ended: publish its first ``length`` bytes
        (checksummed), or free the slot (``length`` 0: the bytes did not arrive)."""
        ...

    def pin_slot(self, slot: int) -> None: ...

    def unpin_slot(self, slot: int) -> None: ...

    def free_slot_count(self) -> int: ...

    def eviction_count(self) -> int:
        """Chunks the pool evicted so far (every namespace's)."""
        ...

    def evict_held(self, ns: int, count: int, protected: Container[bytes]) -> dict[bytes, int]:
        """Evict up to ``count`` of namespace ``ns``'s least recently used ready chunks,
        neither pinned, in ``protected`` nor within another tenant's protected share,
        holding their slots (never reused, their bytes unchanged) until
        :meth:`release_held`; key → slot."""
        ...

    def hold_free(self, ns: int, count: int) -> list[int]:
        """Hold up to ``count`` free slots for namespace ``ns`` (a second hop's
        staging)."""
        ...

    def detach_promotion(self, ns: int, key: bytes, slot: int) -> None:
        """Give up ``key``'s promotion into ``slot`` (the key is gone), holding the slot
        until :meth:`release_held`."""
        ...

    def release_held(self, slots: Iterable[int]) -> None:
        """Free held slots; :class:`~kvtiers.errors.UnknownKeyError`, changing nothing,
        for a slot not held."""
        ...


class PoolPrimary(OffloadingManager):
    """One namespace's part of the pool as a composite's primary (a
    :class:`~kvtiers.core.primary.HoldingPrimary`: the composite's demotions to
    ``write: back`` tiers evict this namespace's chunks with their slots held while the
    movers copy them down, as in process).

    ``prepare_store``/``complete_store`` are a promotion's: a slot reserved by the service,
    published with its checksum when the bytes arrived. A key the engines store is
    published by the service at its ``Commit``; the composite's ``complete_store`` of it
    (which cascades it) reaches here as a key this primary did not reserve, and is left
    alone. ``prepare_load``/``complete_load`` pin a ready chunk's slot while a cascade
    reads it (the service never evicts a pinned slot)."""

    medium = Medium.CPU
    capabilities = TierCapabilities(persistent=False, evicts=True, recency=True, events=False)

    def __init__(self, keeper: PoolKeeper, ns: int, length: int) -> None:
        self._keeper = keeper
        self._ns = ns
        #: The length a promoted chunk is published with (the engines commit this too).
        self._length = length
        #: Promotions in flight: key → slot.
        self._promoting: dict[OffloadKey, int] = {}
        #: Cascades reading: key → [slot, pins].
        self._reading: dict[OffloadKey, list[int]] = {}

    # -- SlottedPrimary ---------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self._keeper.free_slot_count()

    def slot_of(self, key: OffloadKey) -> int | None:
        slot = self._keeper.ready_slot(self._ns, key)
        return slot if slot is not None else self._keeper.writing_slot(self._ns, key)

    def slot_state(self, key: OffloadKey) -> SlotState:
        if self._keeper.ready_slot(self._ns, key) is not None:
            return SlotState.READY
        if self._keeper.writing_slot(self._ns, key) is not None:
            return SlotState.WRITING
        return SlotState.FREE

    # -- HoldingPrimary -----------------------------------------------------------------
    @property
    def evictions(self) -> int:
        return self._keeper.eviction_count()

    def evict_held(self, count: int,
                   protected: Collection[OffloadKey] = ()) -> dict[OffloadKey, int]:
        held = self._keeper.evict_held(self._ns, count, protected)
        return {OffloadKey(key): slot for key, slot in held.items()}

    def hold_free(self, count: int) -> list[int]:
        return self._keeper.hold_free(self._ns, count)

    def detach_writing(self, keys: Collection[OffloadKey]) -> dict[OffloadKey, int]:
        held: dict[OffloadKey, int] = {}
        for key in keys:
            slot = self._promoting.pop(key, None)
            if slot is not None:
                self._keeper.detach_promotion(self._ns, key, slot)
                held[key] = slot
        return held

    def release_held(self, slots: Iterable[int]) -> None:
        self._keeper.release_held(slots)

    # -- the manager contract -----------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        state = self.slot_state(key)
        if state is SlotState.READY:
            return LookupResult.HIT
        return LookupResult.HIT_PENDING if state is SlotState.WRITING else LookupResult.MISS

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        accepted: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            if self.slot_state(key) is not SlotState.FREE:
                continue
            slot = self._keeper.reserve_promotion(self._ns, key)
            if slot is None:
                return accepted or None
            self._promoting[key] = slot
            accepted.append(key)
        return accepted

    def complete_store(self, keys: Collection[OffloadKey], ctx: ReqContext,
                       success: bool = True, *, generation: int | None = None) -> None:
        for key in keys:
            slot = self._promoting.pop(key, None)
            if slot is not None:
                self._keeper.end_promotion(self._ns, key, slot,
                                           self._length if success else 0)

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        slots = []
        for key in keys:
            slot = self._keeper.ready_slot(self._ns, key)
            if slot is None:
                raise UnknownKeyError("prepare_load: a key the pool does not hold ready")
            slots.append(slot)
        for key, slot in zip(keys, slots, strict=True):
            self._keeper.pin_slot(slot)
            entry = self._reading.setdefault(key, [slot, 0])
            entry[1] += 1

    def get_spec(self, keys: Collection[OffloadKey]) -> CPULoadStoreSpec:
        ids = []
        for key in keys:
            slot = self._promoting.get(key)
            if slot is None:
                entry = self._reading.get(key)
                if entry is None:
                    raise UnknownKeyError("get_spec: a key neither promoted nor pinned here")
                slot = entry[0]
            ids.append(slot)
        return CPULoadStoreSpec(ids)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext, *,
                      generation: int | None = None) -> None:
        for key in keys:
            entry = self._reading.get(key)
            if entry is None:
                raise UnknownKeyError("complete_load: a key this primary has not pinned")
            self._keeper.unpin_slot(entry[0])
            entry[1] -= 1
            if entry[1] <= 0:
                del self._reading[key]

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def get_stats(self) -> Mapping[str, float]:
        return {"promoting": len(self._promoting), "reading": len(self._reading)}


def identity_config(identity: bytes) -> OffloadingConfig:
    """The :class:`OffloadingConfig` whose namespace identity is the canonical JSON
    ``identity`` (what an engine attaches with); :class:`ConfigError` when it does not
    parse or does not give back the same bytes (the lower tiers would then file this
    namespace's chunks under another one)."""
    try:
        data = json.loads(identity)
    except ValueError as exc:
        raise ConfigError(f"the identity is not JSON: {exc}", path="identity") from None
    parsed = NamespaceIdentity.from_dict(data)
    par = parsed.parallel
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(g.tokens_per_block, g.layer_names,
                                           g.bytes_per_block, g.attention)
                     for g in parsed.groups),
        model=OffloadingModelConfig(
            parsed.model_name, parsed.model_revision, parsed.kv_dtype, parsed.kv_layout,
            parsed.model_fingerprint, parsed.compute_dtype, parsed.quantization,
            parsed.kv_scales, parsed.model_overrides, parsed.draft_model,
            parsed.canonical_format, parsed.load_format, parsed.model_config,
        ),
        cache=OffloadingCacheConfig(parsed.tokens_per_hash, parsed.blocks_per_chunk,
                                    parsed.hash_algorithm),
        parallel=OffloadingParallelConfig(is_parallelism_agnostic=True) if par is None
        else OffloadingParallelConfig(world_size=par.world_size, tp_size=par.tp_size,
                                      pp_size=par.pp_size, pcp_size=par.pcp_size,
                                      dcp_size=par.dcp_size),
        engine=parsed.engine,
        salt=parsed.salt,
        identity_source=parsed.identity_source,
    )
    if NamespaceIdentity.from_config(config).canonical_json() != identity:
        raise ConfigError("the identity does not round-trip (another chunk format or "
                          "schema version than this service's)", path="identity")
    return config


class LowerTiers:
    """One namespace's lower tiers under the pool (see the module docstring)."""

    def __init__(self, config: StackConfig, offloading: OffloadingConfig, region: HostRegion,
                 keeper: PoolKeeper, ns: int, *, headroom: int = 0) -> None:
        """``headroom``: with ``write: back`` tiers, the pool's slots kept free at each
        step by demoting this namespace's least recently used chunks (the engines'
        stores take slots the composite does not see reserved)."""
        geometry = ChunkGeometry.from_config(offloading)
        self.primary = PoolPrimary(keeper, ns, geometry.max_chunk_bytes)
        head = config.tiers[0]
        tiers: list[BuiltTier] = [BuiltTier(name=head.name, manager=self.primary,
                                            region=region)]
        try:
            for index in range(1, len(config.tiers)):
                tiers.append(build_tier_at(config, index, offloading, region))
            self.manager = TieredManager(tiers, keys=KeyFormat.for_algorithm(
                len(offloading.groups), offloading.cache.hash_algorithm))
        except BaseException:
            for tier in reversed(tiers[1:]):
                tier.shutdown()
            raise
        self.tiers = tiers
        self._probes = 0
        self.manager.keep_free(headroom)
        #: Chunks the pool evicted before a demotion took them (see evicted_by_pool).
        self._dropped = 0
        #: The tiers a chunk evicted from the pool is not lost from once they hold it.
        self._writing = [t.manager for t in tiers[1:] if t.admission != "never"]
        #: Whether a ``write: back`` tier is below the pool (demotions at eviction).
        self.demotes = any(
            isinstance(tier, LowerTierConfig) and tier.write == "back"
            for tier in config.tiers[1:]
        )
        #: Chunks the pool re-adopted at the service's start, cascaded once every lower
        #: tier's index is complete (each tier skips the chunks it holds already).
        self._readopted: dict[bytes, None] = {}

    def probe(self, keys: list[bytes]) -> list[int]:
        """Each key's probe answer (:data:`~kvtiers.service.protocol.PROBE_HIT`...); a
        lower-tier hit starts its promotion (submitted at the next :meth:`step`)."""
        self._probes += 1
        ctx = ReqContext(req_id=f"kvtiers-probe-{self._probes}")
        try:
            return [_ANSWER[self.manager.lookup(OffloadKey(key), ctx)] for key in keys]
        finally:
            self.manager.on_request_finished(ctx)

    def valid(self, keys: Iterable[bytes]) -> list[bytes]:
        """The ``keys`` that are this cache's (the composite's door refuses the others)."""
        key_format = self.manager.key_format
        kept = []
        for key in keys:
            try:
                key_format.check_all([key], "committed")
            except ValueError:
                continue
            kept.append(key)
        return kept

    def evicted_by_pool(self, key: bytes) -> bool:
        """The pool evicted ``key`` by itself (not a demotion): whether that lost it to
        the ``write: back`` tiers (none holds it; counted as dropped)."""
        lost = self.demotes and not any(holds(m, OffloadKey(key)) for m in self._writing)
        self._dropped += lost
        return lost

    def committed(self, keys: list[bytes]) -> None:
        """Engines committed ``keys`` into the pool: cascade them (write-behind)."""
        if keys:
            self.manager.complete_store([OffloadKey(k) for k in keys],
                                        ReqContext(req_id="kvtiers-commit"))

    def readopted(self, keys: Iterable[bytes]) -> None:
        """The pool re-adopted ``keys`` (this namespace's) at the service's start: a chunk
        committed just before the last stop may not have reached the lower tiers, so each
        is cascaded once the tiers' indexes are complete, if the pool holds it still."""
        self._readopted.update(dict.fromkeys(self.valid(keys)))

    def _indexing(self) -> bool:
        """Whether a lower tier's index is still being built (one whose build failed
        is not: its tier then takes what it already holds as a new store)."""
        return any(getattr(t.manager, "index_building", False) for t in self.tiers[1:])

    def step(self) -> None:
        """Take in the movers' finished jobs (and the lower tiers' finished index
        builds), submit the promotions held, and cascade the re-adopted chunks once the
        lower tiers know what they hold."""
        self.manager.on_schedule_end(_STEP)
        if self._readopted and not self._indexing():
            primary = self.primary
            keys = [k for k in self._readopted
                    if primary.slot_state(OffloadKey(k)) is SlotState.READY]
            self._readopted = {}
            self.committed(keys)

    @property
    def busy(self) -> bool:
        """Whether a copy is in flight or a lower tier still works on its own (an index
        being built), or re-adopted chunks wait for their cascade: the loop then polls."""
        return bool(self._readopted) or self.manager.has_pending_work()

    def state(self) -> list[dict[str, Any]]:
        """What ``kvtiers status`` shows of each lower tier."""
        stats = self.manager.get_stats()
        rows = []
        for tier in self.tiers[1:]:
            manager = tier.manager
            index = getattr(manager, "index", None)
            rows.append({
                "name": tier.name,
                "chunks": len(index) if index is not None else None,
                "indexed": bool(getattr(manager, "index_complete", True)),
                **{f"{moved}{unit}": stats.get(f"{tier.name}.{moved}{unit}", 0)
                   for moved in ("cascaded", "promoted", "demoted")
                   for unit in ("", "_bytes")},
            })
        return rows

    def counters(self) -> dict[str, float]:
        """The composite's own counters (promotions, cascades, demotions, failures), the
        chunks the pool evicted before their demotion among the dropped."""
        stats = self.manager.get_stats()
        counters = {name: stats[name] for name in (
            "promotions", "promotion_failures", "promotions_refused", "cascades",
            "cascade_failures", "cascades_refused", "demotions", "demotion_failures",
            "demotions_refused", "demotions_dropped", "corrupt_chunks")}
        counters["demotions_dropped"] += self._dropped
        return counters

    def wait_idle(self) -> None:
        """Finish every copy in flight (at a graceful stop)."""
        self.manager.wait_idle()

    def shutdown(self) -> None:
        self.manager.shutdown()
