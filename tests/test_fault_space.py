"""A full disk during a cascade (docs/architecture.md, "Liveness"): the file tier evicts
least recently used chunks once per episode and lets one store try again as soon as their
files are gone; only if that store fails too does the tier stay full, with the latch's one
warning."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.tiers.file.io import PublishSettings
from kvtiers.tiers.file.space import SpaceLatch
from tests.test_file_support import CHUNK, CTX, Tier, open_tier
from tests.test_liveness_disk import Clock, SwitchableOps


def _tier(tmp_path: Path) -> tuple[Tier, SpaceLatch, SwitchableOps]:
    latch = SpaceLatch(str(tmp_path), retry_s=5.0, clock=Clock())
    ops = SwitchableOps(errno.ENOSPC)
    ops.failing = False
    tier = open_tier(tmp_path, slots=8, settings=PublishSettings(ops=ops), space=latch)
    tier.mover.space = latch
    assert len(tier.store(range(4))) == 4
    ops.failing = True
    assert tier.store([4]) == []
    assert latch.full
    return tier, latch, ops


def test_a_full_disk_evicts_lru_chunks_then_one_store_tries_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier, latch, ops = _tier(tmp_path)
    manager = tier.manager
    try:
        manager.deletions_gate.clear()
        # Room is made (every chunk here: fewer than ROOM_CHUNKS); until the files are
        # gone, stores wait.
        assert manager.prepare_store([conformance_key(5)], CTX) is None
        stats = manager.get_stats()
        assert stats["evictions"] == 4 and stats["chunks"] == 0
        assert manager.prepare_store([conformance_key(5)], CTX) is None
        manager.deletions_gate.set()
        manager.wait_deletions()
        ops.failing = False
        with caplog.at_level(logging.WARNING):
            assert tier.store([5]) == [conformance_key(5)]  # no retry_s waited
        assert not latch.full
        assert tier.load(5)[1] == conformance_payload(5, CHUNK)
    finally:
        tier.close()


def test_a_disk_still_full_after_eviction_stays_full_without_evicting_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier, latch, _ops = _tier(tmp_path)
    manager = tier.manager
    try:
        assert manager.prepare_store([conformance_key(5)], CTX) is None
        manager.wait_deletions()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert tier.store([5]) == []  # the one retry
            assert latch.full
            assert manager.prepare_store([conformance_key(6)], CTX) is None
        assert caplog.records == []  # the episode's one warning was logged before
        assert manager.get_stats()["evictions"] == 4
    finally:
        tier.close()


def test_a_read_only_filesystem_evicts_nothing(tmp_path: Path) -> None:
    latch = SpaceLatch(str(tmp_path), retry_s=5.0, clock=Clock())
    ops = SwitchableOps(errno.EROFS)
    ops.failing = False
    tier = open_tier(tmp_path, slots=8, settings=PublishSettings(ops=ops), space=latch)
    tier.mover.space = latch
    try:
        assert len(tier.store(range(4))) == 4
        ops.failing = True
        assert tier.store([4]) == []
        assert latch.full and not latch.wants_room
        assert tier.manager.prepare_store([conformance_key(5)], CTX) is None
        stats = tier.manager.get_stats()
        assert stats["evictions"] == 0 and stats["chunks"] == 4
    finally:
        tier.close()
