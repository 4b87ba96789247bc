"""Crash safety: a writer process is SIGKILLed at random moments during a store stream,
with ``durability: process`` (no fsync) and ``durability: power`` alike: a killed process
loses nothing that reached the kernel, so both must leave a consistent tier.

After every kill the tier is reopened as a restarted engine would: no temp file may
remain and every chunk the rebuilt index holds must load byte-exact. The writer is a
forked child (a fresh interpreter would cost most of the time budget per kill); it
stores batches of chunks through the real manager, mover and publish path and reports
each finished batch on a pipe, so the parent kills it after a random number of batches
plus a random delay, landing anywhere inside a publish. ``benchmarks/stress_file.py``
runs the same rounds by the hundred.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from kvtiers.core.publish import DURABILITIES, Durability
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.tiers.file.io import PublishSettings
from tests.test_file_support import CHUNK, open_tier, temp_files

BATCH = 3
KEY_SPACE = 100_000
_INDEX = {}


def key_index(key: bytes) -> int:
    """The chunk number behind a conformance key (keys are hashes, so look them up)."""
    if not _INDEX:
        _INDEX.update({conformance_key(i): i for i in range(KEY_SPACE)})
    return _INDEX[key]


def _writer(root: Path, first: int, report_fd: int, durability: Durability) -> None:
    """Child process: store batches forever, one byte on ``report_fd`` per batch."""
    tier = open_tier(root, slots=BATCH, settings=PublishSettings(durability=durability))
    i = first
    while True:
        tier.store(range(i, i + BATCH))
        os.write(report_fd, b"b")
        i += BATCH


def crash_once(
    root: Path, rng: random.Random, first: int, durability: Durability = "process"
) -> int:
    """Fork a writer starting at chunk ``first``, kill it at a random moment; returns how
    many batches it reported finished."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            _writer(root, first, write_fd, durability)
        finally:
            os._exit(1)
    os.close(write_fd)
    batches = rng.randint(0, 4)
    try:
        for _ in range(batches):
            got = os.read(read_fd, 1)
            assert got == b"b", "the writer died before it was killed"
        time.sleep(rng.uniform(0, 0.003))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        os.close(read_fd)
    return batches


def check_restart(root: Path) -> int:
    """Reopen ``root`` as a restarting engine; check it and return the chunks indexed."""
    tier = open_tier(root)
    try:
        assert temp_files(root) == [], "stale temp files survived the restart"
        namespace_dir = tier.manager.namespace_dir
        keys = [
            tier.manager.mapper.key_from_name(p.name) for p in namespace_dir.glob("??/??/*.kvc")
        ]
        assert tier.manager.get_stats()["chunks"] == len(keys)
        for key in keys:
            assert key is not None
            i = key_index(key)
            result, data = tier.load(i)
            assert result.success, f"chunk {i} does not verify after a crash"
            assert data == conformance_payload(i, CHUNK), f"chunk {i} loaded wrong bytes"
        return len(keys)
    finally:
        tier.close()


@pytest.mark.parametrize("durability", DURABILITIES)
def test_writer_killed_at_random_moments_leaves_a_consistent_tier(
    tmp_path: Path, durability: Durability
) -> None:
    rng = random.Random(20261130)
    first = 0
    finished = 0
    kills = 24
    for _ in range(kills):
        finished += crash_once(tmp_path, rng, first, durability)
        indexed = check_restart(tmp_path)
        # Every batch reported finished was published; later ones may be in part.
        assert indexed >= finished * BATCH
        first += 10 * BATCH
