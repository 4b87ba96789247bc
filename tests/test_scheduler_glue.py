"""The scheduler glue turns group-unaware manager answers into correct per-group
transfers: keys, GPU block ids, chunk slots and alignment offsets."""

from __future__ import annotations

import pytest

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.engine.scheduler import OffloadScheduler, TransferPlan
from kvtiers.errors import UnknownKeyError
from kvtiers.testing.memory_tier import InMemoryTier

CONFIG = OffloadingConfig(
    groups=(
        OffloadingGroupConfig(16, ("full.0",), 1024),
        OffloadingGroupConfig(32, ("swa.0",), 512),
    ),
    model=OffloadingModelConfig(name="glue"),
    cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
)
TOKENS = list(range(7, 7 + 200))
# GPU block ids by logical block index, deliberately non-contiguous.
GPU = [[100 + 3 * i for i in range(13)], [500 + 7 * i for i in range(7)]]


def _slots(plan: TransferPlan, group: int) -> list[int]:
    spec = plan.groups[group].offload_spec
    assert isinstance(spec, CPULoadStoreSpec)
    return spec.slot_ids.tolist()


@pytest.fixture
def glue() -> OffloadScheduler:
    scheduler = OffloadScheduler(InMemoryTier(64), CONFIG)
    scheduler.add_request("r", TOKENS)
    return scheduler


def _store_all(glue: OffloadScheduler) -> TransferPlan:
    plan = glue.plan_store("r", len(TOKENS), GPU)
    assert plan is not None
    glue.complete(plan.job_id, success=True)
    return plan


def test_store_plan_covers_every_full_chunk_of_every_group(glue: OffloadScheduler) -> None:
    plan = _store_all(glue)
    assert len(plan.keys) == 6 + 3  # 200 tokens: 6 chunks of 32 tokens, 3 of 64
    assert plan.groups[0].gpu_spec.block_ids.tolist() == GPU[0][:12]
    assert plan.groups[1].gpu_spec.block_ids.tolist() == GPU[1][:6]
    assert len(_slots(plan, 0)) == 6 and len(_slots(plan, 1)) == 3
    assert plan.groups[0].offload_spec.gpu_block_offset == 0
    assert glue.plan_store("r", len(TOKENS), GPU) is None  # nothing new


def test_store_skips_chunks_already_present(glue: OffloadScheduler) -> None:
    _store_all(glue)
    glue.add_request("r2", TOKENS[:100] + [1] * 100)
    plan = glue.plan_store("r2", 200, GPU)
    assert plan is not None
    # 100 shared tokens: 3 chunks of group 0 and 1 chunk of group 1 are already stored.
    assert plan.groups[0].gpu_spec.block_ids.tolist() == GPU[0][6:12]
    assert plan.groups[1].gpu_spec.block_ids.tolist() == GPU[1][2:6]


def test_prefix_is_the_minimum_across_groups(glue: OffloadScheduler) -> None:
    _store_all(glue)
    glue.add_request("r2", TOKENS[:150])
    match = glue.match_prefix("r2")
    # group 0 has 4 chunks (128 tokens) of the 150, group 1 has 2 (128 tokens).
    assert (match.tokens, match.chunks, match.pending) == (128, (4, 2), False)
    assert glue.match_prefix("r2", max_tokens=100).tokens == 96


def test_load_plan_carries_each_groups_offset(glue: OffloadScheduler) -> None:
    stored = _store_all(glue)
    match = glue.match_prefix("r")
    assert match.tokens == 192
    plan = glue.plan_load("r", match, GPU, gpu_cached_tokens=32)
    assert plan is not None
    # group 0: blocks 2..11 (chunks 1..5); group 1: blocks 1..5 (chunks 0..2, skip 1).
    assert plan.groups[0].offload_spec.gpu_block_offset == 2
    assert plan.groups[1].offload_spec.gpu_block_offset == 1
    assert plan.groups[0].gpu_spec.block_ids.tolist() == GPU[0][2:12]
    assert plan.groups[1].gpu_spec.block_ids.tolist() == GPU[1][1:6]
    assert _slots(plan, 0) == _slots(stored, 0)[1:]
    assert _slots(plan, 1) == _slots(stored, 1)


def test_load_pins_until_complete(glue: OffloadScheduler) -> None:
    _store_all(glue)
    plan = glue.plan_load("r", glue.match_prefix("r"), GPU)
    assert plan is not None
    assert len(glue.manager.get_spec(plan.keys)) == len(plan.keys)
    glue.complete(plan.job_id, success=True)
    with pytest.raises(UnknownKeyError):
        glue.manager.get_spec(plan.keys[:1])
    with pytest.raises(UnknownKeyError):
        glue.complete(plan.job_id, success=True)


def test_chunks_being_written_make_the_prefix_pending(glue: OffloadScheduler) -> None:
    plan = glue.plan_store("r", len(TOKENS), GPU)
    assert plan is not None
    match = glue.match_prefix("r")
    assert match.pending and match.tokens == 192
    with pytest.raises(ValueError, match="still arriving"):
        glue.plan_load("r", match, GPU)
    glue.complete(plan.job_id, success=True)
    assert not glue.match_prefix("r").pending


def test_failed_store_leaves_nothing_behind(glue: OffloadScheduler) -> None:
    plan = glue.plan_store("r", len(TOKENS), GPU)
    assert plan is not None
    glue.complete(plan.job_id, success=False)
    assert glue.match_prefix("r").tokens == 0


def test_refused_store_plans_nothing() -> None:
    scheduler = OffloadScheduler(InMemoryTier(3), CONFIG)
    scheduler.add_request("r", TOKENS)
    first = scheduler.plan_store("r", 64, GPU)
    assert first is not None
    scheduler.complete(first.job_id, success=True)
    scheduler.manager.prepare_load(list(first.keys), ReqContext("x"))
    assert scheduler.plan_store("r", len(TOKENS), GPU) is None


def test_tokens_arriving_later_extend_the_keys(glue: OffloadScheduler) -> None:
    glue.add_request("grow", TOKENS[:40])
    assert [len(glue.chunk_keys("grow", g)) for g in (0, 1)] == [1, 0]
    glue.extend_request("grow", TOKENS[40:130])
    assert [len(glue.chunk_keys("grow", g)) for g in (0, 1)] == [4, 2]
    assert glue.chunk_keys("grow", 0) == glue.chunk_keys("r", 0)[:4]


class _RetryAfter(InMemoryTier):
    """Answers RETRY for the given keys (an asynchronous probe under way)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.retry: set[bytes] = set()
        self.looked_up: list[bytes] = []

    def lookup(self, key, ctx):  # type: ignore[no-untyped-def]
        self.looked_up.append(key)
        return LookupResult.RETRY if key in self.retry else super().lookup(key, ctx)


def test_retry_inside_the_prefix_makes_it_pending() -> None:
    manager = _RetryAfter(64)
    glue = OffloadScheduler(manager, CONFIG)
    glue.add_request("r", TOKENS)
    _store_all(glue)
    manager.retry = {glue.chunk_keys("r", 0)[3]}
    match = glue.match_prefix("r")
    assert match.pending and match.tokens == 96
    manager.retry = {glue.chunk_keys("r", 0)[5]}
    assert glue.match_prefix("r", max_tokens=128).pending is False  # beyond the cap


def test_chunks_beyond_the_cap_are_not_looked_up() -> None:
    manager = _RetryAfter(64)
    glue = OffloadScheduler(manager, CONFIG)
    glue.add_request("r", TOKENS)
    _store_all(glue)
    manager.looked_up.clear()
    glue.match_prefix("r", max_tokens=64)
    assert set(manager.looked_up) == {*glue.chunk_keys("r", 0)[:2], glue.chunk_keys("r", 1)[0]}


def test_each_group_loads_from_its_own_first_uncached_block(glue: OffloadScheduler) -> None:
    _store_all(glue)
    plan = glue.plan_load("r", glue.match_prefix("r"), GPU, gpu_cached_tokens=48)
    assert plan is not None
    assert plan.groups[0].offload_spec.gpu_block_offset == 3  # 48 tokens = 3 blocks of 16
    assert plan.groups[1].offload_spec.gpu_block_offset == 1  # 1 whole block of 32
    assert plan.groups[0].gpu_spec.block_ids.tolist() == GPU[0][3:12]


def test_a_group_storing_nothing_keeps_its_position() -> None:
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(32, ("big.0",), 512),
            OffloadingGroupConfig(16, ("small.0",), 1024),
        ),
        model=OffloadingModelConfig(name="glue"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
    )
    glue = OffloadScheduler(InMemoryTier(64), config)
    glue.add_request("r", TOKENS[:40])
    plan = glue.plan_store("r", 40, [[1, 2], [10, 11, 12]])
    assert plan is not None
    assert len(plan.groups) == 2
    assert plan.groups[0].gpu_spec.block_ids.tolist() == []
    assert plan.groups[1].gpu_spec.block_ids.tolist() == [10, 11]
