"""The command line as scripts and terminals expect it: reports on stdout, problems on
stderr with a non-zero status, JSON on request, 80 columns, quiet on a closed pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.stack.builder import load_stack

CLI = [sys.executable, "-c", "from kvtiers.cli import main; raise SystemExit(main())"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file root with one namespace the real stack wrote."""
    path = tmp_path_factory.mktemp("root")
    stack = load_stack({
        "tiers": [{"kind": "cpu", "capacity": "2MiB"}, {"kind": "file", "root": str(path)}],
        "model": {"name": "team/model", "tokens_per_hash": 16, "blocks_per_chunk": 2,
                  "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "2KiB"}]},
    })
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    workload = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(200, 260))
    for request in conversation_requests(workload):
        engine.run_request(request.req_id, request.token_ids)
    engine.shutdown()
    stack.shutdown()
    return path


@pytest.mark.parametrize("command", ["inspect", "verify", "gc"])
def test_a_location_with_no_store_is_an_error_on_stderr(tmp_path: Path, command: str) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    done = _cli(command, str(tmp_path))
    assert done.returncode == 1
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "holds no kvtiers namespace" in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_gc_of_a_namespace_that_does_not_exist_fails_and_removes_nothing(root: Path) -> None:
    before = sorted(root.rglob("*"))
    done = _cli("gc", str(root), "--namespace", "nope", "--older-than-days", "0")
    assert done.returncode == 1
    assert "no namespace 'nope'" in done.stderr and done.stdout == ""
    assert sorted(root.rglob("*")) == before


def test_gc_without_flags_says_what_it_did(root: Path) -> None:
    done = _cli("gc", str(root))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("gc: nothing to remove in 1 namespace(s)")


def test_inspect_and_verify_speak_json(root: Path) -> None:
    (namespace,) = [p.name for p in root.iterdir() if p.is_dir()]
    chunks = len([p for p in (root / namespace).rglob("*.kvc")])
    inspected = _cli("inspect", "--json", str(root))
    assert inspected.returncode == 0, inspected.stderr
    document = json.loads(inspected.stdout)
    (entry,) = document["namespaces"]
    assert entry["namespace"] == namespace and entry["chunks"] == chunks
    assert entry["manifest"]["identity"]["model_name"] == "team/model"
    verified = _cli("verify", "--json", str(root))
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["ok"] is True
    assert report["namespaces"] == [{"namespace": namespace, "manifest_readable": True,
                                     "ok": chunks, "corrupt": [], "unreadable": []}]


@pytest.mark.parametrize("command", ["inspect", "verify", "gc"])
def test_text_reports_fit_80_columns(root: Path, command: str) -> None:
    done = _cli(command, str(root))
    assert done.returncode == 0, done.stderr
    assert done.stdout and max(len(line) for line in done.stdout.splitlines()) <= 80


#: What a manifest on shared storage could hold to drive a reader's terminal: an escape
#: sequence (clear the screen), an 8-bit CSI, a right-to-left override, a line separator.
HOSTILE = "team/m\x1b[2J\x9b31m\u202eevil\u2028x"


def test_reports_show_a_stored_control_character_as_its_escape(tmp_path: Path) -> None:
    model = {"name": HOSTILE, "salt": HOSTILE,
             "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "2KiB"}]}
    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text(json.dumps({
        "tiers": [{"kind": "cpu", "capacity": "1MiB"},
                  {"kind": "file", "root": str(tmp_path / "root")}],
        "model": model,
    }))
    load_stack(stack_file).shutdown()
    for args in (["inspect", str(tmp_path / "root")], ["identity", str(stack_file)]):
        done = _cli(*args)
        assert done.returncode == 0, done.stderr
        assert all(line.isprintable() for line in done.stdout.split("\n")), done.stdout
        # Escaped, not dropped (identity writes values as JSON, which escapes ESC itself).
        assert "\\x9b31m\\u202eevil\\u2028x" in "".join(done.stdout.split()), done.stdout


def test_a_closed_pipe_ends_the_command_quietly(root: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte is written
    try:
        done = subprocess.run([*CLI, "inspect", str(root)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, check=False)
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""


def test_validate_rejects_a_capacity_written_without_its_unit(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("tiers:\n  - kind: cpu\n    capacity: 8\n")
    done = _cli("validate", str(stack))
    assert done.returncode == 2
    assert "tiers[0].capacity" in done.stderr and "write the unit, e.g. 8GiB" in done.stderr
