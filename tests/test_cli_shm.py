"""``kvtiers gc --shm``: the cpu regions killed engines left in /dev/shm go, live ones stay."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers import cli
from kvtiers.tiers.cpu.region import SlotRegion, engine_region_prefix
from kvtiers.tools.commands import gc_shm

# A child that maps a region under DIR/NAME, says so, then waits to be killed.
HOLDER = """
import sys
from pathlib import Path
from kvtiers.tiers.cpu.region import SlotRegion
region = SlotRegion(4, 4096, sys.argv[2], shm_dir=Path(sys.argv[1]))
print("mapped", flush=True)
sys.stdin.read()
"""


def _flat(out: io.StringIO) -> str:
    """The report with its line breaks folded (it wraps at 80 columns)."""
    return " ".join(out.getvalue().split())


def _killed_engine_region(directory: Path, name: str) -> Path:
    """The region a process mapped and was killed (SIGKILL) holding: left behind."""
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "mapped\n"
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.stdin is not None
    child.stdin.close()
    child.stdout.close()
    return directory / name


def test_an_orphan_is_removed_and_a_region_in_use_kept(tmp_path: Path) -> None:
    prefix = engine_region_prefix()
    orphan = _killed_engine_region(tmp_path, f"{prefix}0000000000000001")
    live = SlotRegion(2, 4096, f"{prefix}0000000000000002", shm_dir=tmp_path)
    other = tmp_path / "someone-elses-region"
    other.write_bytes(b"x")
    other.chmod(0o600)
    try:
        assert orphan.exists()
        out = io.StringIO()
        assert gc_shm(out, dry_run=True, shm_dir=tmp_path) == 0
        assert orphan.exists()
        assert f"would remove (no process maps it; 16.0 KiB): {orphan}" in _flat(out)
        out = io.StringIO()
        assert gc_shm(out, shm_dir=tmp_path) == 0
        report = _flat(out)
        assert f"removed (no process maps it; 16.0 KiB): {orphan}" in report
        assert f"in use, kept (8.0 KiB): {live.path}" in report
        assert report.endswith(f"gc --shm: removed 1 region(s) (16.0 KiB) and kept 1 in use "
                               f"of {prefix}* in {tmp_path}")
        # 80 columns, but for a path longer than that, alone on its line.
        assert all(len(line) <= 80 or " " not in line.strip()
                   for line in out.getvalue().splitlines())
        assert not orphan.exists() and live.path is not None and live.path.exists()
        assert other.exists()
        live.view(0)[:2] = b"ok"  # the live mapping is untouched
        assert bytes(live.view(0)[:2]) == b"ok"
    finally:
        live.close()


def test_the_command_line_takes_shm_without_a_location(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A dry run: the machine's own /dev/shm is only looked at.
    assert cli.main(["gc", "--shm", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    report = " ".join(out.split())
    assert "gc --shm: would remove" in report
    assert report.endswith(f"of {engine_region_prefix()}* in /dev/shm")
    for argv in (["gc"], ["gc", "--shm", "--stale-days", "1"]):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1, err


def test_gc_help_names_shm() -> None:
    done = subprocess.run([sys.executable, "-m", "kvtiers", "gc", "--help"],
                          capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0
    assert "--shm" in done.stdout and "kvtiers-<uid>-*" in " ".join(done.stdout.split())


def test_the_prefix_is_the_one_engines_name_their_regions_with() -> None:
    pytest.importorskip("vllm")
    from kvtiers.integrations.vllm.worker import shared_memory_name

    assert shared_memory_name("engine-0").startswith(engine_region_prefix())
