"""The chunk index (CompactChunkIndex) alone, against one plain model: a dict of entries
and a list for LRU order.

The state machine drives every operation with arbitrary keys (present or not, repeated)
and checks each answer, each raised error and, after every step, every entry, the LRU
order, usage, counters and events against the model. A handful of unit tests pin down the
rules the issue table names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import Locality, LookupResult, Medium, OffloadingEvent
from kvtiers.errors import UnknownKeyError
from kvtiers.tiers import compact
from kvtiers.tiers.compact import (
    CompactChunkIndex,
    PackedChunks,
    build_table,
    key_list,
    stable_order,
)
from kvtiers.tiers.index import ChunkState, IndexChange

KEYS = [make_offload_key(bytes([i]) * 16, 0) for i in range(6)]
key_st = st.sampled_from(KEYS)
keys_st = st.lists(key_st, max_size=5)
size_st = st.integers(min_value=1, max_value=3)

WRITING, READY = ChunkState.WRITING, ChunkState.READY


@dataclass
class ModelEntry:
    size: int
    state: ChunkState
    pins: int = 0


class ChunkIndexMachine(RuleBasedStateMachine):
    """The index and the model receive the same calls (the merge of a background rebuild
    included) and must agree on everything."""

    @initialize(capacity=st.one_of(st.none(), st.integers(min_value=1, max_value=8)))
    def start(self, capacity: int | None) -> None:
        self.index = CompactChunkIndex(capacity, tier="the test tier", medium=Medium.CPU,
                                       locality=Locality.LOCAL)
        self.capacity = capacity
        self.entries: dict[OffloadKey, ModelEntry] = {}
        self.order: list[OffloadKey] = []  # least recently used first
        self.doomed: set[OffloadKey] = set()
        self.events: list[tuple[list[OffloadKey], bool]] = []
        self.counters = Counter[str]()

    # -- the model's own steps ---------------------------------------------------------
    def _to_end(self, key: OffloadKey) -> None:
        self.order.remove(key)
        self.order.append(key)

    def _remove(self, key: OffloadKey) -> None:
        del self.entries[key]
        self.order.remove(key)
        self.doomed.discard(key)

    def _usage(self) -> int:
        return sum(e.size for e in self.entries.values())

    def _evictable(self, protected: set[OffloadKey]) -> list[OffloadKey]:
        return [k for k in self.order if self.entries[k].state is READY
                and not self.entries[k].pins and k not in protected]

    def _pick(self, shortfall: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        victims, freed = [], 0
        for key in self._evictable(protected):
            victims.append(key)
            freed += self.entries[key].size
            if freed >= shortfall:
                return victims
        return None

    def _evict(self, victims: list[OffloadKey]) -> None:
        for key in victims:
            self._remove(key)
        if victims:
            self.counters["evictions"] += len(victims)
            self.events.append((victims, True))

    # -- rules -----------------------------------------------------------------------
    @rule(keys=keys_st, size=size_st)
    def reserve(self, keys: list[OffloadKey], size: int) -> None:
        accepted = list(dict.fromkeys(k for k in keys if k not in self.entries))
        need = len(accepted) * size
        victims: list[OffloadKey] = []
        refused = False
        if need and self.capacity is not None and self._usage() + need > self.capacity:
            picked = None if need > self.capacity else self._pick(
                self._usage() + need - self.capacity, set(keys))
            refused = picked is None
            victims = picked or []
        answer = self.index.reserve(keys, size)
        if refused:
            assert answer is None
            return
        assert answer == IndexChange(accepted, victims)
        self._evict(victims)
        for key in accepted:
            self.entries[key] = ModelEntry(size, WRITING)
            self.order.append(key)

    @rule(keys=keys_st, success=st.booleans())
    def finish(self, keys: list[OffloadKey], success: bool) -> None:
        done = [k for k in dict.fromkeys(keys)
                if k in self.entries and self.entries[k].state is WRITING]
        assert self.index.finish(keys, success) == done
        if success:
            for key in done:
                self.entries[key].state = READY
                self._to_end(key)
            self.counters["stores"] += len(done)
            if done:
                self.events.append((done, False))
        else:
            for key in done:
                self._remove(key)
            self.counters["store_failures"] += len(done)

    @rule(keys=keys_st)
    def pin(self, keys: list[OffloadKey]) -> None:
        if any(k not in self.entries or self.entries[k].state is not READY for k in keys):
            with pytest.raises(UnknownKeyError, match="prepare_load"):
                self.index.pin(keys)
            return
        self.index.pin(keys)
        for key in keys:
            self.entries[key].pins += 1
            self._to_end(key)
        self.counters["loads"] += len(keys)

    @rule(keys=keys_st)
    def unpin(self, keys: list[OffloadKey]) -> None:
        drops = Counter(keys)
        if any(k not in self.entries or self.entries[k].pins < n for k, n in drops.items()):
            with pytest.raises(UnknownKeyError, match="released"):
                self.index.unpin(keys)
            return
        for key, n in drops.items():
            self.entries[key].pins -= n
        freed = [k for k in drops if k in self.doomed and not self.entries[k].pins]
        assert self.index.unpin(keys) == freed
        self._discarded(freed)

    def _discarded(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            self._remove(key)
        if keys:
            self.counters["discarded"] += len(keys)
            self.events.append((keys, True))

    @rule(keys=keys_st)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.index.touch(keys)
        for key in keys:
            if key in self.entries and self.entries[key].state is READY:
                self._to_end(key)

    @rule(found=st.lists(st.tuples(key_st, size_st), max_size=4))
    def add_ready(self, found: list[tuple[OffloadKey, int]]) -> None:
        added = []
        for key, size in found:
            if key not in self.entries:
                self.entries[key] = ModelEntry(size, READY)
                self.order.append(key)
                added.append(key)
        victims: list[OffloadKey] = []
        if self.capacity is not None and self._usage() > self.capacity:
            victims = self._pick(self._usage() - self.capacity, set()) or self._evictable(set())
        assert self.index.add_ready(found) == IndexChange(added, victims)
        # What the tier holds is announced, found or stored; a key found and evicted at
        # once is neither announced nor withdrawn.
        kept = [key for key in added if key not in victims]
        if kept:
            self.events.append((kept, False))
        for key in victims:
            self._remove(key)
        if victims:
            self.counters["evictions"] += len(victims)
        earlier = [key for key in victims if key not in added]
        if earlier:
            self.events.append((earlier, True))

    @rule(keys=keys_st)
    def discard(self, keys: list[OffloadKey]) -> None:
        now = []
        for key in dict.fromkeys(keys):
            entry = self.entries.get(key)
            if entry is None or entry.state is not READY:
                continue
            if entry.pins:
                self.doomed.add(key)
            else:
                now.append(key)
        assert self.index.discard(keys) == now
        self._discarded(now)

    @rule()
    def clear_ready(self) -> None:
        dropped = self._evictable(set())
        assert self.index.clear_ready() == dropped
        for key in dropped:
            self._remove(key)
        if dropped:
            self.events.append((dropped, True))

    @rule(key=key_st)
    def lookup(self, key: OffloadKey) -> None:
        entry = self.entries.get(key)
        if entry is None:
            expected = LookupResult.MISS
            self.counters["misses"] += 1
        elif entry.state is READY:
            expected = LookupResult.HIT
            self.counters["hits"] += 1
        else:
            expected = LookupResult.HIT_PENDING
        assert self.index.lookup(key) is expected

    @rule(keys=keys_st)
    def require_addressable(self, keys: list[OffloadKey]) -> None:
        if any(k not in self.entries or (self.entries[k].state is READY
                                         and not self.entries[k].pins) for k in keys):
            with pytest.raises(UnknownKeyError, match="get_spec"):
                self.index.require_addressable(keys)
        else:
            self.index.require_addressable(keys)

    @rule()
    def take_events(self) -> None:
        expected = [
            OffloadingEvent(keys, Medium.CPU, removed=removed, locality=Locality.LOCAL)
            for keys, removed in self.events
        ]
        assert self.index.take_events() == expected
        self.events = []

    # -- the index agrees with the model after every step ---------------------------------
    @invariant()
    def same_entries_in_same_order(self) -> None:
        got = [(k, e.size, e.state, e.pins) for k, e in self.index.items()]
        assert got == [(k, self.entries[k].size, self.entries[k].state, self.entries[k].pins)
                       for k in self.order]
        assert len(self.index) == len(self.entries)

    @invariant()
    def counts_kept_in_step(self) -> None:
        assert self.index.usage == self._usage()
        ready = sum(1 for e in self.entries.values() if e.state is READY)
        assert self.index.ready_count == ready
        names = ("hits", "misses", "stores", "store_failures", "evictions", "loads",
                 "discarded")
        assert dict(self.index.stats()) == {
            **{name: self.counters[name] for name in names}, "chunks": ready
        }

    @rule(found=st.lists(st.tuples(key_st, size_st), max_size=5), gone=keys_st)
    def merge_oldest(self, found: list[tuple[OffloadKey, int]], gone: list[OffloadKey]) -> None:
        distinct = dict(reversed(found))  # one size a key, first occurrence's
        keys = list(dict.fromkeys(key for key, _ in found))
        packed = PackedChunks.pack(keys, [distinct[key] for key in keys])
        added = [key for key in keys if key not in self.entries and key not in gone]
        for key in reversed(added):
            self.entries[key] = ModelEntry(distinct[key], READY)
            self.order.insert(0, key)
        victims: list[OffloadKey] = []
        if self.capacity is not None and self._usage() > self.capacity:
            victims = self._pick(self._usage() - self.capacity, set()) or self._evictable(set())
        assert self.index.merge_oldest(packed, gone) == IndexChange(added, victims)
        kept = [key for key in added if key not in victims]
        if kept:
            self.events.append((kept, False))
        for key in victims:
            self._remove(key)
        if victims:
            self.counters["evictions"] += len(victims)
        earlier = [key for key in victims if key not in added]
        if earlier:
            self.events.append((earlier, True))


TestChunkIndexMachine = ChunkIndexMachine.TestCase
TestChunkIndexMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)


def _index(capacity: int | None = 4) -> CompactChunkIndex:
    return CompactChunkIndex(capacity, tier="the test tier", medium=Medium.CPU)


def _stored(index: CompactChunkIndex, keys: list[OffloadKey], size: int = 1) -> None:
    assert index.reserve(keys, size) is not None
    index.finish(keys, True)


def test_over_release_raises_and_changes_nothing() -> None:
    index = _index()
    _stored(index, KEYS[:2])
    index.pin([KEYS[0], KEYS[1]])
    with pytest.raises(UnknownKeyError, match=r"pinned 1 times .* released 2 times"):
        index.unpin([KEYS[1], KEYS[0], KEYS[0]])
    assert [e.pins for _, e in index.items()] == [1, 1]


def test_touch_of_a_writing_key_is_ignored() -> None:
    index = _index()
    assert index.reserve([KEYS[0]], 1) is not None
    _stored(index, [KEYS[1]])
    index.touch([KEYS[0]])
    assert [k for k, _ in index.items()] == [KEYS[0], KEYS[1]]


def test_reserve_refusing_changes_nothing() -> None:
    index = _index(capacity=3)
    _stored(index, KEYS[:3])
    index.pin([KEYS[0], KEYS[1]])
    before = [(k, e.size, e.state, e.pins) for k, e in index.items()]
    assert index.reserve([KEYS[3], KEYS[4]], 1) is None
    assert [(k, e.size, e.state, e.pins) for k, e in index.items()] == before
    assert index.usage == 3 and index.stats()["evictions"] == 0


def test_victims_spare_the_batch_and_pinned_keys() -> None:
    index = _index(capacity=3)
    _stored(index, KEYS[:3])
    index.pin([KEYS[1]])
    change = index.reserve([KEYS[0], KEYS[3]], 1)
    assert change == IndexChange([KEYS[3]], [KEYS[2]])


def test_discard_of_a_pinned_key_waits_for_its_last_unpin() -> None:
    index = _index()
    _stored(index, [KEYS[0]])
    index.pin([KEYS[0], KEYS[0]])
    assert index.discard([KEYS[0]]) == []
    assert index.unpin([KEYS[0]]) == []
    assert index.unpin([KEYS[0]]) == [KEYS[0]]
    assert KEYS[0] not in index and index.stats()["discarded"] == 1


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="the test tier: capacity must be positive"):
        _index(capacity=0)


def test_compact_index_takes_keys_of_several_lengths() -> None:
    index = CompactChunkIndex(None, tier="the test tier", medium=Medium.CPU)
    short, long = OffloadKey(b"ab" + bytes(4)), OffloadKey(b"abcdef" * 6)
    padded = OffloadKey(b"ab" + bytes(5))  # the short key padded: a different key
    index.add_ready([(short, 1), (long, 2)])
    assert short in index and long in index and padded not in index
    assert [(k, e.size) for k, e in index.items()] == [(short, 1), (long, 2)]


def test_compact_index_grows_past_its_table() -> None:
    index = CompactChunkIndex(None, tier="the test tier", medium=Medium.CPU)
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(5000)]
    index.add_ready((key, 1) for key in keys)
    for key in keys[::2]:
        index.touch([key])
    assert len(index) == 5000 and all(key in index for key in keys)
    order = [k for k, _ in index.items()]
    assert order == keys[1::2] + keys[::2]
    assert index.evict_lru(2500) == keys[1::2]
    assert list(index.keys()) == keys[::2]


@pytest.mark.parametrize("clustered", [False, True])
def test_a_built_table_reaches_every_slot_from_its_home_cell(clustered: bool) -> None:
    """Every slot is found by probing from its home cell without meeting an empty cell,
    also where runs wrap past the last cell (hashes clustered at the end)."""
    rng = np.random.default_rng(7)
    for _ in range(100):
        size = 2 ** int(rng.integers(4, 11))
        count = int(rng.integers(0, size // 2 + 1))
        hashes = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32)
        if clustered:
            hashes = (hashes % 4 + size - 3).astype(np.uint32)
        table = np.frombuffer(
            build_table(hashes, np.arange(count, dtype=np.int32), size), dtype=np.int32)
        assert sorted(table[table >= 0].tolist()) == list(range(count))
        for slot in range(count):
            cell = int(hashes[slot]) & (size - 1)
            while table[cell] != slot:
                assert table[cell] >= 0, "an empty cell before the slot"
                cell = (cell + 1) & (size - 1)


@pytest.mark.parametrize("keys", [
    [b"\x01\x00\x00\x00", b"\x00\x00\x00\x00", b"\xff\x02\x00\x00"],  # one width, zeros kept
    [b"\x01\x00", b"\x00\x00\x00\x00", b"\x07"],  # widths differ: padding dropped
    [],
])
@pytest.mark.parametrize("slice_keys", [2, compact.SLICE])
def test_key_list_reads_back_padded_keys_exactly(
    keys: list[bytes], slice_keys: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compact, "SLICE", slice_keys)  # 2: passes end inside the keys
    hashes = compact._hashes([OffloadKey(key) for key in keys])
    assert list(hashes) == [hash(key) & 0xFFFFFFFF for key in keys]
    width = max((len(key) for key in keys), default=0)
    key_bytes = bytearray(b"".join(key.ljust(width, b"\0") for key in keys))
    lengths = np.array([len(key) for key in keys], dtype=np.uint16)
    got = key_list(key_bytes, lengths, width)
    assert got == keys
    assert all(type(key) is bytes for key in got)


@pytest.mark.parametrize("low, high", [(0, 50), (-(2**40), 2**40), (10**18, 10**18 + 2**20)])
def test_stable_order_sorts_as_a_stable_argsort(low: int, high: int) -> None:
    rng = np.random.default_rng(high)
    values = rng.integers(low, high, 5000, dtype=np.int64)  # ties among the small ranges
    assert np.array_equal(stable_order(values), np.argsort(values, kind="stable"))
    assert np.array_equal(stable_order(values[:1]), [0])
