"""The mover of an object tier: chunks between primary CPU slots and chunk objects.

Each object is one chunk blob (4 KiB header + payload, xxh3_128-checked; see
:mod:`kvtiers.core.chunkformat`). A job fans out into one task per chunk on the tier's
bounded I/O pool; the job's :class:`~kvtiers.core.mover.MoverResult` is published when its
last chunk is done.

- Store: header + the slot's payload, written with a put that never overwrites; finding
  the object already there (a racing writer) counts as success.
- Load: the header is read into a 4 KiB buffer and the payload straight into the slot's
  view, then both are verified. A missing object fails its key; an object of the wrong
  size, or with a bad header, namespace, key or checksum is corrupt: it fails its key, is
  counted, is deleted when ``delete_corrupt`` is set, and the manager is told to forget
  it. A key is reported as succeeded only after its bytes verified.
- Transient errors are retried by the backend's :class:`~kvtiers.tiers.object.retry.Retrier`;
  when attempts run out the key fails and the job carries on with the others.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtiers.core.chunkformat import HEADER_BYTES, decode_header, encode_header, verify_payload
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.mover import ChunkReporter, HostRegion, Mover, MoverResult
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.errors import CorruptChunkError
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.store import ObjectMissing

log = logging.getLogger(__name__)


@dataclass
class _Job:
    job_id: int
    keys: tuple[OffloadKey, ...]
    remaining: int
    start: float
    succeeded: set[OffloadKey] = field(default_factory=set)
    corrupt: list[OffloadKey] = field(default_factory=list)
    moved: int = 0


class ObjectMover(Mover):
    """Copies chunks between a :class:`HostRegion` and an :class:`ObjectBackend`.

    ``reporter`` (usually the tier's :class:`ObjectTierManager`) is told from I/O threads
    of keys whose objects turned out corrupt or missing.
    """

    def __init__(
        self,
        backend: ObjectBackend,
        region: HostRegion,
        geometry: ChunkGeometry,
        *,
        delete_corrupt: bool = True,
        reporter: ChunkReporter | None = None,
    ) -> None:
        self.backend = backend
        self.region = region
        self.geometry = geometry
        self.delete_corrupt = delete_corrupt
        self.reporter = reporter
        self._digest = backend.identity.digest
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._jobs: dict[int, _Job] = {}
        self._done: list[MoverResult] = []
        self._closed = False

    # -- submission -----------------------------------------------------------------
    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        if self._closed or self.backend.closed:
            return False
        if isinstance(src, CPULoadStoreSpec) and isinstance(dst, ObjectLoadStoreSpec):
            tasks = [
                (self._store, int(slot), key, name)
                for slot, key, name in zip(src.slot_ids, dst.keys, dst.object_keys, strict=True)
            ]
            keys = dst.keys
        elif isinstance(src, ObjectLoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
            tasks = [
                (self._load, int(slot), key, name)
                for slot, key, name in zip(dst.slot_ids, src.keys, src.object_keys, strict=True)
            ]
            keys = src.keys
        else:
            raise TypeError(
                f"an object mover copies between CPU slots and objects, got "
                f"{type(src).__name__} -> {type(dst).__name__}"
            )
        job = _Job(job_id, tuple(keys), len(tasks), time.perf_counter())
        with self._lock:
            self._jobs[job_id] = job
            if not tasks:
                self._finish(job)
                return True
        for run, slot, key, name in tasks:
            self.backend.submit(functools.partial(self._task, job, run, slot, key, name))
        return True

    def _task(
        self,
        job: _Job,
        run: Callable[[int, OffloadKey, str], int],
        slot: int,
        key: OffloadKey,
        name: str,
    ) -> None:
        moved = 0
        ok = corrupt = False
        try:
            moved = run(slot, key, name)
            ok = True
        except CorruptChunkError as exc:
            corrupt = True
            self._on_corrupt(key, name, exc)
        except ObjectMissing:
            if self.reporter is not None:
                self.reporter.forget([key], corrupt=False)
        except Exception as exc:  # any other failure fails this key, never the job
            log.warning("object tier: %s failed: %s: %s",
                        self.backend.store.describe(name), type(exc).__name__, exc)
        with self._lock:
            if corrupt:
                job.corrupt.append(key)
            elif ok:
                job.succeeded.add(key)
                job.moved += moved
            job.remaining -= 1
            if job.remaining == 0:
                self._finish(job)

    def _finish(self, job: _Job) -> None:
        """Publish a finished job's result (``self._lock`` held)."""
        del self._jobs[job.job_id]
        ok = tuple(k for k in job.keys if k in job.succeeded)
        failed = tuple(k for k in job.keys if k not in job.succeeded)
        self._done.append(MoverResult(job.job_id, ok, failed, job.moved,
                                      time.perf_counter() - job.start, tuple(job.corrupt)))
        self._idle.notify_all()

    # -- one chunk each way ---------------------------------------------------------
    def _store(self, slot: int, key: OffloadKey, name: str) -> int:
        size = self.geometry.key_chunk_bytes(key)
        payload = self.region.view(slot)[:size]
        blob = encode_header(self._digest, key, payload) + payload
        store = self.backend.store
        self.backend.retrier.call(lambda: store.put_if_absent(name, [blob]))
        return len(blob)

    def _load(self, slot: int, key: OffloadKey, name: str) -> int:
        size = self.geometry.key_chunk_bytes(key)
        view = self.region.view(slot)
        if size > len(view):
            raise ValueError(f"a {size}-byte chunk does not fit a {len(view)}-byte slot")
        payload = view[:size]
        header = bytearray(HEADER_BYTES)
        buffers = [memoryview(header), payload]
        store = self.backend.store
        total = self.backend.retrier.call(lambda: store.get_into(name, buffers))
        if total != HEADER_BYTES + size:
            raise CorruptChunkError(
                "length", f"object is {total} bytes, a chunk of this key is {HEADER_BYTES + size}"
            )
        verify_payload(decode_header(header, namespace_digest=self._digest, key=key), payload)
        return total

    def _on_corrupt(self, key: OffloadKey, name: str, exc: CorruptChunkError) -> None:
        log.warning("object tier: %s is corrupt (%s)%s", self.backend.store.describe(name),
                    exc.check, "; deleting it" if self.delete_corrupt else "")
        self.backend.count_corrupt()
        if self.delete_corrupt:
            self.backend.delete_quietly(name)
        if self.reporter is not None:
            self.reporter.forget([key], corrupt=True)

    # -- completion -----------------------------------------------------------------
    def get_finished(self) -> list[MoverResult]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def drain(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._jobs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.drain()
