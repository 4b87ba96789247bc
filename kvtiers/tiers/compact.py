"""The chunk index, for millions of chunks: :class:`CompactChunkIndex`, the rules of
:mod:`kvtiers.tiers.index` kept in packed arrays instead of one Python object per key.

An entry of an ordered dict of entry objects would cost about 360 bytes (the key's
``bytes`` object, the dict's node, the entry); here a chunk costs its key's bytes plus
about 30 (20-byte keys: about 60 bytes a chunk). The layout, one *slot* per indexed key:

- the keys, each padded to the widest key seen, in one ``bytearray``, with their lengths;
- each key's ``hash()`` (low 32 bits), its size, its state (free, ``WRITING``, ``READY``)
  and its place in the recency log;
- an open-addressing table (linear probing, a power of two, at most half full counting
  removed cells: a miss probes about 2.5 cells) from hash to slot;
- the recency log: slots in the order they were last made most recent. Moving a key to
  the most recent end appends its slot and records the new place; an older place is stale
  (the slot's recorded place differs) and is skipped by every walk. The log is compacted
  when stale places outnumber live ones, so it holds at most about twice the keys.

Pins and keys waiting to be discarded are few and held in small dicts, and so are the
slots of the keys looked up last, -1 for those absent (at most :data:`HOT_KEYS`; a key
leaves it when its slot is freed or it is indexed): a lookup of a key the scheduler asked
about lately costs one dict probe. Every operation answers as a plain model of the rules
does (tests/test_chunk_index.py runs one against it), so eviction order, hit rate and
events are those of an LRU-ordered dict of entries.

With a retention book (:meth:`CompactChunkIndex.honour_retention`) victims are picked in
retention order instead, as the cpu tier's policy picks them
(:class:`~kvtiers.policies.retention.RetainingPolicy`): expired chunks first, then the
others lowest priority first, each priority least recently used first, the chunks of live
retention pins last (only when nothing else makes the room). A key takes its priority when
it is indexed and again when it is touched, finished or pinned for a load: the slots of
keys with a priority other than 0 are kept per priority in recency order (small dicts);
the default priority's order is the recency log's, walked from a place past the ranked
slots at its head (kept as victims are picked, so ranked chunks that outlive everything
else are not passed again at every eviction). Without a book, or with an empty one and no
ranked slot, nothing of this runs.

:meth:`CompactChunkIndex.merge_oldest` takes in a :class:`PackedChunks` built off the
scheduler's thread (a background rebuild, :mod:`kvtiers.tiers.build`) as the least
recently used entries, under everything indexed since: the scheduler's thread then does
work in proportion to the keys it indexed meanwhile, not to the chunks found.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.core.manager import Locality, LookupResult, Medium, OffloadingEvent
from kvtiers.errors import UnknownKeyError
from kvtiers.policies.retention import RetentionBook
from kvtiers.tiers.index import ChunkEntry, ChunkState, IndexChange

_FREE, _WRITING, _READY = 0, 1, 2
_EMPTY, _REMOVED = -1, -2
_HASH_MASK = 0xFFFFFFFF
_MIN_TABLE = 16
_STATES = {_WRITING: ChunkState.WRITING, _READY: ChunkState.READY}
#: Keys whose slots the index remembers from lookups (dropped all at once beyond it).
HOT_KEYS = 16384


def _hash32(key: bytes) -> int:
    return hash(key) & _HASH_MASK


def _table_size(count: int) -> int:
    """The smallest power of two that holds ``count`` keys at most a third full (it is
    rebuilt at half full)."""
    size = _MIN_TABLE
    while size < 3 * count:
        size *= 2
    return size


#: Keys a C-level pass takes at once: a build's thread holds the interpreter lock through
#: each, so the scheduler's thread waits at most one slice (milliseconds), not the pass.
SLICE = 65536


def _hashes(keys: Sequence[OffloadKey]) -> array:
    """Each key's ``hash()``, low 32 bits (as :func:`_hash32`), in C-level passes of
    :data:`SLICE` keys."""
    hashes = np.empty(len(keys), dtype=np.uint32)
    for start in range(0, len(keys), SLICE):
        part = keys[start:start + SLICE]
        hashes[start:start + len(part)] = np.fromiter(map(hash, part), dtype=np.int64,
                                                      count=len(part))
    out = array("I")
    out.frombytes(hashes.data.cast("B"))
    return out


def key_list(key_bytes: bytes | bytearray, lengths: np.ndarray, width: int) -> list[OffloadKey]:
    """The keys laid out in ``key_bytes`` (each padded to ``width``; ``lengths``: uint16
    each) as ``bytes`` objects: in C-level passes of :data:`SLICE` keys when every key
    is ``width`` long (a void dtype's items are its bytes, trailing zeros kept)."""
    count = len(lengths)
    if not count:
        return []
    if width and bool((lengths == width).all()):
        items = np.frombuffer(key_bytes, dtype=f"V{width}", count=count)
        # Filled in place: a list grown slice by slice leaves its old blocks behind.
        keys = cast("list[OffloadKey]", [b""] * count)
        for start in range(0, count, SLICE):
            keys[start:start + SLICE] = items[start:start + SLICE].tolist()
        return keys
    return [OffloadKey(bytes(key_bytes[i * width:i * width + n]))
            for i, n in enumerate(lengths.tolist())]


def _iota(count: int) -> array:
    """``array("i", range(count))``, built in one step."""
    out = array("i")
    out.frombytes(np.arange(count, dtype=np.int32).data.cast("B"))
    return out


def stable_order(values: np.ndarray) -> np.ndarray:
    """The permutation that sorts integer ``values`` stably (``np.argsort(values,
    kind="stable")``), by 16-bit digits from the lowest, each pass a stable radix sort
    (numpy's for 16-bit integers): linear where a comparison sort of a million keys is
    not. Only the digits that vary from the least value are sorted on."""
    count = len(values)
    if count < 2:
        return np.arange(count, dtype=np.intp)
    least = int(values.min())
    offsets = (values.astype(np.int64) - least).astype(np.uint64)
    spread = int(offsets.max()).bit_length()
    order = np.arange(count, dtype=np.intp)
    for shift in range(0, spread, 16):
        digits = ((offsets[order] >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.uint16)
        order = order[np.argsort(digits, kind="stable")]
    return order


def build_table(hashes: np.ndarray, slots: np.ndarray, size: int) -> array:
    """A linear-probing table of ``size`` cells (a power of two) holding ``slots`` under
    their ``hashes``, vectorised. Taken in home-cell order, each slot sits in the first
    cell at or after its home cell that the slots before it left free: ``max(home,
    previous cell + 1)``, a running maximum; so every cell between a slot's home cell and
    its own is occupied, as a lookup's probe needs. Slots whose run passes the last cell
    wrap to the first free cells from cell 0, in order (the table is at most half full:
    they are few), which keeps that true across the wrap."""
    table = np.full(size, _EMPTY, dtype=np.int32)
    count = len(slots)
    if count:
        home = hashes.astype(np.int64) & (size - 1)
        order = stable_order(home)
        steps = np.arange(count, dtype=np.int64)
        cells = np.maximum.accumulate(home[order] - steps) + steps
        inside = cells < size
        table[cells[inside]] = slots[order[inside]]
        wrapped = order[~inside]
        if wrapped.size:
            table[np.flatnonzero(table == _EMPTY)[:wrapped.size]] = slots[wrapped]
    out = array("i")
    out.frombytes(table.data.cast("B"))
    return out


@dataclass
class PackedChunks:
    """Chunks found in the medium, oldest first, packed for
    :meth:`CompactChunkIndex.merge_oldest`; built off the scheduler's thread by
    :meth:`pack`. ``keys`` holds them as ``bytes`` for the merge's announcement."""

    width: int
    key_bytes: bytearray
    lengths: array
    hashes: array
    sizes: array
    table: array
    keys: list[OffloadKey]
    #: The recency places and log of the merged index (``0 .. count - 1`` each): made
    #: here, off the scheduler's thread (tens of megabytes at millions of chunks).
    places: array = field(default_factory=lambda: array("i"))
    log: array = field(default_factory=lambda: array("i"))

    def __post_init__(self) -> None:
        if len(self.places) != len(self.keys):
            self.places, self.log = _iota(len(self.keys)), _iota(len(self.keys))

    @classmethod
    def pack(cls, keys: Sequence[OffloadKey], sizes: Sequence[int]) -> PackedChunks:
        """Pack distinct ``keys`` (oldest first) with their ``sizes``."""
        width = max((len(key) for key in keys), default=0)
        if all(len(key) == width for key in keys):
            key_bytes = bytearray(b"".join(keys))
        else:
            key_bytes = bytearray(b"".join(key.ljust(width, b"\0") for key in keys))
        lengths = array("H", [len(key) for key in keys]) if keys else array("H")
        hashes = _hashes(keys)
        packed_sizes = array("q", sizes)
        count = len(keys)
        table = build_table(
            np.frombuffer(hashes, dtype=np.uint32) if count else np.zeros(0, np.uint32),
            np.arange(count, dtype=np.int32), _table_size(count),
        )
        return cls(width, key_bytes, lengths, hashes, packed_sizes, table, list(keys))

    @classmethod
    def from_arrays(
        cls, width: int, key_bytes: bytearray, lengths: array, sizes: array,
        keys: list[OffloadKey],
    ) -> PackedChunks:
        """Pack chunks already laid out (a snapshot): ``keys`` as ``bytes`` too (their
        hashes are taken from them)."""
        hashes = _hashes(keys)
        count = len(keys)
        table = build_table(
            np.frombuffer(hashes, dtype=np.uint32) if count else np.zeros(0, np.uint32),
            np.arange(count, dtype=np.int32), _table_size(count),
        )
        return cls(width, key_bytes, lengths, hashes, sizes, table, keys)

    @classmethod
    def from_sorted(
        cls, width: int, key_bytes: bytearray, lengths: np.ndarray, sizes: np.ndarray,
    ) -> PackedChunks:
        """Pack chunks laid out oldest first (:func:`sorted_rows` made ``key_bytes``;
        ``lengths`` uint16 and ``sizes`` int64 in the same order): the keys as ``bytes``
        are made here."""
        keys = key_list(key_bytes, lengths, width)
        return cls.from_arrays(
            width, key_bytes, array("H", lengths.astype(np.uint16).tobytes()),
            array("q", sizes.astype(np.int64).tobytes()), keys,
        )

    def __len__(self) -> int:
        return len(self.keys)


def sorted_rows(matrix: np.ndarray, order: np.ndarray) -> bytearray:
    """``matrix``'s rows (keys padded to its width, uint8) in ``order``, copied once,
    straight into the bytearray an index keeps (the caller can drop ``matrix`` before the
    keys are made as ``bytes``, which is the build's peak)."""
    total, width = matrix.shape
    key_bytes = bytearray(total * width)
    np.take(matrix, order, axis=0,
            out=np.frombuffer(key_bytes, dtype=np.uint8).reshape(total, width))
    return key_bytes


class _Keys(Collection[OffloadKey]):
    """A live, read-only view of the indexed keys (least recently used first)."""

    def __init__(self, index: CompactChunkIndex) -> None:
        self._index = index

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[OffloadKey]:
        index = self._index
        return (index._key(slot) for slot in index._order())

    def __len__(self) -> int:
        return len(self._index)


class CompactChunkIndex:
    """The bookkeeping of one tier: :mod:`kvtiers.tiers.index`'s rules over packed arrays
    (see the module docstring). :meth:`get` and :meth:`items` answer with new
    :class:`~kvtiers.tiers.index.ChunkEntry` objects (copies).

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
        self._counters = dict.fromkeys(
            ("hits", "misses", "stores", "store_failures", "evictions", "loads", "discarded"), 0
        )
        self._events: list[OffloadingEvent] = []
        #: When a set, every key leaving the index otherwise than by a failed store is
        #: added to it (a background rebuild's keys that are gone; see merge_oldest).
        self.removed: set[OffloadKey] | None = None
        #: The retention book whose order victims follow (:meth:`honour_retention`).
        self.retention: RetentionBook | None = None
        self._expiries: Callable[[], list[bytes]] | None = None
        # Block hashes past their expiry that may have keys here (evicted first).
        self._expired: set[bytes] = set()
        self._groups: list[bytes] = []
        self._reset_storage()

    def _reset_storage(self) -> None:
        self._width = 0
        self._key_bytes = bytearray()
        self._lengths = array("H")
        self._hashes = array("I")
        self._sizes = array("q")
        self._states = bytearray()
        self._places = array("i")
        self._free = array("i")
        self._log = array("i")
        self._head = 0
        self._live = 0
        self._table = array("i", [_EMPTY]) * _MIN_TABLE
        self._mask = _MIN_TABLE - 1
        self._filled = 0  # live cells and removed ones
        self._pins: dict[int, int] = {}
        self._doomed: set[OffloadKey] = set()
        self._hot: dict[object, int] = {}
        # After merge_oldest(unverified=True): 1 for each slot still holding a merged
        # entry never touched, stored over or removed since (see refine_unverified).
        self._fresh: bytearray | None = None
        # Retention: slot -> priority of the slots whose key's priority is not 0, and
        # priority -> those slots, least recently used first.
        self._rank_of: dict[int, int] = {}
        self._levels: dict[int, dict[int, None]] = {}
        # A place in the recency log before which no live slot has the default priority:
        # a slot only takes that priority as it moves to the log's end, so the walk of
        # the default level starts here instead of passing the ranked slots again.
        self._default_from = 0

    def honour_retention(self, book: RetentionBook, groups: int) -> None:
        """Pick victims in ``book``'s retention order from now on (module docstring);
        ``groups``: the KV-cache groups a block hash has a key for (its pins and
        expiries name block hashes)."""
        self.retention = book
        self._expiries = book.expiry_feed()
        self._groups = [g.to_bytes(GROUP_INDEX_BYTES, "big") for g in range(groups)]

    # -- slots ----------------------------------------------------------------------
    def _find(self, key: object) -> int:
        """The slot of ``key``, or -1."""
        slot = self._hot.get(key)
        if slot is not None:
            return slot
        if type(key) is not bytes:
            return -1
        h = hash(key) & _HASH_MASK
        table = self._table
        mask = self._mask
        cell = h & mask
        slot = table[cell]
        while slot != _EMPTY:
            if (
                slot >= 0
                and self._hashes[slot] == h
                and self._key_bytes.startswith(key, slot * self._width)
                and self._lengths[slot] == len(key)
            ):
                return slot
            cell = (cell + 1) & mask
            slot = table[cell]
        return -1

    def _key(self, slot: int) -> OffloadKey:
        start = slot * self._width
        return OffloadKey(bytes(self._key_bytes[start:start + self._lengths[slot]]))

    def _insert(self, key: OffloadKey, size: int, state: int) -> int:
        """Index ``key`` (absent) as the most recent entry; its slot."""
        n = len(key)
        if self._hot:
            self._hot.pop(key, None)
        if n > self._width:
            self._widen(n)
        if (self._filled + 1) * 2 > len(self._table):
            self._rehash(self._live + 1)
        width = self._width
        padded = key if n == width else key.ljust(width, b"\0")
        h = hash(key) & _HASH_MASK
        if self._free:
            slot = self._free.pop()
            start = slot * width
            self._key_bytes[start:start + width] = padded
            self._lengths[slot] = n
            self._hashes[slot] = h
            self._sizes[slot] = size
            self._states[slot] = state
        else:
            slot = len(self._lengths)
            self._key_bytes += padded
            self._lengths.append(n)
            self._hashes.append(h)
            self._sizes.append(size)
            self._states.append(state)
            self._places.append(-1)
        table, mask = self._table, self._mask
        cell = h & mask
        while table[cell] >= 0:
            cell = (cell + 1) & mask
        if table[cell] == _EMPTY:
            self._filled += 1
        table[cell] = slot
        self._live += 1
        self._to_end(slot)
        if self.retention is not None:
            self._rank(slot, key)
        return slot

    def _release(self, slot: int) -> None:
        """Free ``slot`` (its key's cell becomes a removed cell)."""
        table, mask = self._table, self._mask
        cell = self._hashes[slot] & mask
        while table[cell] != slot:
            cell = (cell + 1) & mask
        table[cell] = _REMOVED
        if self._hot:
            self._hot.pop(self._key(slot), None)
        self._states[slot] = _FREE
        self._places[slot] = -1
        self._pins.pop(slot, None)
        if self._rank_of:
            self._unrank(slot)
        self._free.append(slot)
        self._live -= 1
        fresh = self._fresh
        if fresh is not None and slot < len(fresh):
            fresh[slot] = 0

    def _to_end(self, slot: int) -> None:
        fresh = self._fresh
        if fresh is not None and slot < len(fresh):
            fresh[slot] = 0
        log = self._log
        self._places[slot] = len(log)
        log.append(slot)
        if len(log) - self._head > 2 * self._live + 1024:
            self._compact_log()

    def _order(self) -> Iterator[int]:
        """The live slots, least recently used first (a stale head is skipped for good)."""
        log, places = self._log, self._places
        i = self._head
        while i < len(log) and places[log[i]] != i:
            i += 1
        self._head = i
        end = len(log)
        while i < end:
            slot = log[i]
            if places[slot] == i:
                yield slot
            i += 1

    def _compact_log(self) -> None:
        log = np.frombuffer(self._log, dtype=np.int32)[self._head:]
        places = np.frombuffer(self._places, dtype=np.int32)
        current = places[log] == np.arange(self._head, self._head + len(log), dtype=np.int32)
        kept = log[current]
        places[kept] = np.arange(len(kept), dtype=np.int32)
        self._default_from = 0
        del log, places
        self._log = array("i")
        self._log.frombytes(kept.tobytes())
        self._head = 0

    def _rehash(self, count: int) -> None:
        size = _table_size(count)
        states = np.frombuffer(self._states, dtype=np.uint8)
        slots = np.flatnonzero(states != _FREE).astype(np.int32)
        hashes = np.frombuffer(self._hashes, dtype=np.uint32)[slots]
        del states
        self._table = build_table(hashes, slots, size)
        self._mask = size - 1
        self._filled = len(slots)

    def _widen(self, width: int) -> None:
        """Pad every stored key to ``width`` bytes (a longer key than any so far)."""
        count = len(self._lengths)
        if count and self._width:
            old = np.frombuffer(self._key_bytes, dtype=np.uint8).reshape(count, self._width)
            wide = np.zeros((count, width), dtype=np.uint8)
            wide[:, : self._width] = old
            del old
            self._key_bytes = bytearray(wide.tobytes())
        else:
            self._key_bytes = bytearray(count * width)
        self._width = width

    # -- queries --------------------------------------------------------------------
    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: object) -> bool:
        return self._find(key) >= 0

    def keys(self) -> Collection[OffloadKey]:
        """The indexed keys, being written included (a live, read-only view)."""
        return _Keys(self)

    def get(self, key: OffloadKey) -> ChunkEntry | None:
        """A copy of the entry of ``key``, or ``None``."""
        slot = self._find(key)
        return None if slot < 0 else self._entry(slot)

    def _entry(self, slot: int) -> ChunkEntry:
        return ChunkEntry(
            self._sizes[slot], _STATES[self._states[slot]], self._pins.get(slot, 0)
        )

    def items(self) -> Iterator[tuple[OffloadKey, ChunkEntry]]:
        """Every entry, least recently used first (copies)."""
        return ((self._key(slot), self._entry(slot)) for slot in list(self._order()))

    def lookup(self, key: OffloadKey) -> LookupResult:
        """``HIT`` (counted), ``HIT_PENDING`` while being written, or ``MISS`` (counted).
        The scheduler's hot path: the slot is remembered for the next lookup."""
        hot = self._hot
        slot = hot.get(key)
        if slot is None:
            slot = self._find(key)
            if len(hot) >= HOT_KEYS:
                hot.clear()
            hot[key] = slot
        if slot < 0:
            self._counters["misses"] += 1
            return LookupResult.MISS
        if self._states[slot] == _READY:
            self._counters["hits"] += 1
            return LookupResult.HIT
        return LookupResult.HIT_PENDING

    def count_miss(self) -> None:
        """Count a miss the owner answered without the index (a remembered probe miss)."""
        self._counters["misses"] += 1

    def require_addressable(self, keys: Iterable[OffloadKey]) -> None:
        """The ``get_spec`` rule: every key is reserved (``WRITING``) or pinned. Raises
        :class:`~kvtiers.errors.UnknownKeyError` naming the first key that is not."""
        for key in keys:
            slot = self._find(key)
            if slot < 0 or (self._states[slot] == _READY and slot not in self._pins):
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
        accepted = list(dict.fromkeys(key for key in keys if self._find(key) < 0))
        need = len(accepted) * size
        victims: list[OffloadKey] = []
        capacity = self.capacity
        if need and capacity is not None and self.usage + need > capacity:
            if need > capacity:
                return None
            picked = self._pick_victims(self.usage + need - capacity, set(keys))
            if picked is None:
                return None
            victims = [key for key, _ in picked]
            self._evict(picked)
        for key in accepted:
            self._insert(key, size, _WRITING)
        self.usage += need
        return IndexChange(accepted, victims)

    def finish(self, keys: Iterable[OffloadKey], success: bool) -> list[OffloadKey]:
        """End the stores of ``keys``: ready (most recent) on success, dropped otherwise.

        Keys that are not ``WRITING`` are ignored; returns the keys that were, each once."""
        done = []
        slots = []
        for key in dict.fromkeys(keys):
            slot = self._find(key)
            if slot >= 0 and self._states[slot] == _WRITING:
                done.append(key)
                slots.append(slot)
        if success:
            ranked = self.retention is not None
            for key, slot in zip(done, slots, strict=True):
                self._states[slot] = _READY
                self._to_end(slot)
                if ranked:
                    self._rank(slot, key)
            self.ready_count += len(done)
            self._counters["stores"] += len(done)
            if done:
                self._record(done, removed=False)
        else:
            for slot in slots:
                self.usage -= self._sizes[slot]
                self._release(slot)
            self._counters["store_failures"] += len(done)
        return done

    # -- load -----------------------------------------------------------------------
    def pin(self, keys: Collection[OffloadKey]) -> None:
        """Pin each occurrence of ``keys`` (most recent first in LRU order). Raises
        :class:`~kvtiers.errors.UnknownKeyError`, changing nothing, unless every key is
        ``READY``."""
        slots = []
        for key in keys:
            slot = self._find(key)
            if slot < 0 or self._states[slot] != _READY:
                raise UnknownKeyError(
                    f"prepare_load: key {key.hex()} is not stored in {self.tier} "
                    "(look it up first; only HIT keys can be loaded)"
                )
            slots.append(slot)
        pins = self._pins
        ranked = self.retention is not None
        for key, slot in zip(keys, slots, strict=True):
            pins[slot] = pins.get(slot, 0) + 1
            self._to_end(slot)
            if ranked:
                self._rank(slot, key)
        self._counters["loads"] += len(keys)

    def unpin(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop one pin per occurrence of each key; returns the keys a :meth:`discard`
        was waiting on, now dropped. Raises :class:`~kvtiers.errors.UnknownKeyError`,
        changing nothing, when a key would drop more pins than it holds."""
        drops = Counter(keys)
        pins = self._pins
        slots = {}
        for key, count in drops.items():
            slot = self._find(key)
            held = 0 if slot < 0 else pins.get(slot, 0)
            if held < count:
                raise UnknownKeyError(
                    f"complete_load: key {key.hex()} is pinned {held} times in {self.tier} "
                    f"but released {count} times (complete each prepare_load once)"
                )
            slots[key] = slot
        for key, count in drops.items():
            slot = slots[key]
            left = pins[slot] - count
            if left:
                pins[slot] = left
            else:
                del pins[slot]
        if not self._doomed:
            return []
        freed = [key for key in drops if key in self._doomed and slots[key] not in pins]
        if freed:
            self._doomed.difference_update(freed)
            self._drop([(key, slots[key]) for key in freed])
        return freed

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Make ``READY`` keys the most recently used, the last one most; others are
        ignored."""
        ranked = self.retention is not None
        for key in keys:
            slot = self._find(key)
            if slot >= 0 and self._states[slot] == _READY:
                self._to_end(slot)
                if ranked:
                    self._rank(slot, key)

    # -- entries found outside the scheduler's own stores ----------------------------
    def add_ready(self, found: Iterable[tuple[OffloadKey, int]]) -> IndexChange:
        """Index already-stored chunks ``(key, size)`` (a rebuild, oldest first, or probe
        hits) as ``READY`` and most recent, skipping keys already indexed; with a
        capacity, evict least recently used ``READY``, unpinned keys (the new ones too,
        if need be) until ``usage`` is within it. What this leaves indexed of the added
        keys is announced stored (one event), like a finished store: what a tier holds is
        announced however it came to hold it; the evicted keys that were indexed before
        are announced removed, those just added and evicted at once not at all."""
        added = []
        for key, size in found:
            if self._find(key) >= 0:
                continue
            self._insert(key, size, _READY)
            self.usage += size
            added.append(key)
        self.ready_count += len(added)
        return self._settle(added)

    def merge_oldest(
        self, packed: PackedChunks, gone: Collection[OffloadKey] = (), *,
        unverified: bool = False,
    ) -> IndexChange:
        """Take in ``packed`` (a rebuild's chunks, oldest first) as ``READY`` entries less
        recently used than every indexed one, leaving out keys already indexed and keys in
        ``gone`` (removed from the medium since the rebuild began); then as
        :meth:`add_ready`: evicted back within the capacity, announced. The work on this
        thread is in proportion to the keys indexed now and ``gone``, not to ``packed``.

        ``unverified``: ``packed`` is a names-only pass's (sizes assumed, order by name);
        :meth:`refine_unverified` later takes their ``stat`` in."""
        current = [(self._key(slot), slot) for slot in self._order()]
        old_sizes, old_states, old_pins = self._sizes, self._states, self._pins
        doomed = self._doomed
        self._reset_storage()
        self._doomed = doomed
        self._width = packed.width
        self._key_bytes = packed.key_bytes
        self._lengths = packed.lengths
        self._hashes = packed.hashes
        self._sizes = packed.sizes
        count = len(packed)
        self._states = bytearray([_READY]) * count
        self._places = packed.places
        self._log = packed.log
        self._live = self._filled = count
        self._table = packed.table
        self._mask = len(packed.table) - 1
        self._fresh = bytearray(b"\1") * count if unverified else None
        base_usage = int(np.frombuffer(packed.sizes, dtype=np.int64).sum()) if count else 0
        # Base slots are packed's positions: the ones released are left out of the
        # announcement by slicing around them (C copies, not a loop over every key).
        dropped: list[int] = []
        for key in [*(key for key, _ in current), *gone]:
            slot = self._find(key)
            if slot >= 0:
                base_usage -= self._sizes[slot]
                self._release(slot)
                dropped.append(slot)
        for key, slot in current:
            new = self._insert(key, old_sizes[slot], old_states[slot])
            if slot in old_pins:
                self._pins[new] = old_pins[slot]
        self.usage += base_usage
        added = packed.keys
        if dropped:
            added = []
            start = 0
            for slot in sorted(dropped):
                added += packed.keys[start:slot]
                start = slot + 1
            added += packed.keys[start:]
        self.ready_count += len(added)
        # The announcement takes the list as it is: no pass over every found key here.
        return self._settle(added, owned=True)

    @property
    def unverified(self) -> bool:
        """Whether a names-only merge awaits :meth:`refine_unverified`."""
        return self._fresh is not None

    def refine_unverified(
        self, sizes: np.ndarray, by_mtime: np.ndarray, max_size: int
    ) -> list[OffloadKey]:
        """Take in the stat pass of the last ``merge_oldest(unverified=True)``: ``sizes`` by the
        merged chunks' positions (a negative size: the file is gone or not a regular file) and
        ``by_mtime``, those positions oldest mtime first (stable; made off this thread,
        :func:`stable_order`). Of the merged entries still untouched since (``READY``, never stored
        over, touched or removed), those whose size is negative or above ``max_size`` are dropped
        (announced removed; their files are left alone), the others take their size (``usage``
        follows) and are reordered among themselves oldest mtime first, keeping the places they hold
        (still the least recently used: nothing touched them). Entries touched since keep their
        assumed size until they leave. Returns the dropped keys; the index is over capacity if the
        true sizes are larger (the caller evicts)."""
        fresh_flags = self._fresh
        self._fresh = None
        if fresh_flags is None:
            return []
        flags = np.frombuffer(fresh_flags, dtype=np.uint8)
        states = np.frombuffer(self._states, dtype=np.uint8)[: len(flags)]
        fresh = (flags == 1) & (states == _READY)
        del flags, states
        bad = (sizes < 0) | (sizes > max_size)
        dropped_slots = np.flatnonzero(fresh & bad)
        good = fresh & ~bad
        slots = np.flatnonzero(good).astype(np.int32)
        index_sizes = np.frombuffer(self._sizes, dtype=np.int64)
        found = sizes[slots]
        self.usage += int(found.sum()) - int(index_sizes[slots].sum())
        index_sizes[slots] = found
        del index_sizes, found
        places = np.frombuffer(self._places, dtype=np.int32)
        log = np.frombuffer(self._log, dtype=np.int32)
        # A fresh slot never moved: the merge placed slot i at place i and the log's
        # compaction keeps the order, so their places ascend with the slots (no sort).
        held = places[slots]
        by_age = by_mtime[good[by_mtime]].astype(np.int32)
        log[held] = by_age
        places[by_age] = held
        del places, log
        dropped = [self._key(int(slot)) for slot in dropped_slots]
        return self.discard(dropped)

    def _settle(self, added: list[OffloadKey], *, owned: bool = False) -> IndexChange:
        """Evict back within the capacity after ``added`` came in; announce (see
        :meth:`add_ready`). ``owned``: nothing else
        changes ``added``, so the announcement may hold it uncopied."""
        picked: list[tuple[OffloadKey, int]] = []
        capacity = self.capacity
        if capacity is not None and self.usage > capacity:
            got = self._pick_victims(self.usage - capacity, ())
            # None: pinned and writing entries alone exceed capacity; evict what can go.
            picked = got if got is not None else self._evictable()
            for _, slot in picked:
                self._remove(slot)
            self._counters["evictions"] += len(picked)
        victims = [key for key, _ in picked]
        gone = set(victims)
        kept = [key for key in added if key not in gone] if gone else added
        if kept:
            self._record(kept, removed=False, copy=kept is added and not owned)
        fresh = set(added) if gone else ()
        announced = [key for key in victims if key not in fresh]
        if announced:
            self._record(announced, removed=True)
        return IndexChange(added, victims)

    def evict_lru(self, nbytes: int) -> list[OffloadKey]:
        """Evict least recently used ``READY``, unpinned keys freeing at least ``nbytes``
        of usage, or every such key when they free less (the medium itself is full, so
        the owner frees room below its capacity); returns them, oldest first."""
        picked = self._pick_victims(nbytes, ())
        if picked is None:
            picked = self._evictable()
        self._evict(picked)
        return [key for key, _ in picked]

    def evict_lru_outside(
        self, nbytes: int, protected: Collection[OffloadKey]
    ) -> list[OffloadKey]:
        """As :meth:`evict_lru`, among the keys not in ``protected`` only (an owner's
        quota: one tenant's chunks go, nobody else's)."""
        picked = self._pick_victims(nbytes, protected)
        if picked is None:
            picked = [(key, slot) for key, slot in self._evictable() if key not in protected]
        self._evict(picked)
        return [key for key, _ in picked]

    def discard(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Drop ``READY`` keys whose chunks were reported bad or gone (an event records
        it); a pinned one is dropped at its last :meth:`unpin`. Keys being written or not
        indexed are ignored. Returns the keys dropped now."""
        now = []
        for key in dict.fromkeys(keys):
            slot = self._find(key)
            if slot < 0 or self._states[slot] != _READY:
                continue
            if slot in self._pins:
                self._doomed.add(key)
            else:
                now.append((key, slot))
        if now:
            self._drop(now)
        return [key for key, _ in now]

    def clear_ready(self) -> list[OffloadKey]:
        """Drop every ``READY``, unpinned key (a non-persistent tier's reset); returns
        them. Not counted as evictions."""
        picked = self._evictable()
        for _, slot in picked:
            self._remove(slot)
        dropped = [key for key, _ in picked]
        if dropped:
            self._record(dropped, removed=True)
        return dropped

    def export_ready(self) -> tuple[int, bytes, bytes, bytes, int]:
        """The ``READY`` entries least recently used first, packed for a snapshot: the key
        width, the keys (each padded to it), their lengths (uint16), their sizes (int64)
        and their count. Vectorised: no object per key."""
        head = self._head
        log = np.frombuffer(self._log, dtype=np.int32)[head:]
        places = np.frombuffer(self._places, dtype=np.int32)
        states = np.frombuffer(self._states, dtype=np.uint8)
        live = places[log] == np.arange(head, head + len(log), dtype=np.int32)
        slots = log[live]
        slots = slots[states[slots] == _READY]
        width = self._width
        if width:
            keys = np.frombuffer(self._key_bytes, dtype=np.uint8).reshape(-1, width)[slots]
            key_bytes = keys.tobytes()
        else:
            key_bytes = b""
        lengths = np.frombuffer(self._lengths, dtype=np.uint16)[slots].tobytes()
        sizes = np.frombuffer(self._sizes, dtype=np.int64)[slots].tobytes()
        return width, key_bytes, lengths, sizes, len(slots)

    # -- reporting ------------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def stats(self) -> Mapping[str, int]:
        """``hits``, ``misses``, ``stores``, ``store_failures``, ``evictions``, ``loads``,
        ``discarded`` and ``chunks`` (``READY`` entries). O(1)."""
        return {**self._counters, "chunks": self.ready_count}

    def resident_bytes(self) -> int:
        """The bytes the packed arrays take (their allocations; pins and the log's stale
        places included, Python's object headers not)."""
        arrays = (self._lengths, self._hashes, self._sizes, self._places, self._free,
                  self._log, self._table)
        return len(self._key_bytes) + len(self._states) + sum(
            a.buffer_info()[1] * a.itemsize for a in arrays
        )

    # -- internals ------------------------------------------------------------------
    def _evictable(self) -> list[tuple[OffloadKey, int]]:
        states, pins = self._states, self._pins
        return [
            (self._key(slot), slot) for slot in list(self._order())
            if states[slot] == _READY and slot not in pins
        ]

    def _pick_victims(
        self, shortfall: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, int]] | None:
        """Least recently used ``READY``, unpinned keys outside ``protected`` (with their
        slots) freeing ``shortfall``, or ``None`` when they cannot. Changes nothing (with
        retention, :meth:`_pick_retained`: in retention order)."""
        book = self.retention
        if book is not None and (self._rank_of or book.hinted()):
            return self._pick_retained(shortfall, protected, book)
        victims = []
        freed = 0
        states, pins, sizes = self._states, self._pins, self._sizes
        for slot in self._order():
            if states[slot] != _READY or slot in pins:
                continue
            key = self._key(slot)
            if key in protected:
                continue
            victims.append((key, slot))
            freed += sizes[slot]
            if freed >= shortfall:
                return victims
        return None

    def _pick_retained(
        self, shortfall: int, protected: Collection[OffloadKey], book: RetentionBook
    ) -> list[tuple[OffloadKey, int]] | None:
        """As :meth:`_pick_victims`, in retention order (module docstring): expired keys,
        then unpinned keys by priority, then the keys of live retention pins. Answered
        victims are evicted by every caller, so the pins among them are counted as
        overridden here; ``None`` changes nothing."""
        states, pins, sizes = self._states, self._pins, self._sizes
        rank_of, places = self._rank_of, self._places
        spared = self._retention_pinned()
        victims: list[tuple[OffloadKey, int]] = []
        chosen: set[int] = set()
        freed = 0

        def ordered() -> Iterator[tuple[int, bool]]:
            for slot in self._expired_slots():
                yield slot, False
            for priority in sorted({0, *self._levels}):
                level = self._levels[priority] if priority else self._default_level()
                for slot in level:
                    if slot not in spared:
                        yield slot, False
            for slot in sorted(spared, key=lambda s: (rank_of.get(s, 0), places[s])):
                yield slot, True

        overridden = 0
        for slot, pinned in ordered():
            if states[slot] != _READY or slot in pins or slot in chosen:
                continue
            key = self._key(slot)
            if key in protected:
                continue
            victims.append((key, slot))
            chosen.add(slot)
            overridden += pinned
            freed += sizes[slot]
            if freed >= shortfall:
                if overridden:
                    book.count_overridden(overridden)
                return victims
        return None

    def _default_level(self) -> Iterator[int]:
        """The live slots of default priority, least recently used first, from the place
        before which there is none (moved up to the first one found)."""
        log, places, rank_of = self._log, self._places, self._rank_of
        i = max(self._default_from, self._head)
        while i < len(log):
            slot = log[i]
            if places[slot] == i and slot not in rank_of:
                self._default_from = i
                break
            i += 1
        else:
            self._default_from = i
            return
        while i < len(log):
            slot = log[i]
            if places[slot] == i and slot not in rank_of:
                yield slot
            i += 1

    def _expired_slots(self) -> list[int]:
        """The slots of keys past their expiry, least recently used first. A block hash
        with no key here, or whose expiry was renewed, is forgotten."""
        book = self.retention
        assert book is not None and self._expiries is not None
        expired = self._expired
        expired.update(self._expiries())
        found: list[int] = []
        for h in list(expired):
            slots = [slot for g in self._groups if (slot := self._find(h + g)) >= 0]
            if not slots or not book.is_expired(h + self._groups[0]):
                expired.discard(h)
                continue
            found.extend(slots)
        places = self._places
        found.sort(key=lambda slot: places[slot])
        return found

    def _retention_pinned(self) -> set[int]:
        """The slots of keys a live retention pin names (at most the pin caps' worth)."""
        book = self.retention
        assert book is not None
        return {slot for h in book.pinned_hashes() for g in self._groups
                if (slot := self._find(h + g)) >= 0}

    def _rank(self, slot: int, key: OffloadKey) -> None:
        """Give ``slot`` the retention priority ``key`` has now, as its level's most
        recently used; nothing to do for a default-priority key none was ranked."""
        book = self.retention
        assert book is not None
        rank_of = self._rank_of
        if not rank_of and not book.hinted():
            return
        priority = book.priority(key)
        if slot in rank_of:
            self._unrank(slot)
        if priority:
            rank_of[slot] = priority
            self._levels.setdefault(priority, {})[slot] = None

    def _unrank(self, slot: int) -> None:
        priority = self._rank_of.pop(slot, None)
        if priority is None:
            return
        level = self._levels[priority]
        del level[slot]
        if not level:
            del self._levels[priority]

    def _evict(self, picked: list[tuple[OffloadKey, int]]) -> None:
        if not picked:
            return
        for _, slot in picked:
            self._remove(slot)
        self._counters["evictions"] += len(picked)
        self._record([key for key, _ in picked], removed=True)

    def _drop(self, picked: list[tuple[OffloadKey, int]]) -> None:
        for key, slot in picked:
            self._remove(slot)
            self._doomed.discard(key)
        self._counters["discarded"] += len(picked)
        self._record([key for key, _ in picked], removed=True)

    def _remove(self, slot: int) -> None:
        self.usage -= self._sizes[slot]
        if self._states[slot] == _READY:
            self.ready_count -= 1
        if self._doomed or self.removed is not None:
            key = self._key(slot)
            self._doomed.discard(key)
            if self.removed is not None:
                self.removed.add(key)
        self._release(slot)

    def _record(self, keys: list[OffloadKey], *, removed: bool, copy: bool = True) -> None:
        self._events.append(OffloadingEvent(
            list(keys) if copy else keys, self.medium, removed=removed, locality=self.locality
        ))
