"""What the file and object tiers' managers share, written once: :class:`PersistentTierManager`.

Both keep their chunks in a :class:`~kvtiers.tiers.compact.CompactChunkIndex` built in the
background (:class:`~kvtiers.tiers.build.IndexBuild`), answer a key whose load failed
from a :class:`~kvtiers.tiers.backoff.LoadBackoff` fed by
:class:`~kvtiers.tiers.backoff.MoverReports`, probe index misses through a
:class:`~kvtiers.tiers.probe.ProbeBook`, and may list a shared namespace in the
background (:class:`~kvtiers.tiers.listing.SharedListing`). This base owns the rules
over those parts that are the same for both: taking the built index in, the mover's
load-failure report, the stats they have in common, and stopping the background work.
What each medium does (deleting, probing, walking or listing) stays in its manager.

Invariant: :meth:`PersistentTierManager._poll_build` runs on the scheduler's thread and
is O(1) until the build is done; a failed build is logged once and leaves the index
incomplete, so index misses stay probed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Generic, TypeVar

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Medium,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    TierCapabilities,
)
from kvtiers.policies.retention import RetentionBook
from kvtiers.tiers.backoff import LoadBackoff, MoverReports
from kvtiers.tiers.build import IndexBuild, release_free_memory
from kvtiers.tiers.compact import CompactChunkIndex
from kvtiers.tiers.listing import ListingSettings, SharedListing
from kvtiers.tiers.probe import ProbeBook

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class PersistentTierManager(OffloadingManager, Generic[_T]):
    """The shared part of a file or object tier's manager (see the module docstring).

    A subclass sets, in its constructor: ``index``, ``_build`` (the build under way, whose
    result :meth:`_merge_build` takes in), ``_complete`` (``False``), ``index_build_s``
    (``None``), ``backoff`` and ``_reports``, ``_probes``, ``listing`` (through
    :meth:`_start_listing`), ``capacity_bytes`` and ``_closed`` (``False``); it closes
    its medium's own parts in :meth:`_close`."""

    capabilities = TierCapabilities(persistent=True, evicts=True, recency=True, events=True)
    medium = Medium.STORAGE

    index: CompactChunkIndex
    _build: IndexBuild[_T] | None
    _complete: bool
    #: Seconds the index build took (``None`` until it is merged).
    index_build_s: float | None
    backoff: LoadBackoff
    _reports: MoverReports
    _probes: ProbeBook
    listing: SharedListing | None
    capacity_bytes: int | None
    _closed: bool
    # A merge's buffers and announcement are freed memory to hand back: 1 once merged,
    # 2 once its announcement was taken (handed back at the end of that step).
    _release_due: int = 0

    # -- the index built in the background ------------------------------------------
    @property
    def index_complete(self) -> bool:
        """Whether every chunk found at start is indexed (the build was merged)."""
        return self._complete

    @property
    def index_building(self) -> bool:
        """Whether the background build is still running or not yet merged (``False``
        once merged, or once a failed build was logged: the index then stays
        incomplete)."""
        return self._build is not None

    def wait_index(self) -> None:
        """Block until the index is built, then merge it. For tests and tools: the
        scheduler never blocks (its calls merge the build once it is done)."""
        if self._build is not None:
            self._build.done.wait()
            self._poll_build()

    def _poll_build(self) -> None:
        """Merge the build once it is done: hand a successful build's result to
        :meth:`_merge_build` with the keys the index removed while it ran; the index is
        complete after. A failed build is logged; index misses stay probed."""
        build = self._build
        if build is None or not build.done.is_set():
            return
        self._build = None
        index = self.index
        gone = index.removed or set()
        index.removed = None
        if build.error is not None or build.result is None:
            logger.error("%s: the index could not be built (%s); index misses stay probed",
                         index.tier, build.error)
            return
        self.index_build_s = build.elapsed_s
        self._merge_build(build.result, gone)
        self._complete = True
        self._release_due = 1

    def _announcement_taken(self) -> None:
        """The index's events were taken (after ``take_events``): a merge's announcement
        among them is the caller's now, gone by the step's end."""
        if self._release_due == 1:
            self._release_due = 2

    def _release_after_merge(self) -> None:
        """At a step's end after a merge's announcement was taken: the allocator's free
        memory (the build's buffers, the announced keys) goes back to the system, on a
        thread of its own (a few milliseconds at a million chunks). Without it the tier's
        process keeps about 50 B a chunk it no longer uses (benchmarks/results/scale.md)."""
        if self._release_due == 2:
            self._release_due = 0
            threading.Thread(target=release_free_memory, name="kvtiers-release-memory",
                             daemon=True).start()

    def _merge_build(self, result: _T, gone: set[OffloadKey]) -> None:
        """Take ``result`` in as the least recently used entries (``merge_oldest``),
        leaving out ``gone``; :attr:`index_build_s` is set."""
        raise NotImplementedError

    # -- the mover's reports --------------------------------------------------------
    def load_failed(
        self, key: OffloadKey, where: str, error: BaseException, *, lasting: bool
    ) -> None:
        """Thread-safe: a load of ``key`` failed (see :class:`~kvtiers.core.mover.ChunkReporter`);
        taken in on the next scheduler-thread call."""
        self._reports.load_failed(key, where, error, lasting=lasting)

    # -- eviction chosen from above ---------------------------------------------------
    def honour_retention(self, book: RetentionBook, groups: int) -> None:
        """Evict in ``book``'s retention order from now on — every eviction: a store's
        room, a full medium's, a quota's (:meth:`CompactChunkIndex.honour_retention
        <kvtiers.tiers.compact.CompactChunkIndex.honour_retention>`). The book lives in
        the engine's process: after a restart the chunks found have the default
        priority until a request or the admin endpoint gives them another."""
        self.index.honour_retention(book, groups)

    def evict_outside(self, nbytes: int, protected: Collection[OffloadKey]) -> list[OffloadKey]:
        """Evict ready, unpinned chunks not in ``protected`` freeing at least ``nbytes``
        (or every such chunk when they free less), least recently used first (in
        retention order with a book: :meth:`honour_retention`), deleting them from the
        medium as the tier's own evictions are; returns their keys. A tenant's quota
        (:mod:`kvtiers.stack.tenants`) takes its own chunks this way."""
        victims = self.index.evict_lru_outside(nbytes, protected)
        self._delete(victims)
        return victims

    def _delete(self, victims: list[OffloadKey]) -> object:
        """Delete evicted chunks from the medium (each kind its own way)."""
        raise NotImplementedError

    # -- the contract's plain parts -------------------------------------------------
    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.index.touch(keys)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        """Persistent: stored chunks stay. Only queued probes and remembered probe
        misses are dropped."""
        self._probes.reset()

    def _shared_stats(self) -> dict[str, float]:
        """The stats both kinds report: the index's counters (``discarded`` left out),
        ``load_failures``, ``unreadable_chunks``, ``backing_off``, ``probes``,
        ``usage_bytes``, ``capacity_bytes`` (0 when unbounded) and, with a listing, its
        own (:meth:`~kvtiers.tiers.listing.SharedListing.stats`)."""
        stats: dict[str, float] = dict(self.index.stats())
        del stats["discarded"]
        stats["load_failures"] = self.backoff.failures
        stats["unreadable_chunks"] = self.backoff.forgotten
        stats["backing_off"] = len(self.backoff)
        stats["probes"] = self._probes.probes
        stats["usage_bytes"] = self.index.usage
        stats["capacity_bytes"] = self.capacity_bytes or 0
        if self.listing is not None:
            stats.update(self.listing.stats())
        return stats

    # -- the background listing ----------------------------------------------------
    def _start_listing(
        self, listing: ListingSettings | None, *, namespace_digest: bytes, where: str,
        clock: Callable[[], float],
    ) -> None:
        """Set :attr:`listing`: the namespace listed in the background as ``listing``
        says (``None``: not listed), over :meth:`_listed_keys`, the summary written by
        :meth:`_publish_summary`; ``where`` names the namespace in messages."""
        self.listing = None if listing is None else listing.start(
            self._listed_keys, publish_summary=self._publish_summary,
            namespace_digest=namespace_digest, medium=self.medium, where=where, clock=clock,
        )

    def _listed_keys(self) -> Iterator[OffloadKey]:
        """The namespace's chunk keys, as one listing finds them (the listing's thread)."""
        raise NotImplementedError

    def _publish_summary(self, data: bytes) -> None:
        """Write the namespace summary ``data`` in one atomic step (the listing's thread)."""
        raise NotImplementedError

    # -- shutdown ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the index build (if still running) and the listing, then :meth:`_close`
        the medium's own parts. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._build is not None:
            self._build.stop()
            self._build = None
        if self.listing is not None:
            self.listing.close()
        self._close()

    def _close(self) -> None:
        """Close what the subclass holds (executors, connections); once, at shutdown."""
