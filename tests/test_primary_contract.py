"""Core's primary-tier contract (:mod:`kvtiers.core.primary`): the stack decides staging
when it is built, the cpu tier is one implementation of the protocols, and a minimal
primary written against core alone (:class:`SlotPrimary`) passes the shipped conformance
kit by itself and in a stack over the file tier, write-back demotion included."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvtiers.config import load_stack_config
from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.primary import DirectPrimary, HoldingPrimary, SlotState, SlottedPrimary
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.core.tier import BuiltTier, WriteRules
from kvtiers.errors import UnknownKeyError
from kvtiers.filemapper import FileMapper
from kvtiers.stack.builder import load_stack, stages
from kvtiers.stack.composite import TieredManager
from kvtiers.testing.conformance import (
    TierConformanceTests,
    conformance_key,
    conformance_payload,
)
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.cpu.manager import CpuTierManager
from kvtiers.tiers.file.io import PosixBackend
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import BadChunkHandler, FileMover
from tests.test_file_support import IDENTITY

MODEL = {
    "name": "test/primary",
    "tokens_per_hash": 16,
    "blocks_per_chunk": 1,
    "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}],
}


def stack_file(root: Path, **file_tier: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"kind": "cpu", "capacity": "16KiB"},
            {"kind": "file", "root": str(root), "io": "posix", "threads": 1, **file_tier},
        ],
        "model": MODEL,
    }


@pytest.mark.parametrize(
    ("file_tier", "expected"),
    [
        ({}, True),
        ({"write": "back"}, False),
        ({"write_after_hits": 2}, False),
        ({"admission": "never"}, False),
    ],
)
def test_the_builder_decides_whether_the_primary_stages(
    tmp_path: Path, file_tier: dict[str, Any], expected: bool
) -> None:
    # Staging is the stack's decision, passed to the primary's factory: every chunk the
    # primary stores reaches a lower tier only under write: through with no count.
    config = stack_file(tmp_path, **file_tier)
    assert stages(load_stack_config(config)) is expected
    with load_stack(config) as stack:
        primary = stack.tiers[0].manager
        assert isinstance(primary, CpuTierManager)
        assert primary.staging is expected


def test_a_stack_of_one_primary_does_not_stage() -> None:
    assert stages(load_stack_config({"tiers": [{"kind": "cpu", "capacity": "16KiB"}],
                                     "model": MODEL})) is False


def test_the_cpu_tier_is_the_contracts_primary(tmp_path: Path) -> None:
    with load_stack(stack_file(tmp_path)) as stack:
        primary = stack.tiers[0].manager
        assert isinstance(primary, SlottedPrimary)
        assert isinstance(primary, HoldingPrimary)
        assert isinstance(primary, DirectPrimary)
        lower = stack.tiers[1].manager
        assert not isinstance(lower, HoldingPrimary)


# -- a primary written against core's contract alone --------------------------------------
class SlotPrimary(OffloadingManager):
    """A minimal primary over ``num_slots`` slots of a host region, written against core
    only (the manager contract and :class:`~kvtiers.core.primary.HoldingPrimary`), not the
    cpu tier: least recently used first, a reset fences the slots of keys being written or
    pinned until their jobs end. It proves a primary other than the cpu tier composes."""

    medium = Medium.CPU
    locality = Locality.LOCAL
    capabilities = TierCapabilities(persistent=False, evicts=True, recency=True, events=True)

    def __init__(self, num_slots: int) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        #: Ready keys, least recently used first.
        self._ready: OrderedDict[OffloadKey, int] = OrderedDict()
        self._writing: dict[OffloadKey, int] = {}
        self._pins: dict[OffloadKey, int] = {}
        self._held: set[int] = set()
        #: A reset's fence: key → its fenced slot; slot → completions it waits for.
        self._fenced: dict[OffloadKey, int] = {}
        self._fence_holds: dict[int, int] = {}
        self._events: list[OffloadingEvent] = []
        self._generation = 0
        self._counts = {"hits": 0, "misses": 0, "stores": 0, "evictions": 0}

    # -- the manager contract -----------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if key in self._ready:
            self._counts["hits"] += 1
            return LookupResult.HIT
        if key in self._writing:
            return LookupResult.HIT_PENDING
        self._counts["misses"] += 1
        return LookupResult.MISS

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        wanted = [k for k in dict.fromkeys(keys) if k not in self._ready
                  and k not in self._writing]
        if not wanted:
            return []
        short = len(wanted) - len(self._free)
        if short > 0:
            victims = self._victims(short, ctx.keep)
            if len(victims) == short:
                self._evict(victims, hold=False)
            elif self._free:
                wanted = wanted[: len(self._free)]  # the leading keys the free slots hold
            else:
                return None
        for key in wanted:
            self._writing[key] = self._free.pop()
        return wanted

    def get_spec(self, keys: Collection[OffloadKey]) -> CPULoadStoreSpec:
        slots = []
        for key in keys:
            slot = self._writing.get(key)
            if slot is None and key in self._pins:
                slot = self._ready[key]
            if slot is None:
                raise UnknownKeyError(f"get_spec: {key!r} is neither reserved nor pinned")
            slots.append(slot)
        return CPULoadStoreSpec(slots)

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True, *,
        generation: int | None = None,
    ) -> None:
        keys = list(dict.fromkeys(keys))
        stale = generation is not None and generation != self._generation
        for key in keys:
            mine = not stale and (key in self._writing or key in self._ready)
            if not mine and key not in self._fenced:
                raise UnknownKeyError(f"complete_store: {key!r} was not reserved")
        stored = []
        for key in keys:
            if stale or (key not in self._writing and key not in self._ready):
                self._unfence(key)
            elif key in self._writing:
                slot = self._writing.pop(key)
                if success:
                    self._ready[key] = slot
                    stored.append(key)
                else:
                    self._free.append(slot)
        if stored:
            self._counts["stores"] += len(stored)
            self._events.append(self._event(stored, removed=False))

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        missing = [key for key in keys if key not in self._ready]
        if missing:
            raise UnknownKeyError(f"prepare_load: {missing[0]!r} is not stored")
        for key in keys:
            self._pins[key] = self._pins.get(key, 0) + 1

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        stale = generation is not None and generation != self._generation
        named = Counter(keys)
        for key, count in named.items():
            held = 0 if stale else self._pins.get(key, 0)
            if held < count and (held or key not in self._fenced):
                raise UnknownKeyError(f"complete_load: {key!r} is pinned {held} times")
        for key, count in named.items():
            held = 0 if stale else self._pins.get(key, 0)
            if not held:
                for _ in range(count):
                    self._unfence(key)
            elif held == count:
                del self._pins[key]
            else:
                self._pins[key] = held - count

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(list(keys)):  # the batch's head ends the most recent
            if key in self._ready:
                self._ready.move_to_end(key)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    @property
    def generation(self) -> int:
        return self._generation

    def reset_cache(self) -> None:
        removed = list(self._ready)
        for key, slot in self._ready.items():
            if key in self._pins:
                self._fence(key, slot, self._pins[key])
            else:
                self._free.append(slot)
        for key, slot in self._writing.items():
            self._fence(key, slot, 1)
        self._ready.clear()
        self._writing.clear()
        self._pins.clear()
        self._generation += 1
        if removed:
            self._events.append(self._event(removed, removed=True))

    def on_reset_flushed(self) -> None:
        self._free.extend(self._fence_holds)
        self._fence_holds.clear()
        self._fenced.clear()

    def get_stats(self) -> Mapping[str, float]:
        return {**self._counts, "chunks": len(self._ready)}

    # -- core's HoldingPrimary ----------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def evictions(self) -> int:
        return self._counts["evictions"]

    def slot_of(self, key: OffloadKey) -> int | None:
        slot = self._ready.get(key)
        return self._writing.get(key) if slot is None else slot

    def slot_state(self, key: OffloadKey) -> SlotState:
        if key in self._ready:
            return SlotState.READY
        return SlotState.WRITING if key in self._writing else SlotState.FREE

    def evict_held(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> dict[OffloadKey, int]:
        return self._evict(self._victims(count, protected), hold=True)

    def hold_free(self, count: int) -> list[int]:
        taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
        self._held.update(taken)
        return taken

    def detach_writing(self, keys: Collection[OffloadKey]) -> dict[OffloadKey, int]:
        detached = {key: self._writing.pop(key) for key in dict.fromkeys(keys)
                    if key in self._writing}
        self._held.update(detached.values())
        if detached:
            self._events.append(
                replace(self._event(list(detached), removed=True), metadata_only=True))
        return detached

    def release_held(self, slots: Iterable[int]) -> None:
        slots = list(dict.fromkeys(slots))
        if not self._held.issuperset(slots):
            raise UnknownKeyError(f"release_held: {sorted(set(slots) - self._held)} not held")
        self._held.difference_update(slots)
        self._free.extend(slots)

    # -- internals ----------------------------------------------------------------------
    def _victims(self, count: int, protected: Collection[OffloadKey]) -> list[OffloadKey]:
        """Up to ``count`` least recently used ready keys, neither pinned nor protected."""
        victims: list[OffloadKey] = []
        for key in self._ready:
            if len(victims) == count:
                break
            if key not in self._pins and key not in protected:
                victims.append(key)
        return victims

    def _evict(self, victims: list[OffloadKey], *, hold: bool) -> dict[OffloadKey, int]:
        slots = {key: self._ready.pop(key) for key in victims}
        (self._held.update if hold else self._free.extend)(slots.values())
        self._counts["evictions"] += len(slots)
        if slots:
            self._events.append(self._event(list(slots), removed=True))
        return slots

    def _fence(self, key: OffloadKey, slot: int, holds: int) -> None:
        self._fenced[key] = slot
        self._fence_holds[slot] = holds

    def _unfence(self, key: OffloadKey) -> None:
        slot = self._fenced.get(key)
        if slot is None:
            return
        self._fence_holds[slot] -= 1
        if not self._fence_holds[slot]:
            del self._fence_holds[slot], self._fenced[key]
            self._free.append(slot)

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=Medium.CPU, removed=removed,
                               locality=Locality.LOCAL)


class TestSlotPrimaryConformance(TierConformanceTests):
    """The minimal primary alone passes the shipped conformance kit."""

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        primary = SlotPrimary(capacity_chunks)
        primary.region = BytearrayRegion(  # type: ignore[attr-defined]
            capacity_chunks, self.geometry.slot_bytes)
        return primary

    def _view(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> memoryview:
        assert isinstance(spec, CPULoadStoreSpec)
        region: BytearrayRegion = manager.region  # type: ignore[attr-defined]
        return region.view(int(spec.slot_ids[index]))

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        self._view(manager, spec, index)[: len(payload)] = payload

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        return bytes(self._view(manager, spec, index)[: self.chunk_size])


class FileStack:
    """The minimal primary over a bytearray region, with a file tier below it."""

    def __init__(self, root: Path, chunks: int, geometry: ChunkGeometry,
                 write: WriteRules | None = None) -> None:
        self.region = BytearrayRegion(chunks, geometry.slot_bytes)
        self.primary = SlotPrimary(chunks)
        chunk_file = HEADER_BYTES + geometry.chunk_bytes(0)
        disk = FileTierManager(FileMapper(root, IDENTITY), geometry,
                               capacity_bytes=chunks * chunk_file)
        mover = FileMover(self.region, geometry, IDENTITY.digest, PosixBackend(o_direct=False),
                          threads=1, bad_chunks=BadChunkHandler(disk, disk.quarantine_dir))
        self.manager = TieredManager([
            BuiltTier("mine", self.primary, region=self.region),
            BuiltTier("file", disk, mover=mover, write=write or WriteRules()),
        ])
        self.manager.stack = self  # type: ignore[attr-defined]


class TestSlotPrimaryOverFileConformance(TierConformanceTests):
    """The minimal primary composes with the file tier: the stack passes the kit, its
    file tier mirroring the primary's capacity so the stack behaves as one tier."""

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        return FileStack(self.tmp_path / "root", capacity_chunks, self.geometry).manager

    def reopen(self, manager: OffloadingManager) -> OffloadingManager:
        manager.shutdown()
        return self.make_manager(self.capacity_chunks)

    def settle(self, manager: OffloadingManager) -> None:
        assert isinstance(manager, TieredManager)
        manager.wait_idle()

    def _view(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> memoryview:
        assert isinstance(spec, CPULoadStoreSpec)
        stack: FileStack = manager.stack  # type: ignore[attr-defined]
        return stack.region.view(int(spec.slot_ids[index]))

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        self._view(manager, spec, index)[: len(payload)] = payload

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        return bytes(self._view(manager, spec, index)[: self.chunk_size])


def test_the_minimal_primary_demotes_to_a_write_back_file_tier(tmp_path: Path) -> None:
    # write: back needs a holding primary: the composite evicts through evict_held at the
    # end of a step and copies the held slots below, then releases them.
    geometry = TierConformanceTests.geometry
    chunk = geometry.chunk_bytes(0)
    stack = FileStack(tmp_path, 2, geometry, WriteRules("back"))
    tiered, ctx = stack.manager, ReqContext(req_id="r")
    try:
        keys = [conformance_key(i) for i in range(2)]
        assert tiered.prepare_store(keys, ctx) == keys
        spec = tiered.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        for i, slot in enumerate(spec.slot_ids.tolist()):
            stack.region.view(slot)[:chunk] = conformance_payload(i, chunk)
        tiered.complete_store(keys, ctx)
        # The step reserved two slots: the next keeps two free, demoting both.
        tiered.on_schedule_end(ScheduleEndContext())
        tiered.wait_idle()
        assert tiered.get_stats()["demotions"] == 2
        assert stack.primary.free_slots == 2 and not stack.primary._held
        assert [tiered.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 2
        tiered.on_schedule_end(ScheduleEndContext())
        tiered.wait_idle()
        tiered.prepare_load(keys, ctx)
        spec = tiered.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        assert [bytes(stack.region.view(slot)[:chunk]) for slot in spec.slot_ids.tolist()] == [
            conformance_payload(i, chunk) for i in range(2)]
        tiered.complete_load(keys, ctx)
    finally:
        tiered.shutdown()
