"""Announcing what other servers publish into a shared namespace: a background listing.

With ``shared: true`` several servers write one namespace (a shared file root, a bucket
prefix). A server's index holds what it found at start, stored or probed since, so a
chunk another server published later is invisible to a router until something here
looks it up. A tier with ``list_interval_s`` lists its namespace in the background and
turns what changed into events for its ``take_events``:

* a chunk the listing finds and the tier's index does not hold is announced stored, as a
  ``listed`` event with locality ``REMOTE`` (a chunk another server published, which this
  one can load: its lookup probes the namespace);
* a chunk so announced that a later complete listing no longer finds is announced
  removed (``listed`` too);
* when the index comes to hold an announced chunk (stored here, or found by a probe) the
  listed announcement is withdrawn by a removal just before the index's own store event,
  so a chunk has at most one live announcement per tier, and every removal follows the
  store it undoes.

After a complete listing the tier may also republish the namespace summary
(:mod:`kvtiers.filemapper.summary`), at most once per ``summary_interval_s``; that runs
on the listing's thread too.

Bounds: one listing at a time, on a daemon thread of its own below the engine's priority
(a background :class:`~kvtiers.tiers.iopool.IOPool`), started at most once per ``interval_s`` of the
injected clock and only once the previous listing's results were taken in; a listing
stops after ``max_chunks`` chunks (it is then incomplete: it announces what it found,
withdraws nothing and writes no summary, and a warning says so once); the scheduler
thread only polls for a finished listing and compares at most :data:`KEYS_PER_STEP` keys
per :meth:`SharedListing.on_schedule_end`, first the listed keys, then the keys a
complete listing no longer found (the listing thread works those out, against every key
listed since the last complete listing). It never lists, reads or writes itself, nor
walks a whole key set in one step.

A chunk the index removed during the current listing or the one before is not announced
by it: its file or object may have been listed just before this server's own delete
removed it. A tier therefore passes its index's events through :meth:`SharedListing.
observe` before the step's comparison (a chunk evicted in that very step is known as
removed), counts the chunks it is still deleting among those it holds, and reports each
delete that finished (:meth:`SharedListing.deleted`): a delete queued behind others may
run listings after the eviction, once a listing has seen the chunk. Removals by other
servers of chunks this tier's index holds are not noticed here; a load finds them gone
(``vanished_chunks``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import Locality, Medium, OffloadingEvent
from kvtiers.filemapper.summary import NamespaceSummary
from kvtiers.tiers.iopool import IOPool

if TYPE_CHECKING:
    from kvtiers.config.tiers import LowerTierConfig

logger = logging.getLogger(__name__)

#: Listed keys compared with the index per scheduler step.
KEYS_PER_STEP = 4096
#: Default bound of one listing, in chunks (the ``list_max_chunks`` YAML key's default).
DEFAULT_LIST_MAX_CHUNKS = 1_000_000


@dataclass(frozen=True)
class ListingSettings:
    """A tier's background listing, as its ``list_interval_s``, ``list_max_chunks`` and
    ``summary_interval_s`` keys give it: list at most once per ``interval_s``, stop a
    listing after ``max_chunks`` chunks, and (``summary_interval_s`` set) republish the
    namespace summary after a complete listing at most that often. A tier without a
    listing has no settings (``None``), so a summary without a listing cannot be asked
    for."""

    interval_s: float
    max_chunks: int = DEFAULT_LIST_MAX_CHUNKS
    summary_interval_s: float | None = None

    @classmethod
    def from_config(cls, config: LowerTierConfig) -> ListingSettings | None:
        """The listing a lower tier's section asks for; ``None`` without
        ``list_interval_s`` (the section's check refuses a summary without it)."""
        if config.list_interval_s is None:
            return None
        return cls(config.list_interval_s, config.list_max_chunks, config.summary_interval_s)

    def start(
        self,
        list_keys: ListKeys,
        *,
        publish_summary: Callable[[bytes], None],
        namespace_digest: bytes,
        medium: Medium,
        where: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> SharedListing:
        """The tier's :class:`SharedListing` over ``list_keys``, with its
        :class:`SummaryWriter` over ``publish_summary`` when a summary is asked for."""
        summary = None
        if self.summary_interval_s is not None:
            summary = SummaryWriter(publish_summary, namespace_digest=namespace_digest,
                                    interval_s=self.summary_interval_s, clock=clock)
        return SharedListing(list_keys, interval_s=self.interval_s, max_chunks=self.max_chunks,
                             medium=medium, where=where, summary=summary, clock=clock)
#: Seconds shutdown waits for a listing in progress before abandoning its thread.
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Listing:
    """One listing of a namespace: the chunk keys it found (a set, and in an order to
    compare them by), whether it saw the whole namespace (no error, under the bound),
    when it began (wall clock, nanoseconds) and how long it took; ``gone``: the keys an
    earlier listing found that this complete one did not (the only ones it may
    withdraw); ``error`` says why an incomplete listing stopped early."""

    keys: frozenset[OffloadKey]
    order: tuple[OffloadKey, ...]
    gone: tuple[OffloadKey, ...]
    complete: bool
    started_ns: int
    seconds: float
    error: str | None = None
    #: Why the summary could not be written after it, if it could not.
    summary_error: str | None = None


#: Lists a namespace's chunk keys, in any order; the listing thread stops taking them
#: after the bound it was given.
ListKeys = Callable[[], Iterator[OffloadKey]]


class SharedListing:
    """The background listing of one tier's namespace; see the module docstring.

    ``list_keys`` runs on the listing thread; ``summary`` (optional) too, after each
    complete listing. ``medium`` labels the events; ``where`` names the namespace in
    messages. ``clock`` is injectable for tests.
    """

    def __init__(
        self,
        list_keys: ListKeys,
        *,
        interval_s: float,
        max_chunks: int,
        medium: Medium,
        where: str,
        summary: SummaryWriter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or max_chunks < 1:
            raise ValueError(
                f"{where}: a listing needs interval_s > 0 and max_chunks >= 1, got "
                f"{interval_s} and {max_chunks}"
            )
        self.interval_s = interval_s
        self.max_chunks = max_chunks
        self.where = where
        self._list_keys = list_keys
        self._summary = summary
        self._clock = clock
        self._medium = medium
        self._pool = IOPool(1, "kvtiers-listing", background=True)
        # The listing under way and the one whose keys are being compared.
        self._running: Future[Listing] | None = None
        self._listing: Listing | None = None
        # How far the listing being compared got: in its keys, in its gone keys.
        self._position = 0
        self._gone_position = 0
        # Listing thread only: every key listed since the last complete listing (a
        # superset of what is announced, so a complete listing's gone keys are found
        # off the scheduler's thread).
        self._since_complete: frozenset[OffloadKey] = frozenset()
        # The first listing waits one interval: at start the index was just rebuilt
        # from the namespace itself.
        self._last_start = clock()
        # Chunks announced by listings and not withdrawn.
        self.announced: set[OffloadKey] = set()
        # Keys the index removed during the current and the previous listing.
        self._removed_now: set[OffloadKey] = set()
        self._removed_before: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] = []
        self._warned_bound = False
        self._closed = False
        self._stats = dict.fromkeys(
            ("listings", "listings_incomplete", "listed_chunks", "summary_failures"), 0
        )
        self.last_listing_s = 0.0

    # -- the scheduler thread's side -------------------------------------------------
    def observe(self, events: Iterable[OffloadingEvent]) -> list[OffloadingEvent]:
        """The index's ``events`` as the tier announces them: a store of an announced
        chunk first withdraws the listed announcement; the listing's own events since the
        last call follow."""
        out: list[OffloadingEvent] = []
        announced = self.announced
        for event in events:
            if event.metadata_only:
                out.append(event)
                continue
            if event.removed:
                self._removed_now.update(event.keys)
            elif announced:
                taken = [key for key in event.keys if key in announced]
                if taken:
                    announced.difference_update(taken)
                    out.append(self._event(taken, removed=True))
            out.append(event)
        if self._events:
            out.extend(self._events)
            self._events = []
        return out

    def deleted(self, keys: Iterable[OffloadKey]) -> None:
        """This tier's deletes of ``keys`` finished (on the scheduler thread): a listing
        under way, or the next one, may have listed them before they went."""
        self._removed_now.update(keys)

    def on_schedule_end(self, held: Sequence[Container[OffloadKey]]) -> None:
        """Take in a finished listing, compare up to :data:`KEYS_PER_STEP` of its keys
        with what the tier holds (``held``: containers of the keys it has, being written
        included; dicts or sets, tested with ``in``), and start the next listing when one
        is due."""
        if self._closed:
            return
        if self._listing is None and self._running is not None and self._running.done():
            self._take(self._running)
            self._running = None
        if self._listing is not None:
            self._compare(held)
        if self._listing is None and self._running is None:
            now = self._clock()
            if now - self._last_start >= self.interval_s:
                self._last_start = now
                self._removed_before = self._removed_now
                self._removed_now = set()
                self._running = self._pool.submit(self._run)

    def list_soon(self) -> None:
        """Start a listing at the next step (once none runs), whatever the interval: for
        tools and tests; the interval counts from that listing on."""
        self._last_start = self._clock() - self.interval_s

    @property
    def busy(self) -> bool:
        """Whether a listing runs or its keys are still being compared."""
        return self._running is not None or self._listing is not None

    def wait(self) -> None:
        """Block until the listing under way (if any) has finished. For tests and tools:
        the scheduler never blocks; the results are taken in at the next step."""
        if self._running is not None:
            self._running.exception()

    def stats(self) -> Mapping[str, float]:
        """``listings`` (complete ones), ``listings_incomplete``, ``listed_chunks`` (by
        the last listing), ``listing_s`` (its duration), ``announced_chunks`` (listed
        announcements live now), ``summary_failures`` (summaries not written) and
        ``summaries`` (written)."""
        return {
            **self._stats,
            "listing_s": self.last_listing_s,
            "announced_chunks": len(self.announced),
            "summaries": 0 if self._summary is None else self._summary.written,
        }

    def close(self) -> None:
        """Stop listing: a listing under way is given :data:`CLOSE_TIMEOUT_S`, then its
        thread is abandoned (it is a daemon). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._pool.shutdown(CLOSE_TIMEOUT_S, cancel_queued=True):
            logger.warning("%s: a namespace listing still runs at shutdown; it is abandoned",
                           self.where)

    # -- internals (scheduler thread) ------------------------------------------------
    def _take(self, running: Future[Listing]) -> None:
        error = running.exception()
        if error is not None:
            # _run catches what listing and the summary raise: this is a bug.
            raise error
        listing = running.result()
        self._stats["listings" if listing.complete else "listings_incomplete"] += 1
        if listing.summary_error is not None:
            self._stats["summary_failures"] += 1
            logger.warning("%s: could not write the namespace summary: %s", self.where,
                           listing.summary_error)
        self._stats["listed_chunks"] = len(listing.keys)
        self.last_listing_s = listing.seconds
        if not listing.complete:
            if listing.error is not None:
                logger.warning("%s: the namespace listing stopped early: %s", self.where,
                               listing.error)
            elif not self._warned_bound:
                self._warned_bound = True
                logger.warning(
                    "%s: the namespace holds more than list_max_chunks (%d) chunks; listings "
                    "announce the first %d found, withdraw nothing and write no summary",
                    self.where, self.max_chunks, self.max_chunks,
                )
        self._listing = listing
        self._position = self._gone_position = 0

    def _compare(self, held: Sequence[Container[OffloadKey]]) -> None:
        listing = self._listing
        assert listing is not None
        budget = KEYS_PER_STEP
        order = listing.order
        if self._position < len(order):
            batch = order[self._position : self._position + budget]
            self._position += len(batch)
            budget -= len(batch)
            # Set differences first (the common case, a key already announced, costs no
            # Python-level test), then what the tier holds.
            candidates = set(batch)
            candidates -= self.announced
            candidates -= self._removed_now
            candidates -= self._removed_before
            for container in held:
                if not candidates:
                    break
                candidates = {key for key in candidates if key not in container}
            fresh = [key for key in batch if key in candidates]
            if fresh:
                self.announced.update(fresh)
                self._events.append(self._event(fresh, removed=False))
            if self._position < len(order):
                return
        gone_keys = listing.gone
        if budget and self._gone_position < len(gone_keys):
            batch = gone_keys[self._gone_position : self._gone_position + budget]
            self._gone_position += len(batch)
            gone = [key for key in batch if key in self.announced]
            if gone:
                self.announced.difference_update(gone)
                self._events.append(self._event(gone, removed=True))
        if self._gone_position >= len(gone_keys):
            self._listing = None

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys, self._medium, removed=removed, locality=Locality.REMOTE, listed=True
        )

    # -- the listing thread ----------------------------------------------------------
    def _run(self) -> Listing:
        started_ns = time.time_ns()
        start = time.perf_counter()
        found: set[OffloadKey] = set()
        complete = True
        error: str | None = None
        try:
            for key in self._list_keys():
                if len(found) >= self.max_chunks and key not in found:
                    complete = False
                    break
                found.add(key)
                if self._closed:
                    complete = False
                    error = "the tier shut down"
                    break
        except Exception as exc:  # an unreachable store is an incomplete listing, logged
            complete = False
            error = f"{type(exc).__name__}: {exc}"
        keys = frozenset(found)
        if complete:
            gone = tuple(self._since_complete - keys)
            self._since_complete = keys
        else:
            gone = ()
            self._since_complete = self._since_complete | keys
        listing = Listing(keys, tuple(found), gone, complete, started_ns,
                          time.perf_counter() - start, error)
        if complete and self._summary is not None and not self._closed:
            try:
                self._summary(listing)
            except Exception as exc:  # the summary is an extra; the listing stands
                return replace(listing, summary_error=f"{type(exc).__name__}: {exc}")
        return listing


class SummaryWriter:
    """Republishes a namespace's summary after a complete listing, at most once per
    ``interval_s`` of ``clock``. :class:`SharedListing` calls it on the listing thread
    after each complete listing; an exception is logged and counted there.
    ``publish`` writes the encoded summary in one atomic step (the tier's own way)."""

    def __init__(
        self,
        publish: Callable[[bytes], None],
        *,
        namespace_digest: bytes,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._publish = publish
        self._digest = namespace_digest
        self.interval_s = interval_s
        self._clock = clock
        self._written_at: float | None = None
        self.written = 0

    def __call__(self, listing: Listing) -> None:
        now = self._clock()
        if self._written_at is not None and now - self._written_at < self.interval_s:
            return
        summary = NamespaceSummary.build(
            listing.keys, namespace_digest=self._digest, listed_at_ns=listing.started_ns
        )
        self._publish(summary.encode())
        self._written_at = now
        self.written += 1
