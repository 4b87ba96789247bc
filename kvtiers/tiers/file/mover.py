"""The file tier's mover: chunks between CPU-tier slots and chunk files.

Bounded thread pools run one task per chunk (the fan-out of
:class:`~kvtiers.tiers.fanout.FanOutMover`): loads on threads at the engine's priority,
stores (their hashing and encoding included) on threads of their own below it
(:mod:`kvtiers.tiers.iopool`); a job's result is reported when its last chunk is done.
Stores (``CPULoadStoreSpec`` → ``FileLoadStoreSpec``) encode the 4096-byte header over
the slot's payload (encoded first with the tier's codec when that makes it smaller) and
publish header + payload atomically through the I/O backend. Loads
(``FileLoadStoreSpec`` → ``CPULoadStoreSpec``) read the header and the stored payload
straight into the slot and verify both, decoding an encoded payload in place and checking
it again, before the chunk counts as arrived; any codec is read, whatever the tier's own
setting, and a chunk stored with a codec this reader cannot decode fails its key as
unreadable (it stays in place for readers that can).

With ``durability: process`` (the default) a store publishes without any fsync: the
chunk survives the crash of any process, and a power cut may lose it (it then reads as a
miss: every load verifies). With ``durability: power`` a store job's chunks are durable
before its result is reported. Where the platform has ``syncfs`` (Linux) the job's
chunks are published as in ``process`` mode and one ``syncfs`` of their filesystem at the
job's end makes all of them durable at once (data, names and new directories: one flush
instead of one per chunk and one per directory; it also flushes whatever else is pending
on that filesystem). Elsewhere each chunk's bytes are fsynced before its rename and the
directory fsyncs (new directories' parents included) run once per directory at the job's
end. Either way a chunk whose flush fails is failed and its file removed, and a file torn
by a power cut before the flush is only ever a miss (every load verifies).

Invariants: a chunk is in ``succeeded_keys`` only when its bytes are exactly right; any
failure puts it in ``failed_keys``. A chunk that fails verification is also in
``corrupt_keys``: its file is moved to ``<namespace>/quarantine/`` (or removed) and the
manager is told to forget the key, so it becomes a miss, never wrong bytes. A chunk whose
file has vanished is forgotten the same way without counting as corrupt. A failed store
leaves no file behind (publish removes its temp file) and the final name untouched.

``shutdown`` is bounded: it waits for jobs in flight at most ``shutdown_timeout_s``
(default :data:`~kvtiers.core.mover.SHUTDOWN_TIMEOUT_S`), then abandons threads stuck in
I/O with one warning. Chunk reads never block on a FIFO or device put in a chunk's place
(the I/O backend refuses non-regular files), and a read that fails with any error fails
its key.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtiers.core.buffers import Buffer
from kvtiers.core.chunkformat import (
    HEADER_BYTES,
    decode_header,
    encode_blob,
    encode_header,
    finish_load,
    payload_checksum,
)
from kvtiers.core.codec import Codec, CodecUnavailableError, Scratch
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.mover import SHUTDOWN_TIMEOUT_S, ChunkReporter, HostRegion
from kvtiers.core.publish import FileOps, ensure_dir
from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec, LoadStoreSpec
from kvtiers.errors import CorruptChunkError
from kvtiers.tiers.backoff import lasting_os_error
from kvtiers.tiers.fanout import ChunkCopy, FanOutJob, FanOutMover, plan_chunks
from kvtiers.tiers.file.io import AlignedHeaders, IOBackend, LateHeader, PublishSettings
from kvtiers.tiers.file.space import SpaceLatch, is_no_space
from kvtiers.tiers.iopool import IOPool

logger = logging.getLogger(__name__)

#: Payloads stored as they are from this size up are hashed on a thread of their own
#: while the payload is written (the header, written last, carries the checksum); a
#: smaller one is hashed first, which costs less than handing it over.
OVERLAP_HASH_BYTES = 1 << 20

class BadChunkHandler:
    """What happens to a chunk file that failed verification or vanished.

    ``quarantine_dir`` ``None`` removes corrupt files; otherwise they are moved there
    under a unique name for inspection. ``reporter`` (the manager) is told, thread-safe.
    """

    def __init__(
        self,
        reporter: ChunkReporter | None,
        quarantine_dir: Path | None,
        dir_mode: int = 0o700,
    ) -> None:
        self._reporter = reporter
        self.quarantine_dir = quarantine_dir
        self._dir_mode = dir_mode

    def corrupt(self, path: Path, key: OffloadKey, error: CorruptChunkError) -> None:
        logger.warning("file tier: %s: %s; the chunk is treated as a miss", path, error)
        try:
            if self.quarantine_dir is None:
                os.unlink(path)
            else:
                # Not through a link: the quarantine sits in the namespace, under the root.
                ensure_dir(
                    self.quarantine_dir, mode=self._dir_mode, root=self.quarantine_dir.parent
                )
                os.replace(path, self.quarantine_dir / f"{path.name}.{secrets.token_hex(4)}")
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("file tier: could not move corrupt chunk %s aside: %s", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(path)
        if self._reporter is not None:
            self._reporter.forget([key], corrupt=True)

    def vanished(self, key: OffloadKey) -> None:
        if self._reporter is not None:
            self._reporter.forget([key], corrupt=False)

    def unreadable(self, path: Path, key: OffloadKey, error: Exception) -> bool:
        """A load of ``key`` from ``path`` failed otherwise: the manager backs the key off
        (and logs, aggregated). False when there is no manager to tell."""
        if self._reporter is None:
            return False
        lasting = lasting_os_error(error) or isinstance(error, CodecUnavailableError)
        self._reporter.load_failed(key, str(path), error, lasting=lasting)
        return True


class _DeferredDirSync(FileOps):
    """``base``'s system calls, except that directory fsyncs are recorded for the job to
    run once at its end (see :class:`FileMover`)."""

    def __init__(self, base: FileOps, job: _FileJob) -> None:
        self.base = base
        self.job = job

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        return self.base.open_exclusive(path, mode, extra_flags)

    def has_anonymous(self) -> bool:
        return self.base.has_anonymous()

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        return self.base.open_anonymous(directory, mode, extra_flags)

    def link_anonymous(self, fd: int, dst: Path) -> None:
        self.base.link_anonymous(fd, dst)

    def fsync(self, fd: int) -> None:
        self.base.fsync(fd)

    def close(self, fd: int) -> None:
        self.base.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        self.base.replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        self.base.link(src, dst)

    def unlink(self, path: Path) -> None:
        self.base.unlink(path)

    def fsync_dir(self, path: Path) -> None:
        with self.job.lock:
            self.job.dirs.setdefault(path, [])


@dataclass
class _FileJob(FanOutJob):
    # Store jobs: directories to fsync before the result is reported, and the chunks (by
    # index in the job) published into each.
    dirs: dict[Path, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    settings: PublishSettings | None = None


class FileMover(FanOutMover[_FileJob]):
    """Copies chunks between ``region``'s slots and chunk files; see the module docstring.

    ``digest`` is the namespace identity digest every header carries. ``threads`` bounds
    the I/O concurrency of each class of work (loads; stores). ``space``, when given, is
    told of stores that fail for want of space (one aggregated warning there instead of
    one per chunk) and of stores that succeed. ``codec`` encodes what this mover stores
    (``None``: payloads as they are).
    """

    def __init__(
        self,
        region: HostRegion,
        geometry: ChunkGeometry,
        digest: bytes,
        backend: IOBackend,
        *,
        threads: int = 8,
        settings: PublishSettings | None = None,
        bad_chunks: BadChunkHandler | None = None,
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
        space: SpaceLatch | None = None,
        codec: Codec | None = None,
    ) -> None:
        if region.slot_bytes < geometry.max_chunk_bytes:
            raise ValueError(
                f"slots of {region.slot_bytes} bytes cannot hold a chunk of "
                f"{geometry.max_chunk_bytes} bytes"
            )
        super().__init__("file tier", shutdown_timeout_s)
        self.region = region
        self.geometry = geometry
        self.digest = digest
        self.backend = backend
        self.settings = settings or PublishSettings()
        self.bad_chunks = bad_chunks or BadChunkHandler(None, None)
        self.space = space
        # durability: power with one syncfs per store job instead of fsyncs per chunk.
        self._grouped = self.settings.sync and self.settings.ops.has_syncfs()
        # Loads at the engine's priority; stores (hashing and encoding included) on
        # threads of their own below it, so a load never queues behind a store.
        self._pool = IOPool(threads, "kvtiers-file")
        self._store_pool = IOPool(threads, "kvtiers-file-store", background=True)
        self._hasher = (
            IOPool(1, "kvtiers-file-hash", background=True) if backend.late_header else None
        )
        self._headers = AlignedHeaders()
        self.codec = codec
        self._scratch = Scratch()

    # -- the fan-out mover's hooks --------------------------------------------------
    def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> _FileJob:
        if isinstance(src, CPULoadStoreSpec) and isinstance(dst, FileLoadStoreSpec):
            slots, files, store = src.slot_ids, dst, True
        elif isinstance(src, FileLoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
            slots, files, store = dst.slot_ids, src, False
        else:
            raise TypeError(
                f"a file mover copies between CPU slots and files, got {src!r} -> {dst!r}"
            )
        if len(slots) != len(files):
            raise ValueError(f"{len(slots)} slots for {len(files)} chunk files")
        job = _FileJob(job_id, store, plan_chunks(slots.tolist(), files.keys, files.paths))
        job.settings = self.settings
        if store and self._grouped:
            job.settings = replace(self.settings, durability="process")
        elif store and self.settings.sync:
            job.settings = replace(self.settings, ops=_DeferredDirSync(self.settings.ops, job))
        return job

    def _start_task(self, task: Callable[[], None]) -> None:
        self._pool.submit(task)

    def _start_store_task(self, task: Callable[[], None]) -> None:
        self._store_pool.submit(task)

    def _copy(self, job: _FileJob, chunk: ChunkCopy) -> int:
        return self._store_one(job, chunk) if job.store else self._load_one(chunk)

    def _chunk_corrupt(self, job: _FileJob, chunk: ChunkCopy, error: CorruptChunkError) -> None:
        self.bad_chunks.corrupt(Path(chunk.address), chunk.key, error)

    def _chunk_failed(self, job: _FileJob, chunk: ChunkCopy, error: Exception) -> None:
        if job.store and self.space is not None and is_no_space(error):
            self.space.mark_full(error)
        elif not isinstance(error, FileNotFoundError):
            if job.store or not self.bad_chunks.unreadable(Path(chunk.address), chunk.key, error):
                super()._chunk_failed(job, chunk, error)
        elif job.store:
            self.warnings.failed(f"storing {chunk.address}", error)
        else:
            self.bad_chunks.vanished(chunk.key)

    def _before_result(self, job: _FileJob) -> None:
        """With ``durability: power``, make the store job's chunks durable: one
        ``syncfs`` where available, else one fsync per directory it touched (on a
        journaling filesystem the first commits every rename of the job, so the rest are
        nearly free). A chunk whose flush fails fails too, and its file is removed (best
        effort) so that no unindexed file stays behind."""
        if not job.dirs:
            return
        base = self.settings.ops
        if self._grouped:
            try:
                base.syncfs(next(iter(job.dirs)))
            except OSError as exc:
                logger.warning("file tier: syncfs after a store job failed: %s", exc)
                if self.space is not None and is_no_space(exc):
                    self.space.mark_full(exc)
                for published in job.dirs.values():
                    self._drop(job, published)
            return
        for directory, published in job.dirs.items():
            try:
                base.fsync_dir(directory)
            except OSError as exc:
                logger.warning("file tier: fsync of %s failed: %s", directory, exc)
                self._drop(job, published)

    def _drop(self, job: _FileJob, indexes: list[int]) -> None:
        """Fail the published chunks ``indexes`` of ``job`` and remove their files."""
        for index in indexes:
            chunk = job.chunks[index]
            job.revoke(index, self.geometry.key_chunk_bytes(chunk.key))
            with contextlib.suppress(OSError):
                os.unlink(chunk.address)

    def _release(self, idle: bool) -> None:
        self._pool.shutdown(None if idle else 0.0, cancel_queued=not idle)
        self._store_pool.shutdown(None if idle else 0.0, cancel_queued=not idle)
        if self._hasher is not None:
            self._hasher.shutdown(None if idle else 0.0, cancel_queued=not idle)

    # -- one chunk ------------------------------------------------------------------
    def _store_one(self, job: _FileJob, chunk: ChunkCopy) -> int:
        size = self.geometry.key_chunk_bytes(chunk.key)
        payload = self.region.view(chunk.slot)[:size]
        header: bytes | LateHeader
        if self.codec is None and self._hasher is not None and size >= OVERLAP_HASH_BYTES:
            digest = self._hasher.submit(lambda: payload_checksum(payload))
            key = chunk.key

            def header() -> bytes:
                return encode_header(self.digest, key, payload, checksum=digest.result())

            stored: Buffer = payload
        else:
            header, stored = encode_blob(self.digest, chunk.key, payload, self.codec)
        path = Path(chunk.address)
        assert job.settings is not None
        self.backend.write(path, header, stored, job.settings)
        if self.space is not None:
            self.space.mark_ok()
        if self.settings.sync:
            with job.lock:
                job.dirs.setdefault(path.parent, []).append(chunk.index)
        return size

    def _load_one(self, chunk: ChunkCopy) -> int:
        size = self.geometry.key_chunk_bytes(chunk.key)
        payload = self.region.view(chunk.slot)[:size]
        header_buf = self._headers.view
        got, file_size = self.backend.read(Path(chunk.address), header_buf, payload)
        if got < HEADER_BYTES or got != file_size:
            raise CorruptChunkError(
                "length", f"file holds {file_size} bytes, a chunk of this key is at most "
                f"{HEADER_BYTES + size}"
            )
        header = decode_header(header_buf, namespace_digest=self.digest, key=chunk.key)
        finish_load(header, payload, got - HEADER_BYTES, self._scratch)
        return size
