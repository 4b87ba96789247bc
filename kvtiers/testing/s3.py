"""S3 test helpers: moto servers (the address of one, and one in its own process) and a
botocore fault injector.

- :class:`MotoServer`: where a (test-started) moto server listens; ``reset`` empties it.
- :class:`MotoProcess`: a moto server in a process of its own (``python -m moto.server``)
  on a free loopback port, stopped by its PID — for measurements, where a server in the
  measuring process would share its cores and its GIL with the client.
- :class:`S3Server`: an S3 server a test runs against (moto or SeaweedFS), by endpoint.
- :data:`AWS_UNSET` / :data:`AWS_TEST_ENV`: the environment a test's S3 clients run in,
  so nothing can reach a real AWS account.
- :class:`FaultInjector`: a botocore ``before-send`` hook, registered on a tier's
  clients, that answers requests itself instead of sending them — throttling (503
  SlowDown), 500s, dropped connections, read timeouts — or delays them, ``n`` requests at
  a time, optionally only for one HTTP method.

botocore is imported only when a fault is delivered, so importing this module is light.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

#: The bucket the test fixtures create.
BUCKET = "kvtiers-test"


#: AWS environment variables removed for a test (profiles, tokens, a real endpoint).
AWS_UNSET = (
    "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_REGION", "AWS_ENDPOINT_URL",
)
#: AWS environment variables set for a test: dummy credentials, a region, no EC2 metadata.
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass(frozen=True)
class S3Server:
    """An S3 server a test runs against: its endpoint, and what it is."""

    endpoint_url: str
    name: str


@dataclass(frozen=True)
class MotoServer:
    """Where a moto server listens."""

    endpoint_url: str

    def reset(self) -> None:
        """Forget every bucket and object (``POST /moto-api/reset``)."""
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


#: How long :meth:`MotoProcess.start` waits for the server to answer.
MOTO_READY_TIMEOUT_S = 60.0
#: How long :meth:`MotoProcess.stop` waits after SIGTERM before it kills the server.
MOTO_STOP_TIMEOUT_S = 5.0


class MotoProcess:
    """A moto S3 server in a child process on 127.0.0.1.

    :meth:`start` picks a free port, starts ``python -m moto.server`` with this
    interpreter and returns the :class:`MotoServer` once it answers; :meth:`stop` ends that
    child by its PID (SIGTERM, SIGKILL after :data:`MOTO_STOP_TIMEOUT_S`). The server's own
    log (a line per request) goes to a temporary file, quoted when start-up fails. Usable
    as a context manager.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs; ``None`` before start and after stop."""
        return None if self._process is None else self._process.pid

    def start(self) -> MotoServer:
        """Start the server and wait until it answers. Raises ``RuntimeError`` when it is
        already running, exits at start-up or does not answer in time."""
        if self._process is not None:
            raise RuntimeError("this moto server is already running; stop() it first")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by stop()
            prefix="kvtiers-moto-", suffix=".log")
        env = {**os.environ, "MOTO_PORT": str(port)}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        server = MotoServer(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + MOTO_READY_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._log.seek(0)
                tail = self._log.read()[-2000:].decode(errors="replace").strip()
                self.stop()
                raise RuntimeError(f"the moto server exited with {code} at start-up "
                                   f"(is moto[server] installed?); its output: {tail}")
            try:
                server.reset()
                return server
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the moto server on port {port} did not answer in "
                        f"{MOTO_READY_TIMEOUT_S:g} s; is moto[server] installed?"
                    ) from None
                time.sleep(0.05)  # polling a server's readiness, not synchronising threads

    def stop(self) -> None:
        """End the server (by its PID). Idempotent."""
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=MOTO_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class ResponseBody:
    """The ``raw`` of a fabricated botocore response (what a hook returns instead of
    sending the request)."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self._data


class FaultInjector:
    """A botocore ``before-send`` hook that fails or delays chosen requests.

    Each knob arms the next ``n`` matching requests (``method`` "GET", "PUT", "HEAD"…
    or ``None`` for any). ``injected`` counts faults delivered, ``passed`` requests let
    through to the server. Thread-safe.
    """

    EVENT = "before-send.s3"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[tuple[str, str | None, float]] = []
        self.injected = 0
        self.passed = 0

    def hooks(self) -> list[tuple[str, Any]]:
        return [(self.EVENT, self)]

    def _arm(self, kind: str, n: int, method: str | None, delay_s: float = 0.0) -> None:
        with self._lock:
            self._armed.extend([(kind, method, delay_s)] * n)

    def throttle(self, n: int, method: str | None = None) -> None:
        self._arm("throttle", n, method)

    def server_error(self, n: int, method: str | None = None) -> None:
        self._arm("500", n, method)

    def drop(self, n: int, method: str | None = None) -> None:
        self._arm("drop", n, method)

    def timeout(self, n: int, method: str | None = None) -> None:
        self._arm("timeout", n, method)

    def slow(self, n: int, delay_s: float, method: str | None = None) -> None:
        self._arm("slow", n, method, delay_s)

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def _take(self, method: str) -> tuple[str, float] | None:
        with self._lock:
            for i, (kind, wanted, delay_s) in enumerate(self._armed):
                if wanted is None or wanted == method:
                    del self._armed[i]
                    self.injected += 1
                    return kind, delay_s
            self.passed += 1
            return None

    def __call__(self, request: Any, **_: Any) -> Any:
        import botocore.exceptions
        from botocore.awsrequest import AWSResponse

        fault = self._take(request.method)
        if fault is None:
            return None
        kind, delay_s = fault
        if kind == "slow":
            time.sleep(delay_s)  # the fault itself: a slow server, not synchronisation
            return None
        if kind == "drop":
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=request.url)
        if kind == "timeout":
            raise botocore.exceptions.ReadTimeoutError(endpoint_url=request.url)
        status, code = (503, "SlowDown") if kind == "throttle" else (500, "InternalError")
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        headers = {"Content-Type": "application/xml"}
        return AWSResponse(request.url, status, headers, ResponseBody(body))
