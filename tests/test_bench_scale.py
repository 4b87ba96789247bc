"""``benchmarks/bench_scale.py``'s ``--reuse``: the file rows an earlier run measured at
sizes this run does not are kept, rounds and all, and the page says which run each
came from. The starts themselves run in ``benchmarks/bench_scale.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load() -> ModuleType:
    # The script imports its siblings (harness) by bare name, as a script run does.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_scale", BENCHMARKS / "bench_scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


def _row(n: int, full_s: float, **extra: Any) -> dict[str, Any]:
    start = {"first_s": 0.1, "usable_s": full_s / 2, "full_s": full_s, "answers": 10,
             "wrong": 0, "max_call_ms": 5.0, "ctor_s": 0.001, "index_bytes": 60.0,
             "rss_bytes": 90.0, "hit_ns": 900.0, "miss_ns": 800.0,
             "full_s_rounds": [full_s, full_s]}
    return {"n": n, "walk": {**start, "source": "walk"},
            "snapshot": {**start, "source": "snapshot"}, **extra}


def _earlier() -> dict[str, Any]:
    older = {"date": "2026-12-07 09:12 UTC", "load": "9.0, 9.0, 9.0",
             "load_end": "8.0, 8.0, 8.0", "command": "bench_scale.py --sizes 3000000"}
    return {"machine": {"date": "2026-12-07 15:30 UTC", "load": "4.4, 6.0, 8.5",
                        "load_end": "6.8, 6.6, 8.4"},
            "command": "bench_scale.py --sizes 100000,1000000",
            "file": [_row(100_000, 1.0), _row(1_000_000, 13.6),
                     _row(3_000_000, 34.7, run=older)],
            "reused": "The before rows are from 09:12 UTC."}


def test_reuse_keeps_the_unmeasured_sizes_with_the_run_that_measured_them() -> None:
    rows = [_row(100_000, 2.0)]
    kept = bench.keep_file_rows(_earlier(), rows)
    assert [row["n"] for row in rows] == [100_000, 1_000_000, 3_000_000]
    # The size this run measured is its own, not the earlier run's.
    assert rows[0]["walk"]["full_s"] == 2.0 and "run" not in rows[0]
    assert [row["n"] for row in kept] == [1_000_000, 3_000_000]
    assert rows[1]["run"]["date"] == "2026-12-07 15:30 UTC"
    assert rows[1]["walk"]["full_s_rounds"] == [13.6, 13.6]
    # A row carried a second time names the run that measured it.
    assert rows[2]["run"]["date"] == "2026-12-07 09:12 UTC"

    sentence = bench.reused_sentence(kept)
    assert "the file rows at 1,000,000, from the run of 2026-12-07 15:30 UTC" in sentence
    assert "load 4.4, 6.0, 8.5" in sentence
    assert "the file rows at 3,000,000, from the run of 2026-12-07 09:12 UTC" in sentence
    assert "load 9.0, 9.0, 9.0" in sentence
    assert "100,000" not in sentence
    assert "The before rows" in sentence

    page = bench.render({"machine": {"unknown": "test"}, "command": "bench_scale.py",
                         "file": rows, "index": [], "reused": sentence})
    assert "| file | 100,000 |" in page
    assert "| file (run 2026-12-07 15:30 UTC) | 1,000,000 |" in page
    assert "| file (run 2026-12-07 09:12 UTC) | 3,000,000 |" in page


def test_seaweedfs_rows_of_an_earlier_run_are_kept_with_their_run() -> None:
    """An older page holds one SeaweedFS row (a dict), a newer a list; either is read
    as rows by object count, and a row carried over names its run on the page."""
    s3 = {**_row(0, 24.0)["walk"], "objects": 100_000, "create_s": 79.0}
    assert bench.s3_list({"s3": s3}) == [s3]
    assert bench.s3_list({"s3": [{**s3, "objects": 1_000_000}, s3]})[0] is s3
    carried = {"run": bench.run_of(_earlier()), **s3}
    sentence = bench.reused_sentence([carried])
    assert "the SeaweedFS rows at 100,000, from the run of 2026-12-07 15:30 UTC" in sentence
    page = bench.render({"machine": {"unknown": "test"}, "command": "bench_scale.py",
                         "file": [], "index": [], "s3": [carried], "reused": sentence})
    assert "| s3 (SeaweedFS, run 2026-12-07 15:30 UTC) | 100,000 |" in page
    assert "the blocking start with one lister at a time was not measured" in page
