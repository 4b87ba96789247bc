"""Test doubles for code built on the contracts: a host region over a bytearray, an
in-memory "object store" tier, and its mover with fault injection.

``MemoryObjectTier`` + ``MemoryMover`` behave like a lower tier: chunks live in a
:class:`MemoryObjectStore` that outlives the managers (so a reopened tier rebuilds its
index from it), the mover copies between primary slots and the store on a thread pool, and
tests can make chunks fail, arrive corrupt, or hold jobs in flight behind a gate.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import Locality, LookupResult, Medium, ReqContext, TierCapabilities
from kvtiers.core.mover import Mover, MoverResult
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.testing.reference import InMemoryTier


class BytearrayRegion:
    """A :class:`~kvtiers.core.mover.HostRegion` over one bytearray."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self.buffer = bytearray(num_slots * slot_bytes)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def view(self, slot_id: int) -> memoryview:
        start = slot_id * self._slot_bytes
        return memoryview(self.buffer)[start : start + self._slot_bytes]


@dataclass
class MemoryObjectStore:
    """Chunks by key, each with the xxh3_128 of its bytes (checked on read)."""

    objects: dict[OffloadKey, tuple[bytes, bytes]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, key: OffloadKey, data: bytes) -> None:
        with self.lock:
            self.objects[key] = (data, xxhash.xxh3_128_digest(data))

    def corrupt(self, key: OffloadKey) -> None:
        """Flip one byte of a stored chunk (its checksum is kept, so reads detect it)."""
        with self.lock:
            data, digest = self.objects[key]
            self.objects[key] = (bytes([data[0] ^ 0xFF]) + data[1:], digest)


class MemoryObjectTier(InMemoryTier):
    """A lower-tier manager over a :class:`MemoryObjectStore`.

    Its mover reports corrupt chunks through :meth:`forget`, which is thread-safe; the
    manager drops them on its next call from the scheduler thread.
    """

    medium = Medium.STORAGE
    locality = Locality.REMOTE

    def __init__(
        self, capacity_chunks: int, store: MemoryObjectStore, *, persistent: bool = True
    ) -> None:
        super().__init__(capacity_chunks)
        self.capabilities = TierCapabilities(
            persistent=persistent, evicts=True, recency=True, events=True
        )
        self.store = store
        self._forgotten: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        with store.lock:
            existing = list(store.objects) if persistent else []
            if not persistent:
                store.objects.clear()
        self._insert_ready(existing)

    def forget(self, keys: Collection[OffloadKey], *, corrupt: bool) -> None:
        for key in keys:
            self._forgotten.put(key)

    def _drain_forgotten(self) -> None:
        reported = []
        while not self._forgotten.empty():
            reported.append(self._forgotten.get())
        if reported:
            self._release(self.index.discard(reported))

    def _release(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        super()._release(keys)
        with self.store.lock:
            for key in keys:
                self.store.objects.pop(key, None)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._drain_forgotten()
        return super().lookup(key, ctx)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        super().complete_load(keys, ctx)
        self._drain_forgotten()

    def reset_cache(self) -> None:
        if not self.capabilities.persistent:
            super().reset_cache()

    def get_spec(self, keys: Collection[OffloadKey]) -> ObjectLoadStoreSpec:
        super().get_spec(keys)
        return ObjectLoadStoreSpec("memory", [k.hex() for k in keys], list(keys))


class MemoryMover(Mover):
    """Copies chunks between primary slots and a :class:`MemoryObjectStore`.

    Fault injection: keys in ``fail_keys`` fail (nothing written or read); while ``gate``
    is cleared, jobs wait before touching memory, so tests can act with I/O in flight.
    """

    def __init__(
        self,
        region: BytearrayRegion,
        geometry: ChunkGeometry,
        tier: MemoryObjectTier,
        threads: int = 2,
    ) -> None:
        self.region = region
        self.geometry = geometry
        self.tier = tier
        self.fail_keys: set[OffloadKey] = set()
        self.gate = threading.Event()
        self.gate.set()
        self._pool = ThreadPoolExecutor(max_workers=threads)
        self._done: list[MoverResult] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        if self._closed:
            return False
        with self._lock:
            self._in_flight += 1
        self._pool.submit(self._run, job_id, src, dst)
        return True

    def _run(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        self.gate.wait()
        start = time.perf_counter()
        ok: list[OffloadKey] = []
        bad: list[OffloadKey] = []
        corrupt: list[OffloadKey] = []
        moved = 0
        if isinstance(src, CPULoadStoreSpec):
            assert isinstance(dst, ObjectLoadStoreSpec)
            for slot, key in zip(src.slot_ids, dst.keys, strict=True):
                if key in self.fail_keys:
                    bad.append(key)
                    continue
                size = self.geometry.key_chunk_bytes(key)
                self.tier.store.put(key, bytes(self.region.view(int(slot))[:size]))
                ok.append(key)
                moved += size
        else:
            assert isinstance(src, ObjectLoadStoreSpec) and isinstance(dst, CPULoadStoreSpec)
            for key, slot in zip(src.keys, dst.slot_ids, strict=True):
                with self.tier.store.lock:
                    data, digest = self.tier.store.objects[key]
                if key in self.fail_keys:
                    bad.append(key)
                elif xxhash.xxh3_128_digest(data) != digest:
                    bad.append(key)
                    corrupt.append(key)
                else:
                    self.region.view(int(slot))[: len(data)] = data
                    ok.append(key)
                    moved += len(data)
        if corrupt:
            self.tier.forget(corrupt, corrupt=True)
        result = MoverResult(job_id, tuple(ok), tuple(bad), moved,
                             time.perf_counter() - start, tuple(corrupt))
        with self._lock:
            self._done.append(result)
            self._in_flight -= 1
            self._idle.notify_all()

    def get_finished(self) -> list[MoverResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.gate.set()
        self.drain()
        self._pool.shutdown(wait=True)
