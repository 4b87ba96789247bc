"""Crash stress for the file tier: hundreds of SIGKILLs of a writer during a store stream.

Each round forks a writer that stores batches of chunks through the real manager, mover
and publish path, kills it at a random moment, then reopens the root as a restarted
engine and checks that no temp file remains and every indexed chunk loads byte-exact
(the harness of :mod:`kvtiers.testing.crash`, which ``tests/test_file_crash.py`` runs).
Reports how many kills landed inside a publish (a temp file was left for the restart to
clean). Run from the repository root::

    .venv/bin/python benchmarks/stress_file.py --rounds 300 [--durability power]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtiers.core.publish import DURABILITIES
from kvtiers.testing.crash import BATCH, check_restart, crash_once, temp_files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="writer kills (default 300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where to put the root")
    parser.add_argument("--durability", choices=DURABILITIES, default="process")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    start = time.perf_counter()
    torn = 0
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtiers-stress-") as tmp:
        root = Path(tmp)
        first = 0
        indexed = 0
        for round_no in range(1, args.rounds + 1):
            crash_once(root, rng, first, args.durability)
            torn += bool(temp_files(root))
            indexed = check_restart(root)
            first += 10 * BATCH
            if round_no % 50 == 0:
                print(f"{round_no} kills, {torn} inside a publish, {indexed} chunks verified")
    elapsed = time.perf_counter() - start
    print(
        f"OK: {args.rounds} kills in {elapsed:.1f} s; {torn} landed inside a publish (temp "
        f"file cleaned at restart); every indexed chunk ({indexed} at the end) loaded "
        "byte-exact after every restart"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
