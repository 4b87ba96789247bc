"""The file tier's mover: chunks between CPU-tier slots and chunk files.

A bounded thread pool runs one task per chunk; a job's result is reported when its last
chunk is done. Stores (``CPULoadStoreSpec`` → ``FileLoadStoreSpec``) encode the 4096-byte
header over the slot's payload and publish header + payload atomically through the I/O
backend. Loads (``FileLoadStoreSpec`` → ``CPULoadStoreSpec``) read the header and the
payload straight into the slot and verify both before the chunk counts as arrived.

Directory fsyncs of a store job are deferred to its end and run once per directory
before the result is reported: each chunk's bytes are still fsynced before its rename,
so nothing torn can ever appear, and on journaling filesystems one commit then covers
every rename of the job instead of one commit per chunk.

Invariants: a chunk is in ``succeeded_keys`` only when its bytes are exactly right; any
failure puts it in ``failed_keys``. A chunk that fails verification is also in
``corrupt_keys``: its file is moved to ``<namespace>/quarantine/`` (or removed) and the
manager is told to forget the key, so it becomes a miss, never wrong bytes. A chunk whose
file has vanished is forgotten the same way without counting as corrupt. A failed store
leaves no file behind (publish removes its temp file) and the final name untouched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvtiers.core.chunkformat import HEADER_BYTES, decode_header, encode_header, verify_payload
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.mover import HostRegion, Mover, MoverResult
from kvtiers.core.publish import FileOps, ensure_dir
from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec, LoadStoreSpec
from kvtiers.errors import CorruptChunkError
from kvtiers.tiers.file.io import AlignedHeaders, IOBackend, PublishSettings

logger = logging.getLogger(__name__)

class BadChunkHandler:
    """What happens to a chunk file that failed verification or vanished.

    ``quarantine_dir`` ``None`` removes corrupt files; otherwise they are moved there
    under a unique name for inspection. ``forget`` tells the manager (thread-safe).
    """

    def __init__(
        self,
        forget: Callable[..., None] | None,
        quarantine_dir: Path | None,
        dir_mode: int = 0o700,
    ) -> None:
        self._forget = forget
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
        if self._forget is not None:
            self._forget([key], corrupt=True)

    def vanished(self, key: OffloadKey) -> None:
        if self._forget is not None:
            self._forget([key], corrupt=False)


class _DeferredDirSync(FileOps):
    """``base``'s system calls, except that directory fsyncs are recorded for the job to
    run once at its end (see :class:`FileMover`)."""

    def __init__(self, base: FileOps, job: _JobState) -> None:
        self.base = base
        self.job = job

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        return self.base.open_exclusive(path, mode, extra_flags)

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
class _JobState:
    job_id: int
    remaining: int
    start: float
    ok: list[OffloadKey] = field(default_factory=list)
    failed: list[OffloadKey] = field(default_factory=list)
    corrupt: list[OffloadKey] = field(default_factory=list)
    moved: int = 0
    # Store jobs: directories to fsync before the result is reported, and the keys
    # published into each.
    dirs: dict[Path, list[tuple[OffloadKey, Path]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    settings: PublishSettings | None = None


class FileMover(Mover):
    """Copies chunks between ``region``'s slots and chunk files; see the module docstring.

    ``digest`` is the namespace identity digest every header carries. ``threads`` bounds
    the I/O concurrency.
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
    ) -> None:
        if region.slot_bytes < geometry.max_chunk_bytes:
            raise ValueError(
                f"slots of {region.slot_bytes} bytes cannot hold a chunk of "
                f"{geometry.max_chunk_bytes} bytes"
            )
        self.region = region
        self.geometry = geometry
        self.digest = digest
        self.backend = backend
        self.settings = settings or PublishSettings()
        self.bad_chunks = bad_chunks or BadChunkHandler(None, None)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtiers-file")
        self._cond = threading.Condition()
        self._in_flight = 0
        self._done: list[MoverResult] = []
        self._closed = False
        self._headers = AlignedHeaders()

    # -- submission -----------------------------------------------------------------
    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
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
        with self._cond:
            if self._closed:
                return False
            self._in_flight += 1
        job = _JobState(job_id, len(files), time.perf_counter())
        if store:
            job.settings = replace(self.settings, ops=_DeferredDirSync(self.settings.ops, job))
        if not len(files):
            self._finish(job)
            return True
        task = self._store_one if store else self._load_one
        for slot, path, key in zip(slots.tolist(), files.paths, files.keys, strict=True):
            self._pool.submit(self._run_one, task, job, int(slot), Path(path), key)
        return True

    def _run_one(
        self,
        task: Callable[[_JobState, int, Path, OffloadKey], int],
        job: _JobState,
        slot: int,
        path: Path,
        key: OffloadKey,
    ) -> None:
        corrupt = False
        moved = 0
        try:
            moved = task(job, slot, path, key)
            ok = True
        except CorruptChunkError as exc:
            self.bad_chunks.corrupt(path, key, exc)
            ok, corrupt = False, True
        except FileNotFoundError as exc:
            if task == self._load_one:
                self.bad_chunks.vanished(key)
            else:
                logger.warning("file tier: storing chunk %s failed: %s", path, exc)
            ok = False
        except Exception as exc:
            logger.warning("file tier: chunk %s failed: %s", path, exc)
            ok = False
        with self._cond:
            if ok:
                job.ok.append(key)
                job.moved += moved
            else:
                job.failed.append(key)
                if corrupt:
                    job.corrupt.append(key)
            job.remaining -= 1
            last = job.remaining == 0
        if last:
            self._finish(job)

    def _finish(self, job: _JobState) -> None:
        self._sync_dirs(job)
        result = MoverResult(
            job.job_id,
            tuple(job.ok),
            tuple(job.failed),
            job.moved,
            time.perf_counter() - job.start,
            tuple(job.corrupt),
        )
        with self._cond:
            self._done.append(result)
            self._in_flight -= 1
            self._cond.notify_all()

    def _sync_dirs(self, job: _JobState) -> None:
        """Make the job's new names durable: one fsync per directory it touched. On a
        journaling filesystem the first commits every rename of the job, so the rest are
        nearly free. A chunk published into a directory whose fsync fails fails too, and
        its file is removed (best effort) so that no unindexed file stays behind."""
        base = self.settings.ops
        for directory, published in job.dirs.items():
            try:
                base.fsync_dir(directory)
            except OSError as exc:
                logger.warning("file tier: fsync of %s failed: %s", directory, exc)
                lost = {key for key, _path in published}
                job.ok = [k for k in job.ok if k not in lost]
                job.failed.extend(lost)
                job.moved -= sum(self.geometry.key_chunk_bytes(k) for k in lost)
                for _key, path in published:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    # -- one chunk ------------------------------------------------------------------
    def _store_one(self, job: _JobState, slot: int, path: Path, key: OffloadKey) -> int:
        size = self.geometry.key_chunk_bytes(key)
        payload = self.region.view(slot)[:size]
        header = encode_header(self.digest, key, payload)
        assert job.settings is not None
        self.backend.write(path, header, payload, job.settings)
        with job.lock:
            job.dirs.setdefault(path.parent, []).append((key, path))
        return size

    def _load_one(self, job: _JobState, slot: int, path: Path, key: OffloadKey) -> int:
        size = self.geometry.key_chunk_bytes(key)
        payload = self.region.view(slot)[:size]
        header_buf = self._headers.view
        got, file_size = self.backend.read(path, header_buf, payload)
        if got < HEADER_BYTES + size or file_size != HEADER_BYTES + size:
            raise CorruptChunkError(
                "length", f"file holds {file_size} bytes, a chunk of this key is "
                f"{HEADER_BYTES + size}"
            )
        header = decode_header(header_buf, namespace_digest=self.digest, key=key)
        verify_payload(header, payload)
        return size

    # -- completion -----------------------------------------------------------------
    def get_finished(self) -> list[MoverResult]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0)

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.drain()
        self._pool.shutdown(wait=True)
