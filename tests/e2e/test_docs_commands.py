"""docs/vllm.md's CPU-build commands run as written: model, stack, check, server.

The block under "vLLM's CPU build" is run by bash in an empty directory, with ``python``
and ``kvtiers`` this environment's (and port 8000 replaced by a free one). The server must
answer ``/health`` and a completion, log kvtiers' start line for the file tier, and on
SIGINT stop within ``--shutdown-timeout``, the file tier holding a namespace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtiers.testing.serve import READY_TIMEOUT_S, free_port
from tests.e2e.conftest import SERVER_ENV

pytestmark = pytest.mark.timeout(900)

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def _cpu_build_block() -> str:
    text = DOC.read_text()
    section = text.split("## vLLM's CPU build", 1)[1]
    match = re.search(r"```\n(python -m kvtiers\.testing\.models .*?)```", section, re.S)
    assert match, "docs/vllm.md's CPU-build section has no runnable block"
    return match.group(1)


def _server_pid(shell_pid: int) -> int:
    """The API server's process: the shell itself when it ran the last command in its
    place, else the shell's child running it."""
    def command(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()

    if "vllm.entrypoints.openai.api_server" in command(shell_pid):
        return shell_pid
    children = Path(f"/proc/{shell_pid}/task/{shell_pid}/children").read_text().split()
    (server,) = [int(c) for c in children
                 if "vllm.entrypoints.openai.api_server" in command(int(c))]
    return server


def test_the_cpu_build_commands_run_as_written(tmp_path: Path) -> None:
    block = _cpu_build_block()
    assert "--shutdown-timeout" in block and "kvtiers vllm-config" in block
    port = free_port()
    script = block.replace("--port 8000", f"--port {port}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, line in (("python", f'exec {sys.executable} "$@"'),
                       ("kvtiers", f'exec {sys.executable} -m kvtiers "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    log_path = tmp_path / "server.log"
    env = {**os.environ, **SERVER_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    with log_path.open("wb") as sink:
        process = subprocess.Popen(["bash", "-e", "-c", script], cwd=work, env=env,
                                   stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health",
                                            timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, "the server never answered /health"
            time.sleep(0.5)  # polling a server's readiness, not synchronising threads
        prompt = " ".join(f"w{i}" for i in range(10, 210))
        body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 4,
                           "temperature": 0.0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            assert json.loads(response.read())["choices"][0]["text"] is not None
    finally:
        # SIGINT to the server's process, as test_serve.py and a process manager stop it
        # (--shutdown-timeout: it drains, and kvtiers finishes writing chunks down).
        os.kill(_server_pid(process.pid), signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    log = log_path.read_text(errors="replace")
    assert ": ok — ready to start" in log  # kvtiers check
    assert re.search(r"kvtiers: tier 1 file started: file kv-cache", log), log[-3000:]
    assert "kvtiers: tier file stopped: chunks stored" in log, log[-3000:]
    assert [p.name for p in (work / "kv-cache").iterdir()], "no namespace in the file tier"
