"""The shared conformance suite of the ``OffloadingManager`` contract.

Every tier (and the composite) passes the same tests. A tier's test module subclasses
:class:`TierConformanceTests` and supplies a factory plus two backdoor helpers that touch
the medium directly::

    class TestMyTier(TierConformanceTests):
        def make_manager(self, capacity_chunks): ...
        def write_chunk(self, manager, spec, index, payload): ...
        def read_chunk(self, manager, spec, index): ...
        def reopen(self, manager): ...          # persistent tiers only

Tests are skipped only through the manager's declared
:class:`~kvtiers.core.manager.TierCapabilities`, never by catching errors. Chunks are
``geometry.chunk_bytes(0)`` bytes of group 0; a tier made with ``capacity_chunks = n`` must
hold exactly ``n`` of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import pytest
import xxhash

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    TierCapabilities,
)
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.errors import UnknownKeyError

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def conformance_key(i: int, group: int = 0) -> OffloadKey:
    """A deterministic key for test chunk ``i``."""
    return make_offload_key(xxhash.xxh3_128_digest(b"conformance:%d" % i), group)


def conformance_payload(i: int, size: int) -> bytes:
    """Deterministic, chunk-specific bytes (no two chunks share a prefix)."""
    seed = xxhash.xxh3_128_digest(b"payload:%d" % i)
    return (seed * (size // len(seed) + 1))[:size]


class TierConformanceTests:
    """The manager contract as tests. See the module docstring for how to use it."""

    geometry: ClassVar[ChunkGeometry] = ChunkGeometry(
        blocks_per_chunk=1, group_bytes_per_block=(8192,)
    )
    capacity_chunks: ClassVar[int] = 4
    tmp_path: Path

    # -- what a tier's test class supplies ------------------------------------------
    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        raise NotImplementedError

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        raise NotImplementedError

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        raise NotImplementedError

    def reopen(self, manager: OffloadingManager) -> OffloadingManager:
        raise NotImplementedError

    def settle(self, manager: OffloadingManager) -> None:
        """Let asynchronous work a store started finish (a composite's cascades)."""

    # -- plumbing -------------------------------------------------------------------
    @pytest.fixture(autouse=True)
    def _conformance_setup(self, tmp_path: Path) -> Iterator[None]:
        self.tmp_path = tmp_path
        # A context per test: a composite keeps the keys a request's lookups found in
        # ctx.keep (never evicted for that request's stores), which must not leak into
        # the next test.
        self.ctx = ReqContext(req_id="conformance")
        self._made: list[OffloadingManager] = []
        yield
        for manager in self._made:
            manager.shutdown()

    def new_manager(self, capacity_chunks: int | None = None) -> OffloadingManager:
        manager = self.make_manager(capacity_chunks or self.capacity_chunks)
        self._made.append(manager)
        return manager

    @property
    def chunk_size(self) -> int:
        return self.geometry.chunk_bytes(0)

    ctx: ReqContext

    def caps(self, manager: OffloadingManager) -> TierCapabilities:
        return manager.capabilities

    def store(
        self, manager: OffloadingManager, ids: Sequence[int], *, success: bool = True
    ) -> list[OffloadKey] | None:
        """prepare_store → get_spec → write each payload → complete_store."""
        keys = [conformance_key(i) for i in ids]
        accepted = manager.prepare_store(keys, self.ctx)
        if accepted is None:
            return None
        if accepted:
            spec = manager.get_spec(accepted)
            by_key = dict(zip(keys, ids, strict=True))
            for index, key in enumerate(accepted):
                payload = conformance_payload(by_key[key], self.chunk_size)
                self.write_chunk(manager, spec, index, payload)
            manager.complete_store(accepted, self.ctx, success=success)
            self.settle(manager)
        return accepted

    def load(self, manager: OffloadingManager, i: int) -> bytes:
        """prepare_load → get_spec → read → complete_load."""
        key = conformance_key(i)
        manager.prepare_load([key], self.ctx)
        try:
            return self.read_chunk(manager, manager.get_spec([key]), 0)
        finally:
            manager.complete_load([key], self.ctx)

    def states(self, manager: OffloadingManager, ids: Sequence[int]) -> list[LookupResult]:
        return [manager.lookup(conformance_key(i), self.ctx) for i in ids]

    def settled_states(
        self, manager: OffloadingManager, ids: Sequence[int]
    ) -> list[LookupResult]:
        """Lookups after letting what they started finish: a composite answers
        ``HIT_PENDING`` while it promotes a chunk from a lower tier, then ``HIT``."""
        first = self.states(manager, ids)
        if PENDING not in first:
            return first
        self.settle(manager)
        return self.states(manager, ids)

    def events(self, manager: OffloadingManager) -> list[OffloadingEvent]:
        """Events of the manager's own storage (a composite marks lower tiers' events
        with their tier name in ``ownership``)."""
        return [e for e in manager.take_events() if e.ownership is None]

    def require(self, manager: OffloadingManager, **flags: bool) -> None:
        caps = self.caps(manager)
        for name, wanted in flags.items():
            if getattr(caps, name) != wanted:
                pytest.skip(f"tier declares {name}={getattr(caps, name)}")

    # -- lookup and store -----------------------------------------------------------
    def test_unknown_key_is_miss(self) -> None:
        manager = self.new_manager()
        assert manager.lookup(conformance_key(0), self.ctx) is MISS

    def test_store_lifecycle(self) -> None:
        manager = self.new_manager()
        keys = [conformance_key(i) for i in range(2)]
        assert manager.prepare_store(keys, self.ctx) == keys
        assert self.states(manager, [0, 1]) == [PENDING, PENDING]
        spec = manager.get_spec(keys)
        assert len(spec) == 2
        for index in range(2):
            self.write_chunk(manager, spec, index, conformance_payload(index, self.chunk_size))
        manager.complete_store(keys, self.ctx)
        self.settle(manager)
        assert self.states(manager, [0, 1]) == [HIT, HIT]

    def test_empty_store_accepts_nothing(self) -> None:
        manager = self.new_manager()
        assert manager.prepare_store([], self.ctx) == []

    def test_present_keys_are_not_returned(self) -> None:
        manager = self.new_manager()
        self.store(manager, [0])
        in_flight = manager.prepare_store([conformance_key(1)], self.ctx)
        assert in_flight == [conformance_key(1)]
        accepted = manager.prepare_store([conformance_key(i) for i in (0, 1, 2, 2)], self.ctx)
        assert accepted == [conformance_key(2)]

    def test_failed_store_is_miss_and_frees_space(self) -> None:
        manager = self.new_manager()
        assert self.store(manager, [0, 1], success=False) is not None
        assert self.states(manager, [0, 1]) == [MISS, MISS]
        ids = list(range(10, 10 + self.capacity_chunks))
        assert self.store(manager, ids) is not None
        assert set(self.states(manager, ids)) == {HIT}

    def test_loaded_bytes_are_the_stored_bytes(self) -> None:
        manager = self.new_manager()
        ids = list(range(self.capacity_chunks))
        self.store(manager, ids)
        for i in ids:
            assert self.load(manager, i) == conformance_payload(i, self.chunk_size), i

    # -- get_spec rules -------------------------------------------------------------
    def test_get_spec_refuses_unknown_and_unpinned_keys(self) -> None:
        manager = self.new_manager()
        with pytest.raises(UnknownKeyError):
            manager.get_spec([conformance_key(0)])
        self.store(manager, [0])
        with pytest.raises(KeyError):
            manager.get_spec([conformance_key(0)])

    def test_get_spec_follows_pins(self) -> None:
        manager = self.new_manager()
        self.store(manager, [0])
        key = conformance_key(0)
        manager.prepare_load([key], self.ctx)
        manager.prepare_load([key], self.ctx)
        assert len(manager.get_spec([key])) == 1
        manager.complete_load([key], self.ctx)
        assert len(manager.get_spec([key])) == 1
        manager.complete_load([key], self.ctx)
        with pytest.raises(UnknownKeyError):
            manager.get_spec([key])

    def test_prepare_load_needs_a_hit(self) -> None:
        manager = self.new_manager()
        with pytest.raises(UnknownKeyError):
            manager.prepare_load([conformance_key(0)], self.ctx)
        manager.prepare_store([conformance_key(1)], self.ctx)
        with pytest.raises(UnknownKeyError):
            manager.prepare_load([conformance_key(1)], self.ctx)

    # -- capacity and eviction ------------------------------------------------------
    def test_capacity_is_never_exceeded(self) -> None:
        manager = self.new_manager()
        for i in range(3 * self.capacity_chunks):
            self.store(manager, [i])
        hits = self.states(manager, range(3 * self.capacity_chunks)).count(HIT)
        assert hits <= self.capacity_chunks

    def test_full_tier_evicts_to_make_room(self) -> None:
        manager = self.new_manager()
        self.require(manager, evicts=True)
        ids = list(range(self.capacity_chunks))
        self.store(manager, ids)
        self.events(manager)
        assert self.store(manager, [100]) == [conformance_key(100)]
        assert manager.lookup(conformance_key(100), self.ctx) is HIT
        assert self.states(manager, ids).count(MISS) == 1

    def test_eviction_is_least_recently_used_first(self) -> None:
        manager = self.new_manager()
        self.require(manager, evicts=True, recency=True)
        ids = list(range(self.capacity_chunks))
        for i in ids:
            self.store(manager, [i])
        manager.touch([conformance_key(0)], self.ctx)
        self.store(manager, [100])
        assert manager.lookup(conformance_key(0), self.ctx) is HIT
        assert manager.lookup(conformance_key(1), self.ctx) is MISS

    def test_full_tier_without_eviction_refuses(self) -> None:
        manager = self.new_manager()
        self.require(manager, evicts=False)
        ids = list(range(self.capacity_chunks))
        self.store(manager, ids)
        assert manager.prepare_store([conformance_key(100)], self.ctx) is None
        assert set(self.states(manager, ids)) == {HIT}

    def test_pinned_and_writing_chunks_are_never_evicted(self) -> None:
        manager = self.new_manager()
        self.require(manager, evicts=True)
        pinned = list(range(self.capacity_chunks - 1))
        self.store(manager, pinned)
        manager.prepare_load([conformance_key(i) for i in pinned], self.ctx)
        writing = manager.prepare_store([conformance_key(50)], self.ctx)
        assert writing == [conformance_key(50)]
        assert manager.prepare_store([conformance_key(51)], self.ctx) is None
        assert set(self.states(manager, pinned)) == {HIT}
        assert manager.lookup(conformance_key(50), self.ctx) is PENDING

    def test_refusal_changes_nothing(self) -> None:
        manager = self.new_manager()
        pinned = list(range(self.capacity_chunks - 1))
        self.store(manager, pinned)
        manager.prepare_load([conformance_key(i) for i in pinned], self.ctx)
        self.events(manager)
        before = dict(manager.get_stats())
        # One of the two fits: a tier either reserves the leading key alone or refuses the
        # batch; a refusal changes nothing.
        accepted = manager.prepare_store([conformance_key(i) for i in (60, 61)], self.ctx)
        if accepted is None:
            assert dict(manager.get_stats()) == before
            assert self.events(manager) == []
            assert self.states(manager, [60, 61]) == [MISS, MISS]
        else:
            assert accepted == [conformance_key(60)]
            assert self.states(manager, [60, 61]) == [PENDING, MISS]
            manager.complete_store(accepted, self.ctx, success=False)
        assert self.store(manager, [62]) == [conformance_key(62)]
        # Nothing fits any more: every tier refuses, changing nothing.
        manager.prepare_load([conformance_key(62)], self.ctx)
        self.events(manager)
        before = dict(manager.get_stats())
        assert manager.prepare_store([conformance_key(63)], self.ctx) is None
        assert dict(manager.get_stats()) == before
        assert self.events(manager) == []
        assert self.states(manager, [63]) == [MISS]

    # -- events and stats -----------------------------------------------------------
    def test_events_report_stores_and_evictions(self) -> None:
        manager = self.new_manager()
        self.require(manager, events=True)
        self.store(manager, [0, 1])
        self.store(manager, [2], success=False)
        events = self.events(manager)
        stored = [k for e in events if not e.removed for k in e.keys]
        assert stored == [conformance_key(0), conformance_key(1)]
        assert all(e.medium == manager.medium for e in events)
        assert self.events(manager) == []
        if self.caps(manager).evicts:
            self.store(manager, range(10, 10 + self.capacity_chunks))
            removed = [k for e in self.events(manager) if e.removed for k in e.keys]
            assert sorted(removed) == sorted([conformance_key(0), conformance_key(1)])

    def test_stats_count_hits_and_misses(self) -> None:
        manager = self.new_manager()
        self.store(manager, [0])
        before = dict(manager.get_stats())
        manager.lookup(conformance_key(0), self.ctx)
        manager.lookup(conformance_key(1), self.ctx)
        after = dict(manager.get_stats())
        assert after["hits"] == before["hits"] + 1
        assert after["misses"] == before["misses"] + 1

    # -- rules every tier shares (docs/architecture.md) ------------------------------
    def test_releasing_more_pins_than_held_raises_and_changes_nothing(self) -> None:
        manager = self.new_manager()
        self.store(manager, [0, 1])
        key, other = conformance_key(0), conformance_key(1)
        manager.prepare_load([other, key], self.ctx)
        with pytest.raises(UnknownKeyError):
            manager.complete_load([other, key, key], self.ctx)
        # Both pins are still held: each key has a spec and releases once more.
        assert len(manager.get_spec([key, other])) == 2
        manager.complete_load([other, key], self.ctx)
        with pytest.raises(UnknownKeyError):
            manager.get_spec([key])

    def test_a_key_named_twice_in_complete_store_counts_once(self) -> None:
        manager = self.new_manager()
        self.require(manager, events=True)
        key, failed = conformance_key(0), conformance_key(1)
        assert manager.prepare_store([key, failed], self.ctx) == [key, failed]
        spec = manager.get_spec([key, failed])
        self.write_chunk(manager, spec, 0, conformance_payload(0, self.chunk_size))
        before = dict(manager.get_stats())
        manager.complete_store([key, key], self.ctx)
        manager.complete_store([failed, failed], self.ctx, success=False)
        self.settle(manager)
        if "stores" in before:  # a tier that counts stores (a composite does not)
            assert manager.get_stats()["stores"] == before["stores"] + 1
        assert self.settled_states(manager, [0, 1]) == [HIT, MISS]
        stored = [k for e in self.events(manager) if not e.removed for k in e.keys]
        assert stored == [key]

    # -- lifecycle ------------------------------------------------------------------
    def test_new_request_gets_a_context(self) -> None:
        manager = self.new_manager()
        assert isinstance(manager.on_new_request(self.ctx), RequestOffloadingContext)
        manager.on_request_finished(self.ctx)

    def test_reset_cache(self) -> None:
        manager = self.new_manager()
        self.store(manager, [0, 1])
        manager.prepare_load([conformance_key(1)], self.ctx)
        manager.reset_cache()
        expected_0 = HIT if self.caps(manager).persistent else MISS
        assert self.settled_states(manager, [0]) == [expected_0]
        # The load from before the reset still completes (an engine that delivers it) and
        # the tier then serves stores again.
        manager.complete_load([conformance_key(1)], self.ctx)
        manager.on_reset_flushed()
        assert self.store(manager, [2]) == [conformance_key(2)]

    def test_a_completion_from_before_a_reset_completes_nothing_newer(self) -> None:
        """A completion carries the generation its job was planned in. A tier whose reset
        dropped the job's key (its generation moved on) stores nothing for it: the key's
        new reservation waits for its own job's bytes. A tier that kept the reservation
        (its generation did not move) completes it with the old job's bytes."""
        manager = self.new_manager()
        key = conformance_key(0)
        old, new = (conformance_payload(i, self.chunk_size) for i in (0, 1))
        generation = manager.generation
        assert manager.prepare_store([key], self.ctx) == [key]
        self.write_chunk(manager, manager.get_spec([key]), 0, old)
        manager.reset_cache()
        again = manager.prepare_store([key], self.ctx)
        manager.complete_store([key], self.ctx, generation=generation)
        self.settle(manager)
        if manager.generation == generation:
            assert again == []
            assert self.load(manager, 0) == old
            return
        assert again == [key]
        assert self.states(manager, [0]) == [PENDING]
        self.write_chunk(manager, manager.get_spec([key]), 0, new)
        manager.complete_store([key], self.ctx, generation=manager.generation)
        self.settle(manager)
        assert self.settled_states(manager, [0]) == [HIT]
        assert self.load(manager, 0) == new

    def test_persisted_chunks_survive_reopen(self) -> None:
        manager = self.new_manager()
        self.require(manager, persistent=True)
        ids = [0, 1]
        self.store(manager, ids)
        reopened = self.reopen(manager)
        self._made.append(reopened)
        assert self.settled_states(reopened, ids) == [HIT, HIT]
        for i in ids:
            assert self.load(reopened, i) == conformance_payload(i, self.chunk_size)

    def test_shutdown_is_idempotent(self) -> None:
        manager = self.make_manager(self.capacity_chunks)
        manager.shutdown()
        manager.shutdown()
