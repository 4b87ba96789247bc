"""Liveness in time (docs/architecture.md, "Liveness"): one object-store operation ends
by its deadline (``op_deadline_s``) whatever the server does, and a mover's shutdown
returns with I/O still stuck.

The retry policy is checked with an injected clock (exact). The stalled-server and
stuck-I/O tests wait for the call under test with a generous bound that only turns a
hang into a failure; what they assert is the outcome (a deadline error, a failed key, a
returned shutdown), not a duration.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtiers.config.tiers import FsspecTierConfig, S3TierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.file.io import IOBackend, LateHeader, PublishSettings
from kvtiers.tiers.file.mover import FileMover
from kvtiers.tiers.iopool import IOPool
from kvtiers.tiers.object import ObjectBackend, ObjectMover, Retrier
from kvtiers.tiers.object.retry import OperationDeadlineError, remaining_s
from kvtiers.tiers.object.store import Buffer, ObjectInfo, ObjectStore
from tests.test_file_support import GEOMETRY, IDENTITY
from tests.test_liveness_io import run_bounded


# -- the retry policy -----------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_attempts_and_back_off_never_pass_the_deadline() -> None:
    clock = FakeClock()
    seen: list[float | None] = []

    def stalls() -> None:
        seen.append(remaining_s())
        clock.now += 4.0  # each attempt takes 4 s, then times out
        raise TimeoutError("read timed out")

    retrier = Retrier(lambda e: True, max_attempts=100, base_s=1.0, max_s=1.0,
                      deadline_s=10.0, sleep=clock.sleep, rng=lambda: 1.0, clock=clock)
    with pytest.raises(OperationDeadlineError, match="2 attempt") as error:
        retrier.call(stalls)
    assert isinstance(error.value.__cause__, TimeoutError)
    # attempt at 0 s (10 left), back-off 1 s, attempt at 5 s (5 left); a third back-off
    # would start an attempt at 10 s, the deadline itself.
    assert seen == [10.0, 5.0]
    assert clock.now - 100.0 <= 10.0
    assert remaining_s() is None


def test_a_nested_call_never_outlives_the_outer_one() -> None:
    clock = FakeClock()
    outer = Retrier(lambda e: True, deadline_s=5.0, sleep=clock.sleep, clock=clock)
    inner = Retrier(lambda e: True, deadline_s=60.0, sleep=clock.sleep, clock=clock)
    assert outer.call(lambda: inner.call(remaining_s)) == 5.0
    assert inner.call(remaining_s, bounded=False) is None


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        Retrier(lambda e: True, deadline_s=0.0)


def test_object_tier_configs_carry_op_deadline_s() -> None:
    assert S3TierConfig(name="s3", bucket="kv-cache").op_deadline_s == 30.0
    assert FsspecTierConfig(name="f", url="memory://kv", op_deadline_s=2.5).op_deadline_s == 2.5
    from kvtiers.errors import ConfigError

    with pytest.raises(ConfigError, match="op_deadline_s"):
        S3TierConfig(name="s3", bucket="kv-cache", op_deadline_s=0)


# -- a server that accepts and never answers ------------------------------------------
@pytest.fixture
def stalling_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>``: accepts connections, reads nothing, answers nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    server.close()
    for conn in held:
        conn.close()


def _stalled_s3(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from kvtiers.tiers.s3.store import S3Store

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # A socket timeout far beyond the deadline: only the deadline can end the wait.
    return S3Store("kv-cache", region="us-east-1", endpoint_url=endpoint, timeout_s=600.0,
                   credentials=("testing", "testing"))


def test_an_s3_request_to_a_stalled_server_fails_by_its_deadline(
    stalling_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _stalled_s3(stalling_endpoint, monkeypatch)
    retrier = Retrier(store.is_transient, max_attempts=5, deadline_s=0.5)
    try:
        with pytest.raises(OperationDeadlineError, match="op_deadline_s"):
            run_bounded(lambda: retrier.call(lambda: store.head("ns/manifest.json")))
    finally:
        store.close()


def test_an_object_load_from_a_stalled_server_fails_its_key(
    stalling_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _stalled_s3(stalling_endpoint, monkeypatch)
    backend = ObjectBackend(store, IDENTITY, threads=2,
                            retrier=Retrier(store.is_transient, deadline_s=0.5))
    region = BytearrayRegion(2, GEOMETRY.slot_bytes)
    mover = ObjectMover(backend, region, GEOMETRY)
    keys = [conformance_key(0), conformance_key(1)]
    spec = ObjectLoadStoreSpec("kv-cache", [backend.object_key(k) for k in keys], keys)
    try:
        assert mover.submit(1, spec, CPULoadStoreSpec([0, 1]))
        run_bounded(mover.drain)
        (result,) = mover.get_finished()
        assert set(result.failed_keys) == set(keys) and result.succeeded_keys == ()
    finally:
        mover.shutdown()
        backend.close()


# -- shutdown with I/O stuck ----------------------------------------------------------
class StuckStore(ObjectStore):
    """Every read blocks until ``release`` is set."""

    bucket = "stuck"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def describe(self, name: str = "") -> str:
        return f"stuck://{name}"

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(())

    def head(self, name: str) -> int | None:
        return None

    def get_into(self, name: str, buffers: Sequence[memoryview]) -> int:
        self.entered.set()
        self.release.wait()
        raise ConnectionError("released")

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        return True

    def put(self, name: str, parts: Sequence[Buffer]) -> None:
        return None

    def delete(self, name: str) -> None:
        return None

    def is_transient(self, exc: BaseException) -> bool:
        return False


def test_object_mover_and_backend_shutdown_return_with_a_request_stuck(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = StuckStore()
    backend = ObjectBackend(store, IDENTITY, threads=1, shutdown_timeout_s=0.2)
    mover = ObjectMover(backend, BytearrayRegion(1, GEOMETRY.slot_bytes), GEOMETRY)
    key = conformance_key(0)
    spec = ObjectLoadStoreSpec("stuck", [backend.object_key(key)], [key])
    try:
        assert mover.submit(1, spec, CPULoadStoreSpec([0]))
        assert store.entered.wait(60)
        with caplog.at_level(logging.WARNING):
            run_bounded(mover.shutdown)
            run_bounded(backend.close)
        assert "abandoned" in caplog.text
        assert not mover.submit(2, spec, CPULoadStoreSpec([0]))
    finally:
        store.release.set()


class StuckBackend(IOBackend):
    """A file I/O backend whose reads block until ``release`` is set (a hung mount)."""

    name = "stuck"
    code = 0

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, path: Path, header: bytes | LateHeader, payload: Any,
              settings: PublishSettings) -> None:
        raise OSError("read-only test backend")

    def read(self, path: Path, header: memoryview, payload: Any) -> tuple[int, int]:
        self.entered.set()
        self.release.wait()
        raise OSError("released")


def test_file_mover_shutdown_returns_with_a_read_stuck(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = StuckBackend()
    geometry = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(8192,))
    mover = FileMover(BytearrayRegion(1, geometry.slot_bytes), geometry, IDENTITY.digest,
                      backend, threads=1, shutdown_timeout_s=0.2)
    key = conformance_key(0)
    try:
        assert mover.submit(1, FileLoadStoreSpec([str(tmp_path / "c.kvc")], [key]),
                            CPULoadStoreSpec([0]))
        assert backend.entered.wait(60)
        with caplog.at_level(logging.WARNING):
            run_bounded(mover.shutdown)
        assert "abandoned" in caplog.text
    finally:
        backend.release.set()


def test_io_pool_shutdown_runs_queued_work_then_gives_up_on_a_stuck_thread() -> None:
    pool = IOPool(1, "test-pool")
    gate = threading.Event()
    first = pool.submit(gate.wait)
    queued = pool.submit(lambda: "never")
    assert not pool.shutdown(0.0)
    gate.set()
    assert first.result(60) is True
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)

    again = IOPool(2, "test-pool")
    error = again.submit(lambda: 1 // 0)
    results = [again.submit(lambda i=i: i) for i in range(20)]
    assert again.shutdown(60)
    with pytest.raises(ZeroDivisionError):
        error.result(0)
    assert [r.result(0) for r in results] == list(range(20))

    third = IOPool(1, "test-pool")
    hold = threading.Event()
    third.submit(hold.wait)
    dropped = third.submit(lambda: "dropped")
    assert not third.shutdown(0.0, cancel_queued=True)
    assert dropped.cancelled()
    hold.set()
