"""`kvtiers validate` and the CLI's exit statuses: one line per file, no tracebacks."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers import __version__, cli
from kvtiers.config import load_stack_config
from kvtiers.config.examples import EXAMPLES_DIR
from kvtiers.errors import ConfigError, TransferError

CONFIGS = sorted(EXAMPLES_DIR.glob("*.yaml"))
ENTRY = "from kvtiers.cli import main; raise SystemExit(main())"


def _kvtiers(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", ENTRY, *args], capture_output=True, text=True, timeout=60
    )


def test_every_example_config_validates() -> None:
    result = _kvtiers("validate", *map(str, CONFIGS))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == len(CONFIGS) >= 5
    for path, line in zip(CONFIGS, lines, strict=True):
        assert line == f"{path}: ok — {load_stack_config(path).summary()}"


def test_bad_files_exit_2_with_one_line_each(tmp_path: Path) -> None:
    bad_size = tmp_path / "bad-size.yaml"
    bad_size.write_text("tiers:\n  - kind: cpu\n    capacity: lots\n")
    bad_syntax = tmp_path / "bad-syntax.yaml"
    bad_syntax.write_text("tiers:\n  - kind: cpu\n    capacity: 1GiB: 2\n")
    missing = tmp_path / "missing.yaml"
    good = CONFIGS[0]
    result = _kvtiers("validate", str(bad_size), str(good), str(bad_syntax), str(missing))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout.splitlines() == [f"{good}: ok — {load_stack_config(good).summary()}"]
    assert result.stderr.splitlines() == [
        f"{bad_size}:3: tiers[0].capacity: expected a size like 8GiB, 512MiB or a number of "
        "bytes, got 'lots'",
        f"{bad_syntax}:3: invalid YAML: mapping values are not allowed here; fix the syntax",
        f"{missing}: no such file; pass the path of a YAML stack file (examples: {EXAMPLES_DIR})",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    capacity: 2GiB\n",
        "- 1\n- 2\n",
        "tiers:\n  - {kind: file, root: /a, gds: true}\n  - {kind: s3, bucket: kvc}\n",
    ],
    ids=["empty", "duplicate-key", "not-a-mapping", "gds-with-lower-tiers"],
)
def test_one_bad_file_is_one_stderr_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    assert cli.main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith(f"{path}:")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtiers {__version__}"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["validate"], ["no-such-command"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def _raising(error: Exception) -> cli.Command:
    def run(args: argparse.Namespace) -> int:
        raise error

    return cli.Command(name="boom", help="fails", configure=lambda parser: None, run=run)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ConfigError("expected a size", path="tiers[0].capacity", source="s.yaml:3"), 2),
        (TransferError("disk went away\nwhile writing"), 1),
    ],
)
def test_errors_escaping_a_command_are_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    status: int,
) -> None:
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, _raising(error)))
    assert cli.main(["boom"]) == status
    err = capsys.readouterr().err
    assert err.splitlines() == [f"kvtiers: {' '.join(str(error).split())}"]


def test_commands_are_a_table_of_parsers() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["validate", "a.yaml", "b.yaml"])
    assert args.files == ["a.yaml", "b.yaml"]
    assert args.run is next(c.run for c in cli.COMMANDS if c.name == "validate")
