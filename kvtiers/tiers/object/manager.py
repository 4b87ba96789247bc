"""The manager of an object tier (``s3``, ``fsspec``): an in-memory index of one namespace.

The index is rebuilt at start from paginated listings of the namespace (sizes, and
modification times as recency) — never a request per key — and kept in LRU order. The
listings run by fan-out prefix (``<namespace>/<hh>/``), several at once, on a thread of
their own (:mod:`kvtiers.tiers.build`); with ``background_index`` the tier serves
meanwhile, answering an index miss with a batched existence probe (``RETRY`` until it
answers) as a shared namespace does, and merges the listings' chunks under what it
indexed since once they are all in (docs/architecture.md, "Start-up"). It
never decodes a key's group: a reservation is accounted at ``HEADER_BYTES +
max_chunk_bytes``, a listed or probed object at its real size. With a ``capacity``
(bytes) the least recently used ready, unpinned chunks are dropped from the index at once
and their objects deleted on the I/O pool — to make room for a store (never evicting a key
of the same batch that is already present) or for chunks a probe found. A key whose
delete is still running is not stored again until the delete is done (``prepare_store``
answers ``None``), so a delete never removes a newer copy.

Everything here runs on the scheduler thread and never waits for I/O. Work finished on
I/O threads (deletes, existence probes, chunks the mover found corrupt or missing) comes
back through thread-safe queues drained at the start of the next call.

The index is a :class:`~kvtiers.tiers.compact.CompactChunkIndex`. ``shared: true`` is for
namespaces other engines write into: an index miss is booked in a
:class:`~kvtiers.tiers.probe.ProbeBook` for a batched existence probe (sent in
:meth:`on_schedule_end`) and answers ``RETRY`` until it resolves to ``HIT`` or ``MISS``;
negative answers are remembered for ``negative_ttl_s`` so a cold key is not probed every
step. With ``list_interval_s`` the namespace is also listed in the background, on a
thread of its own, to announce what other engines published (:mod:`kvtiers.tiers.listing`).

A key whose load failed (the mover's ``load_failed``) is a ``MISS`` while its
:class:`~kvtiers.tiers.backoff.LoadBackoff` says so and is forgotten after lasting
failures (counted in ``unreadable_chunks``): a server that is down costs one failed
promotion per key per back-off period, and the key is served again once it is back.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
)
from kvtiers.core.specs import ObjectLoadStoreSpec
from kvtiers.filemapper.summary import SUMMARY_NAME
from kvtiers.tiers.backoff import DEFAULT_BACKOFF, BackoffSettings, LoadBackoff, MoverReports
from kvtiers.tiers.build import IndexBuild
from kvtiers.tiers.compact import CompactChunkIndex, PackedChunks, sorted_rows, stable_order
from kvtiers.tiers.listing import ListingSettings
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.persistent import PersistentTierManager
from kvtiers.tiers.probe import DEFAULT_NEGATIVE_TTL_S, ProbeBook

logger = logging.getLogger(__name__)

#: Prefix listings running at once while the index is built.
DEFAULT_LIST_THREADS = 8


class ObjectTierManager(PersistentTierManager[PackedChunks]):
    """Bookkeeping of one namespace of an object store. See the module docstring.

    ``get_stats``: ``hits``, ``misses``, ``stores``, ``store_failures``, ``evictions``,
    ``loads``, ``probes``, ``forgotten`` (chunks dropped on a mover's report),
    ``vanished_chunks`` (reported missing), ``chunks``, ``usage_bytes``,
    ``capacity_bytes`` (0 when unbounded), ``corrupt_chunks``, ``retries``,
    ``load_failures``, ``unreadable_chunks`` and ``backing_off`` (see
    :mod:`kvtiers.tiers.backoff`, as ``load_backoff`` sets it); with a ``listing`` also
    the listing's (:meth:`~kvtiers.tiers.listing.SharedListing.stats`).
    """

    locality = Locality.REMOTE

    def __init__(
        self,
        backend: ObjectBackend,
        *,
        max_chunk_bytes: int,
        capacity_bytes: int | None = None,
        shared: bool = False,
        negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
        load_backoff: BackoffSettings = DEFAULT_BACKOFF,
        listing: ListingSettings | None = None,
        background_index: bool = False,
        list_threads: int = DEFAULT_LIST_THREADS,
        before_list_part: Callable[[int], None] | None = None,
    ) -> None:
        if listing is not None and not shared:
            raise ValueError("a namespace listing is for shared namespaces; set shared")
        self.backend = backend
        self.reserve_bytes = HEADER_BYTES + max_chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        where = backend.store.describe(backend.namespace_prefix)
        self.index = CompactChunkIndex(
            capacity_bytes, tier=f"the object tier at {where}", medium=self.medium,
            locality=self.locality,
        )
        # Index misses are probed in a shared namespace, and in any while the index is built.
        self._probes = ProbeBook(negative_ttl_s=negative_ttl_s, clock=clock)
        self.backoff = LoadBackoff(
            tier=f"object tier at {where}", base_s=load_backoff.base_s, max_s=load_backoff.max_s,
            clock=clock,
        )
        self._reports = MoverReports(self.backoff)
        # Filled on I/O threads, drained on the scheduler thread.
        self._deleted: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._probed: queue.SimpleQueue[tuple[OffloadKey, int | None]] = queue.SimpleQueue()
        self._vanished = 0
        self._vanished_lock = threading.Lock()
        self._deleting: set[OffloadKey] = set()
        self._background: list[Future[None]] = []
        self._closed = False
        backend.open_namespace()
        self._complete = False
        self.index_build_s: float | None = None
        self.index.removed = set()
        self._build: IndexBuild[PackedChunks] | None = IndexBuild(
            lambda build: self._list_chunks(build, list_threads, before_list_part),
            name="kvtiers-object-index",
        )
        if not background_index:
            self._build.done.wait()
            self._poll_build()
        self._start_listing(listing, namespace_digest=backend.identity.digest,
                            where=f"object tier at {where}", clock=clock)
        # Events the listing observed before a comparison, for the next take_events.
        self._observed: list[OffloadingEvent] = []

    @property
    def negative_ttl_s(self) -> float | None:
        """How long a probe's negative answer is trusted; ``None`` unless ``shared``."""
        return self._probes.negative_ttl_s if self.shared else None

    # -- start-up -------------------------------------------------------------------
    def _list_chunks(
        self, build: IndexBuild[Any], threads: int, before_part: Callable[[int], None] | None
    ) -> PackedChunks:
        """The build's work (its own thread): every chunk object of the namespace, oldest
        modification first (then by name), listed by fan-out prefix, ``threads`` prefixes
        at once; the objects outside them (manifest, summary) are no chunks. Each
        prefix's chunks are packed into arrays as its pages come (:class:`_Listed`): the
        listing's per-object Python objects live for one page, never for the namespace."""
        backend = self.backend
        base = backend.namespace_prefix + "/"
        prefixes = [f"{base}{i:02x}/" for i in range(256)]

        def one(i: int) -> _Listed:
            if build.stopping:
                return _Listed()
            if before_part is not None:
                before_part(i)
            listed = backend.retrier.call(
                lambda: _Listed.of(backend, prefixes[i]),
                bounded=False,  # one listing is many pages; each is bounded by the store
            )
            build.part_done()
            return listed

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvtiers-object-list") as pool:
            parts = list(pool.map(one, range(len(prefixes))))
        return _Listed.pack(parts)

    def _merge_build(self, result: PackedChunks, gone: set[OffloadKey]) -> None:
        # Listed chunks are least recently used, by mtime; beyond capacity the oldest go.
        self._delete(self.index.merge_oldest(result, gone).victims)

    # -- messages from I/O threads --------------------------------------------------
    def forget(self, keys: Collection[OffloadKey], *, corrupt: bool) -> None:
        """Thread-safe: the objects of ``keys`` are corrupt (``corrupt``; the mover counts
        those) or gone. The index drops them at the next scheduler call; pinned keys go
        when their last pin is dropped."""
        if not corrupt:
            with self._vanished_lock:
                self._vanished += len(keys)
        self._reports.forget(keys)

    def _drain(self) -> None:
        if self._build is not None:
            self._poll_build()
        while not self._deleted.empty():
            key = self._deleted.get()
            self._deleting.discard(key)
            if self.listing is not None:
                self.listing.deleted((key,))
        reported = self._reports.drain()
        if reported:
            self.index.discard(reported)
        if self._probed.empty():
            return
        answers = []
        while not self._probed.empty():
            answers.append(self._probed.get())
        found = self._probes.answered(answers)
        # A closed tier takes no new entries: it could not delete any to stay in capacity.
        # Never one removed while the index is built (its delete may not have run when the
        # probe looked).
        if found and not self._closed:
            removed = self.index.removed or ()
            change = self.index.add_ready(
                (key, size) for key, size in found
                if key not in self._deleting and key not in removed
            )
            self._delete(change.victims)

    # -- the contract ---------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._drain()
        if self.backoff.blocked(key):
            self.index.count_miss()
            return LookupResult.MISS
        index = self.index
        if (self.shared or not self._complete) and key not in index:
            if self._probes.known_absent(key):
                index.count_miss()
                return LookupResult.MISS
            return LookupResult.RETRY
        return index.lookup(key)

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        self._drain()
        index = self.index
        for key in keys:
            if key in self._deleting and key not in index:
                # Its old object is still being deleted; a store now could be removed by
                # that delete, and leaving the key out would claim it is present.
                return None
        change = index.reserve(keys, self.reserve_bytes)
        if change is None:
            return None
        self._delete(change.victims)
        for key in change.keys:
            self._probes.stored(key)
        return change.keys

    def _delete(self, victims: list[OffloadKey]) -> None:
        """Delete the objects of keys the index evicted, on the I/O pool."""
        if not victims:
            return
        self._background = [f for f in self._background if not f.done()]
        for key in victims:
            self._deleting.add(key)
            self._background.append(self.backend.submit_background(self._delete_job(key)))

    def _delete_job(self, key: OffloadKey) -> Callable[[], None]:
        name = self.backend.object_key(key)

        def run() -> None:
            try:
                self.backend.delete_quietly(name)
            finally:
                self._deleted.put(key)

        return run

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._drain()
        self.index.pin(keys)

    def get_spec(self, keys: Collection[OffloadKey]) -> ObjectLoadStoreSpec:
        self.index.require_addressable(keys)
        return ObjectLoadStoreSpec(
            self.backend.store.bucket, [self.backend.object_key(k) for k in keys], list(keys)
        )

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        # Persistent: a reset keeps every reservation, so every completion is current.
        self.index.finish(keys, success)
        self._drain()

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        self.index.unpin(keys)
        self._drain()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._drain()
        events = self.index.take_events()
        self._announcement_taken()
        if self.listing is None:
            return events
        observed, self._observed = self._observed, []
        observed.extend(self.listing.observe(events))
        return observed

    # -- shared namespaces: batched existence probes --------------------------------
    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self._drain()
        self._release_after_merge()
        self._background = [f for f in self._background if not f.done()]
        if self.listing is not None and not self._closed and self._complete:
            # This step's removals reach the listing before it compares (their events
            # wait for take_events), then this tier's keys: indexed, or being deleted.
            self._observed.extend(self.listing.observe(self.index.take_events()))
            self.listing.on_schedule_end((self.index.keys(), self._deleting))
        if self._closed:
            return
        batch = self._probes.take_batch()
        if not batch:
            return
        # One task per I/O thread at most: a batch costs a few round trips, not one each.
        parts = min(self.backend.threads, len(batch))
        for i in range(parts):
            self._background.append(self.backend.submit(self._probe_job(batch[i::parts])))

    def _probe_job(self, keys: list[OffloadKey]) -> Callable[[], None]:
        def run() -> None:
            store = self.backend.store
            for key in keys:
                name = self.backend.object_key(key)
                try:
                    size = self.backend.retrier.call(functools.partial(store.head, name))
                except Exception:  # an unanswered probe is a miss; the key is probed again later
                    size = None
                self._probed.put((key, size))

        return run

    # -- the background listing (shared namespaces, kvtiers.tiers.listing) -------------
    def _listed_keys(self) -> Iterator[OffloadKey]:
        """The chunk objects of the namespace (listing thread; one paginated listing)."""
        backend = self.backend
        for info in backend.store.list(backend.namespace_prefix + "/"):
            if info.irregular is None:
                key = backend.key_of(info.name)
                if key is not None:
                    yield key

    def _publish_summary(self, data: bytes) -> None:
        backend = self.backend
        name = f"{backend.namespace_prefix}/{SUMMARY_NAME}"
        backend.retrier.call(lambda: backend.store.put(name, [data]))

    def wait_background(self) -> None:
        """Block until every delete and probe started so far is done (tests, demos);
        their results are taken in at the next call."""
        wait(self._background)

    def has_pending_work(self) -> bool:
        return self._probes.pending

    # -- the rest -------------------------------------------------------------------
    def clear(self) -> int:
        """Delete every stored object of this namespace that no job is writing or
        reading (an operator's wipe, such as SGLang's ``clear``); returns how many. Not
        counted as evictions."""
        self._drain()
        victims = self.index.clear_ready()
        self._delete(victims)
        return len(victims)

    def get_stats(self) -> Mapping[str, float]:
        self._drain()
        stats = self._shared_stats()
        stats["forgotten"] = self.index.stats()["discarded"]
        with self._vanished_lock:
            stats["vanished_chunks"] = self._vanished
        stats["corrupt_chunks"] = self.backend.corrupt_chunks
        stats["retries"] = self.backend.retries
        return stats

    def _close(self) -> None:
        self.backend.close()


@dataclass
class _Listed:
    """The chunk objects of one listed prefix, packed as they come, in listing order
    (name order: every store lists sorted): keys end to end with their lengths, sizes,
    and mtimes in integer nanoseconds."""

    keys: bytearray = field(default_factory=bytearray)
    lengths: array = field(default_factory=lambda: array("H"))
    sizes: array = field(default_factory=lambda: array("q"))
    mtimes: array = field(default_factory=lambda: array("q"))

    @classmethod
    def of(cls, backend: ObjectBackend, prefix: str) -> _Listed:
        """Every chunk object under ``prefix`` (a listing thread; one paginated listing)."""
        listed = cls()
        keys, lengths, sizes, mtimes = (listed.keys.extend, listed.lengths.append,
                                        listed.sizes.append, listed.mtimes.append)
        for info in backend.store.list(prefix):
            key = backend.key_of(info.name)
            if key is None:
                continue
            keys(key)
            lengths(len(key))
            sizes(info.size)
            # A float's seconds to nanoseconds keeps their order: near today's epoch two
            # doubles differ by more than a nanosecond.
            mtimes(round(info.mtime * 1e9))
        return listed

    @staticmethod
    def pack(parts: list[_Listed]) -> PackedChunks:
        """``parts`` (in prefix order) packed oldest first, ties in listing order."""
        lengths = np.frombuffer(b"".join(part.lengths for part in parts), dtype=np.uint16)
        sizes = np.frombuffer(b"".join(part.sizes for part in parts), dtype=np.int64)
        mtimes = np.frombuffer(b"".join(part.mtimes for part in parts), dtype=np.int64)
        total = len(lengths)
        width = int(lengths.max()) if total else 0
        joined = b"".join(part.keys for part in parts)
        parts.clear()
        if total and bool((lengths == width).all()):
            matrix = np.frombuffer(joined, dtype=np.uint8).reshape(total, width)
        else:
            # Keys of several lengths (never in one namespace today): padded one by one.
            matrix = np.zeros((total, width), dtype=np.uint8)
            at = 0
            for row, length in enumerate(lengths.tolist()):
                matrix[row, :length] = np.frombuffer(joined, dtype=np.uint8, count=length,
                                                     offset=at)
                at += length
        del joined
        order = stable_order(mtimes)
        key_bytes = sorted_rows(matrix, order)
        del matrix
        return PackedChunks.from_sorted(width, key_bytes, lengths[order], sizes[order])
