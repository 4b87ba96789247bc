"""The mover of an object tier: chunks between primary CPU slots and chunk objects.

Each object is one chunk blob (4 KiB header + payload, xxh3_128-checked; see
:mod:`kvtiers.core.chunkformat`). A job fans out into one task per chunk on the tier's
bounded I/O pools (:class:`~kvtiers.tiers.fanout.FanOutMover`; loads on the backend's pool
at the engine's priority, stores, their hashing and encoding included, on its background
pool below it); the job's
:class:`~kvtiers.core.mover.MoverResult` is published when its last chunk is done.

- Store: header + the slot's payload (encoded with the tier's codec when that makes it
  smaller), written with a put that never overwrites; the body is a view over the header
  and the payload, never a joined copy. Finding the object already there (a racing
  writer) counts as success.
- Load: the header is read into a 4 KiB buffer and the stored payload straight into the
  slot's view, hashed as it lands; then both are verified, and an encoded payload is
  decoded into the slot and checked again (:func:`~kvtiers.core.chunkformat.finish_load`).
  Any codec is read, whatever the tier's own setting. A missing object fails its key; an
  object of the wrong size, or with a bad header, namespace, key or checksum is read once
  more (damage in transit is not damage in the store) and, bad again, is corrupt: it
  fails its key, is counted, is deleted when ``delete_corrupt`` is set, and the manager is
  told to forget it. An object stored with a codec this reader cannot decode (its package
  missing) fails its key as unreadable and stays in the store. A key is reported as
  succeeded only after its bytes verified.
- Transient errors are retried by the backend's :class:`~kvtiers.tiers.object.retry.Retrier`
  within the tier's operation deadline; when attempts or the deadline run out the key
  fails and the job carries on with the others. ``shutdown`` waits for jobs in flight at
  most the backend's ``shutdown_timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtiers.core.chunkformat import (
    HEADER_BYTES,
    decode_header,
    encode_blob,
    finish_load,
    payload_hasher,
)
from kvtiers.core.codec import Codec, Scratch
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.mover import ChunkReporter, HostRegion
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.errors import CorruptChunkError
from kvtiers.tiers.fanout import ChunkCopy, FanOutJob, FanOutMover, plan_chunks
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.store import ObjectMissing

log = logging.getLogger(__name__)


class ObjectMover(FanOutMover[FanOutJob]):
    """Copies chunks between a :class:`HostRegion` and an :class:`ObjectBackend`.

    ``reporter`` (usually the tier's :class:`ObjectTierManager`) is told from I/O threads
    of keys whose objects turned out corrupt or missing. ``codec`` encodes what this
    mover stores (``None``: payloads as they are).
    """

    def __init__(
        self,
        backend: ObjectBackend,
        region: HostRegion,
        geometry: ChunkGeometry,
        *,
        delete_corrupt: bool = True,
        reporter: ChunkReporter | None = None,
        codec: Codec | None = None,
    ) -> None:
        super().__init__("object tier")
        self.backend = backend
        self.region = region
        self.geometry = geometry
        self.delete_corrupt = delete_corrupt
        self.reporter = reporter
        self._digest = backend.identity.digest
        self.codec = codec
        self._scratch = Scratch()

    # -- the fan-out mover's hooks --------------------------------------------------
    def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> FanOutJob:
        if isinstance(src, CPULoadStoreSpec) and isinstance(dst, ObjectLoadStoreSpec):
            return FanOutJob(job_id, True, plan_chunks(src.slot_ids, dst.keys, dst.object_keys))
        if isinstance(src, ObjectLoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
            return FanOutJob(job_id, False, plan_chunks(dst.slot_ids, src.keys, src.object_keys))
        raise TypeError(
            f"an object mover copies between CPU slots and objects, got "
            f"{type(src).__name__} -> {type(dst).__name__}"
        )

    def _shutdown_wait_s(self) -> float:
        # The backend's deadline is shared with its own pool's shutdown, so the two waits
        # together stay within its shutdown_timeout_s.
        return max(0.0, self.backend.shutdown_deadline() - time.monotonic())

    def _accepting(self) -> bool:
        return not self.backend.closed

    def _start_task(self, task: Callable[[], None]) -> None:
        self.backend.submit(task)

    def _start_store_task(self, task: Callable[[], None]) -> None:
        self.backend.submit_background(task)

    def _copy(self, job: FanOutJob, chunk: ChunkCopy) -> int:
        if job.store:
            return self._store(chunk.slot, chunk.key, chunk.address)
        return self._load(chunk.slot, chunk.key, chunk.address)

    def _chunk_corrupt(self, job: FanOutJob, chunk: ChunkCopy, error: CorruptChunkError) -> None:
        self._on_corrupt(chunk.key, chunk.address, error)

    def _chunk_failed(self, job: FanOutJob, chunk: ChunkCopy, error: Exception) -> None:
        if isinstance(error, ObjectMissing):
            if self.reporter is not None:
                self.reporter.forget([chunk.key], corrupt=False)
            return
        if not job.store and self.reporter is not None:
            # The manager backs the key off and logs, aggregated. A non-transient error
            # (access denied, a directory at a local path) is the object's own.
            lasting = not isinstance(error, TimeoutError) and not self.backend.store.is_transient(
                error
            )
            where = self.backend.store.describe(chunk.address)
            self.reporter.load_failed(chunk.key, where, error, lasting=lasting)
            return
        self.warnings.failed(f"storing {self.backend.store.describe(chunk.address)}", error)

    # -- one chunk each way ---------------------------------------------------------
    def _store(self, slot: int, key: OffloadKey, name: str) -> int:
        size = self.geometry.key_chunk_bytes(key)
        payload = self.region.view(slot)[:size]
        header, stored = encode_blob(self._digest, key, payload, self.codec)
        store = self.backend.store
        self.backend.retrier.call(lambda: store.put_if_absent(name, [header, stored]))
        return HEADER_BYTES + size

    def _load(self, slot: int, key: OffloadKey, name: str) -> int:
        size = self.geometry.key_chunk_bytes(key)
        view = self.region.view(slot)
        if size > len(view):
            raise ValueError(f"a {size}-byte chunk does not fit a {len(view)}-byte slot")
        try:
            return self._read_checked(key, name, view[:size])
        except CorruptChunkError as exc:
            # A bit damaged in transit looks the same as a damaged object; only an object
            # that reads bad twice is corrupt (and, shared, deleted for every engine).
            log.info("object tier: %s read bad (%s); reading it again",
                     self.backend.store.describe(name), exc.check)
            return self._read_checked(key, name, view[:size])

    def _read_checked(self, key: OffloadKey, name: str, payload: memoryview) -> int:
        """Read ``name`` into a header buffer and ``payload``, verify (and decode) both."""
        header_buf = bytearray(HEADER_BYTES)
        buffers = [memoryview(header_buf), payload]
        store = self.backend.store

        def attempt() -> tuple[int, bytes]:
            hasher = payload_hasher()
            size = store.get_hashed(name, buffers, hasher)
            return size, hasher.digest()

        total, digest = self.backend.retrier.call(attempt)
        largest = HEADER_BYTES + len(payload)
        if not HEADER_BYTES <= total <= largest:
            raise CorruptChunkError(
                "length", f"object is {total} bytes, a chunk of this key is {largest} at most"
            )
        header = decode_header(header_buf, namespace_digest=self._digest, key=key)
        finish_load(header, payload, total - HEADER_BYTES, self._scratch,
                    stored_checksum=digest)
        return largest

    def _on_corrupt(self, key: OffloadKey, name: str, exc: CorruptChunkError) -> None:
        log.warning("object tier: %s is corrupt (%s)%s", self.backend.store.describe(name),
                    exc.check, "; deleting it" if self.delete_corrupt else "")
        self.backend.count_corrupt()
        if self.delete_corrupt:
            self.backend.delete_quietly(name)
        if self.reporter is not None:
            self.reporter.forget([key], corrupt=True)
