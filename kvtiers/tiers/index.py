"""The chunk index a tier's manager owns: key → (size, state, pins) in LRU order.

A plain object — no threads, no I/O — that managers hold by composition; the file, object
and in-memory tiers keep all their bookkeeping here (see docs/architecture.md). Sizes are
in the owner's unit of capacity: bytes for persistent tiers (which reserve a key at the
largest blob size and account rebuilt entries at their real size), 1 per chunk for a tier
that counts chunks.

Invariants, kept in step on every operation so that :meth:`ChunkIndex.stats` is O(1):

- ``usage`` is the sum of the entries' sizes and ``ready_count`` the number of ``READY``
  entries; with a ``capacity``, :meth:`reserve` never takes ``usage`` above it and
  :meth:`add_ready` evicts back under it;
- entries are in least recently used order: a finished store and a pin move a key to the
  most recent end, :meth:`touch` moves ``READY`` keys only (a ``WRITING`` key has no
  recency yet);
- a victim is ``READY``, unpinned and not named by the batch that needs the room; every
  victim picker answers the same way (:class:`IndexChange`), and a reservation that cannot
  free enough changes nothing;
- releasing more pins than a key holds raises :class:`~kvtiers.errors.UnknownKeyError`
  and changes nothing;
- a chunk reported bad goes through :meth:`discard`: dropped at once when unpinned, at
  its last unpin otherwise.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Iterator, KeysView, Mapping
from dataclasses import dataclass, field
from enum import Enum

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import Locality, LookupResult, Medium, OffloadingEvent
from kvtiers.errors import UnknownKeyError


class ChunkState(Enum):
    """Where a key's chunk stands: bytes in flight, or stored."""

    WRITING = 1
    READY = 2


_WRITING = ChunkState.WRITING
_READY = ChunkState.READY


@dataclass(slots=True)
class ChunkEntry:
    """One indexed chunk. ``size`` is in the index's capacity unit."""

    size: int
    state: ChunkState
    pins: int = 0


@dataclass(frozen=True, slots=True)
class IndexChange:
    """What an operation added and what it evicted to make room (oldest first).

    The evicted keys are already gone from the index; the owner deletes their bytes."""

    keys: list[OffloadKey]
    victims: list[OffloadKey] = field(default_factory=list)


class ChunkIndex:
    """The bookkeeping of one tier; see the module docstring.

    ``capacity`` ``None`` means unbounded. ``tier`` names the tier in error messages (for
    example ``"the file tier at /mnt/kv/ns"``); ``medium`` and ``locality`` label the
    events it records.
    """

    def __init__(
        self,
        capacity: int | None,
        *,
        tier: str,
        medium: Medium,
        locality: Locality | None = None,
    ) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"{tier}: capacity must be positive or None, got {capacity}")
        self.capacity = capacity
        self.tier = tier
        self.medium = medium
        self.locality = locality
        self.usage = 0
        self.ready_count = 0
        self._entries: OrderedDict[OffloadKey, ChunkEntry] = OrderedDict()
        self._doomed: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] = []
        self._counters = dict.fromkeys(
            ("hits", "misses", "stores", "store_failures", "evictions", "loads", "discarded"), 0
        )

    # -- queries --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> KeysView[OffloadKey]:
        """The indexed keys, being written included (a live, read-only view)."""
        return self._entries.keys()

    def get(self, key: OffloadKey) -> ChunkEntry | None:
        """The entry of ``key`` (do not modify it), or ``None``."""
        return self._entries.get(key)

    def items(self) -> Iterator[tuple[OffloadKey, ChunkEntry]]:
        """Every entry, least recently used first (do not modify them)."""
        return iter(self._entries.items())

    def lookup(self, key: OffloadKey) -> LookupResult:
        """``HIT`` (counted), ``HIT_PENDING`` while being written, or ``MISS`` (counted)."""
        entry = self._entries.get(key)
        if entry is None:
            self._counters["misses"] += 1
            return LookupResult.MISS
        if entry.state is _READY:
            self._counters["hits"] += 1
            return LookupResult.HIT
        return LookupResult.HIT_PENDING

    def count_miss(self) -> None:
        """Count a miss the owner answered without the index (a remembered probe miss)."""
        self._counters["misses"] += 1

    def require_addressable(self, keys: Iterable[OffloadKey]) -> None:
        """The ``get_spec`` rule: every key is reserved (``WRITING``) or pinned. Raises
        :class:`~kvtiers.errors.UnknownKeyError` naming the first key that is not."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None or (entry.state is _READY and not entry.pins):
                raise UnknownKeyError(
                    f"get_spec: key {key.hex()} is neither reserved by prepare_store nor "
                    f"pinned by prepare_load in {self.tier}"
                )

    # -- store ----------------------------------------------------------------------
    def reserve(self, keys: Collection[OffloadKey], size: int) -> IndexChange | None:
        """Reserve ``size`` for each key of ``keys`` not yet indexed, as ``WRITING``.

        The answer's ``keys`` are the reserved keys (first occurrence order, possibly
        none); its ``victims`` were evicted to make room. ``None``, changing nothing, when
        not enough ``READY``, unpinned keys outside ``keys`` can be evicted."""
        entries = self._entries
        accepted = list(dict.fromkeys(key for key in keys if key not in entries))
        need = len(accepted) * size
        victims: list[OffloadKey] = []
        capacity = self.capacity
        if need and capacity is not None and self.usage + need > capacity:
            if need > capacity:
                return None
            picked = self._pick_victims(self.usage + need - capacity, set(keys))
            if picked is None:
                return None
            victims = picked
            self._evict(victims)
        for key in accepted:
            entries[key] = ChunkEntry(size, _WRITING)
        self.usage += need
        return IndexChange(accepted, victims)

    def finish(self, keys: Iterable[OffloadKey], success: bool) -> list[OffloadKey]:
        """End the stores of ``keys``: ready (most recent) on success, dropped otherwise.

        Keys that are not ``WRITING`` are ignored; returns the keys that were, each once."""
        entries = self._entries
        done = [
            key for key in dict.fromkeys(keys)
            if (e := entries.get(key)) is not None and e.state is _WRITING
        ]
        if success:
            for key in done:
                entries[key].state = _READY
                entries.move_to_end(key)
            self.ready_count += len(done)
            self._counters["stores"] += len(done)
            if done:
                self._record(done, removed=False)
        else:
            for key in done:
                self.usage -= entries.pop(key).size
            self._counters["store_failures"] += len(done)
        return done

    # -- load -----------------------------------------------------------------------
    def pin(self, keys: Collection[OffloadKey]) -> None:
        """Pin each occurrence of ``keys`` (most recent first in LRU order). Raises
        :class:`~kvtiers.errors.UnknownKeyError`, changing nothing, unless every key is
        ``READY``."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not _READY:
                raise UnknownKeyError(
                    f"prepare_load: key {key.hex()} is not stored in {self.tier} "
                    "(look it up first; only HIT keys can be loaded)"
                )
        for key in keys:
            entries[key].pins += 1
            entries.move_to_end(key)
        self._counters["loads"] += len(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop one pin per occurrence of each key; returns the keys a :meth:`discard`
        was waiting on, now dropped. Raises :class:`~kvtiers.errors.UnknownKeyError`,
        changing nothing, when a key would drop more pins than it holds."""
        entries = self._entries
        drops = Counter(keys)
        for key, count in drops.items():
            entry = entries.get(key)
            held = 0 if entry is None else entry.pins
            if held < count:
                raise UnknownKeyError(
                    f"complete_load: key {key.hex()} is pinned {held} times in {self.tier} "
                    f"but released {count} times (complete each prepare_load once)"
                )
        for key, count in drops.items():
            entries[key].pins -= count
        if not self._doomed:
            return []
        freed = [key for key in drops if key in self._doomed and not entries[key].pins]
        if freed:
            self._doomed.difference_update(freed)
            self._drop(freed)
        return freed

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Make ``READY`` keys the most recently used, the last one most; others are
        ignored."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is not None and entry.state is _READY:
                entries.move_to_end(key)

    # -- entries found outside the scheduler's own stores ----------------------------
    def add_ready(self, found: Iterable[tuple[OffloadKey, int]]) -> IndexChange:
        """Index already-stored chunks ``(key, size)`` (a rebuild, oldest first, or probe
        hits) as ``READY`` and most recent, skipping keys already indexed; with a
        capacity, evict least recently used ``READY``, unpinned keys (the new ones too,
        if need be) until ``usage`` is within it. What this leaves indexed of the added
        keys is announced stored (one event), like a finished store: what a tier holds is
        announced however it came to hold it; the evicted keys that were indexed before
        are announced removed, those just added and evicted at once not at all."""
        entries = self._entries
        added = []
        for key, size in found:
            if key in entries:
                continue
            entries[key] = ChunkEntry(size, _READY)
            self.usage += size
            added.append(key)
        self.ready_count += len(added)
        victims: list[OffloadKey] = []
        capacity = self.capacity
        if capacity is not None and self.usage > capacity:
            picked = self._pick_victims(self.usage - capacity, ())
            if picked is None:
                # Pinned and writing entries alone exceed capacity: evict what can go.
                picked = [k for k, e in entries.items() if e.state is _READY and not e.pins]
            victims = picked
            for key in victims:
                self._remove(key)
            self._counters["evictions"] += len(victims)
        gone = set(victims)
        kept = [key for key in added if key not in gone] if gone else added
        if kept:
            self._record(kept, removed=False)
        fresh = set(added)
        announced = [key for key in victims if key not in fresh]
        if announced:
            self._record(announced, removed=True)
        return IndexChange(added, victims)

    def evict_lru(self, nbytes: int) -> list[OffloadKey]:
        """Evict least recently used ``READY``, unpinned keys freeing at least ``nbytes``
        of usage, or every such key when they free less (the medium itself is full, so
        the owner frees room below its capacity); returns them, oldest first."""
        victims = self._pick_victims(nbytes, ())
        if victims is None:
            victims = [k for k, e in self._entries.items() if e.state is _READY and not e.pins]
        self._evict(victims)
        return victims

    def discard(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop ``READY`` keys whose chunks were reported bad or gone (an event records
        it); a pinned one is dropped at its last :meth:`unpin`. Keys being written or not
        indexed are ignored. Returns the keys dropped now."""
        entries = self._entries
        now = []
        for key in dict.fromkeys(keys):
            entry = entries.get(key)
            if entry is None or entry.state is not _READY:
                continue
            if entry.pins:
                self._doomed.add(key)
            else:
                now.append(key)
        if now:
            self._drop(now)
        return now

    def clear_ready(self) -> list[OffloadKey]:
        """Drop every ``READY``, unpinned key (a non-persistent tier's reset); returns
        them. Not counted as evictions."""
        dropped = [k for k, e in self._entries.items() if e.state is _READY and not e.pins]
        for key in dropped:
            self._remove(key)
        if dropped:
            self._record(dropped, removed=True)
        return dropped

    # -- reporting ------------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> Mapping[str, int]:
        """``hits``, ``misses``, ``stores``, ``store_failures``, ``evictions``, ``loads``,
        ``discarded`` and ``chunks`` (``READY`` entries). O(1)."""
        return {**self._counters, "chunks": self.ready_count}

    # -- internals ------------------------------------------------------------------
    def _pick_victims(
        self, shortfall: int, protected: Collection[OffloadKey]
    ) -> list[OffloadKey] | None:
        """Least recently used ``READY``, unpinned keys outside ``protected`` freeing
        ``shortfall``, or ``None`` when they cannot. Changes nothing."""
        victims = []
        freed = 0
        for key, entry in self._entries.items():
            if entry.state is _READY and not entry.pins and key not in protected:
                victims.append(key)
                freed += entry.size
                if freed >= shortfall:
                    return victims
        return None

    def _evict(self, victims: list[OffloadKey]) -> None:
        if not victims:
            return
        for key in victims:
            self._remove(key)
        self._counters["evictions"] += len(victims)
        self._record(victims, removed=True)

    def _drop(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            self._remove(key)
        self._counters["discarded"] += len(keys)
        self._record(keys, removed=True)

    def _remove(self, key: OffloadKey) -> None:
        entry = self._entries.pop(key)
        self.usage -= entry.size
        if entry.state is _READY:
            self.ready_count -= 1
        self._doomed.discard(key)

    def _record(self, keys: list[OffloadKey], *, removed: bool) -> None:
        self._events.append(
            OffloadingEvent(list(keys), self.medium, removed=removed, locality=self.locality)
        )
