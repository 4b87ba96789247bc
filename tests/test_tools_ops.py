"""The offline tools as an operator uses them: quarantine shown and aged out, gc totals
that count whole namespaces, inspect's fields never split, ``--json`` on validate,
``vllm-config``, and a CLI user's S3 credentials error."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from kvtiers.cli import main
from kvtiers.config.examples import example_path
from kvtiers.config.sizes import format_size
from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.filemapper import MANIFEST_NAME
from kvtiers.filemapper.mapper import GENERATION_NAME, SNAPSHOT_NAME
from kvtiers.stack.builder import load_stack
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tools.text import WIDTH

WORKLOAD = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(200, 260))
DAY_S = 86400.0


def _fill(root: Path, model: str) -> Path:
    """A namespace of chunks a real stack wrote under ``root``; its directory."""
    before = set(root.iterdir()) if root.exists() else set()
    stack = load_stack({
        "tiers": [{"kind": "cpu", "capacity": "2MiB"}, {"kind": "file", "root": str(root)}],
        "model": {"name": model, "tokens_per_hash": 16, "blocks_per_chunk": 2,
                  "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "2KiB"}]},
    })
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    for request in conversation_requests(WORKLOAD):
        engine.run_request(request.req_id, request.token_ids)
    engine.shutdown()
    stack.shutdown()
    (made,) = set(root.iterdir()) - before
    return made


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def _chunks(namespace: Path) -> list[Path]:
    return sorted(p for p in namespace.rglob("*.kvc") if "quarantine" not in p.parts)


def test_quarantined_chunks_are_shown_and_aged_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = _fill(tmp_path, "team/model-q")
    victim = _chunks(namespace)[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    assert _run(capsys, "verify", "--fix", str(tmp_path))[0] == 0
    (moved,) = (namespace / "quarantine").iterdir()
    size = moved.stat().st_size

    status, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert status == 0
    flat = " ".join(out.split())
    assert f"quarantined 1 ({format_size(size)}), oldest" in flat
    assert "kvtiers gc --quarantine-older-than-days removes them" in flat
    status, out, _ = _run(capsys, "inspect", "--json", str(tmp_path))
    (entry,) = json.loads(out)["namespaces"]
    assert (entry["quarantined"], entry["quarantined_bytes"]) == (1, size)

    # Fresh: kept. Set aside two days ago: removed by a one-day limit, and counted.
    status, out, _ = _run(capsys, "gc", str(tmp_path), "--quarantine-older-than-days", "1")
    assert status == 0 and moved.exists()
    assert out.startswith("gc: nothing to remove")
    old = time.time() - 2 * DAY_S
    os.utime(moved, (old, old))
    status, out, _ = _run(capsys, "gc", str(tmp_path), "--quarantine-older-than", "1")
    assert status == 0
    assert not moved.exists()
    assert out.splitlines() == [
        f"{namespace.name}: removed 1 files ({format_size(size)})",
        f"gc: removed 0 namespace(s) and 1 file(s) ({format_size(size)}) of 1 namespace(s)",
    ]
    status, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert "quarantined 1" not in " ".join(out.split())


def test_gc_totals_count_the_namespaces_it_removes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = _fill(tmp_path, "team/model-gone")
    _fill(tmp_path, "team/model-kept")
    # What gc counts: the chunks and other files, not the namespace's own bookkeeping.
    bookkeeping = {MANIFEST_NAME, SNAPSHOT_NAME, GENERATION_NAME}
    size = sum(p.stat().st_size for p in namespace.rglob("*")
               if p.is_file() and p.name not in bookkeeping)
    assert size > 0
    for dry, verb in ((["--dry-run"], "would remove"), ([], "removed")):
        status, out, _ = _run(capsys, "gc", str(tmp_path), "--namespace", namespace.name, *dry)
        assert status == 0
        flat = " ".join(out.split())  # reports wrap at 80 columns
        assert flat.startswith(f"{namespace.name}: {verb} the namespace (named; ")
        assert f" entries, {format_size(size)}) gc: " in flat
        assert flat.endswith(f"gc: {verb} 1 namespace(s) and 0 file(s) "
                             f"({format_size(size)}) of 2 namespace(s)")
    assert not namespace.exists()


def _manifest(namespace: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((namespace / "manifest.json").read_text())
    return document


def test_inspect_never_splits_a_field_and_shows_no_empty_revision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    namespace = _fill(tmp_path, "an-organisation-with-a-long-name/a-model-with-a-long-name")
    document = _manifest(namespace)
    document["identity"]["model_revision"] = None
    document["identity"]["kv_dtype"] = "torch.float8_e4m3fn"
    (namespace / "manifest.json").write_text(json.dumps(document))
    status, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert status == 0
    lines = out.splitlines()
    assert max(map(len, lines)) <= WIDTH
    model = "model an-organisation-with-a-long-name/a-model-with-a-long-name"
    # Whole fields, each on one line: a line may break only between fields.
    assert any(line.strip() == f"{model}," for line in lines), lines
    assert "@" not in out
    ident = document["identity"]
    for field in (f"kv torch.float8_e4m3fn {ident['kv_layout']},",
                  f"hash {ident['hash_algorithm']}",
                  f"created {document['created_at']},"):
        assert any(field in line for line in lines), (field, lines)


def test_inspect_shows_a_revision_after_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fill(tmp_path, "team/model-r")
    status, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert status == 0
    assert "  model team/model-r@main, engine" in out


def test_validate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = example_path("cpu")
    assert good is not None
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers:\n  - kind: cpu\n    capacity: lots\n")
    status, out, err = _run(capsys, "validate", "--json", str(good), str(bad))
    assert (status, err) == (2, "")
    document = json.loads(out)
    assert document["ok"] is False
    first, second = document["files"]
    assert first["ok"] is True and first["summary"]
    assert (second["ok"], second["path"]) == (False, "tiers[0].capacity")
    assert second["error"].startswith(f"{bad}:3: tiers[0].capacity: expected a size")


def test_vllm_config_prints_the_flag_for_the_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("tiers:\n  - kind: cpu\n    capacity: 1GiB\n")
    monkeypatch.chdir(tmp_path)
    status, out, _ = _run(capsys, "vllm-config", "stack.yaml")
    assert status == 0
    flag, value = shlex.split(out)
    assert flag == "--kv-transfer-config"
    assert json.loads(value) == {
        "kv_connector": "KVTiersConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvtiers.integrations.vllm",
        "kv_connector_extra_config": {
            "spec_name": "KVTiersOffloadingSpec",
            "spec_module_path": "kvtiers.integrations.vllm",
            "kvtiers_config": str(stack),
        },
    }
    status, out, _ = _run(capsys, "vllm-config", "--json", "stack.yaml")
    assert (status, json.loads(out)) == (0, json.loads(value))
    # A stack that does not validate gets no flag.
    stack.write_text("tiers: []\n")
    status, out, err = _run(capsys, "vllm-config", "stack.yaml")
    assert (status, out) == (2, "")
    assert err.startswith("kvtiers: stack.yaml")


def test_a_cli_user_is_not_told_of_a_stack_file_key(
    s3_endpoint: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    status, _, err = _run(capsys, "inspect", f"s3://{BUCKET}/kv",
                          "--endpoint-url", s3_endpoint.endpoint_url)
    assert status == 2
    assert err == (f"kvtiers: location: no AWS credentials found for bucket {BUCKET!r}; set "
                   "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where "
                   "an instance role is available\n")
