"""A tiny in-memory tier: the manager contract in its plainest form.

It exists to prove the conformance suite before real tiers arrive, and as a test double
for code built on top of managers. Chunks live in a bytes dict addressed by slot ids; the
eviction policy is LRU over ready, unpinned chunks. Not for production use.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

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
from kvtiers.tiers.compact import CompactChunkIndex


class InMemoryTier(OffloadingManager):
    """An LRU tier of ``capacity_chunks`` slots; ``data[slot]`` holds each chunk's bytes.

    Its :class:`~kvtiers.tiers.compact.CompactChunkIndex` (``index``) counts chunks: each key has
    size 1 and the capacity is ``capacity_chunks``."""

    capabilities = TierCapabilities(persistent=False, evicts=True, recency=True, events=True)
    medium = Medium.CPU

    def __init__(self, capacity_chunks: int) -> None:
        if capacity_chunks <= 0:
            raise ValueError("capacity_chunks must be positive")
        self.capacity_chunks = capacity_chunks
        self.data: dict[int, bytes] = {}
        self.index = CompactChunkIndex(
            capacity_chunks, tier=f"the {type(self).__name__} tier", medium=self.medium,
            locality=self.locality,
        )
        self._slots: dict[OffloadKey, int] = {}
        self._free_slots = list(range(capacity_chunks - 1, -1, -1))

    def _release(self, keys: Iterable[OffloadKey]) -> None:
        """Free the slots of keys the index dropped (subclasses also drop stored bytes)."""
        for key in keys:
            slot = self._slots.pop(key)
            self._free_slots.append(slot)
            self.data.pop(slot, None)

    def _insert_ready(self, keys: Iterable[OffloadKey]) -> None:
        """Track already-stored chunks (index rebuild), evicting the oldest beyond
        capacity."""
        change = self.index.add_ready((key, 1) for key in keys)
        # Victims among the keys just added never had a slot.
        self._release(key for key in change.victims if key in self._slots)
        for key in change.keys:
            if key in self.index:
                self._slots[key] = self._free_slots.pop()

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return self.index.lookup(key)

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        change = self.index.reserve(keys, 1)
        if change is None:
            return None
        self._release(change.victims)
        for key in change.keys:
            self._slots[key] = self._free_slots.pop()
        return change.keys

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.index.pin(keys)

    def get_spec(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        self.index.require_addressable(keys)
        return CPULoadStoreSpec([self._slots[key] for key in keys])

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.index.touch(keys)

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        # A reset keeps every reservation and pin here, so every completion is current.
        done = self.index.finish(keys, success)
        if not success:
            self._release(done)

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        self._release(self.index.unpin(keys))

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.index.take_events()

    def reset_cache(self) -> None:
        self._release(self.index.clear_ready())

    def get_stats(self) -> Mapping[str, float]:
        stats = dict(self.index.stats())
        del stats["discarded"]
        return {**stats, "capacity_chunks": self.capacity_chunks}
