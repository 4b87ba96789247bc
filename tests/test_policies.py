"""Eviction policies: one shared test class run against each policy, then what makes each
policy itself, and the name / dotted-path resolver."""

from __future__ import annotations

import copy
from collections.abc import Collection, Hashable
from typing import Any, ClassVar

import pytest

from kvtiers.errors import ConfigError
from kvtiers.policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    load_policy,
)


class PolicyTests:
    """Behaviour every policy shares. Subclasses set ``policy_class``."""

    policy_class: ClassVar[type[EvictionPolicy]]

    def make(self, keys: Collection[Hashable] = (), capacity: int = 8) -> EvictionPolicy:
        policy = self.policy_class(capacity)
        for key in keys:
            policy.insert(key)
        return policy

    def drain(self, policy: EvictionPolicy) -> list[Any]:
        victims = policy.evict(len(policy))
        assert victims is not None
        return victims

    def test_tracks_inserted_keys(self) -> None:
        policy = self.make(range(5))
        assert len(policy) == 5
        assert all(key in policy for key in range(5))
        assert 5 not in policy

    def test_evict_returns_exactly_n_tracked_keys_and_untracks_them(self) -> None:
        policy = self.make(range(6))
        victims = policy.evict(4)
        assert victims is not None and len(victims) == 4 and len(set(victims)) == 4
        assert set(victims) <= set(range(6))
        assert len(policy) == 2
        assert not any(key in policy for key in victims)

    def test_evict_nothing(self) -> None:
        policy = self.make(range(3))
        assert policy.evict(0) == []
        assert len(policy) == 3

    def test_protected_keys_are_never_victims(self) -> None:
        policy = self.make(range(6))
        for key in range(6):
            policy.touch(key)
        victims = policy.evict(4, protected={0, 3})
        assert victims is not None and set(victims) == {1, 2, 4, 5}
        assert 0 in policy and 3 in policy

    def test_refused_eviction_changes_nothing(self) -> None:
        policy = self.make(range(6))
        policy.touch(2)
        twin = copy.deepcopy(policy)
        assert policy.evict(5, protected={0, 1}) is None
        assert policy.evict(7) is None
        assert len(policy) == 6
        assert self.drain(policy) == self.drain(twin)

    def test_remove_untracks_without_evicting(self) -> None:
        policy = self.make(range(3))
        policy.remove(1)
        policy.remove(42)
        assert len(policy) == 2 and 1 not in policy
        assert sorted(self.drain(policy)) == [0, 2]

    def test_touching_an_unknown_key_is_ignored(self) -> None:
        policy = self.make(range(2))
        policy.touch(42)
        assert 42 not in policy and len(policy) == 2

    def test_reinsert_after_eviction(self) -> None:
        policy = self.make(range(4), capacity=4)
        victims = policy.evict(2)
        assert victims is not None
        for key in victims:
            policy.insert(key)
        assert len(policy) == 4 and all(key in policy for key in range(4))

    def test_evictable_is_the_most_one_evict_takes(self) -> None:
        for protected, shielded in [(set(), set()), ({0, 3}, set()), ({4, 5}, {4, 5})]:
            policy = self.make(range(6))
            for key in (0, 1):
                policy.touch(key)
            most = policy.evictable(protected, shielded)
            assert policy.evict(most + 1, protected, shielded) is None
            victims = policy.evict(most, protected, shielded)
            assert victims is not None and len(victims) == most
            assert not set(victims) & protected

    def test_long_run_respects_capacity_and_protection(self) -> None:
        capacity = 16
        policy = self.make(capacity=capacity)
        resident: set[int] = set()
        protected = {1, 2, 3}
        for key in range(400):
            if key % 3 == 0 and resident:
                policy.touch(min(resident))
            if len(resident) == capacity:
                victims = policy.evict(1, protected & resident)
                assert victims is not None and victims[0] not in protected
                resident.discard(victims[0])
            policy.insert(key)
            resident.add(key)
            assert len(policy) == len(resident) <= capacity
        assert protected <= resident


class TestLRU(PolicyTests):
    policy_class = LRUPolicy

    def test_victims_are_least_recently_used_first(self) -> None:
        policy = self.make(range(5))
        policy.touch(0)
        policy.touch(2)
        assert policy.evict(3) == [1, 3, 4]
        assert self.drain(policy) == [0, 2]


class TestARC(PolicyTests):
    policy_class = ARCPolicy

    def test_keys_used_again_outlive_keys_seen_once(self) -> None:
        policy = self.make(range(4), capacity=4)
        policy.touch(0)
        policy.touch(1)
        assert policy.evict(2) == [2, 3]

    def test_a_ghost_hit_comes_back_seen_once_and_grows_p(self) -> None:
        policy = self.make(range(4), capacity=4)
        assert isinstance(policy, ARCPolicy)
        assert policy.evict(1) == [0]
        policy.insert(0)
        # 0 came back from the B1 ghost list: a store is not a use, so it enters T1 (the
        # paper's T2 is for keys loaded again), and the B1 hit grows T1's target p to 1.
        assert list(policy._t1) == [1, 2, 3, 0] and not policy._t2
        assert policy._p == 1

    def test_p_moves_one_step_per_eviction_round(self) -> None:
        policy = self.make(range(4), capacity=4)
        assert isinstance(policy, ARCPolicy)
        assert policy.evict(2) == [0, 1]
        policy.insert(0)
        policy.insert(1)
        # Two ghosts of one batch re-stored: one miss of one prompt, so one step (a step
        # per key would make p 2).
        assert policy._p == 1
        assert policy.evict(1) == [2]  # a new round
        policy.insert(2)
        assert policy._p == 2

    def test_a_prompt_that_holds_t1_takes_no_t2_key(self) -> None:
        policy = self.make(capacity=4)
        for key in (0, 1):
            policy.insert(key)
            policy.touch(key)  # loaded again: T2
        policy.insert(2)
        policy.insert(3)
        # T1 (2, 3) is over its target p = 0 and holds the storing request's own keys:
        # they stay, and T2's keys are not taken in their place.
        assert policy.evict(1, {2, 3}, shielded={2, 3}) is None
        assert policy.evictable({2, 3}, shielded={2, 3}) == 0
        assert len(policy) == 4
        # Keys protected for another reason (pins) do not stop T2 from giving a victim.
        assert policy.evict(1, {2, 3}) == [0]
        # A T1 key the request does not hold goes first.
        policy.insert(4)
        assert policy.evict(1, {2, 3}, shielded={2, 3}) == [4]


class TestS3FIFO(PolicyTests):
    policy_class = S3FIFOPolicy

    def test_one_hit_wonders_leave_before_frequent_keys(self) -> None:
        policy = self.make(range(10), capacity=10)
        for _ in range(2):
            policy.touch(0)
        victims = policy.evict(9)
        assert victims is not None and 0 not in victims and 0 in policy

    def test_a_ghost_hit_goes_to_the_main_queue(self) -> None:
        policy = self.make(range(10), capacity=10)
        assert policy.evict(1) == [0]
        policy.insert(0)
        policy.insert(10)
        victims = policy.evict(9)
        assert victims is not None and 0 not in victims


class _ThirdParty(LRUPolicy):
    pass


def test_load_policy_by_name_and_by_dotted_path() -> None:
    assert load_policy("lru") is LRUPolicy
    assert load_policy("arc") is ARCPolicy
    assert load_policy("s3fifo") is S3FIFOPolicy
    assert load_policy(f"{__name__}:_ThirdParty") is _ThirdParty


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("mru", "unknown eviction policy 'mru'"),
        ("no_such_module_xyz:Policy", "cannot import module"),
        (f"{__name__}:PolicyTests", "is not an EvictionPolicy subclass"),
        (f"{__name__}:missing", "has no class 'missing'"),
    ],
)
def test_load_policy_errors_name_the_problem(name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_policy(name)
    assert info.value.path == "policy"
