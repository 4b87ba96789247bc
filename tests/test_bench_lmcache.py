"""``benchmarks/bench_lmcache.py`` without LMCache: its one-line skip (exit 0), its pure
helpers (GB/s of a median, ratios, verdicts, the tables) and the integrity harness's
kvtiers side on a real file tier (a flipped byte and a truncated file are misses and are
quarantined; a restart finds the intact chunks). The LMCache side runs only where LMCache
0.5.6 imports (its own virtualenv, see the script's docstring).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
SCRIPT = BENCHMARKS / "bench_lmcache.py"


def _load() -> ModuleType:
    # The script imports its siblings (bench_file, machine) as a script run does.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_lmcache", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_lmcache"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


def _lmcache_importable() -> bool:
    return bench.lmcache_missing() is None


# -- the skip path -----------------------------------------------------------------------
@pytest.mark.skipif(_lmcache_importable(), reason="LMCache is installed here")
def test_the_script_prints_one_skip_line_and_exits_0_without_lmcache() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 1, run.stdout
    assert lines[0].startswith("lmcache not installed: ")
    assert "install with: " in lines[0] and "lmcache==0.5.6" in lines[0]


def test_main_skips_before_any_work_when_lmcache_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(bench, "lmcache_missing", lambda: "No module named 'lmcache'")
    assert bench.main(["--dir", str(tmp_path), "--out", str(tmp_path / "results")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [bench.skip_line("No module named 'lmcache'")]
    assert list(tmp_path.iterdir()) == []


def test_lmcache_missing_names_the_failed_import() -> None:
    def fails_on_yaml(name: str) -> object:
        if name == "lmcache.v1.config":
            raise ModuleNotFoundError("No module named 'yaml'")
        return object()

    assert bench.lmcache_missing(fails_on_yaml) == "No module named 'yaml'"
    assert bench.lmcache_missing(lambda name: object()) is None


# -- pure helpers --------------------------------------------------------------------------
def test_gbps_is_of_the_median_and_ratio_guards_zero() -> None:
    assert bench.gbps(10**9, [4.0, 1.0, 2.0]) == pytest.approx(0.5)
    assert bench.ratio(3.0, 2.0) == pytest.approx(1.5)
    assert math.isnan(bench.ratio(1.0, 0.0))


def test_verdicts() -> None:
    stored = b"abcd"
    assert bench.judge(stored, None) == bench.REFUSED
    assert bench.judge(stored, b"abcd") == bench.RIGHT
    assert bench.judge(stored, b"abce") == bench.WRONG
    assert bench.describe(stored, b"abXX") == "hit, wrong bytes (2 of 4 bytes differ)"
    assert bench.describe(stored, b"ab") == "hit, wrong bytes (2 bytes served, 4 stored)"
    assert bench.describe(stored, None) == "refused (miss)"


def test_throughput_table() -> None:
    row = {"chunk_bytes": 256 * 1024, "kvtiers_store": 1.234, "lmcache_store": 0.5,
           "store_ratio": 2.468, "raw_pwrite": 2.0, "kvtiers_load": 1.0,
           "lmcache_load": 2.0, "load_ratio": 0.5, "raw_pread": 3.0}
    lines = bench.throughput_table([row])
    assert lines[0].startswith("| chunk | kvtiers store | LMCache store | store ratio |")
    assert lines[1].count("|") == lines[0].count("|")
    assert lines[2] == "| 256 KiB | 1.23 | 0.50 | 2.47x | 2.00 | 1.00 | 2.00 | 0.50x | 3.00 |"


def test_spread_table_gives_the_slowest_and_fastest_pass() -> None:
    passes = {name: [1.0, 3.0, 2.0] for name in bench.WRITES + bench.READS}
    passes["lmcache_load"] = [0.25, 0.5]
    lines = bench.spread_table([{"chunk_bytes": 2 * 1024 * 1024, "passes_gbps": passes}])
    assert lines[0] == ("| chunk | raw pwrite | kvtiers store | lmcache store | raw pread | "
                        "kvtiers load | lmcache load |")
    assert lines[2] == "| 2 MiB |" + " 1.00-3.00 |" * 5 + " 0.25-0.50 |"


def test_integrity_table() -> None:
    kvt = {"flipped": "refused (miss)", "flipped_file": "file quarantined",
           "truncated": "refused (miss)", "truncated_file": "file quarantined",
           "intact": 6, "restart_found": 6}
    lmc = {"flipped": "hit, wrong bytes (1 of 4 bytes differ)",
           "flipped_file": "file left in place", "truncated": "hit, wrong bytes",
           "truncated_file": "file left in place", "intact": 6, "restart_found": 0}
    lines = bench.integrity_table(kvt, lmc)
    assert lines[0] == "| 8 chunks of 256 KiB | kvtiers | LMCache 0.5.6 |"
    assert lines[2] == ("| one byte flipped in a chunk's file | refused (miss); file "
                        "quarantined | hit, wrong bytes (1 of 4 bytes differ); file left in "
                        "place |")
    assert lines[4].endswith("| 6 of 6 | 0 of 6 |")


def test_damage_helpers_and_file_fate(tmp_path: Path) -> None:
    path = tmp_path / "chunk"
    path.write_bytes(bytes(range(8)))
    bench.flip_byte(path, 3)
    assert path.read_bytes() == bytes([0, 1, 2, 3, 4, 5 ^ 0xFF, 6, 7])
    bench.truncate_half(path)
    assert path.stat().st_size == 4
    quarantine = tmp_path / "quarantine"
    assert bench.file_fate(path, quarantine) == "file left in place"
    quarantine.mkdir()
    path.rename(quarantine / "chunk.1a2b3c4d")
    assert bench.file_fate(path, quarantine) == "file quarantined"
    assert bench.file_fate(tmp_path / "other", quarantine) == "file removed"


# -- the integrity harness, kvtiers' side --------------------------------------------------
def test_kvtiers_refuses_damaged_chunks_and_finds_intact_ones_after_a_restart(
    tmp_path: Path,
) -> None:
    data = bench.payloads(8, 64 * 1024)
    result = bench.run_integrity(bench.KvtiersIntegrity(tmp_path / "tier", data), data)
    assert result["flipped"] == bench.REFUSED
    assert result["truncated"] == bench.REFUSED
    assert result["flipped_file"] == result["truncated_file"] == "file quarantined"
    assert result["damaged_found_after_load"] == 0
    assert result["intact"] == 6
    assert result["restart_found"] == 6
    assert result["damaged_found_after_restart"] == 0


def test_kvtiers_side_serves_the_stored_bytes_of_an_undamaged_chunk(tmp_path: Path) -> None:
    data = bench.payloads(3, 64 * 1024)
    side = bench.KvtiersIntegrity(tmp_path / "tier", data)
    try:
        side.store()
        assert [side.load(i) for i in range(3)] == data
    finally:
        side.close()


# -- LMCache's side, where it is installed ---------------------------------------------------
def test_lmcache_side_serves_damaged_chunks_and_forgets_on_restart(tmp_path: Path) -> None:
    pytest.importorskip("lmcache.v1.storage_backend.local_disk_backend")
    data = bench.payloads(8, 64 * 1024)
    result = bench.run_integrity(bench.LMCacheIntegrity(tmp_path / "lmc", data), data)
    assert result["flipped"].startswith(bench.WRONG)
    assert result["restart_found"] == 0
    drift = bench.lmcache_remove_drift(tmp_path / "drift")
    assert drift["files_left"] == 0
