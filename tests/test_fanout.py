"""FanOutMover: per-key results in job order, every job reported once (even when a hook
raises or the pool is shut under it), ``drain`` waits for running copies and ``shutdown``
waits for them and nothing else.

The mover under test copies nothing: each chunk's copy waits for its gate and then does
what the test scripted for its key (arrive, fail, turn out corrupt)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtiers.core.keys import OffloadKey
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.errors import CorruptChunkError
from kvtiers.testing.conformance import conformance_key
from kvtiers.tiers.fanout import (
    ChunkCopy,
    FailureWarnings,
    FanOutJob,
    FanOutMover,
    plan_chunks,
)

A, B, C = (conformance_key(i) for i in range(3))


class ScriptedFanOut(FanOutMover[FanOutJob]):
    """A fan-out mover whose copies follow ``script`` (key → exception to raise) and wait
    for ``gate``; it logs what happens, in order, in ``events``."""

    def __init__(self, threads: int = 2) -> None:
        super().__init__("scripted")
        self.script: dict[OffloadKey, Exception] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.copying = threading.Event()
        self.events: list[str] = []
        self.hook_error: Exception | None = None
        self.start_limit: int | None = None
        self._events_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads)

    def log(self, event: str) -> None:
        with self._events_lock:
            self.events.append(event)

    def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> FanOutJob:
        if not isinstance(src, CPULoadStoreSpec) or not isinstance(dst, ObjectLoadStoreSpec):
            raise TypeError("the scripted mover only stores")
        return FanOutJob(job_id, True, plan_chunks(src.slot_ids, dst.keys, dst.object_keys))

    def _start_task(self, task: Callable[[], None]) -> None:
        if self.start_limit is not None:
            if self.start_limit == 0:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self.start_limit -= 1
        self._pool.submit(task)

    def _copy(self, job: FanOutJob, chunk: ChunkCopy) -> int:
        self.copying.set()
        self.gate.wait()
        error = self.script.get(chunk.key)
        self.log(f"copied {chunk.address}")
        if error is not None:
            raise error
        return 10 + chunk.index

    def _chunk_corrupt(self, job: FanOutJob, chunk: ChunkCopy, error: CorruptChunkError) -> None:
        self.log(f"corrupt {chunk.address}")
        if self.hook_error is not None:
            raise self.hook_error

    def _chunk_failed(self, job: FanOutJob, chunk: ChunkCopy, error: Exception) -> None:
        self.log(f"failed {chunk.address}")

    def _release(self, idle: bool) -> None:
        self.log("released")
        self._pool.shutdown(wait=idle)


def specs(*keys: OffloadKey) -> tuple[CPULoadStoreSpec, ObjectLoadStoreSpec]:
    names = [f"k{i}" for i in range(len(keys))]
    return CPULoadStoreSpec(range(len(keys))), ObjectLoadStoreSpec("b", names, list(keys))


@pytest.fixture
def mover() -> Iterator[ScriptedFanOut]:
    made = ScriptedFanOut()
    yield made
    made.gate.set()
    made.shutdown()


def test_results_hold_every_key_in_job_order(mover: ScriptedFanOut) -> None:
    mover.script = {B: CorruptChunkError("checksum"), C: OSError("disk full")}
    assert mover.submit(7, *specs(A, B, C, A))
    mover.drain()
    [result] = mover.get_finished()
    assert result.job_id == 7
    assert result.succeeded_keys == (A, A)
    assert result.failed_keys == (B, C)
    assert result.corrupt_keys == (B,)
    assert result.transfer_bytes == 10 + 13
    assert "corrupt k1" in mover.events and "failed k2" in mover.events
    assert mover.get_finished() == []


def test_an_empty_job_is_reported_at_once(mover: ScriptedFanOut) -> None:
    assert mover.submit(1, *specs())
    [result] = mover.get_finished()
    assert (result.job_id, result.succeeded_keys, result.failed_keys) == (1, (), ())
    assert mover.in_flight == 0


def test_bad_specs_raise_before_anything_starts(mover: ScriptedFanOut) -> None:
    src, dst = specs(A)
    with pytest.raises(TypeError, match="only stores"):
        mover.submit(1, dst, src)
    with pytest.raises(ValueError, match="one of each per chunk"):
        mover.submit(1, CPULoadStoreSpec([0, 1]), dst)
    assert mover.in_flight == 0 and mover.events == []


def test_a_job_id_in_flight_is_refused(mover: ScriptedFanOut) -> None:
    mover.gate.clear()
    assert mover.submit(1, *specs(A))
    with pytest.raises(ValueError, match="job 1 is already in flight"):
        mover.submit(1, *specs(B))
    mover.gate.set()
    mover.drain()
    assert [r.succeeded_keys for r in mover.get_finished()] == [(A,)]


def test_a_raising_hook_still_reports_the_job(mover: ScriptedFanOut) -> None:
    mover.script = {A: CorruptChunkError("header")}
    mover.hook_error = OSError("quarantine failed")
    assert mover.submit(1, *specs(A, B))
    mover.drain()
    [result] = mover.get_finished()
    assert (result.succeeded_keys, result.failed_keys, result.corrupt_keys) == ((B,), (A,), (A,))


def test_chunks_the_pool_will_not_start_fail_and_the_job_ends(mover: ScriptedFanOut) -> None:
    mover.start_limit = 1
    assert mover.submit(1, *specs(A, B, C))
    mover.drain()
    [result] = mover.get_finished()
    assert (result.succeeded_keys, result.failed_keys) == ((A,), (B, C))


def test_drain_waits_for_running_copies(mover: ScriptedFanOut) -> None:
    mover.gate.clear()
    assert mover.submit(1, *specs(A, B))
    mover.copying.wait()
    draining = threading.Event()
    seen: list[int] = []

    def drain() -> None:
        draining.set()
        mover.drain()
        mover.log("drained")
        seen.extend(r.job_id for r in mover.get_finished())

    drainer = threading.Thread(target=drain)
    drainer.start()
    draining.wait()
    mover.gate.set()
    drainer.join()
    assert mover.events[-1] == "drained"
    assert sorted(mover.events[:2]) == ["copied k0", "copied k1"]
    assert seen == [1]


def test_shutdown_waits_for_running_copies_then_refuses_and_releases_once(
    mover: ScriptedFanOut,
) -> None:
    mover.gate.clear()
    assert mover.submit(1, *specs(A))
    mover.copying.wait()
    stopping = threading.Event()

    def stop() -> None:
        stopping.set()
        mover.shutdown()

    stopper = threading.Thread(target=stop)
    stopper.start()
    stopping.wait()
    mover.gate.set()
    stopper.join()
    assert mover.events == ["copied k0", "released"]
    assert [r.succeeded_keys for r in mover.get_finished()] == [(A,)]
    assert not mover.submit(2, *specs(B))
    mover.shutdown()
    assert mover.events == ["copied k0", "released"]
    assert mover.in_flight == 0


def test_failure_warnings_are_one_line_per_episode_and_a_summary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    warnings = FailureWarnings("s3 tier", summary_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvtiers.tiers.fanout"):
        for i in range(100):  # an outage: every chunk fails within a minute
            warnings.failed(f"storing c{i}", ConnectionError("refused"))
        assert len(caplog.records) == 1
        assert "storing c0 failed: ConnectionError: refused" in caplog.records[0].getMessage()
        now[0] = 61.0
        warnings.failed("storing c100", ConnectionError("refused"))
        assert len(caplog.records) == 2
        assert "100 more copies failed" in caplog.records[1].getMessage()
        assert "storing c100" in caplog.records[1].getMessage()
        warnings.failed("storing c101", ConnectionError("refused"))
        warnings.succeeded()  # the store is back: a last summary ends the episode
        assert len(caplog.records) == 3 and "1 more copies failed" in caplog.records[2].getMessage()
        warnings.succeeded()
        warnings.failed("storing c102", TimeoutError("slow"))  # a new episode: logged at once
        assert len(caplog.records) == 4
        assert "storing c102 failed: TimeoutError: slow" in caplog.records[3].getMessage()
