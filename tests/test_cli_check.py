"""``kvtiers check`` and the same checks at build time: a start that would fail stops
before anything exists, one line per problem naming the YAML key, exit status 2."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers import cli
from kvtiers.config import load_stack_config
from kvtiers.config.examples import example_path
from kvtiers.errors import ConfigError
from kvtiers.stack.builder import load_stack
from kvtiers.stack.preflight import PROBE_PREFIX, preflight
from kvtiers.testing.s3 import BUCKET, MotoServer

MODEL = {
    "name": "check/model",
    "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "4KiB"}],
}


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other socket listens on for the test's duration."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def _write(tmp_path: Path, stack: dict[str, Any], name: str = "stack.yaml") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(stack))
    return path


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], list[str]]:
    status = cli.main(["check", *args])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err.splitlines()


def test_a_good_stack_is_ready_and_the_probes_leave_nothing(
    tmp_path: Path, s3_endpoint: MotoServer, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    stack = _write(tmp_path, {"tiers": [
        {"kind": "cpu", "capacity": "16MiB"},
        {"kind": "file", "root": str(root)},
        {"kind": "s3", "bucket": BUCKET, "prefix": "kv", "endpoint_url": s3_endpoint.endpoint_url},
    ], "metrics": {"port": 0}})
    status, out, err = _check(capsys, str(stack))
    assert (status, err) == (0, [])
    assert out == [f"{stack}: ok — ready to start"]
    assert list(root.iterdir()) == []
    import boto3

    listed = boto3.client("s3", endpoint_url=s3_endpoint.endpoint_url).list_objects_v2(
        Bucket=BUCKET)
    assert listed.get("KeyCount", 0) == 0, "the probe object was left behind"


def test_every_problem_is_one_line_naming_its_key(
    tmp_path: Path, s3_endpoint: MotoServer, busy_port: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    stack = _write(tmp_path, {"tiers": [
        {"kind": "cpu", "capacity": "16MiB"},
        {"kind": "file", "root": "/proc/kvtiers-check/root"},
        {"kind": "s3", "bucket": "no-such-bucket", "endpoint_url": s3_endpoint.endpoint_url,
         "max_attempts": 1},
    ], "metrics": {"port": busy_port}})
    status, out, err = _check(capsys, str(stack))
    assert status == 2
    assert out == []
    assert len(err) == 3
    assert err[0].startswith(f"{stack}: tiers[1].root: the root /proc/kvtiers-check/root does "
                             "not exist and cannot be created in /proc")
    assert err[1] == (f"{stack}: tiers[2].bucket: bucket 'no-such-bucket' does not exist at "
                      f"{s3_endpoint.endpoint_url}; create it or fix the bucket name")
    assert err[2].startswith(f"{stack}: metrics.port: the metrics exporter cannot listen on "
                             f"127.0.0.1:{busy_port}")


def test_missing_credentials_name_the_bucket_key(
    tmp_path: Path, s3_endpoint: MotoServer, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    stack = _write(tmp_path, {"tiers": [
        {"kind": "cpu", "capacity": "16MiB"},
        {"kind": "s3", "bucket": BUCKET, "endpoint_url": s3_endpoint.endpoint_url,
         "max_attempts": 1},
    ]})
    status, _, err = _check(capsys, str(stack))
    assert status == 2
    assert len(err) == 1
    assert err[0].startswith(f"{stack}: tiers[1].bucket: no AWS credentials found")


def test_an_unwritable_existing_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /sys/kernel refuses new files to every user, root included.
    stack = _write(tmp_path, {"tiers": [
        {"kind": "cpu", "capacity": "16MiB"}, {"kind": "file", "root": "/sys/kernel"},
    ]})
    status, _, err = _check(capsys, str(stack))
    assert status == 2
    assert len(err) == 1
    assert err[0].startswith(f"{stack}: tiers[1].root: cannot write in the root /sys/kernel")


def test_shm_room_for_a_shared_cpu_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    free = shutil.disk_usage("/dev/shm").free
    too_big = f"{(free >> 30) + 2}GiB"
    config = load_stack_config({"tiers": [
        {"kind": "cpu", "capacity": too_big, "shared_memory_name": "kvtiers-check-none"},
    ]})
    findings = preflight(config)
    assert [(f.path, f.severity) for f in findings] == [("tiers[0].capacity", "problem")]
    assert "does not fit in /dev/shm" in findings[0].message


def test_an_existing_manifest_of_another_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    tiers = [{"kind": "cpu", "capacity": "16MiB"}, {"kind": "file", "root": str(root)}]
    with load_stack({"tiers": tiers, "model": MODEL}):
        pass
    (namespace,) = [p.name for p in root.iterdir()]
    manifest = root / namespace / "manifest.json"
    document = json.loads(manifest.read_text())
    document["identity"]["model_name"] = "someone/else"
    manifest.write_text(json.dumps(document))
    stack = _write(tmp_path, {"tiers": tiers, "model": MODEL})
    status, _, err = _check(capsys, str(stack))
    assert status == 2
    assert len(err) == 1
    assert err[0].startswith(f"{stack}: tiers[1].root: {manifest}: the namespace manifest "
                             "does not match")
    assert "model_name" in err[0]


def test_json_report(tmp_path: Path, busy_port: int,
                     capsys: pytest.CaptureFixture[str]) -> None:
    good = example_path("cpu")
    assert good is not None
    bad = _write(tmp_path, {"tiers": [{"kind": "cpu", "capacity": "16MiB"}],
                            "metrics": {"port": busy_port}})
    status, out, err = _check(capsys, "--json", str(good), str(bad))
    assert (status, err) == (2, [])
    report = json.loads("\n".join(out))
    assert report["ok"] is False
    assert [f["ok"] for f in report["files"]] == [True, False]
    (finding,) = report["files"][1]["findings"]
    assert (finding["severity"], finding["path"]) == ("problem", "metrics.port")


def test_a_failed_build_leaves_no_directory_behind(
    tmp_path: Path, busy_port: int
) -> None:
    root = tmp_path / "root"
    with pytest.raises(ConfigError) as caught:
        load_stack({"tiers": [{"kind": "cpu", "capacity": "16MiB"},
                              {"kind": "file", "root": str(root)}],
                    "metrics": {"port": busy_port}, "model": MODEL})
    assert caught.value.path == "metrics.port"
    assert "\n" not in str(caught.value)
    assert not root.exists()


def test_several_problems_at_build_are_one_line(tmp_path: Path, busy_port: int) -> None:
    with pytest.raises(ConfigError) as caught:
        load_stack({"tiers": [{"kind": "cpu", "capacity": "16MiB"},
                              {"kind": "file", "root": "/proc/kvtiers-check"}],
                    "metrics": {"port": busy_port}, "model": MODEL})
    message = str(caught.value)
    assert message.startswith("2 problems before start: tiers[1].root: ")
    assert "; metrics.port: " in message
    assert "\n" not in message


def test_probe_names_are_never_chunks() -> None:
    from kvtiers.filemapper import key_from_chunk_name

    assert key_from_chunk_name(PROBE_PREFIX + "00ff") is None
