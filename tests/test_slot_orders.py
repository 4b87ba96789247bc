"""The slot-indexed twins of the built-in policies (kvtiers/policies/slots.py) against the
key-based policies they stand in for: random operation sequences must pick the same victims
in the same order, directly and through the CPU tier; and the key path that runs every other
policy."""

from __future__ import annotations

import random
from collections.abc import Hashable
from typing import Any

import pytest

from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import ReqContext
from kvtiers.policies import ARCPolicy, LRUPolicy, S3FIFOPolicy
from kvtiers.policies.arc import SlotARC
from kvtiers.policies.lru import SlotLRU
from kvtiers.policies.s3fifo import SlotS3FIFO
from kvtiers.policies.slots import KeyOrder, SlotOrder, slot_order
from kvtiers.tiers.cpu import CpuTierManager

BUILTINS = [LRUPolicy, ARCPolicy, S3FIFOPolicy]
SLOT_BYTES = 4096


class _KeyLRU(LRUPolicy):
    """A subclass of a built-in: the tier must run its own methods, through KeyOrder."""


class _KeyARC(ARCPolicy):
    pass


class _KeyS3FIFO(S3FIFOPolicy):
    pass


KEY_PATH: dict[Any, Any] = {LRUPolicy: _KeyLRU, ARCPolicy: _KeyARC, S3FIFOPolicy: _KeyS3FIFO}


class Slots:
    """The tier's side of a slot order: slot → key, key → slot, free slots."""

    def __init__(self, capacity: int) -> None:
        self.keys: list[Any] = [None] * capacity
        self.slot_of: dict[Any, int] = {}
        self.free = list(range(capacity - 1, -1, -1))

    def take(self, key: Hashable) -> int:
        slot = self.free.pop()
        self.keys[slot] = key
        self.slot_of[key] = slot
        return slot

    def give_back(self, slot: int) -> Any:
        key = self.keys[slot]
        assert key is not None
        self.keys[slot] = None
        del self.slot_of[key]
        self.free.append(slot)
        return key


def test_builtins_get_their_twins_and_every_other_policy_the_key_path() -> None:
    slots = Slots(4)
    twins: dict[Any, type[SlotOrder]] = {
        LRUPolicy: SlotLRU, ARCPolicy: SlotARC, S3FIFOPolicy: SlotS3FIFO
    }
    for policy_class, twin in twins.items():
        order = slot_order(policy_class(4), 4, slots.keys, slots.slot_of.get)
        assert type(order) is twin
        assert (order.recency, order.shields_request_head) == (
            policy_class.recency, policy_class.shields_request_head
        )
        custom = slot_order(KEY_PATH[policy_class](4), 4, slots.keys, slots.slot_of.get)
        assert isinstance(custom, KeyOrder)
        # Given the class, as a tier built from YAML is: the same twin, and no key-based
        # policy built to be thrown away; a subclass gets an instance of its own.
        assert type(slot_order(policy_class, 4, slots.keys, slots.slot_of.get)) is twin
        assert policy_class.slot_twin is twin
        by_class = slot_order(KEY_PATH[policy_class], 4, slots.keys, slots.slot_of.get)
        assert isinstance(by_class, KeyOrder)
        assert type(by_class.policy) is KEY_PATH[policy_class]
        assert by_class.policy.capacity == 4


@pytest.mark.parametrize("policy_class", BUILTINS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("seed", range(25))
def test_the_twin_picks_the_key_policys_victims(
    policy_class: Any, seed: int
) -> None:
    """Inserts (fresh keys and keys evicted before: ghost hits), touches, refreshes,
    removes and evictions with protected and shielded keys, in the same order on both."""
    rng = random.Random(seed)
    capacity = rng.choice([1, 3, 8, 20])
    slots = Slots(capacity)
    reference = policy_class(capacity)
    twin = slot_order(policy_class(capacity), capacity, slots.keys, slots.slot_of.get)
    assert not isinstance(twin, KeyOrder)
    evicted: list[str] = []
    fresh = 0
    for step in range(300):
        tracked = list(slots.slot_of)
        op = rng.random()
        if op < 0.35 and slots.free:
            if evicted and rng.random() < 0.4:
                key = evicted.pop(rng.randrange(len(evicted)))
            else:
                key, fresh = f"k{fresh}", fresh + 1
            reference.insert(key)
            twin.insert(slots.take(key))
        elif op < 0.55 and tracked:
            key = rng.choice(tracked)
            reference.touch(key)
            twin.touch(slots.slot_of[key])
        elif op < 0.65 and tracked:
            key = rng.choice(tracked)
            reference.refresh(key)
            twin.refresh(slots.slot_of[key])
        elif op < 0.7 and tracked:
            key = rng.choice(tracked)
            reference.remove(key)
            twin.remove(slots.slot_of[key])
            slots.give_back(slots.slot_of[key])
        else:
            protected = set(rng.sample(tracked, rng.randint(0, len(tracked))))
            shielded = set(rng.sample(sorted(protected), rng.randint(0, len(protected))))
            assert twin.evictable(protected, shielded) == reference.evictable(
                protected, shielded
            ), f"step {step}: evictable"
            n = rng.randint(0, capacity)
            want = reference.evict(n, protected, shielded)
            got = twin.evict(n, protected, shielded)
            got_keys = None if got is None else [slots.give_back(slot) for slot in got]
            assert got_keys == want, f"step {step}: evict({n}) picked {got_keys}, not {want}"
            evicted += want or []
        assert len(twin) == len(reference), f"step {step}: tracked count"
        assert all(twin.tracks(key) for key in slots.slot_of), f"step {step}: tracks"


def test_lru_twin_evicts_least_recently_used_first() -> None:
    slots = Slots(4)
    order = SlotLRU(4, slots.keys, slots.slot_of.get)
    for key in "abcd":
        order.insert(slots.take(key))
    order.touch(slots.slot_of["a"])
    order.refresh(slots.slot_of["c"])
    victims = order.evict(4, protected={"b"})
    assert victims is None  # only 3 unprotected: nothing changes
    victims = order.evict(3, protected={"b"})
    assert victims is not None
    assert [slots.keys[slot] for slot in victims] == ["d", "a", "c"]
    assert len(order) == 1


def test_arc_twin_moves_a_touched_key_to_t2_and_evicts_t1_first() -> None:
    slots = Slots(4)
    order = SlotARC(4, slots.keys, slots.slot_of.get)
    for key in "abcd":
        order.insert(slots.take(key))
    order.touch(slots.slot_of["a"])  # a: T2; b, c, d: T1 oldest first
    order.refresh(slots.slot_of["b"])  # b: newest of T1
    victims = order.evict(4)
    assert victims is not None
    assert [slots.keys[slot] for slot in victims] == ["c", "d", "b", "a"]


def test_s3fifo_twin_gives_used_keys_another_lap() -> None:
    slots = Slots(10)
    order = SlotS3FIFO(10, slots.keys, slots.slot_of.get)
    for key in "abc":
        order.insert(slots.take(key))
    for _ in range(2):
        order.touch(slots.slot_of["a"])  # used twice: promoted to main, not dropped
    victims = order.evict(2)
    assert victims is not None
    assert [slots.keys[slot] for slot in victims] == ["b", "c"]


def keys_of(count: int, start: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(start, start + count)]


@pytest.mark.parametrize("policy_class", BUILTINS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("seed", range(6))
def test_the_tier_evicts_as_the_key_path_does(
    policy_class: Any, seed: int
) -> None:
    """The same requests (loads, stores, finishes, touches, demotions) through a CPU tier
    running the twin and one running the key policy itself: the same evictions."""
    rng = random.Random(seed)
    capacity = 16
    fast = CpuTierManager(capacity, SLOT_BYTES, policy_class(capacity))
    keyed = CpuTierManager(capacity, SLOT_BYTES, KEY_PATH[policy_class](capacity))
    assert not isinstance(fast._order, KeyOrder) and isinstance(keyed._order, KeyOrder)
    universe = keys_of(40, 1000 * seed)
    try:
        for r in range(60):
            ctx_fast, ctx_keyed = ReqContext(req_id=f"r{r}"), ReqContext(req_id=f"r{r}")
            announced = rng.random() < 0.8
            if announced:
                fast.on_new_request(ctx_fast)
                keyed.on_new_request(ctx_keyed)
            start = rng.randrange(len(universe) - 8)
            prompt = universe[start : start + rng.randint(1, 8)]
            present = [key for key in prompt if fast.slot_of(key) is not None]
            assert present == [key for key in prompt if keyed.slot_of(key) is not None]
            if present and rng.random() < 0.7:
                fast.prepare_load(present, ctx_fast)
                keyed.prepare_load(present, ctx_keyed)
                fast.complete_load(present, ctx_fast)
                keyed.complete_load(present, ctx_keyed)
            accepted = fast.prepare_store(prompt, ctx_fast)
            assert accepted == keyed.prepare_store(prompt, ctx_keyed), f"round {r}: stored"
            if accepted:
                fast.complete_store(accepted, ctx_fast)
                keyed.complete_store(accepted, ctx_keyed)
            if rng.random() < 0.2:
                touched = rng.sample(universe, 5)
                fast.touch(touched, ctx_fast)
                keyed.touch(touched, ctx_keyed)
            if rng.random() < 0.1:
                held_fast, held_keyed = fast.evict_held(2), keyed.evict_held(2)
                assert list(held_fast) == list(held_keyed), f"round {r}: demoted"
                fast.release_held(held_fast.values())
                keyed.release_held(held_keyed.values())
            if announced:
                fast.on_request_finished(ctx_fast)
                keyed.on_request_finished(ctx_keyed)
            want = [(list(e.keys), e.removed) for e in keyed.take_events()]
            assert [(list(e.keys), e.removed) for e in fast.take_events()] == want, (
                f"round {r}: events"
            )
    finally:
        fast.shutdown()
        keyed.shutdown()


def test_a_custom_policy_runs_through_its_own_methods() -> None:
    calls: list[tuple[str, Hashable]] = []

    class Recording(LRUPolicy):
        def insert(self, key: Hashable) -> None:
            calls.append(("insert", key))
            super().insert(key)

        def touch(self, key: Hashable) -> None:
            calls.append(("touch", key))
            super().touch(key)

    manager = CpuTierManager(2, SLOT_BYTES, Recording(2))
    ctx = ReqContext(req_id="a")
    a, b, c = keys_of(3, 0)
    assert manager.prepare_store([a, b], ctx) == [a, b]
    manager.complete_store([a, b], ctx)
    manager.touch([a], ctx)
    assert manager.prepare_store([c], ctx) == [c]  # b is the least recently used
    assert manager.slot_of(b) is None and manager.slot_of(a) is not None
    assert calls == [("insert", a), ("insert", b), ("touch", a)]
    order: SlotOrder = manager._order
    assert isinstance(order, KeyOrder) and order.policy is manager.policy
    manager.shutdown()
