"""``capacity_scope: root`` (docs/architecture.md, "Liveness"): several namespaces over one
root share one capacity, the least recently used namespace's chunks going first."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtiers.config.tiers import FileTierConfig
from kvtiers.core.manager import ScheduleEndContext
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.filemapper.scan import ScannedEntry
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.tiers.file import manager as file_manager
from tests.test_file_support import BLOB, CHUNK, CTX, offloading_config, open_tier

BUDGET = 4  # chunks


def identity(salt: str) -> NamespaceIdentity:
    return NamespaceIdentity.from_config(offloading_config(salt=salt))


def chunk_files(root: Path) -> dict[str, int]:
    """Chunk files per namespace directory under ``root``."""
    counts = {}
    for namespace in sorted(p for p in root.iterdir() if p.is_dir()):
        counts[namespace.name] = sum(
            1 for path in namespace.rglob("*.kvc") if "quarantine" not in path.parts
        )
    return counts


def test_namespaces_over_one_root_share_one_budget_oldest_namespace_first(
    tmp_path: Path,
) -> None:
    names = []
    for n, salt in enumerate(("a", "b", "c")):
        tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity(salt),
                         capacity_scope="root")
        names.append(tier.manager.namespace_dir.name)
        stored = tier.store(range(10 * n, 10 * n + 3))
        assert len(stored) == 3
        tier.manager.wait_deletions()
        usage = tier.manager.get_stats()["usage_bytes"]
        tier.close()
        assert usage == 3 * BLOB
        # Each namespace gets a newer mtime than the previous one's chunks.
        for path in tier.manager.namespace_dir.rglob("*.kvc"):
            os.utime(path, (1000.0 * (n + 1), 1000.0 * (n + 1)))
        files = chunk_files(tmp_path)
        assert sum(files.values()) <= BUDGET, files
    files = chunk_files(tmp_path)
    # "a" (least recently used) went first and entirely; "b" kept what the budget left.
    assert files == {names[0]: 0, names[1]: 1, names[2]: 3}


def test_a_namespace_opened_over_a_root_over_budget_trims_the_others(tmp_path: Path) -> None:
    old = open_tier(tmp_path, identity=identity("old"))
    old.store(range(6))
    old.close()
    tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity("new"),
                     capacity_scope="root")
    try:
        tier.manager.wait_deletions()
        assert sum(chunk_files(tmp_path).values()) == BUDGET
        # The remaining foreign chunks still count: a store of 2 gives up 2 of them.
        assert tier.store([100, 101]) == [conformance_key(100), conformance_key(101)]
        tier.manager.wait_deletions()
        assert chunk_files(tmp_path)[old.manager.namespace_dir.name] == BUDGET - 2
    finally:
        tier.close()


def test_root_scope_needs_a_capacity() -> None:
    with pytest.raises(ConfigError, match="set a capacity"):
        FileTierConfig(name="file", root="/tmp/x", capacity_scope="root")


def test_other_namespaces_chunks_that_cannot_be_unlinked_still_count(tmp_path: Path) -> None:
    """A chunk of another namespace given up for room but whose unlink fails is still on
    disk: its bytes must not count as freed, so this namespace's own chunks give way."""
    old = open_tier(tmp_path, identity=identity("old"))
    old.store(range(3))
    old.close()
    old_dir = old.manager.namespace_dir
    tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity("new"),
                     capacity_scope="root")
    manager = tier.manager

    def refuse(path: Path) -> None:
        if old_dir in path.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        os.unlink(path)

    manager._deleter._unlink = refuse  # the deleter's test hook
    try:
        assert len(tier.store([100, 101])) == 2  # room from "old", whose unlinks fail
        for _ in range(BUDGET + 1):
            manager.wait_deletions()
            manager.on_schedule_end(ScheduleEndContext())
        manager.wait_deletions()
        files = chunk_files(tmp_path)
        assert files[old_dir.name] == 3
        assert sum(files.values()) <= BUDGET, files
        assert manager.get_stats()["usage_bytes"] == files[manager.namespace_dir.name] * BLOB
    finally:
        tier.close()


def test_chunks_being_written_when_unlinks_fail_give_way_once_written(
    tmp_path: Path,
) -> None:
    """Other namespaces' unlinks that fail while this namespace's store is still being
    written leave it over the budget for the moment (a chunk being written cannot be
    evicted); once the store is done, its chunks give way at the next step end."""
    old = open_tier(tmp_path, identity=identity("old"))
    old.store(range(3))
    old.close()
    old_dir = old.manager.namespace_dir
    tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity("new"),
                     capacity_scope="root")
    manager = tier.manager

    def refuse(path: Path) -> None:
        if old_dir in path.parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        os.unlink(path)

    manager._deleter._unlink = refuse  # the deleter's test hook
    ids = (100, 101)
    keys = [conformance_key(i) for i in ids]
    for slot, i in enumerate(ids):
        tier.region.view(slot)[:CHUNK] = conformance_payload(i, CHUNK)
    try:
        slots = {key: slot for slot, key in enumerate(keys)}
        assert tier.driver.store(next(tier.jobs), keys, CTX, None, slots=slots) == keys
        # Every unlink of "old" fails, and is seen, before the store is polled.
        for _ in range(BUDGET + 1):
            manager.wait_deletions()
            manager.on_schedule_end(ScheduleEndContext())
        tier.driver.drain()
        assert {key for job in tier._finished for key in job.result.succeeded_keys} == set(keys)
        manager.on_schedule_end(ScheduleEndContext())
        manager.wait_deletions()
        files = chunk_files(tmp_path)
        assert files[old_dir.name] == 3
        assert sum(files.values()) <= BUDGET, files
        assert manager.get_stats()["usage_bytes"] == files[manager.namespace_dir.name] * BLOB
    finally:
        tier.close()


@pytest.fixture
def unreadable(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[Path]]:
    """Directories (namespaces, or one of their fan-out directories) whose listing fails
    with EACCES, as for a directory of another user (these tests run as root, where
    permissions do not stop a read)."""
    denied: set[Path] = set()
    real_scan = file_manager.scan_namespace
    real_stat = os.stat

    def scan(directory: Path) -> Iterator[ScannedEntry]:
        for item in real_scan(directory):
            yield item
            if Path(item.entry.path).parent in denied:
                raise PermissionError(errno.EACCES, "Permission denied", item.entry.path)

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if Path(str(path)).parent in denied and Path(str(path)).name == "manifest.json":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(file_manager, "scan_namespace", scan)
    monkeypatch.setattr(file_manager.os, "stat", stat)
    yield denied


@pytest.mark.parametrize("where", ["namespace", "fan-out directory"])
def test_a_namespace_the_root_budget_cannot_measure_is_named_in_a_warning(
    tmp_path: Path, unreadable: set[Path], where: str, caplog: pytest.LogCaptureFixture
) -> None:
    old = open_tier(tmp_path, identity=identity("old"))
    old.store(range(3))
    old.close()
    old_dir = old.manager.namespace_dir
    if where == "namespace":
        unreadable.add(old_dir)
    else:
        unreadable.update(path.parent for path in old_dir.glob("??/??/*.kvc"))
    with caplog.at_level(logging.WARNING, logger="kvtiers.tiers.file.manager"):
        tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity("new"),
                         capacity_scope="root")
    tier.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "could not measure" in warnings[0] and str(old_dir) in warnings[0], warnings


def test_a_failed_store_under_an_evicted_chunks_name_leaves_no_file_behind(
    tmp_path: Path,
) -> None:
    """A store of an evicted key cancels the old file's queued unlink (the name is reused);
    if that store fails, the old file must still go: nothing indexes it."""
    tier = open_tier(tmp_path, capacity_chunks=1)
    manager = tier.manager
    key0 = conformance_key(0)
    try:
        tier.store([0])
        manager.deletions_gate.clear()
        tier.store([1])  # evicts 0; its unlink waits behind the gate
        assert manager.prepare_store([key0], CTX) == [key0]  # cancels it, evicts 1
        manager.complete_store([key0], CTX, success=False)
        manager.deletions_gate.set()
        manager.wait_deletions()
        assert not manager.mapper.path(key0).exists(), "an unindexed chunk file was left"
        assert manager.get_stats()["chunks"] == 0
    finally:
        tier.close()
