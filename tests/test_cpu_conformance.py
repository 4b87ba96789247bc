"""The shared manager conformance suite, run against the CPU tier with each policy."""

from __future__ import annotations

from typing import ClassVar

from kvtiers.core.manager import OffloadingManager
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.policies import load_policy
from kvtiers.policies.retention import RetainingPolicy, RetentionBook
from kvtiers.testing.conformance import TierConformanceTests
from kvtiers.tiers.cpu import CpuTierManager, SlotRegion


class TestCpuTierConformance(TierConformanceTests):
    policy: ClassVar[str] = "lru"

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        slot_bytes = self.geometry.slot_bytes
        region = SlotRegion(capacity_chunks, slot_bytes)
        policy = load_policy(self.policy)(capacity_chunks)
        return CpuTierManager(capacity_chunks, slot_bytes, policy, region=region)

    def _view(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> memoryview:
        assert isinstance(manager, CpuTierManager) and manager.region is not None
        assert isinstance(spec, CPULoadStoreSpec)
        return manager.region.view(int(spec.slot_ids[index]))

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        self._view(manager, spec, index)[: len(payload)] = payload

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        return bytes(self._view(manager, spec, index)[: self.chunk_size])


class TestCpuTierConformanceARC(TestCpuTierConformance):
    policy = "arc"


class TestCpuTierConformanceS3FIFO(TestCpuTierConformance):
    policy = "s3fifo"


class TestCpuTierConformanceRetaining(TestCpuTierConformance):
    """The cpu tier with retention's policy over LRU and an empty retention book: the
    tier contract (LRU order included) holds unchanged."""

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        slot_bytes = self.geometry.slot_bytes
        region = SlotRegion(capacity_chunks, slot_bytes)
        book = RetentionBook(hash_bytes=slot_bytes, max_pinned_bytes=0)
        policy = RetainingPolicy(load_policy(self.policy), capacity_chunks, book)
        return CpuTierManager(capacity_chunks, slot_bytes, policy, region=region)
