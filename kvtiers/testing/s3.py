"""S3 test helpers: the moto server's address and a botocore fault injector.

- :class:`MotoServer`: where a (test-started) moto server listens; ``reset`` empties it.
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

import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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
