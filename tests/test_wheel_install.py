"""Acceptance: kvtiers outside its checkout. Build the wheel, install it with the demo
extra into a fresh virtual environment in a temporary directory, and run `kvtiers demo`
(small) and the example program there.

It needs pip to reach the package index (or pip's cache) for torch and the demo extra's
packages; torch is pinned so pip takes the CPU wheel. Slow (about a minute with a warm
pip cache), but part of the default run: it is the only test of what a user installs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
# Only what a wheel is built from, so the build leaves nothing in the checkout.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "kvtiers")


def _run(args: list[str], *, cwd: Path, env: dict[str, str],
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args[:4]}…: {result.stdout[-2000:]}{result.stderr[-4000:]}"
    return result


@pytest.mark.slow
def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_ROOT_USER_ACTION="ignore")
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, source / name)
    shutil.rmtree(source / "kvtiers" / "__pycache__", ignore_errors=True)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
          str(source)], cwd=tmp_path, env=env)
    (wheel,) = wheels.glob("kvtiers-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env)
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", TORCH, f"{wheel}[demo]"],
         cwd=tmp_path, env=env, timeout=900)

    work = tmp_path / "work"
    work.mkdir()
    demo = _run([str(venv / "bin" / "kvtiers"), "demo", "--conversations", "2", "--turns", "2"],
                cwd=work, env=env)
    assert demo.stdout.splitlines()[-1].startswith("verdict: ok: "), demo.stdout
    assert (work / "kvtiers-demo" / "demo.png").stat().st_size > 10_000
    # The package came from the venv, not from the checkout.
    where = _run([str(python), "-c", "import kvtiers; print(kvtiers.__file__)"],
                 cwd=work, env=env)
    assert where.stdout.startswith(str(venv))

    example = _run([str(python), str(ROOT / "examples" / "store_restart_load.py")],
                   cwd=work, env=env)
    assert example.stdout.startswith("ok: "), example.stdout

    named = _run([str(venv / "bin" / "kvtiers"), "demo", "--config", "cpu-file",
                  "--conversations", "1", "--turns", "2", "--no-plot", "--out", "by-name"],
                 cwd=work, env=env)
    assert named.stdout.splitlines()[-1].startswith("verdict: ok: ")
