"""Test doubles for code built on the contracts: a host region over a bytearray, an
in-memory "object store" tier, and its mover with fault injection.

``MemoryObjectTier`` + ``MemoryMover`` behave like a lower tier: chunks live in a
:class:`MemoryObjectStore` that outlives the managers (so a reopened tier rebuilds its
index from it), the mover copies between primary slots and the store on a thread pool, and
tests can make chunks fail, arrive corrupt, or hold jobs in flight behind a gate.
``HandingMemoryTier`` also hands the chunks it evicts to the composite, as the file tier
does above a write-back tier.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import xxhash

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import Locality, LookupResult, Medium, ReqContext, TierCapabilities
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.errors import CorruptChunkError, UnknownKeyError
from kvtiers.testing.memory_tier import InMemoryTier
from kvtiers.tiers.fanout import ChunkCopy, FanOutJob, FanOutMover, plan_chunks


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

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        super().complete_load(keys, ctx)
        self._drain_forgotten()

    def reset_cache(self) -> None:
        if not self.capabilities.persistent:
            super().reset_cache()

    def get_spec(self, keys: Collection[OffloadKey]) -> ObjectLoadStoreSpec:
        super().get_spec(keys)
        return ObjectLoadStoreSpec("memory", [k.hex() for k in keys], list(keys))


class HandingMemoryTier(MemoryObjectTier):
    """A :class:`MemoryObjectTier` that can hand the chunks it evicts to the composite
    (:class:`~kvtiers.core.primary.HandingTier`), as the file tier does: once asked, an
    evicted chunk (every one, or with ``wanted_only`` each one marked by
    :meth:`want_evictions`) leaves the index at once but its object stays in the store
    until :meth:`release_evicted`. ``handed`` names the objects kept for the caller."""

    def __init__(
        self, capacity_chunks: int, store: MemoryObjectStore, *, persistent: bool = True
    ) -> None:
        self._wanted: set[OffloadKey] = set()  # before the index is rebuilt
        super().__init__(capacity_chunks, store, persistent=persistent)
        self._handing = False
        self._wanted_only = False
        self.handed: set[OffloadKey] = set()
        self._fresh: list[OffloadKey] = []

    def hand_over_evictions(self, wanted_only: bool = False) -> None:
        self._handing = True
        self._wanted_only = wanted_only

    def want_evictions(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        absent = []
        for key in keys:
            if key in self.index:
                self._wanted.add(key)
            else:
                absent.append(key)
        return absent

    def _release(self, keys: Iterable[OffloadKey]) -> None:
        keys = list(keys)
        self._wanted.difference_update(keys)
        super()._release(keys)

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        if not self._handing:
            return super().prepare_store(keys, ctx)
        change = self.index.reserve(keys, 1)
        if change is None:
            return None
        handed = [key for key in change.victims
                  if not self._wanted_only or key in self._wanted]
        kept = set(handed)
        self._release(key for key in change.victims if key not in kept)
        # The handed victims' slots go, their objects stay until released.
        self._wanted.difference_update(handed)
        InMemoryTier._release(self, handed)
        self.handed.update(handed)
        self._fresh.extend(handed)
        for key in change.keys:
            self.handed.discard(key)  # stored anew: the tier's own again
            self._slots[key] = self._free_slots.pop()
        return change.keys

    def take_evicted(self) -> list[OffloadKey]:
        fresh, self._fresh = self._fresh, []
        return [key for key in fresh if key in self.handed]

    def evicted_spec(self, keys: Sequence[OffloadKey]) -> ObjectLoadStoreSpec:
        missing = [key.hex() for key in keys if key not in self.handed]
        if missing:
            raise UnknownKeyError(f"evicted_spec: keys {missing} were not handed over")
        return ObjectLoadStoreSpec("memory", [k.hex() for k in keys], list(keys))

    def release_evicted(self, keys: Iterable[OffloadKey]) -> None:
        released = [key for key in keys if key in self.handed]
        self.handed.difference_update(released)
        with self.store.lock:
            for key in released:
                self.store.objects.pop(key, None)

    def shutdown(self) -> None:
        self.release_evicted(list(self.handed))
        super().shutdown()


class InjectedFailure(Exception):
    """The failure a :class:`MemoryMover` gives a key in its ``fail_keys``."""


class MemoryMover(FanOutMover[FanOutJob]):
    """Copies chunks between primary slots and a :class:`MemoryObjectStore`, one pool task
    per chunk (see :class:`~kvtiers.tiers.fanout.FanOutMover`).

    Fault injection: keys in ``fail_keys`` fail (nothing written or read); while ``gate``
    is cleared, copies wait before touching memory, so tests can act with I/O in flight.
    """

    def __init__(
        self,
        region: BytearrayRegion,
        geometry: ChunkGeometry,
        tier: MemoryObjectTier,
        threads: int = 2,
    ) -> None:
        super().__init__("memory tier")
        self.region = region
        self.geometry = geometry
        self.tier = tier
        self.fail_keys: set[OffloadKey] = set()
        self.gate = threading.Event()
        self.gate.set()
        self._pool = ThreadPoolExecutor(max_workers=threads)

    def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> FanOutJob:
        if isinstance(src, CPULoadStoreSpec) and isinstance(dst, ObjectLoadStoreSpec):
            return FanOutJob(job_id, True, plan_chunks(src.slot_ids, dst.keys, dst.object_keys))
        if isinstance(src, ObjectLoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
            return FanOutJob(job_id, False, plan_chunks(dst.slot_ids, src.keys, src.object_keys))
        raise TypeError(f"a memory mover copies between CPU slots and objects, got "
                        f"{type(src).__name__} -> {type(dst).__name__}")

    def _start_task(self, task: Callable[[], None]) -> None:
        self._pool.submit(task)

    def _copy(self, job: FanOutJob, chunk: ChunkCopy) -> int:
        self.gate.wait()
        if chunk.key in self.fail_keys:
            raise InjectedFailure(f"chunk {chunk.address} is in fail_keys")
        view = self.region.view(chunk.slot)
        if job.store:
            size = self.geometry.key_chunk_bytes(chunk.key)
            self.tier.store.put(chunk.key, bytes(view[:size]))
            return size
        with self.tier.store.lock:
            data, digest = self.tier.store.objects[chunk.key]
        if xxhash.xxh3_128_digest(data) != digest:
            raise CorruptChunkError("checksum", f"chunk {chunk.address} in memory")
        view[: len(data)] = data
        return len(data)

    def _chunk_corrupt(self, job: FanOutJob, chunk: ChunkCopy, error: CorruptChunkError) -> None:
        self.tier.forget([chunk.key], corrupt=True)

    def _chunk_failed(self, job: FanOutJob, chunk: ChunkCopy, error: Exception) -> None:
        """Injected failures are the test's own doing: not logged."""
        if not isinstance(error, InjectedFailure):
            super()._chunk_failed(job, chunk, error)

    def shutdown(self) -> None:
        """Open the gate (so held copies run), then shut down as every mover does."""
        self.gate.set()
        super().shutdown()

    def _release(self, idle: bool) -> None:
        self._pool.shutdown(wait=idle, cancel_futures=not idle)
