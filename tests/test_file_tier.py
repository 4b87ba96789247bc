"""File tier behaviour beyond the shared suite: persistence across processes, identity,
corruption, capacity, full disks, shared directories, operator safety, backend choice."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvtiers.config.sizes import Size
from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, ScheduleEndContext
from kvtiers.core.publish import Durability, FileOps, KnownDirs
from kvtiers.errors import BackendUnavailableError, NamespaceMismatchError
from kvtiers.filemapper import FileMapper, NamespaceIdentity
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.tiers.file.io import (
    IO_POSIX,
    IO_POSIX_DIRECT,
    PosixBackend,
    PublishSettings,
    select_backend,
)
from kvtiers.tiers.file.mover import FileMover
from tests.test_file_support import (
    BLOB,
    CHUNK,
    CTX,
    IDENTITY,
    chunk_files,
    offloading_config,
    open_tier,
    temp_files,
)

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
REPO = Path(__file__).resolve().parents[1]


# -- persistence ----------------------------------------------------------------------
def test_chunks_stored_by_another_process_hit_and_load_after_restart(tmp_path: Path) -> None:
    n = 12
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from tests.test_file_support import open_tier
        tier = open_tier(Path({str(tmp_path)!r}), slots={n})
        assert len(tier.store(range({n}))) == {n}
        tier.close()
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=60)
    tier = open_tier(tmp_path)
    try:
        assert [tier.manager.lookup(conformance_key(i), CTX) for i in range(n)] == [HIT] * n
        for i in range(n):
            result, data = tier.load(i)
            assert result.success and data == conformance_payload(i, CHUNK), i
        assert tier.manager.get_stats()["usage_bytes"] == n * BLOB
    finally:
        tier.close()


def test_rebuild_seeds_recency_from_mtimes(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.store(range(3))
    tier.close()
    files = {conformance_key(i): FileMapper(tmp_path, IDENTITY).path(conformance_key(i))
             for i in range(3)}
    # Chunk 2 is the oldest on disk, then 0, then 1.
    for age, i in ((300, 2), (200, 0), (100, 1)):
        stamp = os.stat(files[conformance_key(i)]).st_mtime - age
        os.utime(files[conformance_key(i)], (stamp, stamp))
    # The walk's recency: a snapshot keeps the last run's own order instead.
    tier = open_tier(tmp_path, capacity_chunks=3, snapshot=False)
    try:
        tier.store([10])
        assert tier.manager.lookup(conformance_key(2), CTX) is MISS
        assert [tier.manager.lookup(conformance_key(i), CTX) for i in (0, 1)] == [HIT, HIT]
    finally:
        tier.close()


# -- identity -------------------------------------------------------------------------
IDENTITY_CHANGES = {
    "model": "org/other",
    "revision": "v2",
    "dtype": "float16",
    "kv_layout": "HND",
    "tokens_per_block": 32,
    "tokens_per_hash": 8,
    "bytes_per_block": CHUNK,  # same size, so only the layers below change it
    "layer_names": ("layer.1",),
    "hash_algorithm": "sha256",
    "engine": "vllm",
    "salt": "tenant-a",
}


@pytest.mark.parametrize("field", [f for f in IDENTITY_CHANGES if f != "bytes_per_block"])
def test_any_identity_change_sees_nothing_and_leaves_the_old_namespace(
    tmp_path: Path, field: str
) -> None:
    tier = open_tier(tmp_path)
    tier.store(range(3))
    tier.close()
    old_dir = FileMapper(tmp_path, IDENTITY).namespace_dir
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in old_dir.rglob("*") if p.is_file()}
    other = NamespaceIdentity.from_config(offloading_config(**{field: IDENTITY_CHANGES[field]}))
    assert other.digest != IDENTITY.digest
    changed = open_tier(tmp_path, identity=other)
    try:
        assert [changed.manager.lookup(conformance_key(i), CTX) for i in range(3)] == [MISS] * 3
        assert changed.manager.get_stats()["chunks"] == 0
    finally:
        changed.close()
    after = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in old_dir.rglob("*") if p.is_file()}
    assert after == before


def test_tampered_manifest_fails_closed(tmp_path: Path) -> None:
    open_tier(tmp_path).close()
    manifest = FileMapper(tmp_path, IDENTITY).manifest_path
    document = json.loads(manifest.read_text())
    document["identity"]["kv_dtype"] = "float32"
    manifest.write_text(json.dumps(document))
    with pytest.raises(NamespaceMismatchError, match="kv_dtype"):
        open_tier(tmp_path)


# -- corruption -----------------------------------------------------------------------
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


DAMAGE = {
    "header magic": lambda p: _flip(p, 0),
    "header key": lambda p: _flip(p, 100),
    "first payload byte": lambda p: _flip(p, HEADER_BYTES),
    "last payload byte": lambda p: _flip(p, BLOB - 1),
    "truncated payload": lambda p: _truncate(p, BLOB - 1),
    "truncated header": lambda p: _truncate(p, 100),
    "empty": lambda p: _truncate(p, 0),
    "appended byte": lambda p: p.write_bytes(p.read_bytes() + b"x"),
}


@pytest.mark.parametrize("anonymous", [True, False], ids=["anonymous", "named"])
@pytest.mark.parametrize("durability", ["process", "power"])
def test_a_store_replaces_an_unindexed_file_at_its_name(
    tmp_path: Path, anonymous: bool, durability: Durability
) -> None:
    """A file the index does not know (torn by a power cut, left by an older build, put
    there by hand) sits at a chunk's name: the store replaces it, so the name holds the
    chunk's bytes (with anonymous files the name's link fails with EEXIST first)."""
    tier = open_tier(tmp_path, settings=PublishSettings(
        durability=durability, known_dirs=KnownDirs(anonymous=anonymous)))
    try:
        path = tier.manager.mapper.path(conformance_key(1))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"torn")
        assert tier.store([1]) == [conformance_key(1)]
        assert path.stat().st_size == HEADER_BYTES + CHUNK
        result, data = tier.load(1)
        assert result.success and data == conformance_payload(1, CHUNK)
        assert temp_files(tmp_path) == []
    finally:
        tier.close()


@pytest.mark.parametrize("quarantine", [True, False])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_chunk_is_a_miss_never_wrong_bytes(
    tmp_path: Path, damage: str, quarantine: bool
) -> None:
    tier = open_tier(tmp_path, quarantine=quarantine)
    try:
        tier.store(range(3))
        path = tier.manager.mapper.path(conformance_key(1))
        DAMAGE[damage](path)
        result, _data = tier.load(1)
        assert result.failed_keys == result.corrupt_keys == (conformance_key(1),)
        assert tier.manager.get_stats()["corrupt_chunks"] == 1
        assert tier.manager.lookup(conformance_key(1), CTX) is MISS
        assert not path.exists()
        quarantined = list(tier.manager.quarantine_dir.glob("*")) if quarantine else []
        assert len(quarantined) == (1 if quarantine else 0)
        removed = [k for e in tier.manager.take_events() if e.removed for k in e.keys]
        assert removed == [conformance_key(1)]
        for i in (0, 2):
            result, data = tier.load(i)
            assert result.success and data == conformance_payload(i, CHUNK)
        assert tier.store([1]) == [conformance_key(1)]
        assert tier.load(1)[1] == conformance_payload(1, CHUNK)
    finally:
        tier.close()


def test_chunk_under_another_key_name_is_corrupt(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    try:
        tier.store([0, 1])
        mapper = tier.manager.mapper
        os.replace(mapper.path(conformance_key(0)), mapper.path(conformance_key(1)))
        result, _ = tier.load(1)
        assert result.corrupt_keys == (conformance_key(1),)
        assert tier.load(0)[0].failed_keys == (conformance_key(0),)
        assert tier.manager.get_stats()["vanished_chunks"] == 1
        assert tier.manager.lookup(conformance_key(0), CTX) is MISS
    finally:
        tier.close()


# -- capacity -------------------------------------------------------------------------
def _disk_bytes(namespace_dir: Path) -> int:
    return sum(p.stat().st_size for p in chunk_files(namespace_dir))


def test_capacity_is_kept_with_lru_eviction_of_files(tmp_path: Path) -> None:
    capacity = 4
    tier = open_tier(tmp_path, capacity_chunks=capacity)
    manager = tier.manager
    try:
        order: list[int] = []
        removed_events: list[OffloadKey] = []
        for i in range(12):
            if i % 3 == 2:
                # Touching the oldest key moves it to the young end.
                manager.touch([conformance_key(order[0])], CTX)
                order.append(order.pop(0))
            expected_victim = order[0] if len(order) == capacity else None
            tier.store([i])
            order.append(i)
            removed = [k for e in manager.take_events() if e.removed for k in e.keys]
            removed_events.extend(removed)
            if expected_victim is None:
                assert removed == []
            else:
                assert removed == [conformance_key(expected_victim)]
                order.remove(expected_victim)
            stats = manager.get_stats()
            assert stats["usage_bytes"] <= capacity * BLOB
            manager.wait_deletions()
            assert _disk_bytes(manager.namespace_dir) <= capacity * BLOB
        on_disk = {p.name for p in chunk_files(manager.namespace_dir)}
        assert on_disk == {manager.mapper.path(conformance_key(i)).name for i in order}
        assert all(not manager.mapper.path(k).exists() for k in removed_events)
        assert manager.get_stats()["evictions"] == len(removed_events) == 12 - capacity
    finally:
        tier.close()


def test_concurrent_reservations_cannot_overshoot(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity_chunks=3)
    manager = tier.manager
    try:
        assert manager.prepare_store([conformance_key(0), conformance_key(1)], CTX) is not None
        assert manager.prepare_store([conformance_key(2), conformance_key(3)], CTX) is None
        assert manager.prepare_store([conformance_key(2)], CTX) == [conformance_key(2)]
        assert manager.get_stats()["usage_bytes"] == 3 * BLOB
        assert manager.prepare_store([conformance_key(9)] * 4, CTX) is None
    finally:
        tier.close()


def test_reopening_over_capacity_evicts_oldest(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.store(range(5))
    tier.close()
    small = open_tier(tmp_path, capacity_chunks=2)
    try:
        small.manager.wait_deletions()
        assert small.manager.get_stats()["usage_bytes"] <= 2 * BLOB
        assert len(chunk_files(small.manager.namespace_dir)) == 2
    finally:
        small.close()


def test_restore_of_an_evicted_key_is_not_deleted_late(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity_chunks=1)
    manager = tier.manager
    try:
        tier.store([0])
        manager.deletions_gate.clear()
        tier.store([1])  # evicts 0; its unlink waits behind the gate
        tier.store([0])  # evicts 1 and publishes 0's name again
        manager.deletions_gate.set()
        manager.wait_deletions()
        assert not manager.mapper.path(conformance_key(1)).exists()
        assert manager.lookup(conformance_key(0), CTX) is HIT
        assert tier.load(0)[1] == conformance_payload(0, CHUNK)
    finally:
        tier.close()


def test_a_store_with_no_unlink_queued_works_out_no_path(tmp_path: Path) -> None:
    """prepare_store looks for queued unlinks of the keys' names only while some unlink is
    queued or running: a store of new keys costs the scheduler no path per key."""
    tier = open_tier(tmp_path, capacity_chunks=8)
    manager = tier.manager
    asked: list[OffloadKey] = []
    real_path = manager.mapper.path

    def counted(key: OffloadKey) -> Path:
        asked.append(key)
        return real_path(key)

    try:
        manager.mapper.path = counted  # type: ignore[method-assign]
        keys = [conformance_key(i) for i in range(4)]
        assert manager.prepare_store(keys, CTX) == keys
        assert asked == []
        manager.complete_store(keys, CTX, success=False)
        manager.deletions_gate.clear()
        manager._deleter.delete([real_path(conformance_key(9))])
        assert manager.prepare_store(keys, CTX) == keys
        assert sorted(asked) == sorted(keys)
        manager.complete_store(keys, CTX, success=False)
    finally:
        manager.mapper.path = real_path  # type: ignore[method-assign]
        manager.deletions_gate.set()
        tier.close()


def test_restore_while_its_unlink_runs_is_refused_and_never_waits(tmp_path: Path) -> None:
    """The scheduler must not wait on a running unlink, nor publish under its name."""
    tier = open_tier(tmp_path, capacity_chunks=1)
    manager = tier.manager
    started, release = threading.Event(), threading.Event()

    def slow_unlink(path: Path) -> None:
        started.set()
        release.wait(timeout=60)
        os.unlink(path)

    manager._deleter._unlink = slow_unlink
    key0, key1 = conformance_key(0), conformance_key(1)
    try:
        tier.store([0])
        tier.store([1])  # evicts 0; its unlink starts and holds
        assert started.wait(timeout=60)
        answers: list[object] = []
        caller = threading.Thread(target=lambda: answers.append(manager.prepare_store([key0], CTX)))
        caller.start()
        caller.join(timeout=10)
        blocked = caller.is_alive()
        release.set()
        caller.join()
        assert not blocked, "prepare_store waited on the deleter's unlink"
        assert answers == [None], "a name being unlinked was reserved again"
        assert manager.lookup(key1, CTX) is HIT and manager.get_stats()["evictions"] == 1
        manager.wait_deletions()
        assert tier.store([0]) == [key0]
        manager.wait_deletions()
        assert tier.load(0)[1] == conformance_payload(0, CHUNK)
    finally:
        release.set()
        tier.close()


def test_shared_probe_hits_are_kept_within_capacity(tmp_path: Path) -> None:
    reader = open_tier(tmp_path, shared=True, capacity_chunks=2)
    writer = open_tier(tmp_path)
    manager = reader.manager
    try:
        reader.store([0, 1])
        writer.store([5, 6])
        manager.take_events()
        found = [conformance_key(5), conformance_key(6)]
        assert [manager.lookup(key, CTX) for key in found] == [RETRY, RETRY]
        manager.on_schedule_end(ScheduleEndContext())
        manager.wait_probes()
        assert [manager.lookup(key, CTX) for key in found] == [HIT, HIT]
        stats = manager.get_stats()
        assert stats["usage_bytes"] <= stats["capacity_bytes"], "probe hits overshot capacity"
        assert stats["evictions"] == 2
        removed = [key for event in manager.take_events() if event.removed for key in event.keys]
        # 0 and 1 were stored in one batch: which of them goes first is not specified.
        assert sorted(removed) == sorted([conformance_key(0), conformance_key(1)])
        assert [manager.lookup(conformance_key(i), CTX) for i in (0, 1)] == [RETRY, RETRY]
    finally:
        writer.close()
        reader.close()


# -- full disk, read-only filesystem --------------------------------------------------
class FailingOps(FileOps):
    """Fails ``step`` with ``error``. ``syncfs=False`` hides syncfs, so that a power
    mover takes the per-file fsync path it takes on other platforms; ``anonymous=False``
    hides anonymous files (publishing uses named temp files and renames them)."""

    def __init__(self, error: int, step: str, *, syncfs: bool = True,
                 anonymous: bool = True) -> None:
        self.error = error
        self.step = step
        self.syncfs_available = syncfs
        self.anonymous = anonymous

    def has_syncfs(self) -> bool:
        return self.syncfs_available and super().has_syncfs()

    def has_anonymous(self) -> bool:
        return self.anonymous and super().has_anonymous()

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        self._maybe_fail("open")
        return super().open_anonymous(directory, mode, extra_flags)

    def link_anonymous(self, fd: int, dst: Path) -> None:
        self._maybe_fail("link")
        super().link_anonymous(fd, dst)

    def syncfs(self, path: Path) -> None:
        self._maybe_fail("syncfs")
        super().syncfs(path)

    def _maybe_fail(self, step: str) -> None:
        if step == self.step:
            raise OSError(self.error, os.strerror(self.error))

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        self._maybe_fail("open")
        return super().open_exclusive(path, mode, extra_flags)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)

    def replace(self, src: Path, dst: Path) -> None:
        self._maybe_fail("replace")
        super().replace(src, dst)

    def fsync_dir(self, path: Path) -> None:
        self._maybe_fail("fsync_dir")
        super().fsync_dir(path)


@pytest.mark.parametrize(
    ("error", "step"),
    [
        (errno.ENOSPC, "fsync"),
        (errno.ENOSPC, "replace"),
        (errno.ENOSPC, "link"),
        (errno.EROFS, "open"),
        (errno.EIO, "fsync_dir"),
        (errno.EIO, "syncfs"),
        (errno.ENOSPC, "syncfs"),
    ],
)
def test_full_or_read_only_disk_fails_the_store_cleanly(
    tmp_path: Path, error: int, step: str
) -> None:
    good = open_tier(tmp_path, capacity_chunks=4)
    good.store([0, 1])
    good.close()
    ops = FailingOps(error, step, syncfs=step not in ("fsync", "fsync_dir"),
                     anonymous=step != "replace")
    if step == "syncfs" and not ops.has_syncfs():
        pytest.skip("this platform has no syncfs")
    if step == "link" and not ops.has_anonymous():
        pytest.skip("no anonymous files here")
    settings = PublishSettings(ops=ops, durability="power")
    tier = open_tier(tmp_path, capacity_chunks=4, settings=settings)
    manager = tier.manager
    try:
        before = dict(manager.get_stats())
        assert tier.store([2, 3]) == []
        after = manager.get_stats()
        assert after["usage_bytes"] == before["usage_bytes"]
        assert after["store_failures"] == before["store_failures"] + 2
        assert [manager.lookup(conformance_key(i), CTX) for i in (2, 3)] == [MISS, MISS]
        assert temp_files(tmp_path) == []
        assert len(chunk_files(manager.namespace_dir)) == 2
        for i in (0, 1):
            assert tier.load(i)[1] == conformance_payload(i, CHUNK)
    finally:
        tier.close()


def test_real_full_filesystem(tmp_path: Path) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True, check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        tier = open_tier(mount, slots=12)
        try:
            stored = tier.store(range(12))
            assert 0 < len(stored) < 12
            assert temp_files(mount) == []
            for key in stored:
                i = next(j for j in range(12) if conformance_key(j) == key)
                assert tier.load(i)[1] == conformance_payload(i, CHUNK)
        finally:
            tier.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# -- shared directories ---------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_shared_tier_finds_chunks_written_by_another_engine(tmp_path: Path) -> None:
    clock = Clock()
    reader = open_tier(tmp_path, shared=True, clock=clock)
    writer = open_tier(tmp_path)
    manager = reader.manager
    end = ScheduleEndContext()
    try:
        writer.store([5])
        key, absent = conformance_key(5), conformance_key(6)
        assert manager.lookup(key, CTX) is RETRY
        assert manager.lookup(absent, CTX) is RETRY
        assert manager.has_pending_work()
        manager.on_schedule_end(end)
        manager.wait_probes()
        assert manager.lookup(key, CTX) is HIT
        assert manager.lookup(absent, CTX) is MISS
        assert reader.load(5)[1] == conformance_payload(5, CHUNK)
        probes = manager.get_stats()["probes"]
        manager.on_schedule_end(end)
        assert manager.lookup(absent, CTX) is MISS
        assert manager.get_stats()["probes"] == probes
        assert not manager.has_pending_work()
        clock.now += 10
        assert manager.lookup(absent, CTX) is RETRY
    finally:
        writer.close()
        reader.close()


def test_shared_tier_keeps_young_temp_files_of_live_writers(tmp_path: Path) -> None:
    open_tier(tmp_path).close()
    namespace_dir = FileMapper(tmp_path, IDENTITY).namespace_dir
    young = namespace_dir / "ab" / ".x.kvc.123.kvtmp"
    old = namespace_dir / "ab" / ".y.kvc.456.kvtmp"
    young.parent.mkdir()
    young.write_bytes(b"partial")
    old.write_bytes(b"partial")
    os.utime(old, (0, 0))
    open_tier(tmp_path, shared=True).close()
    assert young.exists() and not old.exists()
    open_tier(tmp_path).close()
    assert not young.exists()


# -- operator safety ------------------------------------------------------------------
def test_files_and_directories_are_private_by_default(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    try:
        tier.store([0])
        path = tier.manager.mapper.path(conformance_key(0))
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for directory in (path.parent, path.parent.parent, tier.manager.namespace_dir):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert stat.S_IMODE(tier.manager.mapper.manifest_path.stat().st_mode) == 0o600
    finally:
        tier.close()


@pytest.mark.parametrize(
    "block_hash", [b"../../../../etc", b"/\x00..", b"\xff" * 40, b"..", b"a/b/c/d"]
)
def test_no_key_escapes_the_namespace(tmp_path: Path, block_hash: bytes) -> None:
    mapper = FileMapper(tmp_path, IDENTITY)
    path = mapper.path(make_offload_key(block_hash, 7)).resolve()
    assert path.is_relative_to(mapper.namespace_dir.resolve())
    assert path.parent.parent.parent == mapper.namespace_dir.resolve()
    for name in ("../x_g0.kvc", "..", ".hidden.kvc", "ab/cd_g0.kvc", "abcd_g0.kvc/"):
        assert mapper.key_from_name(name) is None


# -- backends -------------------------------------------------------------------------
def test_auto_falls_back_to_posix_and_explicit_kvikio_fails_at_start(tmp_path: Path) -> None:
    from kvtiers.tiers.file.io import kvikio_status

    if kvikio_status(tmp_path) is None:
        pytest.skip("kvikio is usable on this machine")
    assert select_backend("auto", o_direct=False, directory=tmp_path).code == IO_POSIX
    with pytest.raises(BackendUnavailableError, match="io: kvikio"):
        select_backend("kvikio", o_direct=False, directory=tmp_path)
    assert os.environ.get("KVIKIO_COMPAT_MODE") != ""


class RecordingOps(FileOps):
    def __init__(self) -> None:
        self.flags: list[int] = []

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        self.flags.append(extra_flags)
        return super().open_exclusive(path, mode, extra_flags)

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        self.flags.append(extra_flags)
        return super().open_anonymous(directory, mode, extra_flags)


def test_o_direct_is_used_for_aligned_slots(tmp_path: Path) -> None:
    backend = select_backend("posix", o_direct=True, directory=tmp_path)
    if backend.code != IO_POSIX_DIRECT:
        pytest.skip(f"this filesystem refuses O_DIRECT ({tmp_path})")
    ops = RecordingOps()
    tier = open_tier(tmp_path, backend=backend, settings=PublishSettings(ops=ops), aligned=True)
    try:
        tier.store(range(3))
        assert ops.flags and all(flag & os.O_DIRECT for flag in ops.flags)
        assert all(p.stat().st_size == BLOB for p in chunk_files(tier.manager.namespace_dir))
        for i in range(3):
            assert tier.load(i)[1] == conformance_payload(i, CHUNK)
    finally:
        tier.close()


def test_o_direct_refused_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtiers.tiers.file.io as io

    monkeypatch.setattr(io, "probe_o_direct", lambda directory: "refused for the test")
    assert select_backend("posix", o_direct=True, directory=tmp_path).code == IO_POSIX
    assert PosixBackend(o_direct=False).name == "posix"


class SyncRecordingOps(FileOps):
    """Real system calls; records every fsync (``None``), directory fsync (its path) and
    syncfs (``"syncfs"``). ``syncfs=False`` hides syncfs."""

    def __init__(self, *, syncfs: bool = True) -> None:
        self.calls: list[Path | str | None] = []
        self.lock = threading.Lock()
        self.syncfs_available = syncfs

    def has_syncfs(self) -> bool:
        return self.syncfs_available and super().has_syncfs()

    def syncfs(self, path: Path) -> None:
        with self.lock:
            self.calls.append("syncfs")
        super().syncfs(path)

    def fsync(self, fd: int) -> None:
        with self.lock:
            self.calls.append(None)
        super().fsync(fd)

    def fsync_dir(self, path: Path) -> None:
        with self.lock:
            self.calls.append(path)
        super().fsync_dir(path)


def test_durability_process_stores_without_any_fsync(tmp_path: Path) -> None:
    ops = SyncRecordingOps()
    tier = open_tier(tmp_path, settings=PublishSettings(ops=ops, durability="process"))
    try:
        assert len(tier.store(range(6))) == 6
        assert ops.calls == []
        for i in range(6):
            assert tier.load(i)[1] == conformance_payload(i, CHUNK)
    finally:
        tier.close()


def test_durability_power_without_syncfs_fsyncs_each_chunk_then_each_directory_once(
    tmp_path: Path,
) -> None:
    ops = SyncRecordingOps(syncfs=False)
    tier = open_tier(tmp_path, settings=PublishSettings(ops=ops, durability="power"))
    try:
        assert len(tier.store(range(6))) == 6
        files = chunk_files(tier.manager.namespace_dir)
        data_syncs = ops.calls.count(None)
        dirs = ops.calls[data_syncs:]
        assert ops.calls[:data_syncs] == [None] * 6, "a directory fsync ran before a chunk's"
        assert None not in dirs and len(dirs) == len(set(dirs)), dirs
        assert {f.parent for f in files} | {f.parent.parent for f in files} <= set(dirs)
    finally:
        tier.close()


def test_durability_power_flushes_each_store_job_with_one_syncfs(tmp_path: Path) -> None:
    ops = SyncRecordingOps()
    if not ops.has_syncfs():
        pytest.skip("this platform has no syncfs")
    tier = open_tier(tmp_path, settings=PublishSettings(ops=ops, durability="power"))
    try:
        assert len(tier.store(range(6))) == 6
        assert len(tier.store(range(6, 9))) == 3
        assert ops.calls == ["syncfs", "syncfs"]
        for i in range(9):
            assert tier.load(i)[1] == conformance_payload(i, CHUNK)
    finally:
        tier.close()


def test_the_config_chooses_the_durability(tmp_path: Path) -> None:
    from kvtiers.config.stack import load_stack_config
    from kvtiers.config.tiers import CPUTierConfig, FileTierConfig
    from kvtiers.errors import ConfigError
    from kvtiers.tiers.cpu.factory import build_tier as build_cpu
    from kvtiers.tiers.file.factory import build_tier as build_file

    def file_tier(**extra: object) -> FileTierConfig:
        stack = load_stack_config({"tiers": [
            {"kind": "cpu", "capacity": "1MiB"}, {"kind": "file", "root": str(tmp_path), **extra},
        ]})
        tier = stack.tiers[1]
        assert isinstance(tier, FileTierConfig)
        return tier

    assert file_tier().durability == "process"
    assert file_tier(durability="power").durability == "power"
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.durability: expected one of process"):
        file_tier(durability="disk")
    offloading = offloading_config()
    cpu = build_cpu(CPUTierConfig(name="cpu", capacity=Size(4 * 8192)), offloading,
                    primary_region=None, name="cpu")
    for durability in ("process", "power"):
        config = FileTierConfig(name="disk", root=str(tmp_path), durability=durability)
        disk = build_file(config, offloading, primary_region=cpu.region, name="disk")
        try:
            assert isinstance(disk.mover, FileMover)
            assert disk.mover.settings.durability == durability
        finally:
            assert disk.mover is not None
            disk.mover.shutdown()
            disk.manager.shutdown()
    cpu.manager.shutdown()


# -- in a stack -----------------------------------------------------------------------
def test_cpu_and_file_stack_cascades_then_promotes_after_restart(tmp_path: Path) -> None:
    from kvtiers.config.sizes import Size
    from kvtiers.config.tiers import CPUTierConfig, FileTierConfig
    from kvtiers.core.specs import CPULoadStoreSpec
    from kvtiers.stack.composite import TieredManager
    from kvtiers.tiers.cpu.factory import build_tier as build_cpu
    from kvtiers.tiers.file.factory import build_tier as build_file

    offloading = offloading_config()

    def stack() -> TieredManager:
        cpu = build_cpu(CPUTierConfig(name="cpu", capacity=Size(4 * 8192)), offloading,
                        primary_region=None, name="cpu", staging=True)
        disk = build_file(FileTierConfig(name="disk", root=str(tmp_path)), offloading,
                          primary_region=cpu.region, name="disk")
        disk.manager.wait_index()
        return TieredManager([cpu, disk])

    ids = range(3)
    keys = [conformance_key(i) for i in ids]
    first = stack()
    try:
        assert first.prepare_store(keys, CTX) == keys
        spec = first.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        region = first.tiers[0].region
        assert region is not None
        for i, slot in zip(ids, spec.slot_ids.tolist(), strict=True):
            region.view(slot)[:CHUNK] = conformance_payload(i, CHUNK)
        first.complete_store(keys, CTX)
        first.wait_idle()
        assert first.get_stats()["cascades"] == 3
    finally:
        first.shutdown()

    second = stack()
    try:
        assert [second.lookup(k, CTX) for k in keys] == [LookupResult.HIT_PENDING] * 3
        second.wait_idle()
        assert [second.lookup(k, CTX) for k in keys] == [HIT] * 3
        second.prepare_load(keys, CTX)
        spec = second.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        region = second.tiers[0].region
        assert region is not None
        for i, slot in zip(ids, spec.slot_ids.tolist(), strict=True):
            assert bytes(region.view(slot)[:CHUNK]) == conformance_payload(i, CHUNK)
        second.complete_load(keys, CTX)
        assert second.get_stats()["promotions"] == 3
    finally:
        second.shutdown()


# -- large chunks: the checksum computed while the payload is written --------------------
@pytest.mark.parametrize("o_direct", [False, True])
def test_a_large_chunk_hashed_beside_its_write_loads_and_verifies(
    tmp_path: Path, o_direct: bool
) -> None:
    from kvtiers.core import chunkformat
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.testing.driver import TierDriver
    from kvtiers.tiers.file.factory import build_tier
    from kvtiers.tiers.file.mover import OVERLAP_HASH_BYTES
    from tests.test_file_support import MmapRegion

    size = OVERLAP_HASH_BYTES * 2
    offloading = offloading_config(bytes_per_block=size)
    geometry = ChunkGeometry.from_config(offloading)
    from kvtiers.config.tiers import FileTierConfig

    config = FileTierConfig(name="file", root=str(tmp_path), threads=2, o_direct=o_direct)
    region = MmapRegion(4, geometry.slot_bytes)
    tier = build_tier(config, offloading, primary_region=region, name="file")
    try:
        driver = TierDriver(tier, region, geometry)
        data = {conformance_key(i): conformance_payload(i, size) for i in range(3)}
        assert set(driver.store(data).succeeded_keys) == set(data)
        identity = NamespaceIdentity.from_config(offloading)
        for key, payload in data.items():
            blob = FileMapper(tmp_path, identity).path(key).read_bytes()
            assert blob[HEADER_BYTES:] == payload
            header = chunkformat.decode_header(blob, namespace_digest=identity.digest, key=key)
            assert header.checksum == chunkformat.payload_checksum(payload)
        assert TierDriver(tier, region, geometry).load(list(data))[1] == data
    finally:
        tier.shutdown()
