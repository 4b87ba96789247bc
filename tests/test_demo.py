"""`kvtiers demo` from any directory: shipped examples by name, its own output directory,
and never a file it did not create touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers.config import FileTierConfig, S3TierConfig
from kvtiers.config.examples import EXAMPLES_DIR, example_names
from kvtiers.engine.demo import MARKER, clear_namespaces, resolve_config
from kvtiers.errors import ConfigError

SMALL = ("--conversations", "2", "--turns", "2", "--no-plot", "--no-progress")


def _demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Run from a directory outside the checkout, as an installed kvtiers would be.
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", "from kvtiers.cli import main; raise SystemExit(main())",
         "demo", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=240,
    )


def _stack_file(path: Path, root: Path) -> Path:
    path.write_text(
        "tiers:\n  - kind: cpu\n    capacity: 4MiB\n"
        f"  - kind: file\n    root: {root}\n    capacity: 8MiB\n"
    )
    return path


def test_every_example_is_addressable_by_name(tmp_path: Path) -> None:
    assert {"cpu", "cpu-file", "cpu-file-s3", "file-gds", "demo"} <= set(example_names())
    stack = resolve_config("cpu-file-s3", tmp_path / "out")
    file_tier, s3_tier = stack.tiers[1], stack.tiers[2]
    assert isinstance(file_tier, FileTierConfig) and isinstance(s3_tier, S3TierConfig)
    # Demo scale: roots under the output directory, S3 embedded, small capacities.
    assert file_tier.root_path == (tmp_path / "out" / "file").absolute()
    assert s3_tier.endpoint_url == "embedded"
    assert stack.model is not None and stack.tiers[0].capacity <= 16 << 20  # type: ignore[attr-defined]


def test_an_unknown_name_lists_the_examples(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no example named 'cpu-nvme'.*cpu-file"):
        resolve_config("cpu-nvme", tmp_path)


@pytest.mark.slow
def test_the_demo_refuses_a_root_holding_a_user_file(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    notes = root / "notes.txt"
    notes.write_text("mine")
    stack = _stack_file(tmp_path / "mine.yaml", root)
    result = _demo("--config", str(stack), "--out", str(tmp_path / "out"), *SMALL, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"kvtiers: tiers[1].root: {root} is not empty and was not created by kvtiers demo; the "
        "demo never touches files it did not create: point tiers[1].root at a new or empty "
        "directory"
    ]
    assert notes.read_text() == "mine" and sorted(root.iterdir()) == [notes]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_demo_owns_what_it_creates_and_removes_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    stack = _stack_file(tmp_path / "mine.yaml", root)
    first = _demo("--config", str(stack), "--out", str(tmp_path / "out"), *SMALL, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[-1].startswith("verdict: ok: ")
    assert (root / MARKER).is_file() and (tmp_path / "out" / MARKER).is_file()
    namespaces = [p for p in root.iterdir() if (p / "manifest.json").is_file()]
    assert len(namespaces) == 1
    # A file the user later puts into the demo's root survives the next fresh run.
    (root / "notes.txt").write_text("mine")
    second = _demo("--config", str(stack), "--out", str(tmp_path / "out"), *SMALL, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert (root / "notes.txt").read_text() == "mine"


def test_clearing_removes_only_namespaces(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text("")
    namespace = tmp_path / "m-0123456789abcdef"
    (namespace / "ab").mkdir(parents=True)
    (namespace / "manifest.json").write_text("{}")
    (tmp_path / "plain-dir").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert clear_namespaces(tmp_path) == [namespace]
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "notes.txt", "plain-dir"]


@pytest.mark.slow
def test_the_default_demo_runs_by_name_from_any_directory(tmp_path: Path) -> None:
    result = _demo(*SMALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("verdict: ok: ")
    # Within 80 columns, but for lines that name a path of this machine.
    lines = [line for line in result.stdout.splitlines() if str(tmp_path) not in line]
    assert max(len(line) for line in lines) <= 80
    assert (tmp_path / "kvtiers-demo" / "file" / MARKER).is_file()
    assert result.stderr == ""


def test_every_flag_is_explained() -> None:
    from kvtiers.cli import build_parser

    parser = build_parser()
    demo = parser._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]
    for action in demo._actions:
        assert action.help, f"{action.option_strings} has no help"
    assert EXAMPLES_DIR.is_dir()


@pytest.mark.parametrize(
    ("blocked", "args", "extra"),
    [
        ("matplotlib", ("demo", "--conversations", "1", "--turns", "1"), "demo"),
        ("boto3", ("inspect", "s3://kv-cache/prod"), "s3"),
    ],
)
def test_a_missing_optional_package_is_one_line_naming_its_extra(
    tmp_path: Path, blocked: str, args: tuple[str, ...], extra: str
) -> None:
    # sys.modules[name] = None makes every import of it fail as if it were not installed.
    code = (f"import sys; sys.modules[{blocked!r}] = None; "
            "from kvtiers.cli import main; raise SystemExit(main())")
    root = str(Path(__file__).resolve().parent.parent)
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                            text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": root},
                            timeout=120)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"'{blocked}' is not installed" in result.stderr
    assert f"pip install 'kvtiers[{extra}]'" in result.stderr
    assert not (tmp_path / "kvtiers-demo").exists()
