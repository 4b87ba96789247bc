"""The in-memory tier passes the shared conformance suite (proving the suite)."""

from __future__ import annotations

from kvtiers.core.manager import OffloadingManager
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.testing.conformance import TierConformanceTests
from kvtiers.testing.memory_tier import InMemoryTier


class TestReferenceTierConformance(TierConformanceTests):
    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        return InMemoryTier(capacity_chunks)

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        assert isinstance(manager, InMemoryTier) and isinstance(spec, CPULoadStoreSpec)
        manager.data[int(spec.slot_ids[index])] = payload

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        assert isinstance(manager, InMemoryTier) and isinstance(spec, CPULoadStoreSpec)
        return manager.data[int(spec.slot_ids[index])]
