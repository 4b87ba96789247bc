"""The file tier's manager: an in-memory index over one namespace directory.

At start the namespace's manifest is checked (or created), then the index is built on a
thread of its own (:mod:`kvtiers.tiers.build`): from a trusted snapshot
(:mod:`kvtiers.tiers.file.snapshot`), else by one walk of the fan-out directories, several
at a time, in child processes (``walk_processes``, two; its per-entry objects never enter this
process, :mod:`kvtiers.tiers.file.walk`), that both removes stale temp files of
interrupted publishes (older than this opening) and finds the chunks — names and places
parsed as :func:`~kvtiers.filemapper.scan_namespace` does, sizes and mtimes from ``stat``
(never opening a file), recency seeded from mtimes; with ``background_index`` the walk
takes names only (no ``stat``; chunks at the largest blob's size, in name order) and a
stat pass refines sizes and order afterwards: in the walking child processes, which go on
to ``lstat`` the chunks they named, else on a thread of this process
(:meth:`FileTierManager._merge_names`, docs/architecture.md). The constructor waits for
the build unless
``background_index`` (and then still when the namespace has no fan-out directory, so
nothing to find, and ``capacity_scope`` is the namespace's); until it is merged, index
misses are probed as in a shared directory, and keys dropped meanwhile stay dropped
(docs/architecture.md).

The index is a :class:`~kvtiers.tiers.compact.CompactChunkIndex` (size, state, pins in LRU
order, packed) and probes are booked in a :class:`~kvtiers.tiers.probe.ProbeBook`.
Invariants:

- ``usage`` is the sum of the entries' sizes: reserved keys count at the largest blob
  (``HEADER_BYTES + geometry.max_chunk_bytes``; managers never decode a key's group),
  rebuilt ones and shared-directory probe hits at their file size; with a ``capacity`` it
  never exceeds it (probe hits evict like stores do), so once a store completes the tier
  is within capacity;
- ``prepare_store`` evicts least recently used ready, unpinned chunks to make room, or
  returns ``None`` and changes nothing;
- the scheduler thread never does file I/O: evicted files are unlinked on a one-thread
  deleter executor (dropped from the index at once), shared-directory existence probes
  run as batches on a one-thread probe executor, a shared directory's background listing
  (``list_interval_s``, :mod:`kvtiers.tiers.listing`) and its summary run on a thread of
  their own, and movers report corrupt or vanished
  chunks through :meth:`forget`, a thread-safe queue drained on the next
  scheduler-thread call;
- a key whose load failed otherwise is a ``MISS`` while its
  :class:`~kvtiers.tiers.backoff.LoadBackoff` says so, and is forgotten (counted in
  ``unreadable_chunks``) after lasting failures, so no lookup answers ``HIT`` for a chunk
  that fails every time.

A cascade that finds the disk full (the :class:`~kvtiers.tiers.file.space.SpaceLatch` begins
an episode) makes room once per episode: :data:`ROOM_CHUNKS` least recently used chunks
(or more, as many as the episode refused) are evicted, stores are refused until their files
are unlinked, then one store tries at once; if it fails too, the latch keeps the tier full
as before.

With ``capacity_scope="root"`` the capacity is one budget for every namespace under the
root (other identities, old configurations): at start the other namespaces' chunk files
are measured (one walk, ``stat`` only) and held as *foreign* chunks, least recently used
namespace first (by its newest chunk), oldest chunk first within one. Foreign bytes count
against the budget and go before this namespace's own chunks whenever room is needed:
at start if the root is over budget, then by each ``prepare_store`` that needs room. The
budget is settled by the namespaces that open; ones that keep writing meanwhile are
trimmed when the next namespace opens. A foreign chunk's bytes count as freed when its
unlink is queued; one whose unlink fails counts again once the deleter says so (checked at
each store and step end), and the tier comes back within the budget (this namespace's
chunks being written or loaded then give way once they can). A directory it cannot
measure is named in one warning at start.

An eviction whose unlink is still queued when the same key is stored again is cancelled;
one whose unlink is running makes that store return ``None`` (try again later), so the
deleter can never remove a freshly published file and the scheduler never waits on it.
If that store fails, the old file's eviction stands (unlinked, or handed over again).

Above a ``write: back`` tier the composite calls :meth:`FileTierManager.hand_over_evictions`
(docs/architecture.md, "Placement"): from then on every chunk evicted after start-up — by
a store that needs room, by a probe hit over capacity, by a full disk — leaves the index
at once but keeps its file until the composite has read it for the tier below and calls
``release_evicted`` (a full-disk episode's stores wait for those unlinks as for the
others). Chunks beyond capacity at start-up are deleted as before: no composite holds the
tier yet. A handed-over key stored again is the tier's own again, and releasing it deletes
nothing; a probe never indexes a handed-over file. With ``wanted_only`` only the chunks
marked by :meth:`FileTierManager.want_evictions` are handed over (a frequency-admitting
tier below); the mark lives and dies with the index entry.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Literal

import numpy as np

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
)
from kvtiers.core.publish import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, publish_bytes
from kvtiers.core.specs import FileLoadStoreSpec
from kvtiers.errors import UnknownKeyError
from kvtiers.filemapper import (
    QUARANTINE_DIR,
    FileMapper,
    key_from_chunk_name,
    open_namespace,
    scan_namespace,
)
from kvtiers.filemapper.manifest import MANIFEST_NAME
from kvtiers.filemapper.summary import SUMMARY_NAME
from kvtiers.tiers.backoff import DEFAULT_BACKOFF, BackoffSettings, LoadBackoff, MoverReports
from kvtiers.tiers.build import IndexBuild
from kvtiers.tiers.compact import CompactChunkIndex, PackedChunks, stable_order
from kvtiers.tiers.file.io import IO_POSIX
from kvtiers.tiers.file.snapshot import (
    current_generation,
    open_generation,
    read_snapshot,
    write_snapshot,
)
from kvtiers.tiers.file.space import SpaceLatch
from kvtiers.tiers.file.walk import (
    DEFAULT_WALK_PROCESSES,
    DEFAULT_WALK_THREADS,
    ChildStats,
    Walked,
    stat_chunks,
    walk_in_children,
    walk_namespace,
)
from kvtiers.tiers.iopool import background_initializer
from kvtiers.tiers.listing import ListingSettings
from kvtiers.tiers.persistent import PersistentTierManager
from kvtiers.tiers.probe import DEFAULT_NEGATIVE_TTL_S, ProbeBook

logger = logging.getLogger(__name__)

#: On a shared directory, temp files younger than this may belong to a live writer.
SHARED_TEMP_AGE_S = 3600.0
#: Chunks evicted to make room when a cascade finds the disk full (at least).
ROOM_CHUNKS = 16


class _Deleter:
    """Unlinks evicted chunk files on a one-thread executor, off the scheduler thread.

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
        self._lock = threading.Lock()
        # Queued unlinks per path; a cancelled path's count is dropped, so they skip it.
        self._pending: dict[Path, int] = {}
        self._running: Path | None = None
        #: With ``record`` set, the paths unlinked since the owner last took them
        #: (:meth:`take_unlinked`; a shared namespace's listing needs them).
        self.record = False
        self._unlinked: list[Path] = []
        #: Unlinks that failed (their files stay, unindexed: a snapshot would lose them).
        self.failures = 0
        self._futures: list[Future[bool]] = []
        # Deletion is write-behind: below the engine's priority (kvtiers.tiers.iopool).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtiers-file-deleter",
                                        initializer=background_initializer())

    def delete(self, paths: Iterable[Path]) -> list[Future[bool]]:
        """Queue unlinks of ``paths``; their futures, done once each unlink ran: False when
        the file could not be removed (it is still there), True otherwise."""
        paths = list(paths)
        with self._lock:
            for path in paths:
                self._pending[path] = self._pending.get(path, 0) + 1
        self._futures = [f for f in self._futures if not f.done()]
        batch = [self._pool.submit(self._unlink_one, path) for path in paths]
        self._futures.extend(batch)
        return batch

    def cancel_keys(
        self, keys: Iterable[OffloadKey], held: Container[OffloadKey],
        path: Callable[[OffloadKey], Path],
    ) -> list[Path] | None:
        """:meth:`cancel` of the paths of ``keys`` not in ``held``. With no unlink queued or
        running nothing can be cancelled, and no path is worked out: a store of new keys
        then costs the scheduler no path per key. Only the thread that queues unlinks
        calls this, so none is queued between the check and the stores it guards."""
        with self._lock:
            if not self._pending and self._running is None:
                return []
        return self.cancel({path(key) for key in keys if key not in held})

    def cancel(self, paths: Collection[Path]) -> list[Path] | None:
        """Keep ``paths``: their queued unlinks are skipped (the names are about to be
        reused); returns the paths that had some, to :meth:`delete` again if the names
        are not reused after all. ``None``, changing nothing, while one of them is being
        unlinked: a file published under that name now could be removed by it."""
        with self._lock:
            if self._running is not None and self._running in paths:
                return None
            return [path for path in paths if self._pending.pop(path, None)]

    def wait(self) -> None:
        """Block until every queued unlink has run."""
        wait(list(self._futures))

    def queued(self, path: Path) -> bool:
        """Whether an unlink of ``path`` is queued or running."""
        with self._lock:
            return path in self._pending or self._running == path

    def take_unlinked(self) -> list[Path]:
        """The paths unlinked (or found gone) since the last call, with ``record`` set."""
        with self._lock:
            taken, self._unlinked = self._unlinked, []
        return taken

    def close(self) -> None:
        """Run the queued unlinks and stop the executor. Idempotent."""
        self.gate.set()
        self._pool.shutdown(wait=True)

    def _unlink_one(self, path: Path) -> bool:
        self.gate.wait()
        with self._lock:
            count = self._pending.get(path, 0)
            if not count:
                return True  # cancelled: the name is reused
            if count == 1:
                del self._pending[path]
            else:
                self._pending[path] = count - 1
            # Taken with the pending count, so cancel() either skipped it or sees it.
            self._running = path
        gone = True
        try:
            self._unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("file tier: could not remove evicted chunk %s: %s", path, exc)
            self.failures += 1
            gone = False
        finally:
            with self._lock:
                self._running = None
                if self.record and gone:
                    self._unlinked.append(path)
        return gone


class _Unlinking:
    """The keys whose files a file tier is unlinking, as a container the listing tests."""

    __slots__ = ("_manager",)

    def __init__(self, manager: FileTierManager) -> None:
        self._manager = manager

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._manager.unlinking(OffloadKey(key))


class _Prober:
    """Batched existence checks (``os.stat``) for a shared directory, one batch at a time
    on a one-thread executor."""

    def __init__(self, mapper: FileMapper) -> None:
        self._mapper = mapper
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtiers-file-prober")
        self._batches: list[Future[list[tuple[OffloadKey, int | None]]]] = []
        self._closed = False

    @property
    def busy(self) -> bool:
        return bool(self._batches) and not self._batches[-1].done()

    def submit(self, keys: list[OffloadKey]) -> bool:
        """Start probing ``keys``; False while the previous batch still runs."""
        if self.busy or self._closed:
            return False
        self._batches.append(self._pool.submit(self._probe, keys))
        return True

    def take_results(self) -> list[tuple[OffloadKey, int | None]]:
        """``(key, file size or None)`` for every key of the batches done since the last
        call."""
        results: list[tuple[OffloadKey, int | None]] = []
        running = []
        for batch in self._batches:
            if batch.done():
                results.extend(batch.result())
            else:
                running.append(batch)
        self._batches = running
        return results

    def wait(self) -> None:
        wait(list(self._batches))

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _probe(self, keys: list[OffloadKey]) -> list[tuple[OffloadKey, int | None]]:
        found: list[tuple[OffloadKey, int | None]] = []
        for key in keys:
            try:
                found.append((key, os.stat(self._mapper.path(key)).st_size))
            except OSError:
                found.append((key, None))
        return found


class _Foreign:
    """Other namespaces' chunk files under the root, in the order they are given up:
    least recently used namespace first, oldest chunk first within one. ``unreadable``:
    each directory under the root that could not be measured (in whole or in part), with
    the error; their unmeasured chunks count against nothing."""

    def __init__(self, root: Path, own: str) -> None:
        self.usage = 0
        self._chunks: list[tuple[Path, int]] = []
        self.unreadable: list[tuple[str, OSError]] = []
        namespaces = []
        try:
            with os.scandir(root) as it:
                candidates = [e for e in it if e.name != own and e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            self.unreadable.append((str(root), exc))
            candidates = []
        for entry in candidates:
            try:
                os.stat(os.path.join(entry.path, MANIFEST_NAME))
            except (FileNotFoundError, NotADirectoryError):
                continue  # not a namespace
            except OSError as exc:
                self.unreadable.append((entry.path, exc))
                continue
            files, error = _chunk_files(entry.path)
            if error is not None:
                self.unreadable.append((entry.path, error))
            newest = max((mtime for mtime, _, _ in files), default=0.0)
            namespaces.append((newest, entry.name, sorted(files)))
        for _, _, files in sorted(namespaces):
            for _, path, size in files:
                self._chunks.append((Path(path), size))
                self.usage += size
        self._next = 0

    def take(self, nbytes: int) -> list[tuple[Path, int]]:
        """The next chunks to give up, with their sizes, freeing at least ``nbytes`` (or
        all that are left); their bytes no longer count in :attr:`usage`."""
        taken = []
        freed = 0
        chunks = self._chunks
        while freed < nbytes and self._next < len(chunks):
            path, size = chunks[self._next]
            self._next += 1
            taken.append((path, size))
            freed += size
        self.usage -= freed
        return taken


def _chunk_files(namespace_dir: str) -> tuple[list[tuple[float, str, int]], OSError | None]:
    """``(mtime, path, size)`` of the regular chunk files of one namespace directory, and
    the error of an unreadable directory that stopped the walk (the files are those found
    before it), or ``None``."""
    found = []
    try:
        for item in scan_namespace(Path(namespace_dir)):
            if item.chunk_key() is None:
                continue
            try:
                st = item.entry.stat(follow_symlinks=False)
            except OSError:  # gone since the walk listed it
                continue
            if stat.S_ISREG(st.st_mode):
                found.append((st.st_mtime, item.entry.path, st.st_size))
    except OSError as exc:
        return found, exc
    return found, None


def _has_subdirectory(directory: Path) -> bool:
    """Whether ``directory`` holds a directory (or cannot be listed: assume it does)."""
    try:
        with os.scandir(directory) as it:
            return any(entry.is_dir(follow_symlinks=False) for entry in it)
    except OSError:
        return True


class FileTierManager(PersistentTierManager[tuple[Walked, _Foreign | None]]):
    """Bookkeeping of the chunk files of one namespace; see the module docstring.

    ``capacity_bytes`` ``None`` means bounded only by the filesystem. ``shared``: other
    engines write into the same namespace, so an index miss is checked on disk by a
    background probe (``RETRY`` until it answers; a "not there" answer is trusted for
    ``negative_ttl_s``). ``io_backend`` is the numeric code of the I/O path in use
    (reported in stats). ``clock`` is injectable for tests.
    ``space`` (:class:`~kvtiers.tiers.file.space.SpaceLatch`): while it does not admit
    (read-only root, full disk) ``prepare_store`` answers ``None``. ``load_backoff``: how
    long a key whose load failed is a miss (see :mod:`kvtiers.tiers.backoff`).
    ``capacity_scope``: ``"namespace"`` (the capacity is this namespace's) or ``"root"``
    (one budget for every namespace under the root; see the module docstring), which
    needs a ``capacity_bytes``. ``names_first`` (with ``background_index`` and
    ``capacity_scope="namespace"``): a walk takes names only and stats them afterwards
    (module docstring); ``before_stat_pass`` runs on the stat pass's thread before it
    begins (tests hold it there).

    ``get_stats``: ``hits``, ``misses``, ``stores``, ``store_failures``, ``evictions``,
    ``loads``, ``chunks``, ``usage_bytes``, ``capacity_bytes`` (0 when unbounded),
    ``corrupt_chunks`` and ``vanished_chunks`` (reported by movers), ``load_failures``
    (failed loads reported by movers), ``unreadable_chunks`` (keys forgotten after lasting
    load failures), ``backing_off`` (keys with a failure record), ``probes`` and
    ``probe_hits`` (shared directories), ``stat_dropped`` (entries the stat pass after a
    names-only walk dropped: gone, not regular, or larger than any chunk) and
    ``io_backend`` (see :mod:`.io`'s ``IO_*`` codes; the name is in
    :attr:`io_backend_name`); with a ``listing`` also the
    listing's (:meth:`~kvtiers.tiers.listing.SharedListing.stats`).
    """

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
        negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        space: SpaceLatch | None = None,
        load_backoff: BackoffSettings = DEFAULT_BACKOFF,
        capacity_scope: Literal["namespace", "root"] = "namespace",
        listing: ListingSettings | None = None,
        background_index: bool = False,
        walk_threads: int = DEFAULT_WALK_THREADS,
        walk_processes: int = DEFAULT_WALK_PROCESSES,
        snapshot: bool = True,
        before_walk_part: Callable[[int], None] | None = None,
        names_first: bool = True,
        before_stat_pass: Callable[[], None] | None = None,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if capacity_scope not in ("namespace", "root"):
            raise ValueError(
                f"capacity_scope must be 'namespace' or 'root', got {capacity_scope!r}"
            )
        if capacity_scope == "root" and capacity_bytes is None:
            raise ValueError("capacity_scope 'root' shares a capacity; give capacity_bytes")
        if listing is not None and not shared:
            raise ValueError("a namespace listing is for shared directories; set shared")
        self.mapper = mapper
        self.geometry = geometry
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.io_backend = io_backend
        self.io_backend_name = io_backend_name
        self.reserve_bytes = HEADER_BYTES + geometry.max_chunk_bytes
        self._space = space
        self.namespace_dir = open_namespace(
            mapper.root, mapper.identity, file_mode=file_mode, dir_mode=dir_mode
        )
        self.quarantine_dir = self.namespace_dir / QUARANTINE_DIR
        self.index = CompactChunkIndex(
            capacity_bytes, tier=f"the file tier at {self.namespace_dir}", medium=self.medium,
            locality=self.locality,
        )
        self.backoff = LoadBackoff(
            tier=f"file tier at {self.namespace_dir}", base_s=load_backoff.base_s,
            max_s=load_backoff.max_s, clock=clock,
        )
        self._reports = MoverReports(self.backoff)
        self._reported_lock = threading.Lock()
        self._reported = {"corrupt_chunks": 0, "vanished_chunks": 0}
        self._probe_hits = 0
        self._deleter = _Deleter()
        # Evictions handed to the composite (hand_over_evictions): key → its file, kept
        # until released, and the keys not yet taken; the full-disk episode's handed keys.
        self._handing = False
        # With wanted_only: only the chunks marked by want_evictions (kept while indexed).
        self._wanted_only = False
        self._wanted: set[OffloadKey] = set()
        self._handed: dict[OffloadKey, Path] = {}
        self._fresh: list[OffloadKey] = []
        self._room_keys: set[OffloadKey] = set()
        # Keys being stored whose evicted chunk's file was kept for the store to take its
        # name: True for a handed-over one, False for one whose unlink was cancelled.
        self._revived: dict[OffloadKey, bool] = {}
        # Index misses are probed in a shared directory, and in any while the index is built.
        self._prober = _Prober(mapper)
        self._probes = ProbeBook(negative_ttl_s=negative_ttl_s, clock=clock)
        self._closed = False
        # The latch's episode this manager last made room for, and the unlinks of the
        # chunks it evicted then (stores wait for them before one tries again).
        self._room_for = 0
        self._room_unlinks: list[Future[bool]] = []
        # capacity_scope "root": the other namespaces' chunks, and the unlinks of those
        # given up with the bytes each frees.
        self._foreign: _Foreign | None = None
        self._foreign_unlinks: list[tuple[Future[bool], int]] = []
        start = time.perf_counter()
        # Start-up (module docstring): the index is built on a thread of its own; until it
        # is merged, index misses are probed. Temp files are removed when older than this
        # opening (by the filesystem's clock, which stamps this tier's own temp files too),
        # or than SHARED_TEMP_AGE_S in a shared directory: this tier's own publishes begin
        # while the walk runs. Every opening counts (its chunks make older snapshots stale).
        self.unindexed_entries = 0
        self.index_source = "walk"
        self.index_build_s: float | None = None
        self._complete = False
        self._cleared = False  # clear() while the index is built
        self._capacity_scope = capacity_scope
        # The names-only walk (module docstring): its stat pass, the capacity it holds
        # back while the assumed sizes stand, and what the stat pass dropped.
        self._names_first = names_first and background_index and capacity_scope == "namespace"
        self._before_stat = before_stat_pass
        self._stat_pass: IndexBuild[tuple[np.ndarray, np.ndarray] | None] | None = None
        self._held_capacity: int | None = None
        self.stat_dropped = 0
        self.stat_pass_s: float | None = None
        opened = open_generation(self.namespace_dir)
        # Snapshots only where this tier is the namespace's one writer (not shared): other
        # writers' chunks and temp files would be missed until a walk.
        self._generation = None if opened is None or not snapshot or shared else opened[0]
        opened_at = time.time() if opened is None else opened[1]
        self.index.removed = set()
        temp_cutoff = opened_at - SHARED_TEMP_AGE_S if shared else opened_at
        self._build: IndexBuild[tuple[Walked, _Foreign | None]] | None = IndexBuild(
            lambda build: self._find_chunks(
                build, temp_cutoff, walk_threads, walk_processes, before_walk_part
            ),
            name="kvtiers-file-index",
        )
        if not background_index or (capacity_scope == "namespace"
                                    and not _has_subdirectory(self.namespace_dir)):
            # Without a fan-out directory there is no chunk to find: a new namespace's
            # tier answers from its first lookup instead of probing.
            self._build.done.wait()
            self._poll_build()
        self.rebuild_s = time.perf_counter() - start
        self._file_mode, self._dir_mode = file_mode, dir_mode
        self._start_listing(listing, namespace_digest=mapper.identity.digest,
                            where=f"file tier {self.namespace_dir}", clock=clock)
        if self.listing is not None:
            self._deleter.record = True
        # Events the listing observed before a comparison, for the next take_events.
        self._observed: list[OffloadingEvent] = []

    @property
    def usage_bytes(self) -> int:
        """Bytes the indexed chunks take or have reserved."""
        return self.index.usage

    # -- start-up -------------------------------------------------------------------
    def _find_chunks(
        self,
        build: IndexBuild[tuple[Walked, _Foreign | None]],
        temp_cutoff: float,
        threads: int,
        processes: int,
        before_part: Callable[[int], None] | None,
    ) -> tuple[Walked, _Foreign | None]:
        """The build's work (its own thread): the chunks of a trusted snapshot, else of a
        walk — in ``processes`` child processes, or in this one when that is 0, when a
        ``before_part`` hook is given (tests) or when the children fail; with
        ``capacity_scope="root"`` the other namespaces measured."""
        walked = None
        if self._generation is not None:
            found = read_snapshot(
                self.namespace_dir, self.mapper.identity.digest, self._generation
            )
            if found is not None:
                walked = Walked(found)
                self.index_source = "snapshot"
        assume = self.reserve_bytes if self._names_first else None
        if walked is None and processes > 0 and before_part is None:
            walked = walk_in_children(
                self.namespace_dir, build, temp_cutoff=temp_cutoff, threads=threads,
                processes=processes, assume_size=assume,
            )
            if walked is None and not build.stopping:
                logger.warning("file tier %s: walking in this process instead",
                               self.namespace_dir)
        if walked is None:
            walked = walk_namespace(
                self.namespace_dir, build, temp_cutoff=temp_cutoff, threads=threads,
                before_part=before_part, assume_size=assume,
            )
        foreign = None
        if self._capacity_scope == "root" and not build.stopping:
            foreign = _Foreign(self.mapper.root, self.namespace_dir.name)
        return walked, foreign

    def _merge_build(
        self, result: tuple[Walked, _Foreign | None], gone: set[OffloadKey]
    ) -> None:
        walked, foreign = result
        index = self.index
        stats = walked.stats
        walked.stats = None
        if stats is not None and (self._cleared or not len(walked.packed)):
            stats.close()  # nothing to stat
            stats = None
        if self._cleared:
            # Cleared while the walk ran: what it found goes, except what was stored since.
            self._delete([key for key in walked.packed.keys if key not in index])
            walked.packed = PackedChunks.pack([], [])
        # Chunks found at start are least recently used, by mtime; beyond capacity the
        # oldest go. What was stored, found or removed meanwhile stands.
        if walked.names_only and len(walked.packed):
            self._merge_names(walked.packed, gone, stats)
        else:
            self._delete(index.merge_oldest(walked.packed, gone).victims)
        self.unindexed_entries = walked.unindexed
        if foreign is not None and self.capacity_bytes is not None:
            self._share_root(self.capacity_bytes, foreign)
        if walked.removed_temps:
            logger.info("file tier %s: removed %d stale temp files", self.namespace_dir,
                        walked.removed_temps)
        if self.unindexed_entries:
            logger.warning(
                "file tier %s: %d entries named like chunks are not regular files and were "
                "not indexed; `kvtiers verify` lists them", self.namespace_dir,
                self.unindexed_entries,
            )
        logger.info(
            "file tier %s: %d chunks (%d bytes) indexed from a %s in %.3f s",
            self.namespace_dir, len(walked.packed), self.index.usage, self.index_source,
            self.index_build_s or 0.0,
        )

    def _merge_names(
        self, packed: PackedChunks, gone: set[OffloadKey], children: ChildStats | None,
    ) -> None:
        """Take a names-only walk in (module docstring) and start its stat pass: the
        walking children's (``children``, collected on a thread), else ``lstat`` on a
        thread of this process (and when the children's fails). The
        chunks count at the largest blob's size, which a chunk's file never exceeds, so
        ``usage`` is not below the truth; nothing is evicted on that estimate (it could
        delete chunks that fit): the capacity is held at the estimate's usage, never
        above the configured one plus what the namespace already holds, until the stat
        pass gives the true sizes and the configured capacity back."""
        index = self.index
        capacity = index.capacity
        index.capacity = None
        index.merge_oldest(packed, gone, unverified=True)
        # No eviction happened (no capacity): the announcement is what merge_oldest
        # recorded, taken with the next take_events.
        if capacity is not None:
            self._held_capacity = capacity
            index.capacity = max(capacity, index.usage)
        keys = packed.keys
        namespace_dir, before = self.namespace_dir, self._before_stat

        def stat_pass(build: IndexBuild[tuple[np.ndarray, np.ndarray] | None]
                      ) -> tuple[np.ndarray, np.ndarray] | None:
            if children is not None:
                build.on_stop(children.close)
            if before is not None:
                before()
            found = None
            if children is not None:
                answer = children.collect()
                if build.stopping:
                    return None
                if isinstance(answer, str):
                    logger.warning("file tier %s: the walk's processes' stat pass failed "
                                   "(%s); stat-ing in this process instead", namespace_dir,
                                   answer)
                else:
                    found = answer
            if found is None:
                found = stat_chunks(namespace_dir, keys, lambda: build.stopping)
            # The mtime order made here, off the scheduler's thread.
            return None if found is None else (found[0], stable_order(found[1]))

        self._stat_pass = IndexBuild(stat_pass, name="kvtiers-file-stat")

    def _poll_stat_pass(self) -> None:
        """Take the stat pass in once it is done (scheduler thread; O(1) until then):
        sizes and mtime order refined, entries that are no chunk file dropped, the
        configured capacity back (least recently used chunks evicted down to it)."""
        stat_pass = self._stat_pass
        if stat_pass is None or not stat_pass.done.is_set():
            return
        self._stat_pass = None
        index = self.index
        if stat_pass.error is not None or stat_pass.result is None:
            if stat_pass.error is not None:
                logger.error("file tier %s: the stat pass failed (%s); chunks keep their "
                             "assumed sizes", self.namespace_dir, stat_pass.error)
            # The entries stay unverified: no snapshot will take their assumed sizes.
            self._restore_capacity()
            return
        sizes, by_mtime = stat_pass.result
        dropped = index.refine_unverified(sizes, by_mtime, self.reserve_bytes)
        self._release_due = 1
        self.stat_dropped += len(dropped)
        self.stat_pass_s = stat_pass.elapsed_s
        self._unwant(dropped)
        if dropped:
            logger.warning(
                "file tier %s: %d entries named like chunks are not chunk files (not regular, "
                "gone, or larger than any chunk) and were dropped from the index; `kvtiers "
                "verify` lists them", self.namespace_dir, len(dropped),
            )
        self._restore_capacity()

    def _restore_capacity(self) -> None:
        held = self._held_capacity
        if held is None:
            return
        self._held_capacity = None
        index = self.index
        index.capacity = held
        if index.usage > held:
            self._delete(index.evict_lru(index.usage - held))

    def _share_root(self, capacity: int, foreign: _Foreign) -> None:
        """Given the other namespaces under the root (measured by the build), trim them
        to the shared budget and give this namespace's index what is left."""
        if foreign.unreadable:
            where, error = foreign.unreadable[0]
            logger.warning(
                "file tier %s: capacity_scope root could not measure %d director%s under "
                "the root (%s: %s); chunks there count against no capacity and are never "
                "removed: make them readable by this process, or remove them",
                self.namespace_dir, len(foreign.unreadable),
                "y" if len(foreign.unreadable) == 1 else "ies", where, error.strerror or error,
            )
        self._foreign = foreign
        over = self.index.usage + foreign.usage - capacity
        self.index.capacity = capacity - foreign.usage
        if over > 0:
            count = self._give_up_foreign(over)
            logger.info(
                "file tier %s: the root is over its shared capacity; removing %d chunks of "
                "other namespaces, least recently used first", self.namespace_dir, count,
            )

    def _give_up_foreign(self, nbytes: int) -> int:
        """Unlink other namespaces' chunks freeing at least ``nbytes`` (or all that are
        left), their bytes added to this namespace's share now; how many. An unlink that
        fails takes its bytes back (:meth:`_keep_budget`)."""
        assert self._foreign is not None and self.index.capacity is not None
        taken = self._foreign.take(nbytes)
        unlinks = self._deleter.delete(path for path, _ in taken)
        for (_, size), unlink in zip(taken, unlinks, strict=True):
            self._foreign_unlinks.append((unlink, size))
            self.index.capacity += size
        return len(taken)

    def _keep_budget(self) -> None:
        """Count the foreign chunks whose unlinks failed as there again (their bytes leave
        this namespace's share) and come back within the budget: other namespaces'
        chunks first, then this one's least recently used."""
        failed = 0
        running = []
        for unlink, size in self._foreign_unlinks:
            if not unlink.done():
                running.append((unlink, size))
            elif not unlink.result():
                failed += size
        self._foreign_unlinks = running
        foreign = self._foreign
        index = self.index
        assert foreign is not None and index.capacity is not None
        if failed:
            foreign.usage += failed
            index.capacity -= failed
            over = index.usage - index.capacity
            if over > 0:
                self._give_up_foreign(over)
        # Checked whether or not an unlink failed just now: chunks that were being written
        # or loaded when one did could not give way then, and must once they can.
        over = index.usage - index.capacity
        if over > 0:
            self._delete(index.evict_lru(over))

    def _room_from_foreign(self, keys: Collection[OffloadKey]) -> None:
        """Give up other namespaces' chunks before this namespace's own for a store."""
        if self._foreign is None:
            return
        self._keep_budget()
        if not self._foreign.usage:
            return
        index = self.index
        assert index.capacity is not None
        need = len({key for key in keys if key not in index}) * self.reserve_bytes
        short = index.usage + need - index.capacity
        if short > 0:
            self._give_up_foreign(short)

    # -- the mover's side channel ---------------------------------------------------
    def forget(self, keys: Collection[OffloadKey], *, corrupt: bool) -> None:
        """Thread-safe: these chunks' files are gone (``corrupt``: they failed verification
        and were quarantined or removed; otherwise they vanished from disk). Counted at
        once; the index drops them on its next scheduler-thread call once unpinned."""
        with self._reported_lock:
            self._reported["corrupt_chunks" if corrupt else "vanished_chunks"] += len(keys)
        self._reports.forget(keys)

    def _drain_forgotten(self) -> None:
        if self._build is not None:
            self._poll_build()
        if self._stat_pass is not None:
            self._poll_stat_pass()
        reported = self._reports.drain()
        if reported:
            self._unwant(self.index.discard(reported))

    def _unwant(self, gone: Iterable[OffloadKey]) -> None:
        """These keys left the index otherwise than by eviction: their marks go too."""
        if self._wanted:
            self._wanted.difference_update(gone)

    # -- lookup ---------------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._drain_forgotten()
        if self.backoff.blocked(key):
            self.index.count_miss()
            return LookupResult.MISS
        index = self.index
        if (self.shared or not self._complete) and key not in index:
            self._take_probe_results()
            if key not in index:
                if self._probes.known_absent(key):
                    index.count_miss()
                    return LookupResult.MISS
                return LookupResult.RETRY
        return index.lookup(key)

    def _take_probe_results(self) -> None:
        results = self._prober.take_results()
        if not results:
            return
        # Never index a handed-over file, nor one removed while the index is built (its
        # unlink may not have run when the probe looked).
        removed = self.index.removed or ()
        found = [(key, size) for key, size in self._probes.answered(results)
                 if key not in self._handed and key not in removed]
        change = self.index.add_ready(found)
        self._probe_hits += len(change.keys)
        self._delete(change.victims)

    def _flush_probes(self) -> None:
        self._take_probe_results()
        if self._prober.busy:
            return
        batch = self._probes.take_batch()
        if batch:
            started = self._prober.submit(batch)
            assert started, "the prober is idle and open"

    def wait_probes(self) -> None:
        """Block until the probe batch in flight (if any) has answered. For tests and
        tools: the scheduler never blocks."""
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
        if self._space is not None and not self._space_admits(self._space):
            return None  # read-only, or full until the latch lets one store try again
        index = self.index
        path = self.mapper.path
        cancelled = self._deleter.cancel_keys(keys, index, path)
        if cancelled is None:
            # The evicted file of one of these keys is being unlinked right now; waiting
            # for it would stall the scheduler on I/O, so the store is refused for now.
            return None
        self._room_from_foreign(keys)
        change = index.reserve(keys, self.reserve_bytes)
        if change is None:
            # The names are not reused after all: their old files still go.
            self._deleter.delete(cancelled)
            return None
        self._delete(change.victims)
        if cancelled:
            kept = set(cancelled)
            for key in change.keys:
                if path(key) in kept:
                    self._revived[key] = False
        if self._handed:
            for key in change.keys:
                # Stored anew: its name is the tier's again, never deleted at release.
                if self._handed.pop(key, None) is not None:
                    self._revived[key] = True
        for key in change.keys:
            self._probes.stored(key)
        return change.keys

    def _space_admits(self, space: SpaceLatch) -> bool:
        """The latch's answer, after making room once per full-disk episode."""
        if space.full and space.wants_room and space.episodes != self._room_for:
            self._room_for = space.episodes
            need = max(ROOM_CHUNKS, space.refused_chunks) * self.reserve_bytes
            victims = self.index.evict_lru(need)
            if victims:
                logger.info(
                    "file tier %s: the disk is full; evicted %d least recently used chunks "
                    "to make room", self.namespace_dir, len(victims),
                )
                self._room_unlinks = self._delete(victims)
                # Handed over: their unlinks start when the composite releases them.
                self._room_keys = {key for key in victims if key in self._handed}
        if self._room_keys:
            # Handed over: their unlinks start when the composite releases them.
            self._room_keys.intersection_update(self._handed)
            if self._room_keys:
                return False
        if self._room_unlinks:
            if not all(f.done() for f in self._room_unlinks):
                return False
            self._room_unlinks = []
            space.retry_now()
        return space.admits()

    def _delete(self, victims: list[OffloadKey]) -> list[Future[bool]]:
        """Evicted chunks' files: kept for the composite when it takes them over (all of
        them, or the wanted ones), unlinked otherwise; the unlinks started."""
        if not victims:
            return []
        path = self.mapper.path
        if self._handing:
            wanted = self._wanted
            doomed = []
            for key in victims:
                if not self._wanted_only or key in wanted:
                    self._handed[key] = path(key)
                    self._fresh.append(key)
                else:
                    doomed.append(key)
                wanted.discard(key)
            victims = doomed
        return self._deleter.delete(path(key) for key in victims)

    # -- evictions handed to the composite (core.primary.HandingTier) -----------------
    def hand_over_evictions(self, wanted_only: bool = False) -> None:
        """From now on, keep evicted chunks' files for the composite (module docstring):
        every one, or with ``wanted_only`` those marked by :meth:`want_evictions`."""
        self._handing = True
        self._wanted_only = wanted_only

    def want_evictions(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Mark the chunks of ``keys`` the index holds to be handed over at eviction; the
        keys it does not hold."""
        index = self.index
        absent = []
        for key in keys:
            if key in index:
                self._wanted.add(key)
            else:
                absent.append(key)
        return absent

    def take_evicted(self) -> list[OffloadKey]:
        """The chunks evicted since the last call whose files are kept for the caller."""
        fresh, self._fresh = self._fresh, []
        return [key for key in fresh if key in self._handed]

    def evicted_spec(self, keys: Sequence[OffloadKey]) -> FileLoadStoreSpec:
        """The files of handed-over chunks ``keys``, for the mover to read. Raises
        :class:`~kvtiers.errors.UnknownKeyError` for a key not handed over (or released)."""
        missing = [key.hex() for key in keys if key not in self._handed]
        if missing:
            raise UnknownKeyError(
                f"evicted_spec: keys {missing} were not evicted and handed over by the file "
                f"tier at {self.namespace_dir} (or were released already)"
            )
        return FileLoadStoreSpec([str(self._handed[key]) for key in keys], list(keys))

    def release_evicted(self, keys: Iterable[OffloadKey]) -> None:
        """Delete the files of handed-over ``keys`` (others are ignored)."""
        released = [key for key in dict.fromkeys(keys) if key in self._handed]
        if not released:
            return
        unlinks = self._deleter.delete([self._handed.pop(key) for key in released])
        if not self._room_keys.isdisjoint(released):
            # A full disk's stores wait for these unlinks as for the episode's others.
            self._room_unlinks.extend(unlinks)

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        # Persistent: a reset keeps every reservation, so every completion is current.
        done = self.index.finish(keys, success)
        if not success:
            self._unwant(done)
        if not self._revived:
            return
        for key in done:
            handed = self._revived.pop(key, None)
            if handed is None or success:
                continue
            # The store that took over an evicted chunk's name failed: that chunk's file
            # is still there, unindexed. Its eviction stands: handed over again, or
            # unlinked as it was going to be.
            if handed:
                self._handed[key] = self.mapper.path(key)
                self._fresh.append(key)
            else:
                self._deleter.delete([self.mapper.path(key)])

    # -- load -----------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.index.pin(keys)

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        self._drain_forgotten()
        self._unwant(self.index.unpin(keys))

    def get_spec(self, keys: Collection[OffloadKey]) -> FileLoadStoreSpec:
        self.index.require_addressable(keys)
        path = self.mapper.path
        return FileLoadStoreSpec([str(path(key)) for key in keys], list(keys))

    # -- the rest of the contract ---------------------------------------------------
    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.index.take_events()
        self._announcement_taken()
        if self.listing is None:
            return events
        observed, self._observed = self._observed, []
        observed.extend(self.listing.observe(events))
        return observed

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self._release_after_merge()
        self._drain_forgotten()
        self._flush_probes()
        if self._foreign is not None:
            self._keep_budget()
        if self.listing is not None and self._complete:
            # This step's removals and the unlinks finished since reach the listing before
            # it compares (the events wait for take_events); then this tier's keys:
            # indexed, evicted and kept for the composite, or being unlinked. While the
            # index is built the keys it lacks are not others' news.
            listing = self.listing
            self._observed.extend(listing.observe(self.index.take_events()))
            unlinked = self._deleter.take_unlinked()
            if unlinked:
                listing.deleted(key for key in map(self._own_key, unlinked) if key is not None)
            listing.on_schedule_end((self.index.keys(), self._handed, _Unlinking(self)))

    # -- the background listing (shared directories, kvtiers.tiers.listing) ----------
    def _own_key(self, path: Path) -> OffloadKey | None:
        """The key of a chunk file of this namespace; ``None`` for another's."""
        key = key_from_chunk_name(path.name)
        return key if key is not None and self.mapper.path(key) == path else None

    def unlinking(self, key: OffloadKey) -> bool:
        """Whether ``key``'s file is queued for unlinking or being unlinked."""
        return self._deleter.queued(self.mapper.path(key))

    def _listed_keys(self) -> Iterator[OffloadKey]:
        """The chunk files of the namespace (listing thread; names only, no ``stat``
        where the directory entry tells a regular file)."""
        for item in scan_namespace(self.namespace_dir):
            if item.is_temp:
                continue
            key = item.chunk_key()
            if key is not None and item.entry.is_file(follow_symlinks=False):
                yield key

    def _publish_summary(self, data: bytes) -> None:
        publish_bytes(
            self.namespace_dir / SUMMARY_NAME, [data], file_mode=self._file_mode,
            dir_mode=self._dir_mode, root=self.mapper.root,
        )

    def has_pending_work(self) -> bool:
        return self._probes.pending or self._prober.busy

    def clear(self) -> int:
        """Delete every chunk file of this namespace that no job is writing or reading
        (an operator's wipe, such as SGLang's ``clear``); returns how many indexed ones.
        Not counted as evictions. While the index is built, the chunks it finds are
        deleted when it is done instead of indexed."""
        self._drain_forgotten()
        victims = self.index.clear_ready()
        self._delete(victims)
        if not self._complete:
            self._cleared = True
        return len(victims)

    def get_stats(self) -> Mapping[str, float]:
        self._drain_forgotten()
        stats = self._shared_stats()
        with self._reported_lock:
            stats.update(self._reported)
        stats["probe_hits"] = self._probe_hits
        stats["stat_dropped"] = self.stat_dropped
        stats["io_backend"] = self.io_backend
        return stats

    @property
    def index_stat_done(self) -> bool:
        """Whether the index is complete and no stat pass is pending (sizes and the
        eviction order are the files')."""
        return self._complete and self._stat_pass is None

    def wait_index(self) -> None:
        """Block until the index is built and its stat pass (if any) taken in. For tests
        and tools: the scheduler never blocks."""
        super().wait_index()
        stat_pass = self._stat_pass
        if stat_pass is not None:
            stat_pass.done.wait()
            self._poll_stat_pass()

    def _close(self) -> None:
        if self._stat_pass is not None:
            self._stat_pass.stop()
            self._stat_pass = None
        self._prober.close()
        # Handed over and never released: nobody reads them any more.
        self._deleter.delete(self._handed.values())
        self._handed.clear()
        self._deleter.close()
        self._write_snapshot()

    def _write_snapshot(self) -> None:
        """At a clean shutdown, the snapshot of a complete index when no other tier opened
        the namespace since this one (:mod:`kvtiers.tiers.file.snapshot`). Not with
        chunks being stored (their files may land after it) or a failed unlink (a file
        would stay unindexed): the next start walks."""
        if self._generation is None or not self._complete:
            return
        index = self.index
        if index.unverified:
            return  # assumed sizes and name order: the next start walks
        if len(index) != index.ready_count or self._deleter.failures:
            return
        if current_generation(self.namespace_dir) != self._generation + 1:
            return
        width, key_bytes, lengths, sizes, count = index.export_ready()
        try:
            write_snapshot(
                self.namespace_dir, self.mapper.identity.digest, self._generation + 1, width,
                key_bytes, lengths, sizes, count, file_mode=self._file_mode,
                dir_mode=self._dir_mode, root=self.mapper.root,
            )
        except OSError as exc:
            logger.warning("file tier %s: index snapshot not written: %s", self.namespace_dir,
                           exc)
