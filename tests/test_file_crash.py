"""Crash safety: a writer process is SIGKILLed at random moments during a store stream,
with ``durability: process`` (no fsync) and ``durability: power`` alike, publishing
through anonymous files (``O_TMPFILE``) and through named temp files (the fallback): a
killed process loses nothing that reached the kernel, so each must leave a consistent
tier.

After every kill the tier is reopened as a restarted engine would: no temp file may
remain and every chunk the rebuilt index holds must load byte-exact. The writer is a
forked child (a fresh interpreter would cost most of the time budget per kill); it
stores batches of chunks through the real manager, mover and publish path and reports
each finished batch on a pipe, so the parent kills it after a random number of batches
plus a random delay, landing anywhere inside a publish. The harness is
:mod:`kvtiers.testing.crash`; ``benchmarks/stress_file.py`` runs the same rounds by the
hundred.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtiers.core.publish import DURABILITIES, Durability, FileOps
from kvtiers.testing.crash import BATCH, check_restart, crash_once


@pytest.mark.parametrize(
    "anonymous",
    [pytest.param(True, id="anonymous", marks=pytest.mark.skipif(
        not FileOps().has_anonymous(), reason="no O_TMPFILE or no /proc/self/fd here")),
     pytest.param(False, id="named")],
)
@pytest.mark.parametrize("durability", DURABILITIES)
def test_writer_killed_at_random_moments_leaves_a_consistent_tier(
    tmp_path: Path, durability: Durability, anonymous: bool
) -> None:
    rng = random.Random(20261130)
    first = 0
    finished = 0
    kills = 24
    for _ in range(kills):
        finished += crash_once(tmp_path, rng, first, durability, anonymous=anonymous)
        indexed = check_restart(tmp_path)
        # Every batch reported finished was published; later ones may be in part.
        assert indexed >= finished * BATCH
        first += 10 * BATCH
