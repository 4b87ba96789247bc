"""The CPU tier's host region: zero-copy slot views, /dev/shm sharing and its errors."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtiers.errors import CapacityError, ConfigError
from kvtiers.tiers.cpu.region import SHM_DIR, SlotRegion


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
    assert creator.path.exists()
    creator.close()
    assert not (SHM_DIR / shm_name).exists()


def test_attaching_to_a_left_over_file_warns_once_and_keeps_it(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    left_over = SHM_DIR / shm_name
    left_over.write_bytes(b"x" * 8192)
    with caplog.at_level(logging.WARNING, logger="kvtiers.tiers.cpu.region"):
        region = SlotRegion(2, 4096, shm_name)
        assert bytes(region.view(0)[:1]) == b"x"
        region.close()
    (warning,) = caplog.records
    assert str(left_over) in warning.getMessage() and "reused" in warning.getMessage()
    assert "ended without removing it" in warning.getMessage()
    assert f"rm {left_over}" in warning.getMessage()
    assert left_over.exists(), "an attached region must not remove the file it did not create"


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


@pytest.mark.parametrize("name", ["", "a/b", ".."])
def test_shared_memory_name_must_be_a_file_name(name: str) -> None:
    with pytest.raises(ConfigError, match="not a plain file name"):
        SlotRegion(1, 4096, name)
