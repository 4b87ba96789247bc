"""The shared manager conformance suite, run against the fsspec tier on memory:// and
file:// filesystems."""

from __future__ import annotations

import uuid

import pytest

from kvtiers.testing.conformance import TierConformanceTests
from kvtiers.testing.objects import ObjectTierConformance
from kvtiers.tiers.fsspec.store import FsspecStore


class TestFsspecMemoryConformance(ObjectTierConformance, TierConformanceTests):
    @pytest.fixture(autouse=True)
    def _root(self) -> None:
        # The memory filesystem is one process-wide dict: each test gets its own root.
        self.url = f"memory://kvtiers-{uuid.uuid4().hex}"

    def make_store(self) -> FsspecStore:
        return FsspecStore(self.url)


class TestFsspecFileConformance(ObjectTierConformance, TierConformanceTests):
    def make_store(self) -> FsspecStore:
        return FsspecStore(f"file://{self.tmp_path}/objects")
