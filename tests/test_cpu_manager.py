"""The CPU tier manager: a Hypothesis state machine against a dict model for each policy,
plus the details the shared conformance suite leaves open (slot states, stats, factory)."""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, Medium, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.errors import ConfigError, UnknownKeyError
from kvtiers.policies import BUILTIN_POLICIES, ARCPolicy, load_policy
from kvtiers.tiers.cpu import CpuTierManager, SlotRegion, SlotState, build_tier

CTX = ReqContext(req_id="test")
CAPACITY = 4
SLOT_BYTES = 4096
KEYS = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(10)]


def payload(key: OffloadKey, generation: int) -> bytes:
    return (key + generation.to_bytes(4, "big")) * 8


class CpuTierMachine(RuleBasedStateMachine):
    """Drives a CPU tier with stores, loads, touches and resets; the model is a dict of
    key → (state, payload, pins). Evictions are the only changes the model does not
    predict; each one is checked to have hit a ready, unpinned key.

    Resets follow vLLM's protocol: completions of jobs from before a reset are dropped, and
    the fenced slots come back at ``on_reset_flushed``; ``fenced`` counts them."""

    policy = "lru"
    staging = False
    in_flight = Bundle("in_flight")

    def __init__(self) -> None:
        super().__init__()
        self.region = SlotRegion(CAPACITY, SLOT_BYTES)
        policy = load_policy(self.policy)(CAPACITY)
        self.manager = CpuTierManager(CAPACITY, SLOT_BYTES, policy, region=self.region)
        self.manager.staging = self.staging
        self.model: dict[OffloadKey, tuple[SlotState, bytes]] = {}
        self.pins: dict[OffloadKey, int] = {}
        self.generation = 0
        self.fenced = 0

    def teardown(self) -> None:
        self.manager.shutdown()

    def observe(self) -> tuple[object, ...]:
        m = self.manager
        return tuple((m.slot_state(k), m.slot_of(k), m.pin_count(k)) for k in KEYS)

    def sync_evictions(self) -> None:
        for key in list(self.model):
            if self.manager.slot_state(key) is SlotState.FREE:
                state, _ = self.model.pop(key)
                assert state is SlotState.READY and key not in self.pins, "evicted a busy key"

    @rule(target=in_flight, keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def begin_store(self, keys: list[OffloadKey]) -> tuple[OffloadKey, ...]:
        before = self.observe()
        stats = dict(self.manager.get_stats())
        accepted = self.manager.prepare_store(keys, CTX)
        wanted = list(dict.fromkeys(k for k in keys if k not in self.model))
        busy = {k for k, (s, _) in self.model.items() if s is SlotState.WRITING}
        busy |= set(self.pins) | (set(keys) & set(self.model))
        room = CAPACITY - self.fenced - len(busy)
        free = CAPACITY - self.fenced - len(self.model)
        # All of them when they fit, evicting what it takes; else the leading keys the
        # free slots hold, evicting nothing (a staging tier: all that fit).
        fits = len(wanted) <= room
        expected = wanted if fits else wanted[: max(room if self.staging else free, 0)]
        if accepted is None:
            assert self.observe() == before and dict(self.manager.get_stats()) == stats
            assert wanted and not expected, "refused a store that fits"
            return ()
        if not fits and not self.staging:
            assert self.manager.get_stats()["evictions"] == stats["evictions"]
        self.sync_evictions()
        assert accepted == expected
        spec = self.manager.get_spec(accepted)
        assert isinstance(spec, CPULoadStoreSpec)
        self.generation += 1
        for key, slot in zip(accepted, spec.slot_ids.tolist(), strict=True):
            data = payload(key, self.generation)
            self.region.view(slot)[: len(data)] = data
            self.model[key] = (SlotState.WRITING, data)
        return tuple(accepted)

    @rule(batch=in_flight, success=st.booleans())
    def finish_store(self, batch: tuple[OffloadKey, ...], success: bool) -> None:
        writing = [k for k in batch if self.model.get(k, (None,))[0] is SlotState.WRITING]
        self.manager.complete_store(writing, CTX, success=success)
        for key in writing:
            if success:
                self.model[key] = (SlotState.READY, self.model[key][1])
            else:
                del self.model[key]

    @precondition(lambda self: any(s is SlotState.READY for s, _ in self.model.values()))
    @rule(data=st.data())
    def begin_load(self, data: st.DataObject) -> None:
        ready = sorted(k for k, (s, _) in self.model.items() if s is SlotState.READY)
        key = data.draw(st.sampled_from(ready))
        self.manager.prepare_load([key], CTX)
        self.pins[key] = self.pins.get(key, 0) + 1
        (slot,) = self.manager.get_spec([key]).block_ids.tolist()
        stored = self.model[key][1]
        assert bytes(self.region.view(slot)[: len(stored)]) == stored

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.manager.complete_load([key], CTX)
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def touch(self, keys: list[OffloadKey]) -> None:
        self.manager.touch(keys, CTX)

    @rule()
    def reset(self) -> None:
        self.manager.reset_cache()
        self.fenced += sum(
            1 for key, (state, _) in self.model.items()
            if state is SlotState.WRITING or key in self.pins
        )
        self.model.clear()
        self.pins.clear()

    @rule()
    def reset_flushed(self) -> None:
        self.manager.on_reset_flushed()
        self.fenced = 0

    @invariant()
    def matches_model(self) -> None:
        expected = {SlotState.READY: LookupResult.HIT, SlotState.WRITING: LookupResult.HIT_PENDING}
        for key in KEYS:
            state = self.model[key][0] if key in self.model else None
            assert self.manager.slot_state(key) is (state or SlotState.FREE)
            want = expected[state] if state else LookupResult.MISS
            assert self.manager.lookup(key, CTX) is want
            assert self.manager.pin_count(key) == self.pins.get(key, 0)

    @invariant()
    def slots_are_unique_and_within_capacity(self) -> None:
        slots = [self.manager.slot_of(k) for k in self.model]
        assert len(slots) <= CAPACITY
        assert len(set(slots)) == len(slots)
        assert all(s is not None and 0 <= s < CAPACITY for s in slots)
        assert self.manager.get_stats()["chunks"] == len(self.model)
        assert self.manager.get_stats()["fenced_slots"] == self.fenced
        assert len(self.model) + self.fenced <= CAPACITY


for _name in BUILTIN_POLICIES:
    for _staging in (False, True):
        _suffix = f"{_name}_staging" if _staging else _name
        _machine: type[CpuTierMachine] = type(
            f"CpuTierMachine_{_suffix}", (CpuTierMachine,), {"policy": _name, "staging": _staging}
        )
        _case = _machine.TestCase
        _case.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
        globals()[f"TestCpuTierStateMachine_{_suffix}"] = _case


# -- details beyond the conformance suite -------------------------------------------
def make_manager(capacity: int = CAPACITY, policy: str = "lru") -> CpuTierManager:
    return CpuTierManager(capacity, SLOT_BYTES, load_policy(policy)(capacity))


def test_slot_states_and_pins_are_explicit() -> None:
    manager = make_manager()
    key = KEYS[0]
    assert manager.slot_state(key) is SlotState.FREE
    assert manager.prepare_store([key], CTX) == [key]
    assert manager.slot_state(key) is SlotState.WRITING
    manager.complete_store([key], CTX)
    assert manager.slot_state(key) is SlotState.READY
    manager.prepare_load([key, key], CTX)
    assert manager.pin_count(key) == 2
    manager.complete_load([key, key], CTX)
    assert manager.pin_count(key) == 0
    with pytest.raises(UnknownKeyError):
        manager.complete_load([key], CTX)


def test_releasing_more_pins_than_held_changes_nothing() -> None:
    manager = make_manager()
    key, other = KEYS[:2]
    assert manager.prepare_store([key, other], CTX) == [key, other]
    manager.complete_store([key, other], CTX)
    manager.prepare_load([other, key], CTX)
    with pytest.raises(UnknownKeyError, match=r"pinned 1 times .* released 2 times"):
        manager.complete_load([other, key, key], CTX)
    assert (manager.pin_count(other), manager.pin_count(key)) == (1, 1)
    manager.complete_load([other, key], CTX)
    assert (manager.pin_count(other), manager.pin_count(key)) == (0, 0)


def test_present_keys_of_a_batch_survive_the_eviction_it_causes() -> None:
    manager = make_manager(capacity=2)
    for key in KEYS[:2]:
        manager.prepare_store([key], CTX)
        manager.complete_store([key], CTX)
    # KEYS[0] is the LRU victim, but the batch names it as already stored.
    assert manager.prepare_store([KEYS[0], KEYS[2]], CTX) == [KEYS[2]]
    assert manager.lookup(KEYS[0], CTX) is LookupResult.HIT
    assert manager.lookup(KEYS[1], CTX) is LookupResult.MISS
    assert manager.prepare_store([KEYS[0], KEYS[3]], CTX) is None


@pytest.mark.parametrize("policy", sorted(BUILTIN_POLICIES))
def test_a_store_larger_than_the_room_left_takes_the_free_slots_and_evicts_nothing(
    policy: str,
) -> None:
    """The chunks it would evict are what the next requests reuse: a store that cannot fit
    whole keeps its leading keys in the free slots only (one-tier: nothing below to keep
    what it evicts)."""
    manager = make_manager(capacity=4, policy=policy)
    assert manager.prepare_store(KEYS[:3], CTX) == KEYS[:3]
    manager.complete_store(KEYS[:3], CTX)
    # 6 new keys: 1 slot free and 3 chunks evictable are too few.
    assert manager.prepare_store(KEYS[3:9], CTX) == [KEYS[3]]
    assert [manager.lookup(key, CTX) for key in KEYS[:3]] == [LookupResult.HIT] * 3
    assert manager.get_stats()["evictions"] == 0
    manager.complete_store([KEYS[3]], CTX)
    # Full: none fits without evicting, so none is reserved and nothing changes.
    assert manager.prepare_store(KEYS[4:9], CTX) is None
    assert manager.get_stats()["chunks"] == 4 and manager.get_stats()["evictions"] == 0
    # A store that fits whole still evicts for it.
    assert manager.prepare_store(KEYS[4:6], CTX) == KEYS[4:6]
    assert manager.get_stats()["evictions"] == 2


@pytest.mark.parametrize("policy", sorted(BUILTIN_POLICIES))
def test_a_staging_tier_evicts_for_the_leading_keys_of_a_store_larger_than_the_room_left(
    policy: str,
) -> None:
    """Under write-through lower tiers what the primary evicts lives on below, and the head
    it keeps reaches them: a store that cannot fit whole takes every slot it can."""
    manager = make_manager(capacity=4, policy=policy)
    manager.staging = True
    assert manager.prepare_store(KEYS[:3], CTX) == KEYS[:3]
    manager.complete_store(KEYS[:3], CTX)
    assert manager.prepare_store(KEYS[3:9], CTX) == KEYS[3:7]
    assert manager.get_stats()["evictions"] == 3


def test_under_arc_a_long_once_seen_prompt_keeps_its_head_and_the_reused_prefix() -> None:
    manager = make_manager(capacity=8, policy="arc")
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(100, 112)]
    reused, prompt = keys[:4], keys[4:]

    def request(req_id: str, load: list[OffloadKey], store: list[OffloadKey]) -> None:
        ctx = ReqContext(req_id=req_id)
        manager.on_new_request(ctx)
        if load:
            manager.prepare_load(load, ctx)
            manager.complete_load(load, ctx)
        for start in range(0, len(store), 2):
            accepted = manager.prepare_store(store[start : start + 2], ctx)
            if accepted:
                manager.complete_store(accepted, ctx)
        manager.on_request_finished(ctx)

    request("a", [], reused)
    request("b", reused, [])  # loaded again: ARC's frequent list
    request("c", [], prompt)  # 8 once-seen keys, room for 4
    hits = [manager.lookup(key, CTX) is LookupResult.HIT for key in keys]
    # The prompt stores its head and then nothing: its later stores neither evict its own
    # head (the tail alone is of no use) nor the prefix used again (scan resistance).
    assert hits == [True] * 4 + [True] * 4 + [False] * 4


def test_stats_and_events() -> None:
    manager = make_manager(capacity=2)
    manager.prepare_store(KEYS[:2], CTX)
    manager.complete_store(KEYS[:2], CTX)
    manager.prepare_store([KEYS[2]], CTX)
    manager.complete_store([KEYS[2]], CTX, success=False)
    manager.prepare_load([KEYS[1]], CTX)
    manager.prepare_store([KEYS[3]], CTX)
    stats = manager.get_stats()
    assert {k: stats[k] for k in ("stores", "store_failures", "evictions", "loads", "chunks")} == {
        "stores": 2,
        "store_failures": 1,
        "evictions": 1,
        "loads": 1,
        "chunks": 2,
    }
    assert (stats["usage_bytes"], stats["capacity_bytes"]) == (2 * SLOT_BYTES, 2 * SLOT_BYTES)
    events = list(manager.take_events())
    # The failed store frees a reservation never announced: a bookkeeping-only removal.
    assert [(e.keys, e.removed, e.medium, e.metadata_only) for e in events] == [
        (KEYS[:2], False, Medium.CPU, False),
        ([KEYS[0]], True, Medium.CPU, False),
        ([KEYS[2]], True, Medium.CPU, True),
    ]


def test_forwarded_removals_replace_events() -> None:
    """After forward_removals every removed key lands on its list, in order, and no event
    is built; a freed reservation (never stored) is no removal."""
    manager = make_manager(capacity=2)
    manager.prepare_store(KEYS[:2], CTX)
    manager.complete_store(KEYS[:2], CTX)
    manager.prepare_store([KEYS[2]], CTX)  # evicts KEYS[0]: an event not taken yet
    removed = manager.forward_removals()
    assert removed == [KEYS[0]]  # the pending removal moved onto the list
    assert manager.forward_removals() is removed
    assert list(manager.take_events()) == []
    manager.complete_store([KEYS[2]], CTX, success=False)
    assert removed == [KEYS[0]]
    removed.clear()
    assert manager.prepare_store([KEYS[3]], CTX) == [KEYS[3]]  # the freed slot
    manager.complete_store([KEYS[3]], CTX)
    assert manager.prepare_store([KEYS[4]], CTX) == [KEYS[4]]  # evicts KEYS[1]
    manager.reset_cache()  # forgets KEYS[3]; KEYS[4], being written, is fenced
    assert removed == [KEYS[1], KEYS[3]]
    assert list(manager.take_events()) == []
    assert manager.get_stats()["evictions"] == 2


def test_shutdown_calls_each_callback_once() -> None:
    manager = make_manager()
    calls: list[str] = []
    manager.on_shutdown(lambda: calls.append("closed"))
    manager.shutdown()
    manager.shutdown()
    assert calls == ["closed"]


def test_prepare_load_spec_pins_and_addresses_as_prepare_load_and_get_spec() -> None:
    one, two = make_manager(policy="arc"), make_manager(policy="arc")
    for manager in (one, two):
        manager.prepare_store(KEYS[:3], CTX)
        manager.complete_store(KEYS[:3], CTX)
    keys = [KEYS[2], KEYS[0], KEYS[2]]
    spec = one.prepare_load_spec(keys, CTX)
    two.prepare_load(keys, CTX)
    assert spec.slot_ids.tolist() == two.get_spec(keys).slot_ids.tolist()
    assert [one.pin_count(k) for k in KEYS[:3]] == [two.pin_count(k) for k in KEYS[:3]] == [1, 0, 2]
    with pytest.raises(UnknownKeyError, match="prepare_load"):
        one.prepare_load_spec([KEYS[1], KEYS[5]], CTX)
    assert one.pin_count(KEYS[1]) == 0


def test_a_spec_made_from_a_list_is_a_snapshot_read_as_an_int64_array() -> None:
    """The slots are converted on first read (by the worker), as the list was given."""
    slots = [3, 1]
    spec = CPULoadStoreSpec(slots)
    slots.append(7)
    assert len(spec) == 2
    copied = copy.copy(spec)
    copied.set_gpu_block_offset(1)
    again = pickle.loads(pickle.dumps(spec))
    for each in (spec, copied, again):
        assert each.slot_ids.dtype == np.int64 and each.slot_ids.tolist() == [3, 1]
        assert each.block_ids is each.slot_ids and len(each) == 2
    assert (spec.gpu_block_offset, copied.gpu_block_offset) == (0, 1)


@pytest.mark.parametrize(("policy", "recency"), [("lru", True), ("arc", False), ("s3fifo", False)])
def test_capabilities_follow_the_policy(policy: str, recency: bool) -> None:
    caps = make_manager(policy=policy).capabilities
    assert (caps.recency, caps.evicts, caps.persistent, caps.events) == (recency, True, False, True)


@dataclass(frozen=True)
class Settings:
    capacity: int
    policy: str = "arc"
    shared_memory_name: str | None = None


OFFLOADING = OffloadingConfig(
    groups=(OffloadingGroupConfig(16, ("l0", "l1"), 5000),),
    model=OffloadingModelConfig("test-model"),
    cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
)


def test_factory_builds_region_manager_and_worker() -> None:
    slot = 12288  # 2 blocks x 5000 bytes, rounded up to 4096
    tier = build_tier(
        Settings(capacity=3 * slot + 100), OFFLOADING, primary_region=None, name="cpu0"
    )
    try:
        assert isinstance(tier.manager, CpuTierManager)
        assert (tier.manager.num_slots, tier.manager.slot_bytes) == (3, slot)
        assert tier.region is not None and (tier.region.num_slots, tier.region.slot_bytes) == (
            3,
            slot,
        )
        # The YAML's name gives the class: the tier runs its slot twin and builds no
        # ARCPolicy instance.
        assert tier.manager.policy is ARCPolicy
        assert tier.make_worker is not None
    finally:
        tier.shutdown()


def test_factory_refuses_a_capacity_below_one_slot() -> None:
    with pytest.raises(ConfigError, match="holds no chunk") as info:
        build_tier(Settings(capacity=4096), OFFLOADING, primary_region=None, name="cpu0")
    assert info.value.path == "capacity"


def test_lookup_as_answers_like_lookup_and_counts_the_same_across_a_reset() -> None:
    manager = make_manager(capacity=2)
    lookup = manager.lookup_as("hit", "miss", "pending")
    manager.prepare_store(KEYS[:2], CTX)
    manager.complete_store([KEYS[0]], CTX)
    assert [lookup(key, CTX) for key in KEYS[:3]] == ["hit", "pending", "miss"]
    manager.reset_cache()  # the function keeps reading the manager's live tables
    assert manager.prepare_store([KEYS[2]], CTX) == [KEYS[2]]
    manager.complete_store([KEYS[2]], CTX)
    assert [lookup(key, CTX) for key in KEYS[:3]] == ["miss", "miss", "hit"]
    stats = manager.get_stats()
    assert (stats["hits"], stats["misses"]) == (2, 3)
