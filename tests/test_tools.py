"""kvtiers inspect / verify / gc on stores the real tiers wrote (file root and S3)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.stack.builder import load_stack
from kvtiers.testing.s3 import BUCKET, MotoServer

WORKLOAD = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(200, 260))


def _model(name: str) -> dict[str, Any]:
    return {"name": name, "tokens_per_hash": 16, "blocks_per_chunk": 2,
            "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "2KiB"}]}


def _fill(tiers: list[dict[str, Any]], model: str) -> None:
    stack = load_stack({"tiers": [{"kind": "cpu", "capacity": "2MiB"}, *tiers],
                        "model": _model(model)})
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    for request in conversation_requests(WORKLOAD):
        engine.run_request(request.req_id, request.token_ids)
    engine.shutdown()
    stack.shutdown()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from kvtiers.cli import main; raise SystemExit(main())", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})},
    )


def _flat(text: str) -> str:
    """``text`` with every run of white space, line breaks included, folded to one space."""
    return " ".join(text.split())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    _fill([{"kind": "file", "root": str(tmp_path)}], "team/model-a")
    return tmp_path


def _chunks(namespace_dir: Path) -> list[Path]:
    return sorted(p for p in namespace_dir.rglob("*.kvc") if "quarantine" not in p.parts)


def test_inspect_lists_namespace_fields_and_counts(root: Path) -> None:
    (namespace,) = [p for p in root.iterdir() if p.is_dir()]
    result = _cli("inspect", str(root))
    assert result.returncode == 0, result.stderr
    assert namespace.name in result.stdout
    assert "model team/model-a@main" in result.stdout
    assert f"chunks {len(_chunks(namespace))} " in result.stdout


def test_verify_finds_a_flipped_byte_and_fix_quarantines_it(root: Path) -> None:
    (namespace,) = [p for p in root.iterdir() if p.is_dir()]
    chunks = _chunks(namespace)
    assert _cli("verify", str(root)).returncode == 0
    victim = chunks[len(chunks) // 2]
    data = bytearray(victim.read_bytes())
    data[5000] ^= 0x01
    victim.write_bytes(bytes(data))
    found = _cli("verify", str(root))
    assert found.returncode == 1
    # Reports wrap at 80 columns: compare with the line breaks folded.
    assert f"corrupt (payload checksum check failed): {victim.relative_to(root)}" in _flat(
        found.stdout)
    assert f"{len(chunks) - 1} chunks ok, 1 corrupt" in found.stdout
    fixed = _cli("verify", "--fix", str(root))
    assert fixed.returncode == 0 and "failed; quarantined)" in fixed.stdout
    assert (namespace / "quarantine" / victim.name).exists() and not victim.exists()
    assert _cli("verify", str(root)).returncode == 0


def test_gc_removes_a_stale_namespace_and_nothing_else(root: Path) -> None:
    _fill([{"kind": "file", "root": str(root)}], "team/model-b")
    namespaces = sorted(p for p in root.iterdir() if p.is_dir())
    stale, fresh = (namespaces if "model-a" in namespaces[0].name else namespaces[::-1])
    old = time.time() - 10 * 86400
    for path in stale.rglob("*"):
        os.utime(path, (old, old))
    before = {p: p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    result = _cli("gc", str(root), "--stale-days", "1")
    assert result.returncode == 0, result.stderr
    assert not stale.exists()
    assert {p: p.read_bytes() for p in fresh.rglob("*") if p.is_file()} == before


def test_gc_removes_temps_old_chunks_and_bytes_beyond_a_size(root: Path) -> None:
    (namespace,) = [p for p in root.iterdir() if p.is_dir()]
    chunks = _chunks(namespace)
    temp_old = namespace / ".x.kvc.0123.kvtmp"
    temp_new = namespace / ".y.kvc.4567.kvtmp"
    temp_old.write_bytes(b"torn")
    temp_new.write_bytes(b"in flight")
    old = time.time() - 7200
    os.utime(temp_old, (old, old))
    for index, chunk in enumerate(chunks):
        os.utime(chunk, (old + index, old + index))
    dry = _cli("gc", str(root), "--max-bytes", str(2 * chunks[0].stat().st_size), "--dry-run")
    assert "would remove" in dry.stdout and temp_old.exists()
    result = _cli("gc", str(root), "--max-bytes", str(2 * chunks[0].stat().st_size))
    assert result.returncode == 0, result.stderr
    assert not temp_old.exists() and temp_new.exists()
    assert _chunks(namespace) == chunks[-2:]


def test_bad_locations_are_one_line_errors(tmp_path: Path) -> None:
    for args in (["inspect", str(tmp_path / "absent")], ["verify", "gs://bucket/x"],
                 ["gc", str(tmp_path), "--stale-days", "-1"]):
        result = _cli(*args)
        assert result.returncode == 2, args
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_tools_work_on_an_s3_prefix(s3_endpoint: MotoServer) -> None:
    _fill([{"kind": "s3", "bucket": BUCKET, "prefix": "fleet",
            "endpoint_url": s3_endpoint.endpoint_url}], "team/model-s3")
    env = {"AWS_ENDPOINT_URL": s3_endpoint.endpoint_url}
    location = f"s3://{BUCKET}/fleet"
    inspected = _cli("inspect", location, env=env)
    assert inspected.returncode == 0, inspected.stderr
    assert "model team/model-s3@main" in inspected.stdout
    verified = _cli("verify", location, env=env)
    assert verified.returncode == 0 and " 0 corrupt" in verified.stdout
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint.endpoint_url)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="fleet/")["Contents"]
    victim = next(o["Key"] for o in listed if o["Key"].endswith(".kvc"))
    body = bytearray(client.get_object(Bucket=BUCKET, Key=victim)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=victim, Body=bytes(body))
    found = _cli("verify", location, "--fix", env=env)
    assert found.returncode == 0
    assert (f"corrupt (payload checksum check failed; quarantined): "
            f"{victim.removeprefix('fleet/')}") in _flat(found.stdout)
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix="fleet/")["Contents"]
    remaining = {o["Key"] for o in listing}
    assert victim not in remaining
    assert any("/quarantine/" in key for key in remaining)


def test_a_refused_allocation_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    stack = tmp_path / "huge.yaml"
    stack.write_text(
        "tiers:\n  - kind: cpu\n    capacity: 4000000TiB\n"
        "model:\n  name: m\n  groups: [{tokens_per_block: 16, num_layers: 1, page_bytes: 4KiB}]\n"
    )
    result = _cli("demo", "--config", str(stack), "--out", str(tmp_path / "out"), "--no-plot")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"kvtiers: {stack}: tiers[0].capacity: the CPU tier's region")
    assert "lower the tier's capacity" in result.stderr


def test_tools_work_on_an_fsspec_url() -> None:
    fsspec = pytest.importorskip("fsspec")
    from kvtiers.tools.commands import inspect, verify
    from kvtiers.tools.locations import open_location

    url = "memory://kvtiers-tools-test"
    _fill([{"kind": "fsspec", "url": url}], "team/model-fsspec")
    fs = fsspec.filesystem("memory")
    try:
        location = open_location(url)
        out = io.StringIO()
        assert inspect(location, out) == 0
        assert "model team/model-fsspec@main" in out.getvalue()
        assert verify(location, io.StringIO()) == 0
        victim = next(p for p in sorted(fs.find(url)) if p.endswith(".kvc"))
        body = bytearray(fs.cat_file(victim))
        body[-1] ^= 0xFF
        fs.pipe_file(victim, bytes(body))
        out = io.StringIO()
        assert verify(location, out, fix=True) == 0
        assert "corrupt (payload checksum check failed; quarantined):" in out.getvalue()
        remaining = fs.find(url)
        assert victim not in remaining and any("/quarantine/" in p for p in remaining)
    finally:
        fs.rm(url, recursive=True)


#: A name a chunk of this model could have, for a file that is not one.
NOT_A_CHUNK = "0" * 32 + "_g0.kvc"


def test_verify_fix_moves_a_huge_damaged_file_aside_within_bounded_memory(root: Path) -> None:
    """A 2 GiB (sparse) file under a chunk's name is found corrupt from its header and
    quarantined by name, by a command whose address space is capped at 1 GiB."""
    (namespace,) = [p for p in root.iterdir() if p.is_dir()]
    huge = _chunks(namespace)[0].with_name(NOT_A_CHUNK)
    with huge.open("wb") as f:
        f.truncate(2 << 30)
    limit = 1 << 30
    capped = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit})); "
              "from kvtiers.cli import main; raise SystemExit(main())")
    result = subprocess.run([sys.executable, "-c", capped, "verify", "--fix", str(root)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"corrupt (magic check failed; quarantined): {huge.relative_to(root)}" in _flat(
        result.stdout)
    moved = namespace / "quarantine" / NOT_A_CHUNK
    assert not huge.exists() and moved.stat().st_size == 2 << 30


def test_verify_fix_of_a_second_file_of_one_name_keeps_both(root: Path) -> None:
    (namespace,) = [p for p in root.iterdir() if p.is_dir()]
    directory = _chunks(namespace)[0].parent
    for content in (b"first", b"second"):
        (directory / NOT_A_CHUNK).write_bytes(content)
        assert _cli("verify", "--fix", str(root)).returncode == 0
    kept = sorted(p.read_bytes() for p in (namespace / "quarantine").iterdir())
    assert kept == [b"first", b"second"]


def test_verify_fix_on_s3_reads_and_moves_a_huge_object_in_bounded_memory(
    aws_env: None,
) -> None:
    """A 48 MiB object under a chunk's name is read only as far as its header and moved
    aside by a server-side copy: the process never holds it (the server runs in a
    process of its own, so only the client's allocations are traced)."""
    import boto3

    from kvtiers.testing.s3 import MotoProcess
    from kvtiers.tools.commands import verify
    from kvtiers.tools.locations import open_location

    moto = MotoProcess()
    server = moto.start()
    try:
        client = boto3.client("s3", endpoint_url=server.endpoint_url)
        client.create_bucket(Bucket=BUCKET)
        _fill([{"kind": "s3", "bucket": BUCKET, "prefix": "fleet",
                "endpoint_url": server.endpoint_url}], "team/model-s3")
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix="fleet/")["Contents"]
        chunk = next(o["Key"] for o in listed if o["Key"].endswith(".kvc"))
        huge = f"{chunk.rsplit('/', 1)[0]}/{NOT_A_CHUNK}"
        size = 48 << 20
        client.put_object(Bucket=BUCKET, Key=huge, Body=bytes(size))
        location = open_location(f"s3://{BUCKET}/fleet", endpoint_url=server.endpoint_url)
        out = io.StringIO()
        tracemalloc.start()
        try:
            assert verify(location, out, fix=True) == 0
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            location.close()
        assert "1 corrupt" in out.getvalue()
        assert peak < size // 4, f"verify --fix held {peak} bytes at once"
        keys = {o["Key"]: o["Size"]
                for o in client.list_objects_v2(Bucket=BUCKET, Prefix="fleet/")["Contents"]}
        assert huge not in keys
        namespace = huge.removeprefix("fleet/").split("/", 1)[0]
        assert keys[f"fleet/{namespace}/quarantine/{NOT_A_CHUNK}"] == size
    finally:
        moto.stop()


def _corrupt_then_vanish(monkeypatch: pytest.MonkeyPatch, remove: Any) -> list[str]:
    """Make every chunk verify finds corrupt vanish right after its check, as when a
    running engine evicts or quarantines it between verify's check and its quarantine
    (``remove(name)`` deletes it); the names it removed."""
    from kvtiers.errors import CorruptChunkError
    from kvtiers.tools import commands

    checked = commands._verify_chunk
    removed: list[str] = []

    def check_then_lose(location: Any, name: str, digest: bytes, key: bytes) -> None:
        try:
            checked(location, name, digest, key)
        except CorruptChunkError:
            remove(name)
            removed.append(name)
            raise

    monkeypatch.setattr(commands, "_verify_chunk", check_then_lose)
    return removed


def test_verify_fix_goes_on_when_a_corrupt_chunk_vanishes_before_its_quarantine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtiers.tools.commands import verify
    from kvtiers.tools.locations import open_location

    _fill([{"kind": "file", "root": str(tmp_path)}], "team/model-a")
    _fill([{"kind": "file", "root": str(tmp_path)}], "team/model-b")
    first, second = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    for namespace in (first, second):
        victim = _chunks(namespace)[0]
        body = bytearray(victim.read_bytes())
        body[-1] ^= 0xFF
        victim.write_bytes(bytes(body))
    removed = _corrupt_then_vanish(monkeypatch, lambda name: (tmp_path / name).unlink())
    out = io.StringIO()
    location = open_location(str(tmp_path))
    try:
        assert verify(location, out, fix=True) == 0
    finally:
        location.close()
    text = _flat(out.getvalue())
    assert len(removed) == 2
    for namespace, name in zip((first, second), removed, strict=True):
        assert f"{namespace.name}: " in text, "a namespace's report is missing"
        assert ("corrupt (payload checksum check failed; gone before its quarantine): "
                f"{name}") in text
    assert not list(tmp_path.rglob("quarantine/*"))


def test_verify_fix_on_s3_goes_on_when_a_corrupt_object_vanishes(
    s3_endpoint: MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    from kvtiers.tools.commands import verify
    from kvtiers.tools.locations import open_location

    _fill([{"kind": "s3", "bucket": BUCKET, "prefix": "vanish",
            "endpoint_url": s3_endpoint.endpoint_url}], "team/model-s3")
    client = boto3.client("s3", endpoint_url=s3_endpoint.endpoint_url)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="vanish/")["Contents"]
    victim = next(o["Key"] for o in listed if o["Key"].endswith(".kvc"))
    body = bytearray(client.get_object(Bucket=BUCKET, Key=victim)["Body"].read())
    body[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=victim, Body=bytes(body))
    removed = _corrupt_then_vanish(
        monkeypatch, lambda name: client.delete_object(Bucket=BUCKET, Key=f"vanish/{name}"))
    location = open_location(f"s3://{BUCKET}/vanish", endpoint_url=s3_endpoint.endpoint_url)
    out = io.StringIO()
    try:
        assert verify(location, out, fix=True, as_json=True) == 0
    finally:
        location.close()
    import json

    (report,) = json.loads(out.getvalue())["namespaces"]
    assert report["corrupt"] == [{"name": victim.removeprefix("vanish/"),
                                  "check": "payload checksum", "quarantined": False,
                                  "vanished": True}]
    assert removed == [victim.removeprefix("vanish/")]
