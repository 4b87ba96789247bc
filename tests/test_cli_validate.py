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


MODEL = "model: {name: m, groups: [{tokens_per_block: 16, num_layers: 2, page_bytes: 16KiB}]}\n"

# Stacks the build refuses although validate, before, said ok: (id, YAML text, modules to
# hide as not installed, the YAML path the error names, a phrase of its message). The line
# marked `# <-` is the line the error must point at.
BUILD_REFUSES = [
    ("policy-not-a-policy",
     "tiers:\n  - kind: cpu\n    capacity: 1GiB\n    policy: 'collections:OrderedDict'  # <-\n",
     (), "tiers[0].policy", "is not an EvictionPolicy subclass"),
    ("cpu-smaller-than-a-chunk",
     f"tiers:\n  - kind: cpu\n    capacity: 8KiB  # <-\n{MODEL}",
     (), "tiers[0].capacity", "capacity 8192 bytes holds no chunk of 32768 bytes"),
    ("metrics-without-prometheus-client",
     "tiers:\n  - {kind: cpu, capacity: 1GiB}\nmetrics:  # <-\n  port: 0\n",
     ("prometheus_client",), "metrics", "pip install 'kvtiers[metrics]'"),
    ("s3-without-boto3",
     "tiers:\n  - {kind: cpu, capacity: 1GiB}\n  - kind: s3  # <-\n    bucket: kv-cache\n",
     ("boto3",), "tiers[1].kind", "needs 'boto3', which is not installed"),
    ("embedded-s3-without-moto",
     "tiers:\n  - {kind: cpu, capacity: 1GiB}\n  - kind: s3\n    bucket: kv-cache\n"
     "    endpoint_url: embedded  # <-\n",
     ("moto",), "tiers[1].endpoint_url", "'moto' is not installed"),
]


@pytest.mark.parametrize(("text", "hidden", "path", "phrase"),
                         [case[1:] for case in BUILD_REFUSES], ids=[c[0] for c in BUILD_REFUSES])
def test_validate_refuses_what_the_build_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    text: str, hidden: tuple[str, ...], path: str, phrase: str,
) -> None:
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)  # find_spec: not installed
    file = tmp_path / "stack.yaml"
    file.write_text(text)
    (line,) = [n for n, text in enumerate(file.read_text().splitlines(), 1) if "# <-" in text]
    assert cli.main(["validate", str(file)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"{file}:{line}: {path}: "), err
    assert phrase in err and len(err.splitlines()) == 1, err


def test_a_factory_error_names_the_tier_it_came_from() -> None:
    """The engine's identity (not a model: section) gives chunks no cpu slot holds: the
    build's error names the key as ``tiers[0].capacity``, not ``capacity``."""
    from kvtiers.core.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
    )
    from kvtiers.stack.builder import load_stack

    identity = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",),
                                      bytes_per_block=1 << 20),),
        model=OffloadingModelConfig(name="m"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
    )
    with pytest.raises(ConfigError, match="holds no chunk of 1048576 bytes") as info:
        load_stack({"tiers": [{"kind": "cpu", "capacity": "64KiB"}]}, identity)
    assert info.value.path == "tiers[0].capacity"
