"""The CPU tier's host region: zero-copy slot views, /dev/shm sharing and its errors."""

from __future__ import annotations

import logging
import os
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtiers.errors import CapacityError, ConfigError
from kvtiers.tiers.cpu.region import SHM_DIR, SlotRegion, remove_left_overs


def test_a_private_region_the_system_refuses_names_its_size_and_the_key() -> None:
    """4096 PiB exceeds any address space: one ConfigError at the tier's capacity that
    says how much was asked and what to do, not a bare OSError."""
    with pytest.raises(ConfigError) as info:
        SlotRegion(1 << 40, 1 << 22)
    assert info.value.path == "capacity"
    message = info.value.message
    assert "region of 4096.0 PiB (4611686018427387904 bytes) cannot be allocated" in message
    assert message.endswith("lower the tier's capacity") and "\n" not in message


def test_slot_views_are_zero_copy_windows_of_the_region() -> None:
    region = SlotRegion(3, 4096)
    try:
        assert (region.num_slots, region.slot_bytes, region.nbytes) == (3, 4096, 3 * 4096)
        view = region.view(1)
        assert len(view) == 4096 and not view.readonly
        view[:3] = b"abc"
        flat = region.tensor()
        assert bytes(flat[4096:4099].numpy()) == b"abc"
        flat[2 * 4096] = 7
        assert region.view(2)[0] == 7
        assert not region.pinned
        with pytest.raises(IndexError):
            region.view(3)
    finally:
        region.close()
        region.close()


@pytest.fixture
def shm_name() -> Iterator[str]:
    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm on this machine")
    name = f"kvtiers-test-{uuid.uuid4().hex}"
    yield name
    (SHM_DIR / name).unlink(missing_ok=True)


def test_named_region_is_shared_and_removed_by_its_creator(shm_name: str) -> None:
    creator = SlotRegion(2, 4096, shm_name)
    assert creator.path == SHM_DIR / shm_name and creator.path.stat().st_size == 8192
    attached = SlotRegion(2, 4096, shm_name)
    creator.view(1)[:5] = b"hello"
    assert bytes(attached.view(1)[:5]) == b"hello"
    attached.close()
    assert creator.path.exists(), "the creator still maps it"
    creator.close()
    assert not (SHM_DIR / shm_name).exists()


def test_a_left_over_file_of_ours_is_replaced_not_reused(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    left_over = SHM_DIR / shm_name
    left_over.write_bytes(b"x" * 8192)
    left_over.chmod(0o600)
    old_inode = left_over.stat().st_ino
    with caplog.at_level(logging.WARNING, logger="kvtiers.tiers.cpu.region"):
        region = SlotRegion(2, 4096, shm_name)
    try:
        assert bytes(region.view(0)[:1]) == b"\0", "stale bytes must never be reused"
        assert left_over.stat().st_ino != old_inode
    finally:
        region.close()
    (warning,) = caplog.records
    assert str(left_over) in warning.getMessage() and "removed" in warning.getMessage()
    assert not left_over.exists()


def test_a_world_writable_file_at_the_name_is_refused_and_kept(shm_name: str) -> None:
    planted = SHM_DIR / shm_name
    planted.write_bytes(b"x" * 8192)
    planted.chmod(0o666)
    with pytest.raises(ConfigError, match=r"has mode 0666 \(group or others may use it\)"):
        SlotRegion(2, 4096, shm_name)
    assert planted.read_bytes() == b"x" * 8192, "a refused file must be left untouched"


def test_a_file_of_another_user_is_refused(shm_name: str) -> None:
    planted = SHM_DIR / shm_name
    planted.write_bytes(b"x" * 8192)
    planted.chmod(0o600)
    os.chown(planted, os.geteuid() + 4242, -1)
    with pytest.raises(ConfigError, match=f"is owned by uid {os.geteuid() + 4242}"):
        SlotRegion(2, 4096, shm_name)
    assert planted.exists()


def test_a_symlink_at_the_name_is_refused_and_its_target_untouched(
    shm_name: str, tmp_path: Path
) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"secret" + bytes(8186))
    target.chmod(0o600)
    (SHM_DIR / shm_name).symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        SlotRegion(2, 4096, shm_name)
    assert target.read_bytes() == b"secret" + bytes(8186)
    assert (SHM_DIR / shm_name).is_symlink()


def test_a_directory_at_the_name_is_refused(shm_name: str) -> None:
    (SHM_DIR / shm_name).mkdir(mode=0o700)
    try:
        with pytest.raises(ConfigError, match="not a regular file"):
            SlotRegion(2, 4096, shm_name)
    finally:
        (SHM_DIR / shm_name).rmdir()


def test_a_new_region_file_is_private_whatever_the_umask(shm_name: str) -> None:
    old = os.umask(0)
    try:
        region = SlotRegion(2, 4096, shm_name)
    finally:
        os.umask(old)
    try:
        info = (SHM_DIR / shm_name).lstat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(f".{shm_name}.")]
    finally:
        region.close()


def test_the_last_process_out_removes_the_file(shm_name: str) -> None:
    creator = SlotRegion(2, 4096, shm_name)
    attached = SlotRegion(2, 4096, shm_name)
    creator.close()
    assert (SHM_DIR / shm_name).exists(), "a region still mapped elsewhere must stay"
    attached.close()
    assert not (SHM_DIR / shm_name).exists()


def test_attaching_beside_a_live_creator_does_not_warn(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    creator = SlotRegion(2, 4096, shm_name)
    with caplog.at_level(logging.WARNING, logger="kvtiers.tiers.cpu.region"):
        attached = SlotRegion(2, 4096, shm_name)
        attached.close()
    creator.close()
    assert not caplog.records


def test_creating_a_region_does_not_warn(shm_name: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtiers.tiers.cpu.region"):
        SlotRegion(2, 4096, shm_name).close()
    assert not caplog.records


def test_attaching_with_another_size_is_refused(shm_name: str) -> None:
    creator = SlotRegion(2, 4096, shm_name)
    try:
        with pytest.raises(CapacityError, match="exists with 8192 bytes"):
            SlotRegion(3, 4096, shm_name)
    finally:
        creator.close()


def test_too_small_shm_is_a_clear_error(shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    def small(path: str | Path) -> object:
        stats = real(path)
        return SimpleNamespace(f_bavail=10, f_frsize=4096, f_bsize=stats.f_bsize)

    monkeypatch.setattr(os, "statvfs", small)
    with pytest.raises(CapacityError, match=r"/dev/shm has .* free but the CPU tier needs"):
        SlotRegion(1024, 4096, shm_name)
    assert not (SHM_DIR / shm_name).exists()


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden"])
def test_shared_memory_name_must_be_a_file_name(name: str) -> None:
    with pytest.raises(ConfigError, match="not a plain file name"):
        SlotRegion(1, 4096, name)


def test_racing_processes_all_map_one_file(shm_name: str) -> None:
    count = 6
    barrier = threading.Barrier(count)
    regions: list[SlotRegion] = []
    lock = threading.Lock()

    def open_one() -> None:
        barrier.wait()
        region = SlotRegion(2, 4096, shm_name)
        with lock:
            regions.append(region)

    threads = [threading.Thread(target=open_one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(regions) == count and {r.path for r in regions} == {SHM_DIR / shm_name}
        regions[0].view(1)[:4] = b"same"
        assert all(bytes(r.view(1)[:4]) == b"same" for r in regions)
    finally:
        for region in regions:
            region.close()
    assert not (SHM_DIR / shm_name).exists()


def test_left_overs_nobody_maps_are_removed_and_live_or_foreign_files_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed engine's region (no process holds its lock) is removed; a region some
    process maps, a file with group/other bits, a temp file being made and a file with
    another prefix are kept."""
    live = SlotRegion(2, 64, "kvtiers-7-live", shm_dir=tmp_path)
    crashed = tmp_path / "kvtiers-7-crashed"
    crashed.write_bytes(b"\0" * 128)
    crashed.chmod(0o600)
    foreign = tmp_path / "kvtiers-7-shared"
    foreign.write_bytes(b"x")
    foreign.chmod(0o644)
    making = tmp_path / ".kvtiers-7-new.0011.kvtmp"
    making.write_bytes(b"x")
    making.chmod(0o600)
    other = tmp_path / "vllm-7-region"
    other.write_bytes(b"x")
    other.chmod(0o600)
    try:
        with caplog.at_level(logging.WARNING):
            removed = remove_left_overs("kvtiers-7-", shm_dir=tmp_path)
        assert removed == [crashed]
        assert not crashed.exists()
        assert {p.name for p in tmp_path.iterdir()} == {
            "kvtiers-7-live", "kvtiers-7-shared", making.name, "vllm-7-region"
        }
        assert "kvtiers-7-crashed" in caplog.text
        assert remove_left_overs("kvtiers-7-", shm_dir=tmp_path) == []
    finally:
        live.close()
    assert remove_left_overs("kvtiers-7-", shm_dir=tmp_path) == []
    assert not (tmp_path / "kvtiers-7-live").exists()  # its last user removed it
