"""TieredManager: conformance, cascade, promotion, filters, faults, reset and restart,
over in-memory tiers (real tiers are exercised end to end elsewhere)."""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from typing import Literal

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
)
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import UnknownKeyError
from kvtiers.stack.composite import TieredManager
from kvtiers.testing.conformance import (
    TierConformanceTests,
    conformance_key,
    conformance_payload,
)
from kvtiers.testing.doubles import (
    BytearrayRegion,
    MemoryMover,
    MemoryObjectStore,
    MemoryObjectTier,
)
from kvtiers.testing.memory_tier import InMemoryTier
from kvtiers.tiers.index import ChunkState

GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(4096,))
CTX = ReqContext(req_id="r")
HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)


class Harness:
    """A cpu-like reference primary over a bytearray region plus one in-memory lower tier."""

    def __init__(
        self,
        primary_chunks: int = 4,
        lower_chunks: int = 64,
        store: MemoryObjectStore | None = None,
        *,
        persistent: bool = True,
        admission: Literal["always", "never"] = "always",
    ) -> None:
        self.region = BytearrayRegion(primary_chunks, GEOMETRY.slot_bytes)
        self.primary = InMemoryTier(primary_chunks)
        self.store = store if store is not None else MemoryObjectStore()
        self.lower = MemoryObjectTier(lower_chunks, self.store, persistent=persistent)
        self.mover = MemoryMover(self.region, GEOMETRY, self.lower)
        self.manager = TieredManager([
            BuiltTier("cpu", self.primary, region=self.region),
            BuiltTier("mem", self.lower, mover=self.mover, admission=admission),
        ])

    def store_chunks(self, ids: Collection[int], *, settle: bool = True) -> list[OffloadKey]:
        """Store the chunks one batch at a time (each batch fits the primary)."""
        by_key = {conformance_key(i): i for i in ids}
        accepted = self.manager.prepare_store(list(by_key), CTX)
        assert accepted is not None
        if accepted:
            spec = self.manager.get_spec(accepted)
            assert isinstance(spec, CPULoadStoreSpec)
            for key, slot in zip(accepted, spec.slot_ids, strict=True):
                payload = conformance_payload(by_key[key], GEOMETRY.chunk_bytes(0))
                self.region.view(int(slot))[: len(payload)] = payload
            self.manager.complete_store(accepted, CTX)
        if settle:
            self.manager.wait_idle()
        return accepted

    def fill(self, n: int) -> None:
        """Store chunks 0..n-1 one by one: with n > capacity the oldest are evicted."""
        for i in range(n):
            self.store_chunks([i])

    def read(self, i: int) -> bytes:
        key = conformance_key(i)
        self.manager.prepare_load([key], CTX)
        spec = self.manager.get_spec([key])
        assert isinstance(spec, CPULoadStoreSpec)
        data = bytes(self.region.view(int(spec.slot_ids[0]))[: GEOMETRY.chunk_bytes(0)])
        self.manager.complete_load([key], CTX)
        return data

    def lookup(self, i: int, ctx: ReqContext = CTX) -> LookupResult:
        return self.manager.lookup(conformance_key(i), ctx)

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.close()


class TestTieredManagerConformance(TierConformanceTests):
    """The composite passes the suite; its lower tier mirrors the primary's capacity so the
    whole stack behaves as one tier of ``capacity_chunks``."""

    geometry = GEOMETRY
    persistent = False

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        h = Harness(capacity_chunks, capacity_chunks, persistent=self.persistent)
        h.manager.harness = h  # type: ignore[attr-defined]
        return h.manager

    def reopen(self, manager: OffloadingManager) -> OffloadingManager:
        old: Harness = manager.harness  # type: ignore[attr-defined]
        old.close()
        h = Harness(self.capacity_chunks, self.capacity_chunks, old.store,
                    persistent=self.persistent)
        h.manager.harness = h  # type: ignore[attr-defined]
        return h.manager

    def settle(self, manager: OffloadingManager) -> None:
        assert isinstance(manager, TieredManager)
        manager.wait_idle()

    def _region(self, manager: OffloadingManager) -> BytearrayRegion:
        region: BytearrayRegion = manager.harness.region  # type: ignore[attr-defined]
        return region

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        assert isinstance(spec, CPULoadStoreSpec)
        self._region(manager).view(int(spec.slot_ids[index]))[: len(payload)] = payload

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        assert isinstance(spec, CPULoadStoreSpec)
        return bytes(self._region(manager).view(int(spec.slot_ids[index]))[: self.chunk_size])


class TestTieredManagerConformancePersistent(TestTieredManagerConformance):
    """The shape users run: a persistent lower tier under the CPU tier."""

    persistent = True


def test_store_cascades_the_exact_bytes(harness: Harness) -> None:
    harness.store_chunks([0, 1])
    for i in (0, 1):
        data, _ = harness.store.objects[conformance_key(i)]
        assert data == conformance_payload(i, GEOMETRY.chunk_bytes(0))
    stats = harness.manager.get_stats()
    assert stats["cascades"] == 2
    assert stats["cascaded_bytes"] == 2 * GEOMETRY.chunk_bytes(0)


def test_admission_never_keeps_a_tier_out(harness: Harness) -> None:
    h = Harness(admission="never")
    h.store_chunks([0])
    assert h.store.objects == {}
    h.close()


def test_evicted_chunk_is_promoted_back_byte_exact(harness: Harness) -> None:
    harness.fill(6)  # primary holds 4: chunks 0 and 1 were evicted
    assert harness.primary.lookup(conformance_key(0), CTX) is MISS
    assert harness.lookup(0) is PENDING
    assert harness.lookup(0) is PENDING
    harness.manager.on_schedule_end(ScheduleEndContext())
    harness.manager.wait_idle()
    assert harness.lookup(0) is HIT
    assert harness.read(0) == conformance_payload(0, GEOMETRY.chunk_bytes(0))
    assert harness.manager.get_stats()["promotions"] == 1


def test_promotion_into_a_full_pinned_primary_is_a_miss(harness: Harness) -> None:
    harness.fill(6)
    pinned = [conformance_key(i) for i in range(2, 6)]
    harness.manager.prepare_load(pinned, CTX)
    assert harness.lookup(0) is MISS
    assert harness.manager.get_stats()["promotions_refused"] == 1


def test_failed_promotion_is_a_miss_never_wrong_bytes(harness: Harness) -> None:
    harness.fill(6)
    harness.mover.fail_keys.add(conformance_key(0))
    assert harness.lookup(0) is PENDING
    harness.manager.wait_idle()
    assert harness.primary.lookup(conformance_key(0), CTX) is MISS
    assert harness.manager.get_stats()["promotion_failures"] == 1
    harness.mover.fail_keys.clear()
    assert harness.lookup(0) is PENDING
    harness.manager.wait_idle()
    assert harness.read(0) == conformance_payload(0, GEOMETRY.chunk_bytes(0))


def test_corrupt_lower_chunk_is_dropped_and_counted(harness: Harness) -> None:
    harness.fill(6)
    harness.store.corrupt(conformance_key(0))
    assert harness.lookup(0) is PENDING
    harness.manager.wait_idle()
    assert harness.manager.get_stats()["corrupt_chunks"] == 1
    assert harness.lookup(0) is MISS
    assert conformance_key(0) not in harness.store.objects


def test_failed_cascade_leaves_lower_tier_without_the_chunk(harness: Harness) -> None:
    harness.mover.fail_keys.add(conformance_key(0))
    harness.store_chunks([0, 1])
    assert harness.lower.lookup(conformance_key(0), CTX) is MISS
    assert harness.lower.lookup(conformance_key(1), CTX) is HIT
    assert harness.manager.get_stats()["cascade_failures"] == 1
    assert harness.lookup(0) is HIT  # the primary copy is unaffected


def _refuse(job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
    return False


def test_a_cascade_the_mover_refuses_fails_and_unpins_the_primary_slot(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness.mover, "submit", _refuse)
    harness.store_chunks([0, 1, 2, 3], settle=False)
    assert harness.manager.get_stats()["cascade_failures"] == 4
    assert not harness.manager.has_pending_work()
    assert harness.lower.lookup(conformance_key(0), CTX) is MISS
    # Every primary slot is unpinned again: a new chunk can evict one.
    assert harness.manager.prepare_store([conformance_key(9)], CTX) == [conformance_key(9)]


def test_a_promotion_the_mover_refuses_is_a_miss_and_unpins_the_lower_chunk(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness.fill(6)
    monkeypatch.setattr(harness.mover, "submit", _refuse)
    assert harness.lookup(0) is PENDING
    harness.manager.on_schedule_end(ScheduleEndContext())
    assert harness.manager.get_stats()["promotion_failures"] == 1
    assert not harness.manager.has_pending_work()
    assert harness.primary.lookup(conformance_key(0), CTX) is MISS
    # The lower tier's chunk is unpinned: only reserved or pinned keys have a spec.
    with pytest.raises(UnknownKeyError):
        harness.lower.get_spec([conformance_key(0)])


def test_cascading_slot_is_pinned_until_the_mover_is_done(harness: Harness) -> None:
    harness.mover.gate.clear()
    harness.store_chunks([0, 1, 2, 3], settle=False)
    assert harness.manager.has_pending_work()
    assert harness.manager.prepare_store([conformance_key(9)], CTX) is None
    harness.mover.gate.set()
    harness.manager.wait_idle()
    assert not harness.manager.has_pending_work()
    assert harness.manager.prepare_store([conformance_key(9)], CTX) == [conformance_key(9)]


def test_tier_filter_excludes_a_tier(harness: Harness) -> None:
    harness.fill(6)
    local_only = ReqContext(
        "r", load_tier_filter=TierFilter((TierMatcher(locality=Locality.LOCAL),))
    )
    assert harness.lookup(0, local_only) is MISS
    assert harness.lookup(0) is PENDING


class _RetryTier(InMemoryTier):
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return RETRY


def test_retry_propagates_unless_a_later_tier_hits() -> None:
    region = BytearrayRegion(4, GEOMETRY.slot_bytes)
    store = MemoryObjectStore()
    lower = MemoryObjectTier(8, store)
    retry = _RetryTier(4)
    manager = TieredManager([
        BuiltTier("cpu", InMemoryTier(4), region=region),
        BuiltTier("probe", retry, mover=MemoryMover(region, GEOMETRY, lower), admission="never"),
        BuiltTier("mem", lower, mover=MemoryMover(region, GEOMETRY, lower)),
    ])
    assert manager.lookup(conformance_key(0), CTX) is RETRY
    store.put(conformance_key(1), conformance_payload(1, GEOMETRY.chunk_bytes(0)))
    lower._insert_ready([conformance_key(1)])
    assert manager.lookup(conformance_key(1), CTX) is PENDING
    manager.shutdown()


class _RecordingPrimary(InMemoryTier):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.mover: MemoryMover | None = None
        self.in_flight_at_reset: list[int] = []

    def reset_cache(self) -> None:
        assert self.mover is not None
        self.in_flight_at_reset.append(self.mover.in_flight)
        super().reset_cache()


def test_reset_cache_drains_movers_first() -> None:
    region = BytearrayRegion(4, GEOMETRY.slot_bytes)
    store = MemoryObjectStore()
    primary = _RecordingPrimary(4)
    lower = MemoryObjectTier(16, store)
    mover = MemoryMover(region, GEOMETRY, lower)
    primary.mover = mover
    manager = TieredManager([BuiltTier("cpu", primary, region=region),
                             BuiltTier("mem", lower, mover=mover)])
    mover.gate.clear()
    keys = [conformance_key(i) for i in range(3)]
    assert manager.prepare_store(keys, CTX) == keys
    manager.complete_store(keys, CTX)
    resetter = threading.Thread(target=manager.reset_cache)
    resetter.start()
    mover.gate.set()
    resetter.join()
    # The primary was reset only once no mover read its slots any more.
    assert primary.in_flight_at_reset == [0]
    assert all(primary.lookup(k, CTX) is MISS for k in keys)
    assert all(lower.lookup(k, CTX) is HIT for k in keys)
    manager.shutdown()
    manager.shutdown()


def test_restart_hits_warm_from_the_persistent_tier() -> None:
    first = Harness()
    first.store_chunks([0, 1, 2])
    first.close()
    second = Harness(store=first.store)
    assert [second.lookup(i) for i in range(3)] == [PENDING] * 3
    second.manager.wait_idle()
    assert [second.read(i) for i in range(3)] == [
        conformance_payload(i, GEOMETRY.chunk_bytes(0)) for i in range(3)
    ]
    second.close()


class CompositeWithFaults(RuleBasedStateMachine):
    """Random stores, lookups, loads, failures and corruption: every byte that reaches a
    load is the right byte, and the primary never holds more than its capacity."""

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(primary_chunks=3, lower_chunks=6)
        self.size = GEOMETRY.chunk_bytes(0)

    @rule(ids=st.lists(st.integers(0, 11), min_size=1, max_size=3, unique=True))
    def store(self, ids: list[int]) -> None:
        keys = [conformance_key(i) for i in ids]
        accepted = self.h.manager.prepare_store(keys, CTX)
        if accepted is None:
            return
        if accepted:
            spec = self.h.manager.get_spec(accepted)
            assert isinstance(spec, CPULoadStoreSpec)
            for key, slot in zip(accepted, spec.slot_ids, strict=True):
                payload = conformance_payload(ids[keys.index(key)], self.size)
                self.h.region.view(int(slot))[: self.size] = payload
            self.h.manager.complete_store(accepted, CTX)

    @rule(i=st.integers(0, 11))
    def lookup_and_load(self, i: int) -> None:
        result = self.h.lookup(i)
        if result is PENDING:
            self.h.manager.wait_idle()
            result = self.h.lookup(i)
        if result is HIT:
            assert self.h.read(i) == conformance_payload(i, self.size)

    @rule(i=st.integers(0, 11), fail=st.booleans())
    def toggle_failure(self, i: int, fail: bool) -> None:
        (self.h.mover.fail_keys.add if fail else self.h.mover.fail_keys.discard)(
            conformance_key(i))

    @rule(i=st.integers(0, 11))
    def corrupt(self, i: int) -> None:
        if conformance_key(i) in self.h.store.objects:
            self.h.store.corrupt(conformance_key(i))

    @rule()
    def step(self) -> None:
        self.h.manager.on_schedule_end(ScheduleEndContext())

    @invariant()
    def primary_within_capacity(self) -> None:
        assert self.h.primary.get_stats()["chunks"] <= 3

    def teardown(self) -> None:
        # Once everything settled, no pin or reservation is left behind in any tier.
        self.h.manager.wait_idle()
        assert not self.h.manager.has_pending_work()
        for tier in (self.h.primary, self.h.lower):
            assert all(e.state is ChunkState.READY and not e.pins for _, e in tier.index.items())
        self.h.close()


TestCompositeWithFaults = CompositeWithFaults.TestCase
TestCompositeWithFaults.settings = settings(max_examples=40, stateful_step_count=30,
                                            deadline=None)
