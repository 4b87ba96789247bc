"""A tiny in-memory reference tier: the manager contract in its plainest form.

It exists to prove the conformance suite before real tiers arrive, and as a test double
for code built on top of managers. Chunks live in a bytes dict addressed by slot ids; the
eviction policy is LRU over ready, unpinned chunks. Not for production use.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    TierCapabilities,
)
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.errors import UnknownKeyError


@dataclass
class _Entry:
    slot: int
    ready: bool = False
    pins: int = 0


class InMemoryTier(OffloadingManager):
    """An LRU tier of ``capacity_chunks`` slots; ``data[slot]`` holds each chunk's bytes."""

    capabilities = TierCapabilities(persistent=False, evicts=True, recency=True, events=True)
    medium = Medium.CPU

    def __init__(self, capacity_chunks: int) -> None:
        if capacity_chunks <= 0:
            raise ValueError("capacity_chunks must be positive")
        self.capacity_chunks = capacity_chunks
        self.data: dict[int, bytes] = {}
        self._entries: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self._free_slots = list(range(capacity_chunks - 1, -1, -1))
        self._events: list[OffloadingEvent] = []
        self._stats = {"hits": 0, "misses": 0, "stores": 0, "store_failures": 0,
                       "evictions": 0, "loads": 0}

    def _drop(self, key: OffloadKey) -> None:
        """Forget ``key`` and free its slot (subclasses also drop their stored bytes)."""
        slot = self._entries.pop(key).slot
        self._free_slots.append(slot)
        self.data.pop(slot, None)

    def _insert_ready(self, key: OffloadKey) -> bool:
        """Track an already-stored chunk (index rebuild); False when no slot is free."""
        if key in self._entries or not self._free_slots:
            return False
        self._entries[key] = _Entry(slot=self._free_slots.pop(), ready=True)
        return True

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        entry = self._entries.get(key)
        if entry is None:
            self._stats["misses"] += 1
            return LookupResult.MISS
        if not entry.ready:
            return LookupResult.HIT_PENDING
        self._stats["hits"] += 1
        return LookupResult.HIT

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        new_keys = list(dict.fromkeys(k for k in keys if k not in self._entries))
        shortfall = len(new_keys) - len(self._free_slots)
        victims: list[OffloadKey] = []
        if shortfall > 0:
            victims = [k for k, e in self._entries.items() if e.ready and not e.pins][:shortfall]
            if len(victims) < shortfall:
                return None
        for victim in victims:
            self._drop(victim)
        if victims:
            self._stats["evictions"] += len(victims)
            self._events.append(OffloadingEvent(victims, self.medium, removed=True))
        for key in new_keys:
            self._entries[key] = _Entry(slot=self._free_slots.pop())
        return new_keys

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                raise UnknownKeyError(f"prepare_load: {key.hex()} is not a HIT")
        for key in keys:
            self._entries[key].pins += 1
            self._entries.move_to_end(key)
        self._stats["loads"] += len(keys)

    def get_spec(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        slots = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or (entry.ready and not entry.pins):
                raise UnknownKeyError(f"get_spec: {key.hex()} is neither reserved nor pinned")
            slots.append(entry.slot)
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        stored = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            if success:
                entry.ready = True
                stored.append(key)
            else:
                self._drop(key)
                self._stats["store_failures"] += 1
        if stored:
            self._stats["stores"] += len(stored)
            self._events.append(OffloadingEvent(stored, self.medium, removed=False))

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins:
                entry.pins -= 1

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        dropped = [k for k, e in self._entries.items() if e.ready and not e.pins]
        for key in dropped:
            self._drop(key)
        if dropped:
            self._events.append(OffloadingEvent(dropped, self.medium, removed=True))

    def get_stats(self) -> Mapping[str, float]:
        ready = sum(1 for e in self._entries.values() if e.ready)
        return {**self._stats, "chunks": ready, "capacity_chunks": self.capacity_chunks}
