"""Liveness on disks that refuse writes (docs/architecture.md, "Liveness"): a read-only
root opens read-only, a full disk pauses admission with one warning until space returns,
and a namespace that cannot be created is a one-line error leaving nothing behind.

Faults are injected at the system-call layer (we run as root, so permissions cannot make
a filesystem refuse us); where ``mount`` works, the same cases also run on a real small
tmpfs, remounted read-only or filled up.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtiers.config.tiers import FileTierConfig
from kvtiers.core.publish import FileOps
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError
from kvtiers.filemapper import FileMapper, open_namespace
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.file import space as space_module
from kvtiers.tiers.file.factory import build_tier
from kvtiers.tiers.file.io import PublishSettings
from kvtiers.tiers.file.space import SpaceLatch
from tests.test_file_support import (
    CHUNK,
    CTX,
    GEOMETRY,
    IDENTITY,
    offloading_config,
    open_tier,
    temp_files,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SwitchableOps(FileOps):
    """Fails the temp-file create of every publish with ``error`` while ``failing`` (a
    step of every publish whatever the tier's durability)."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.failing = True

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        if self.failing:
            raise OSError(self.error, os.strerror(self.error))
        return super().open_exclusive(path, mode, extra_flags)

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        if self.failing:
            raise OSError(self.error, os.strerror(self.error))
        return super().open_anonymous(directory, mode, extra_flags)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_pauses_admission_with_one_warning_until_space_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, error: int
) -> None:
    clock = Clock()
    latch = SpaceLatch(str(tmp_path), retry_s=5.0, clock=clock)
    ops = SwitchableOps(error)
    tier = open_tier(tmp_path, slots=8, settings=PublishSettings(ops=ops), space=latch)
    tier.mover.space = latch
    manager = tier.manager
    try:
        with caplog.at_level(logging.WARNING):
            assert tier.store(range(4)) == []
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert os.strerror(error) in warnings[0].getMessage()
        assert latch.full and latch.refused_chunks == 4
        assert manager.prepare_store([conformance_key(5)], CTX) is None
        assert manager.get_stats()["usage_bytes"] == 0
        assert temp_files(tmp_path) == []

        clock.now = 5.0  # one store may try again: still full, still quiet
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert tier.store([5]) == []
        assert caplog.records == [] and latch.refused_chunks == 5
        assert manager.prepare_store([conformance_key(6)], CTX) is None

        clock.now = 10.0
        ops.failing = False
        with caplog.at_level(logging.WARNING):
            assert tier.store([6]) == [conformance_key(6)]
        assert not latch.full and "5 chunk(s) were not stored" in caplog.text
        assert tier.load(6)[1] == conformance_payload(6, CHUNK)
    finally:
        tier.close()


def _built(root: Path) -> BuiltTier:
    """The file tier at ``root`` as a stack builds it, once its index is built."""
    config = FileTierConfig(name="file", root=str(root), io="posix")
    built = build_tier(config, offloading_config(),
                       primary_region=BytearrayRegion(4, GEOMETRY.slot_bytes), name="file")
    built.manager.wait_index()
    return built


def _fill_and_leave_a_temp(root: Path) -> Path:
    tier = open_tier(root)
    tier.store([0])
    namespace_dir = tier.manager.namespace_dir
    tier.close()
    temp = namespace_dir / "ab" / ".leftover.kvtmp"
    temp.parent.mkdir(exist_ok=True)
    temp.write_bytes(b"half a chunk")
    return temp


def _check_read_only_tier(built: BuiltTier, caplog: pytest.LogCaptureFixture) -> None:
    try:
        assert built.admission == "never"
        assert built.manager.prepare_store([conformance_key(1)], CTX) is None
        assert built.manager.lookup(conformance_key(0), CTX).name == "HIT"
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert sum("read-only" in w for w in warnings) == 1, warnings
    finally:
        built.shutdown()


def test_a_read_only_root_with_a_leftover_temp_opens_read_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = _fill_and_leave_a_temp(tmp_path)
    real_unlink = os.unlink

    def read_only_unlink(path: object, *args: object, **kwargs: object) -> None:
        if str(path).endswith(".kvtmp"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", read_only_unlink)
    monkeypatch.setattr(space_module, "filesystem_read_only", lambda directory: True)
    with caplog.at_level(logging.WARNING):
        built = _built(tmp_path)
    monkeypatch.undo()
    assert temp.exists()
    _check_read_only_tier(built, caplog)


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, unmounted afterwards; skips where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_real_read_only_root_opens_read_only(
    small_mount: Path, caplog: pytest.LogCaptureFixture
) -> None:
    temp = _fill_and_leave_a_temp(small_mount)
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    with caplog.at_level(logging.WARNING):
        built = _built(small_mount)
    assert temp.exists()
    _check_read_only_tier(built, caplog)


def test_a_namespace_that_cannot_be_created_is_one_line_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self: FileOps, path: Path, mode: int, extra_flags: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(FileOps, "open_exclusive", full)
    monkeypatch.setattr(FileOps, "open_anonymous", full)
    with pytest.raises(ConfigError, match="No space left on device; free space") as error:
        open_namespace(tmp_path, IDENTITY)
    assert "\n" not in str(error.value) and error.value.path == "root"
    assert list(tmp_path.iterdir()) == []


def test_a_real_full_disk_at_open_leaves_no_namespace(small_mount: Path) -> None:
    fd = os.open(small_mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as full:
            while True:
                os.write(fd, bytes(4096))
        assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(ConfigError, match="cannot create the namespace"):
        open_namespace(small_mount, IDENTITY)
    assert sorted(p.name for p in small_mount.iterdir()) == ["filler"]
    assert not FileMapper(small_mount, IDENTITY).manifest_path.parent.exists()


def test_stale_temp_cleanup_leaves_what_a_read_only_filesystem_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtiers.filemapper import remove_stale_temps

    temp = tmp_path / "ab" / ".chunk.kvc.0123.kvtmp"
    temp.parent.mkdir()
    temp.write_bytes(b"x")

    def read_only(path: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "unlink", read_only)
    assert remove_stale_temps(tmp_path) == 0
    monkeypatch.undo()
    assert temp.exists()
    assert remove_stale_temps(tmp_path) == 1
