"""Ctrl-C on a real ``vllm serve`` with kvtiers, and the identity computed before it ran.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the API server,
its engine core and the workers all receive it at once (test_serve.py signals the server
alone, as a process manager does). With ``--shutdown-timeout`` every chunk a finished
request stored must still be in the file tier afterwards and the server must exit 0; the
namespace on disk must be the one ``kvtiers identity STACK --vllm ARGS`` named before the
server started (vLLM's own configuration classes, the model's layers on the meta device),
with nothing created by that command.

What may not hold, on vLLM's side (docs/operations.md, "Stopping"): the engine core drains
on its own SIGINT while the API server sends it SIGTERM. Arriving before the engine core
leaves its loop, the SIGTERM is one more shutdown request (a clean stop); arriving after,
when it has reset its signal handlers and waits for its workers, it kills it before vLLM
shuts the scheduler's connector down: no kvtiers stop summary, no index snapshot, the cpu
tier's ``/dev/shm`` region left for ``kvtiers gc --shm``. The test reports that order as
an expected failure when it happens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtiers.testing.serve import VllmServer, free_port
from tests.e2e.conftest import REPO, SERVER_ENV
from tests.e2e.test_serve import BLOCK, CHUNKS, PROMPTS, _complete

pytestmark = pytest.mark.timeout(600)


def test_ctrl_c_keeps_the_chunks_in_the_namespace_identity_named(
    model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    stack = tmp_path / "stack.yaml"
    stack.write_text(json.dumps({
        "tiers": [
            {"kind": "cpu", "capacity": "64MiB"},
            {"kind": "file", "root": str(root), "threads": 2},
        ],
        "metrics": {"port": free_port(), "refresh_s": 0},
    }))
    engine_args = ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "1024",
                   "--enable-prefix-caching", "--enforce-eager", "--seed", "0"]
    named = subprocess.run(
        [sys.executable, "-m", "kvtiers", "identity", str(stack), "--json",
         "--vllm", str(model_dir), *engine_args],
        cwd=REPO, env={**os.environ, **SERVER_ENV}, capture_output=True, text=True,
        timeout=300, check=False,
    )
    assert named.returncode == 0, named.stderr[-3000:]
    namespace = json.loads(named.stdout)["namespace"]
    assert not root.exists(), "kvtiers identity --vllm created the file tier's root"

    from kvtiers.tools.vllm_config import transfer_config_json

    server = VllmServer(
        model_dir,
        [*engine_args, "--shutdown-timeout", "60",
         "--kv-transfer-config", transfer_config_json(stack)],
        log=tmp_path / "serve.log", env=SERVER_ENV,
    )
    server.start()
    try:
        for prompt in PROMPTS:
            _complete(server, prompt)
    finally:
        status = server.stop(group=True)
    log = server.log.read_text(errors="replace")
    assert status == 0, f"exit status {status}; end of the log:\n{log[-3000:]}"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [namespace]
    stored = list((root / namespace).rglob("*.kvc"))
    assert len(stored) == CHUNKS, f"{len(stored)} chunk files after Ctrl-C"
    # vLLM's API server logs the engine core's exit as a traceback of its own; none may
    # pass through kvtiers' code.
    assert not [line for line in log.splitlines()
                if 'File "' in line and "/kvtiers/" in line], log[-5000:]
    if "kvtiers: stack stopped" not in log:
        pytest.xfail("vLLM's API server killed the engine core before its connector shut "
                     "down (see the module docstring)")
