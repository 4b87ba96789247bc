"""Two classes of work (docs/architecture.md, "Two classes of work"): what a waiting request
needs (loads) runs on threads at the engine's priority and never queues behind write-behind
(stores), which runs on threads of its own below that priority.

Each mover test blocks every store thread inside its write, queues more stores behind
them, then a load, and checks by counts and order (never by timing) that the load
finishes while every store is still blocked and before any store job; the stores finish
once released. The nice value each copy ran at is read on its own thread. A bounded wait
only turns a hang into a failure; it measures nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core.mover import Mover
from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.file.io import PosixBackend, PublishSettings
from kvtiers.tiers.iopool import (
    BACKGROUND_NICE,
    THREAD_PRIORITIES,
    IOPool,
    background_initializer,
    thread_nice,
)
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.local import LocalStore
from kvtiers.tiers.object.mover import ObjectMover
from kvtiers.tiers.object.store import Buffer, Hasher
from tests.test_file_support import CHUNK, GEOMETRY, IDENTITY, open_tier

HANG_GUARD_S = 60.0
#: Store threads per mover, and store chunks queued behind them.
THREADS = 2
QUEUED_STORES = 6

needs_priorities = pytest.mark.skipif(
    not THREAD_PRIORITIES or thread_nice() + BACKGROUND_NICE > 19,
    reason="needs per-thread nice values (Linux) and room above this process's",
)


class Gate:
    """Counts copies as they start, holds stores until :meth:`open`, and records the nice
    value each store and load ran at, on its own thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = False
        self.stores_started = 0
        self.store_nice: list[int] = []
        self.load_nice: list[int] = []

    def store(self) -> None:
        with self._cond:
            self.stores_started += 1
            self.store_nice.append(thread_nice())
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self._open, HANG_GUARD_S), "stores never freed"

    def load(self) -> None:
        with self._cond:
            self.load_nice.append(thread_nice())

    def wait_stores(self, count: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.stores_started >= count, HANG_GUARD_S)

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def rearm(self) -> None:
        """Hold stores again, counting afresh."""
        with self._cond:
            self._open = False
            self.stores_started = 0
            self.store_nice.clear()
            self.load_nice.clear()


class GatedPosix(PosixBackend):
    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    def write(self, path: Path, header: Any, payload: Any, settings: PublishSettings) -> None:
        self.gate.store()
        super().write(path, header, payload, settings)

    def read(self, path: Path, header: memoryview, payload: Any) -> tuple[int, int]:
        self.gate.load()
        return super().read(path, header, payload)


class GatedLocal(LocalStore):
    def __init__(self, root: Path, gate: Gate) -> None:
        super().__init__(root)
        self.gate = gate

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        self.gate.store()
        return super().put_if_absent(name, parts)

    def get_hashed(self, name: str, buffers: Sequence[memoryview], hasher: Hasher) -> int:
        self.gate.load()
        return super().get_hashed(name, buffers, hasher)


def _check_a_load_overtakes_blocked_stores(
    mover: Mover, gate: Gate, region: BytearrayRegion,
    spec: Callable[[list[int]], Any],
) -> None:
    """With chunk 0 stored and ``gate`` holding stores: one store job per chunk 1.. (the
    first ``THREADS`` block in their write, the rest wait in the queue), then a load of
    chunk 0 into a slot of its own. ``spec(ids)`` addresses chunks ``ids`` on the tier."""
    ids = list(range(1, 1 + THREADS + QUEUED_STORES))
    for i in ids:
        region.view(i)[:CHUNK] = conformance_payload(i, CHUNK)
    load_slot = ids[-1] + 1
    try:
        for i in ids:
            assert mover.submit(100 + i, CPULoadStoreSpec([i]), spec([i]))
        gate.wait_stores(THREADS)
        assert mover.submit(1, spec([0]), CPULoadStoreSpec([load_slot]))
        assert mover.wait_job(1, HANG_GUARD_S), "the load waited behind the stores"  # type: ignore[attr-defined]
        # Counts, not timing: the load finished while every store was held, and no store
        # started beyond the threads it blocks.
        assert gate.stores_started == THREADS
        assert mover.in_flight == len(ids)  # type: ignore[attr-defined]
        (load,) = mover.get_finished()
        assert load.job_id == 1 and load.succeeded_keys == (conformance_key(0),)
        assert bytes(region.view(load_slot)[:CHUNK]) == conformance_payload(0, CHUNK)
    finally:
        gate.open()
    mover.drain()
    stores = mover.get_finished()
    assert sorted(r.job_id for r in stores) == [100 + i for i in ids]
    assert all(r.succeeded_keys == (conformance_key(r.job_id - 100),) for r in stores)
    assert gate.stores_started == len(ids)


@pytest.fixture
def gate() -> Gate:
    return Gate()


def test_a_file_load_is_not_delayed_by_a_backlog_of_stores(tmp_path: Path, gate: Gate) -> None:
    tier = open_tier(tmp_path, slots=THREADS + QUEUED_STORES + 2, backend=GatedPosix(gate))
    try:
        gate.open()
        assert tier.store([0]) == [conformance_key(0)]
        gate.rearm()
        mapper = tier.manager.mapper

        def spec(ids: list[int]) -> FileLoadStoreSpec:
            keys = [conformance_key(i) for i in ids]
            return FileLoadStoreSpec([str(mapper.path(k)) for k in keys], keys)

        _check_a_load_overtakes_blocked_stores(tier.mover, gate, tier.region, spec)
    finally:
        gate.open()
        tier.close()


@pytest.fixture
def object_mover(tmp_path: Path, gate: Gate) -> Iterator[tuple[ObjectMover, BytearrayRegion]]:
    backend = ObjectBackend(GatedLocal(tmp_path, gate), IDENTITY, threads=THREADS)
    region = BytearrayRegion(THREADS + QUEUED_STORES + 2, GEOMETRY.slot_bytes)
    mover = ObjectMover(backend, region, GEOMETRY)
    try:
        yield mover, region
    finally:
        gate.open()
        mover.shutdown()
        backend.close()


def _object_spec(mover: ObjectMover) -> Callable[[list[int]], ObjectLoadStoreSpec]:
    def spec(ids: list[int]) -> ObjectLoadStoreSpec:
        keys = [conformance_key(i) for i in ids]
        return ObjectLoadStoreSpec("kv", [mover.backend.object_key(k) for k in keys], keys)

    return spec


def test_an_object_load_is_not_delayed_by_a_backlog_of_stores(
    object_mover: tuple[ObjectMover, BytearrayRegion], gate: Gate,
) -> None:
    mover, region = object_mover
    gate.open()
    spec = _object_spec(mover)
    region.view(0)[:CHUNK] = conformance_payload(0, CHUNK)
    assert mover.submit(0, CPULoadStoreSpec([0]), spec([0]))
    mover.drain()
    assert mover.get_finished()[0].succeeded_keys == (conformance_key(0),)
    gate.rearm()
    _check_a_load_overtakes_blocked_stores(mover, gate, region, spec)


@needs_priorities
def test_store_copies_run_below_the_engine_and_loads_at_its_priority(
    object_mover: tuple[ObjectMover, BytearrayRegion], gate: Gate,
) -> None:
    mover, region = object_mover
    engine = thread_nice()
    gate.open()
    spec = _object_spec(mover)
    region.view(0)[:CHUNK] = conformance_payload(0, CHUNK)
    assert mover.submit(0, CPULoadStoreSpec([0]), spec([0]))
    mover.drain()
    assert mover.submit(1, spec([0]), CPULoadStoreSpec([1]))
    mover.drain()
    assert [r.job_id for r in mover.get_finished()] == [0, 1]
    assert gate.store_nice == [engine + BACKGROUND_NICE]
    assert gate.load_nice == [engine]


@needs_priorities
def test_file_store_copies_run_below_the_engine_and_loads_at_its_priority(
    tmp_path: Path, gate: Gate,
) -> None:
    engine = thread_nice()
    gate.open()
    tier = open_tier(tmp_path, backend=GatedPosix(gate))
    try:
        assert tier.store([0, 1, 2]) == [conformance_key(i) for i in range(3)]
        result, data = tier.load(1)
        assert result.succeeded_keys == (conformance_key(1),)
        assert data == conformance_payload(1, CHUNK)
    finally:
        tier.close()
    assert gate.store_nice == [engine + BACKGROUND_NICE] * 3
    assert gate.load_nice == [engine]


@needs_priorities
def test_pools_take_their_priority_from_the_thread_that_makes_them() -> None:
    engine = thread_nice()
    foreground = IOPool(1, "test-fg")
    background = IOPool(1, "test-bg", background=True)
    try:
        assert foreground.submit(thread_nice).result(HANG_GUARD_S) == engine
        assert background.submit(thread_nice).result(HANG_GUARD_S) == engine + BACKGROUND_NICE
        initialised: list[int] = []

        def initialise() -> None:
            background_initializer()()
            initialised.append(thread_nice())

        thread = threading.Thread(target=initialise)
        thread.start()
        thread.join(HANG_GUARD_S)
        assert initialised == [engine + BACKGROUND_NICE]
        # The engine's own thread is never touched.
        assert thread_nice() == engine
    finally:
        foreground.shutdown(HANG_GUARD_S)
        background.shutdown(HANG_GUARD_S)
