"""Crash harness of the file tier: a writer process SIGKILLed at random moments.

:func:`crash_once` forks a writer that stores batches of chunks through a real file tier
(built by the ``file`` kind's factory: manager, mover, atomic publish) and kills it after
a random number of finished batches plus a random delay, so the kill lands anywhere,
inside a publish included. :func:`check_restart` then reopens the root as a restarted
engine would and checks the invariants: no temp file survives, and every chunk the
rebuilt index holds loads byte-exact. ``tests/test_file_crash.py`` runs a few dozen
rounds; ``benchmarks/stress_file.py`` runs hundreds. POSIX only (``os.fork``).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from kvtiers.config.tiers import FileTierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.publish import Durability, is_temp_name
from kvtiers.filemapper import scan_namespace
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
from kvtiers.tiers.file.factory import build_tier
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import FileMover

#: Chunks per stored batch (the writer reports each finished batch).
BATCH = 3
#: Chunk numbers a writer may use; keys are hashes, looked up in a table this large.
KEY_SPACE = 100_000
OFFLOADING = offloading_config()
GEOMETRY = ChunkGeometry.from_config(OFFLOADING)
CHUNK = GEOMETRY.chunk_bytes(0)
_INDEX: dict[OffloadKey, int] = {}


def key_index(key: OffloadKey) -> int:
    """The chunk number behind a conformance key."""
    if not _INDEX:
        _INDEX.update({conformance_key(i): i for i in range(KEY_SPACE)})
    return _INDEX[key]


def open_file_tier(
    root: Path, *, slots: int = 8, durability: Durability = "process", anonymous: bool = True
) -> TierDriver:
    """A file tier at ``root`` built by its factory, driven over a ``slots``-slot region,
    publishing with ``durability``; ``anonymous=False`` publishes through named temp
    files, as on filesystems without ``O_TMPFILE``."""
    region = BytearrayRegion(slots, GEOMETRY.slot_bytes)
    config = FileTierConfig(
        name="file", root=str(root), io="posix", threads=2, durability=durability
    )
    built = build_tier(config, OFFLOADING, primary_region=region, name="file")
    if not anonymous:
        assert isinstance(built.mover, FileMover)
        built.mover.settings.known_dirs.anonymous = False
    return TierDriver(built, region, GEOMETRY)


def temp_files(root: Path) -> list[str]:
    """Every publish temp file anywhere below ``root``."""
    return sorted(item.name for item in scan_namespace(root, skip_quarantine=False)
                  if is_temp_name(item.entry.name))


def _writer(
    root: Path, first: int, report_fd: int, durability: Durability, anonymous: bool
) -> None:
    """Child process: store batches forever, one byte on ``report_fd`` per batch."""
    tier = open_file_tier(root, slots=BATCH, durability=durability, anonymous=anonymous)
    i = first
    while True:
        tier.store({conformance_key(j): conformance_payload(j, CHUNK) for j in range(i, i + BATCH)})
        os.write(report_fd, b"b")
        i += BATCH


def crash_once(
    root: Path,
    rng: random.Random,
    first: int,
    durability: Durability = "process",
    *,
    anonymous: bool = True,
) -> int:
    """Fork a writer starting at chunk ``first`` that publishes with ``durability`` (and
    anonymous files unless ``anonymous=False``), kill it at a random moment; returns how
    many batches it reported finished."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _writer(root, first, write_fd, durability, anonymous)
        finally:
            os._exit(1)
    os.close(write_fd)
    batches = rng.randint(0, 4)
    try:
        for _ in range(batches):
            got = os.read(read_fd, 1)
            assert got == b"b", "the writer died before it was killed"
        time.sleep(rng.uniform(0, 0.003))  # the random moment of the kill itself
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        os.close(read_fd)
    return batches


def check_restart(root: Path) -> int:
    """Reopen ``root`` as a restarting engine; check it and return the chunks indexed."""
    tier = open_file_tier(root)
    try:
        assert temp_files(root) == [], "stale temp files survived the restart"
        manager = tier.manager
        assert isinstance(manager, FileTierManager)
        keys = [
            key for item in scan_namespace(manager.namespace_dir)
            if (key := item.chunk_key()) is not None
        ]
        assert manager.get_stats()["chunks"] == len(keys)
        for key in keys:
            i = key_index(key)
            result, data = tier.load([key])
            assert result.success, f"chunk {i} does not verify after a crash"
            assert data[key] == conformance_payload(i, CHUNK), f"chunk {i} loaded wrong bytes"
        return len(keys)
    finally:
        tier.built.shutdown()
