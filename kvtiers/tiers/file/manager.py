"""The file tier's manager: an in-memory index over one namespace directory.

At start the namespace's manifest is checked (or created), then one ``os.scandir`` pass
over the namespace and its two fan-out levels both removes stale temp files of
interrupted publishes (what :func:`~kvtiers.core.publish.cleanup_stale_temps` does, without
a second walk) and rebuilds the index — names parsed by :meth:`FileMapper.key_from_name`,
sizes and mtimes from ``stat`` (never opening a file), recency seeded from mtimes.

Index entries hold a size, a ready flag and a pin count, in LRU order. Invariants:

- ``usage`` is the sum of the entries' sizes: reserved keys count at the largest blob
  (``HEADER_BYTES + geometry.max_chunk_bytes``; managers never decode a key's group),
  rebuilt ones and shared-directory probe hits at their file size; with a ``capacity`` it
  never exceeds it (probe hits evict like stores do), so once a store completes the tier
  is within capacity;
- ``prepare_store`` evicts least recently used ready, unpinned chunks to make room, or
  returns ``None`` and changes nothing;
- the scheduler thread never does file I/O: evicted files are unlinked by a deleter
  thread (dropped from the index at once), shared-directory existence probes run on a
  probe thread, and movers report corrupt or vanished chunks through :meth:`forget`, a
  thread-safe queue drained on the next scheduler-thread call.

An eviction whose unlink is still queued when the same key is stored again is cancelled;
one whose unlink is running makes that store return ``None`` (try again later), so the
deleter can never remove a freshly published file and the scheduler never waits on it.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.publish import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, is_temp_name
from kvtiers.core.specs import FileLoadStoreSpec
from kvtiers.errors import UnknownKeyError
from kvtiers.filemapper import FileMapper, open_namespace
from kvtiers.tiers.file.io import IO_POSIX
from kvtiers.tiers.file.space import SpaceLatch

logger = logging.getLogger(__name__)

#: On a shared directory, temp files younger than this may belong to a live writer.
SHARED_TEMP_AGE_S = 3600.0
#: How long a shared-directory probe's "not there" answer is trusted.
NEGATIVE_PROBE_TTL_S = 1.0
QUARANTINE_DIR = "quarantine"

_FANOUT = re.compile(r"[0-9a-f]{2}")
_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY


@dataclass(slots=True)
class _Entry:
    size: int
    ready: bool
    pins: int = 0


class _Deleter:
    """A thread that unlinks evicted chunk files, off the scheduler thread.

    Its lock guards bookkeeping only and is never held across an unlink: the scheduler
    thread takes it, and an unlink on a slow filesystem (NFS) may take long. A queued
    unlink can be cancelled; one already running cannot, so :meth:`cancel` refuses while
    one of its names is being unlinked. While ``gate`` is cleared (tests do this) queued
    unlinks wait. ``unlink`` is injectable for tests.
    """

    def __init__(self, unlink: Callable[[Path], None] = os.unlink) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self._unlink = unlink
        self._cond = threading.Condition()
        self._queue: list[Path] = []
        self._pending: dict[Path, int] = {}
        self._running: Path | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtiers-file-deleter", daemon=True)
        self._thread.start()

    def delete(self, paths: Iterable[Path]) -> None:
        with self._cond:
            for path in paths:
                self._queue.append(path)
                self._pending[path] = self._pending.get(path, 0) + 1
            self._cond.notify_all()

    def cancel(self, paths: Collection[Path]) -> bool:
        """Keep ``paths``: their queued unlinks are skipped (the names are about to be
        reused). False, changing nothing, while one of them is being unlinked: a file
        published under that name now could be removed by it."""
        with self._cond:
            if self._running is not None and self._running in paths:
                return False
            for path in paths:
                self._pending.pop(path, None)
            return True

    def wait(self) -> None:
        """Block until every queued unlink has run."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and self._running is None)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self.gate.set()
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
            self.gate.wait()
            with self._cond:
                path = self._queue.pop(0)
                count = self._pending.get(path, 0)
                if not count:
                    self._cond.notify_all()
                    continue
                if count == 1:
                    del self._pending[path]
                else:
                    self._pending[path] = count - 1
                # Taken with the queue entry, so cancel() either skipped it or sees it.
                self._running = path
            try:
                self._unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("file tier: could not remove evicted chunk %s: %s", path, exc)
            with self._cond:
                self._running = None
                self._cond.notify_all()


class _Prober:
    """Batched existence checks (``os.stat``) for a shared directory, off-thread."""

    def __init__(self, mapper: FileMapper) -> None:
        self._mapper = mapper
        self._cond = threading.Condition()
        self._batch: list[OffloadKey] | None = None
        self._results: list[tuple[OffloadKey, int | None]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtiers-file-prober", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._batch is not None

    def submit(self, keys: list[OffloadKey]) -> bool:
        """Start probing ``keys``; False while the previous batch still runs."""
        with self._cond:
            if self._batch is not None or self._closed:
                return False
            self._batch = keys
            self._cond.notify_all()
            return True

    def take_results(self) -> list[tuple[OffloadKey, int | None]]:
        """``(key, file size or None)`` for every probed key since the last call."""
        with self._cond:
            results, self._results = self._results, []
        return results

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._batch is None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._batch is not None or self._closed)
                if self._batch is None:
                    return
                batch = self._batch
            found: list[tuple[OffloadKey, int | None]] = []
            for key in batch:
                try:
                    found.append((key, os.stat(self._mapper.path(key)).st_size))
                except OSError:
                    found.append((key, None))
            with self._cond:
                self._results.extend(found)
                self._batch = None
                self._cond.notify_all()


class FileTierManager(OffloadingManager):
    """Bookkeeping of the chunk files of one namespace; see the module docstring.

    ``capacity_bytes`` ``None`` means bounded only by the filesystem. ``shared``: other
    engines write into the same namespace, so an index miss is checked on disk by a
    background probe (``RETRY`` until it answers). ``io_backend`` is the numeric code of
    the I/O path in use (reported in stats). ``clock`` is injectable for tests.
    ``space`` (:class:`~kvtiers.tiers.file.space.SpaceLatch`): while it does not admit
    (read-only root, full disk) ``prepare_store`` answers ``None``.

    ``get_stats``: ``hits``, ``misses``, ``stores``, ``store_failures``, ``evictions``,
    ``loads``, ``chunks``, ``usage_bytes``, ``capacity_bytes`` (0 when unbounded),
    ``corrupt_chunks`` and ``vanished_chunks`` (reported by movers), ``probes`` and
    ``probe_hits`` (shared directories) and ``io_backend`` (see :mod:`.io`'s ``IO_*``
    codes; the name is in :attr:`io_backend_name`).
    """

    capabilities = TierCapabilities(persistent=True, evicts=True, recency=True, events=True)
    medium = Medium.STORAGE
    locality = Locality.LOCAL

    def __init__(
        self,
        mapper: FileMapper,
        geometry: ChunkGeometry,
        *,
        capacity_bytes: int | None = None,
        shared: bool = False,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
        io_backend: int = IO_POSIX,
        io_backend_name: str = "posix",
        clock: Callable[[], float] = time.monotonic,
        space: SpaceLatch | None = None,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.mapper = mapper
        self.geometry = geometry
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.io_backend = io_backend
        self.io_backend_name = io_backend_name
        self.reserve_bytes = HEADER_BYTES + geometry.max_chunk_bytes
        self._clock = clock
        self._space = space
        self.namespace_dir = open_namespace(
            mapper.root, mapper.identity, file_mode=file_mode, dir_mode=dir_mode
        )
        self.quarantine_dir = self.namespace_dir / QUARANTINE_DIR
        self._entries: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self.usage_bytes = 0
        self._events: list[OffloadingEvent] = []
        self._forgotten: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._held_back: list[OffloadKey] = []
        self._reported_lock = threading.Lock()
        self._reported = {"corrupt_chunks": 0, "vanished_chunks": 0}
        self._stats: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "stores", "store_failures", "evictions", "loads", "probes",
             "probe_hits"),
            0,
        )
        self._deleter = _Deleter()
        self._prober = _Prober(mapper) if shared else None
        self._probe_queue: dict[OffloadKey, None] = {}
        self._probing: set[OffloadKey] = set()
        self._negative: dict[OffloadKey, float] = {}
        self._closed = False
        start = time.perf_counter()
        removed = self._rebuild(SHARED_TEMP_AGE_S if shared else 0.0)
        self.rebuild_s = time.perf_counter() - start
        if removed:
            logger.info("file tier %s: removed %d stale temp files", self.namespace_dir, removed)
        if self.unindexed_entries:
            logger.warning(
                "file tier %s: %d entries named like chunks are not regular files and were "
                "not indexed; `kvtiers verify` lists them", self.namespace_dir,
                self.unindexed_entries,
            )
        logger.info(
            "file tier %s: %d chunks (%d bytes) indexed in %.3f s",
            self.namespace_dir, len(self._entries), self.usage_bytes, self.rebuild_s,
        )
        if capacity_bytes is not None and self.usage_bytes > capacity_bytes:
            victims = self._pick_victims(self.usage_bytes - capacity_bytes, set())
            assert victims is not None, "nothing is pinned or reserved at start"
            self._evict(victims)

    # -- start-up -------------------------------------------------------------------
    def _rebuild(self, temp_age_s: float) -> int:
        """Index every chunk file and remove stale temp files, in one pass over the tree;
        returns how many temp files were removed. Temp files younger than
        ``temp_age_s`` are left alone (another live writer may own them)."""
        found: list[tuple[float, OffloadKey, int]] = []
        self.unindexed_entries = 0
        key_from_name = self.mapper.key_from_name
        cutoff = time.time() - temp_age_s
        removed = 0
        stack = [(str(self.namespace_dir), 0)]
        while stack:
            directory, level = stack.pop()
            try:
                with os.scandir(directory) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue
            for entry in entries:
                name = entry.name
                if level < 2 and _FANOUT.fullmatch(name) and entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, level + 1))
                    continue
                if is_temp_name(name):
                    removed += _remove_temp(entry, cutoff if temp_age_s > 0 else None)
                    continue
                key = key_from_name(name) if level == 2 else None
                if key is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    # A FIFO, directory or symlink under a chunk's name is never a chunk:
                    # indexed, every load of it would fail. `kvtiers verify` lists them.
                    self.unindexed_entries += 1
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort(key=lambda item: item[0])
        entries_map = self._entries
        for _mtime, key, size in found:
            entries_map[key] = _Entry(size, True)
            self.usage_bytes += size
        return removed

    # -- the mover's side channel ---------------------------------------------------
    def forget(self, keys: Collection[OffloadKey], *, corrupt: bool) -> None:
        """Thread-safe: these chunks' files are gone (``corrupt``: they failed verification
        and were quarantined or removed; otherwise they vanished from disk). Counted at
        once; the index drops them on its next scheduler-thread call once unpinned."""
        with self._reported_lock:
            self._reported["corrupt_chunks" if corrupt else "vanished_chunks"] += len(keys)
        for key in keys:
            self._forgotten.put(key)

    def _drain_forgotten(self) -> None:
        if self._forgotten.empty() and not self._held_back:
            return
        pending, self._held_back = self._held_back, []
        while not self._forgotten.empty():
            pending.append(self._forgotten.get())
        dropped = []
        for key in dict.fromkeys(pending):
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                continue
            if entry.pins:
                # Still pinned by the load that found it bad; dropped once unpinned.
                self._held_back.append(key)
                continue
            del self._entries[key]
            self.usage_bytes -= entry.size
            dropped.append(key)
        if dropped:
            self._events.append(self._event(dropped, removed=True))

    # -- lookup ---------------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._drain_forgotten()
        entry = self._entries.get(key)
        if entry is None and self._prober is not None:
            return self._probe_lookup(key)
        if entry is None:
            self._stats["misses"] += 1
            return _MISS
        if entry.ready:
            self._stats["hits"] += 1
            return _HIT
        return _PENDING

    def _probe_lookup(self, key: OffloadKey) -> LookupResult:
        self._take_probe_results()
        entry = self._entries.get(key)
        if entry is not None:
            self._stats["hits"] += 1
            return _HIT
        expiry = self._negative.get(key)
        if expiry is not None:
            if self._clock() < expiry:
                self._stats["misses"] += 1
                return _MISS
            del self._negative[key]
        if key not in self._probing:
            self._probe_queue[key] = None
        return _RETRY

    def _take_probe_results(self) -> None:
        assert self._prober is not None
        results = self._prober.take_results()
        if not results:
            return
        expiry = self._clock() + NEGATIVE_PROBE_TTL_S
        for key, size in results:
            self._probing.discard(key)
            if key in self._entries:
                continue
            if size is None:
                self._negative[key] = expiry
            else:
                self._entries[key] = _Entry(size, True)
                self.usage_bytes += size
                self._stats["probe_hits"] += 1
        capacity = self.capacity_bytes
        if capacity is not None and self.usage_bytes > capacity:
            victims = self._pick_victims(self.usage_bytes - capacity, set())
            assert victims is not None, "the probe hits are ready and unpinned themselves"
            self._evict(victims)
        if len(self._negative) > 4 * len(results) + 1024:
            now = self._clock()
            self._negative = {k: t for k, t in self._negative.items() if t > now}

    def _flush_probes(self) -> None:
        if self._prober is None:
            return
        self._take_probe_results()
        if self._probe_queue and self._prober.submit(list(self._probe_queue)):
            self._probing.update(self._probe_queue)
            self._stats["probes"] += len(self._probe_queue)
            self._probe_queue = {}

    def wait_probes(self) -> None:
        """Block until the probe batch in flight (if any) has answered. For tests and
        tools: the scheduler never blocks."""
        if self._prober is not None:
            self._prober.wait()

    def wait_deletions(self) -> None:
        """Block until every evicted file has been unlinked. For tests and tools."""
        self._deleter.wait()

    @property
    def deletions_gate(self) -> threading.Event:
        """Cleared, it holds evicted files' unlinks back (tests use it to act meanwhile)."""
        return self._deleter.gate

    # -- store ----------------------------------------------------------------------
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        self._drain_forgotten()
        if self._space is not None and not self._space.admits():
            return None  # read-only, or full until the latch lets one store try again
        entries = self._entries
        accepted = list(dict.fromkeys(key for key in keys if key not in entries))
        need = len(accepted) * self.reserve_bytes
        capacity = self.capacity_bytes
        victims = None
        if capacity is not None and self.usage_bytes + need > capacity:
            if need > capacity:
                return None
            present = {key for key in keys if key in entries}
            victims = self._pick_victims(self.usage_bytes + need - capacity, present)
            if victims is None:
                return None
        path = self.mapper.path
        if not self._deleter.cancel({path(key) for key in accepted}):
            # The evicted file of one of these keys is being unlinked right now; waiting
            # for it would stall the scheduler on I/O, so the store is refused for now.
            return None
        if victims:
            self._evict(victims)
        for key in accepted:
            entries[key] = _Entry(self.reserve_bytes, False)
            self._negative.pop(key, None)
        self.usage_bytes += need
        return accepted

    def _pick_victims(self, shortfall: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        """Least recently used ready, unpinned keys freeing ``shortfall`` bytes, or None."""
        victims = []
        freed = 0
        for key, entry in self._entries.items():
            if entry.ready and not entry.pins and key not in protected:
                victims.append(key)
                freed += entry.size
                if freed >= shortfall:
                    return victims
        return None

    def _evict(self, victims: list[OffloadKey]) -> None:
        for key in victims:
            self.usage_bytes -= self._entries.pop(key).size
        self._deleter.delete(self.mapper.path(key) for key in victims)
        self._stats["evictions"] += len(victims)
        self._events.append(self._event(victims, removed=True))

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        entries = self._entries
        done = [key for key in keys if (e := entries.get(key)) is not None and not e.ready]
        if success:
            for key in done:
                entries[key].ready = True
                entries.move_to_end(key)
            self._stats["stores"] += len(done)
            if done:
                self._events.append(self._event(done, removed=False))
        else:
            for key in done:
                self.usage_bytes -= entries.pop(key).size
            self._stats["store_failures"] += len(done)

    # -- load -----------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None or not entry.ready:
                raise UnknownKeyError(
                    f"prepare_load: key {key.hex()} is not stored in the file tier at "
                    f"{self.namespace_dir} (look it up first; only HIT keys can be loaded)"
                )
        for key in keys:
            entries[key].pins += 1
            entries.move_to_end(key)
        self._stats["loads"] += len(keys)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins:
                entry.pins -= 1
        self._drain_forgotten()

    def get_spec(self, keys: Collection[OffloadKey]) -> FileLoadStoreSpec:
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None or (entry.ready and not entry.pins):
                raise UnknownKeyError(
                    f"get_spec: key {key.hex()} is neither reserved by prepare_store nor "
                    f"pinned by prepare_load in the file tier at {self.namespace_dir}"
                )
        path = self.mapper.path
        return FileLoadStoreSpec([str(path(key)) for key in keys], list(keys))

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        entries = self._entries
        for key in keys:
            if key in entries:
                entries.move_to_end(key)

    # -- the rest of the contract ---------------------------------------------------
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self._drain_forgotten()
        self._flush_probes()

    def has_pending_work(self) -> bool:
        if self._prober is None:
            return False
        return bool(self._probe_queue or self._probing) or self._prober.busy

    def reset_cache(self) -> None:
        """Persistent: stored chunks stay. Only remembered probe misses are dropped."""
        self._negative.clear()

    def get_stats(self) -> Mapping[str, float]:
        self._drain_forgotten()
        ready = sum(1 for e in self._entries.values() if e.ready)
        with self._reported_lock:
            reported = dict(self._reported)
        return {
            **self._stats,
            **reported,
            "chunks": ready,
            "usage_bytes": self.usage_bytes,
            "capacity_bytes": self.capacity_bytes or 0,
            "io_backend": self.io_backend,
        }

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._prober is not None:
            self._prober.close()
        self._deleter.close()

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(list(keys), self.medium, removed=removed, locality=self.locality)


def _remove_temp(entry: os.DirEntry[str], cutoff: float | None) -> int:
    """Unlink a stale temp file (older than ``cutoff`` when given); 1 if removed. One that
    cannot be removed (a read-only filesystem) stays: it is never read as a chunk."""
    try:
        if cutoff is not None and entry.stat(follow_symlinks=False).st_mtime >= cutoff:
            return 0
        os.unlink(entry.path)
    except OSError:
        return 0
    return 1
