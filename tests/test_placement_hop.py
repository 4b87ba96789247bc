"""Write-back's second hop (docs/architecture.md, "Placement"): a ``back`` tier below a
lower tier that hands its evictions over receives a chunk when *that* tier evicts it —
copied from the primary slot while the primary holds it, else staged through a held
primary slot — and the evicted file or object stays until the copy read it.

Over in-memory tiers with fault injection, and end to end over a real file tier above an
object tier (fsspec ``memory://``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import WritePolicy
from kvtiers.stack.builder import Stack as BuiltStack
from kvtiers.stack.builder import load_stack
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import HandingMemoryTier
from kvtiers.testing.objects import offloading_config
from kvtiers.tiers.file.manager import FileTierManager
from tests.test_placement import CHUNK, CTX, MISS, PENDING, Stack, key

THROUGH, BACK = WritePolicy(), WritePolicy("back")


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        for mover in stack.movers:
            mover.gate.set()
        stack.manager.shutdown()


def hop_stack(slots: int = 2, above: int = 2) -> Stack:
    """cpu (``slots``) → mem0 (through, ``above`` chunks, hands evictions over) → mem1
    (back)."""
    return Stack(THROUGH, BACK, slots=slots, lower_chunks=(above, 64), handing=True)


def settle(stack: Stack) -> None:
    stack.manager.wait_idle()
    stack.manager.on_schedule_end(ScheduleEndContext())
    stack.manager.wait_idle()


def test_the_back_tier_receives_what_the_tier_above_evicts_not_the_primary(
    stacks: list[Stack],
) -> None:
    stacks.append(stack := hop_stack(slots=2, above=2))
    for i in range(4):
        stack.store(i)
        settle(stack)
    # The primary evicted 0 and 1 long ago; mem0 evicted 0 and 1 when 2 and 3 came.
    assert stack.held(0) == {2, 3}
    assert stack.held(1) == {0, 1}, "the back tier must receive exactly mem0's evictions"
    stats = stack.manager.get_stats()
    assert stats["mem1.demoted"] == 2 and stats.get("mem1.cascaded", 0) == 0
    mem0 = stack.lower[0]
    assert isinstance(mem0, HandingMemoryTier) and not mem0.handed, "evicted objects left"


def test_a_chunk_the_primary_still_holds_is_copied_from_its_slot(stacks: list[Stack]) -> None:
    stacks.append(stack := hop_stack(slots=4, above=1))
    stack.store(0)
    settle(stack)
    stack.movers[0].fail_keys.add(key(0))  # a staging read of chunk 0 would fail
    stack.store(1)  # mem0 evicts 0, which the primary still holds
    settle(stack)
    assert stack.held(1) == {0}
    assert stack.primary.get_stats()["held_slots"] == 0


def test_the_evicted_object_stays_until_the_staging_read_ended(stacks: list[Stack]) -> None:
    stacks.append(stack := hop_stack(slots=2, above=2))
    for i in (0, 1):
        stack.store(i)
        settle(stack)
    stack.movers[0].gate.clear()  # mem0's copies wait
    stack.store(2)  # the primary evicts 0 for it, and mem0 evicts 0 for its cascade
    stack.manager.on_schedule_end(ScheduleEndContext())  # 0 is staged: read from mem0
    mem0 = stack.lower[0]
    assert isinstance(mem0, HandingMemoryTier)
    assert key(0) in mem0.handed and key(0) in mem0.store.objects, (
        "an evicted object was deleted before its demotion read it"
    )
    assert stack.manager.lookup(key(0), ReqContext(req_id="x")) is MISS
    assert stack.primary.get_stats()["held_slots"] == 1
    stack.movers[0].gate.set()
    settle(stack)
    assert 0 in stack.held(1) and not mem0.handed and key(0) not in mem0.store.objects
    assert stack.primary.get_stats()["held_slots"] == 0


@pytest.mark.parametrize("fault", ["read", "write"])
def test_a_failed_copy_loses_the_chunk_and_leaks_nothing(
    stacks: list[Stack], fault: str
) -> None:
    stacks.append(stack := hop_stack(slots=1, above=1))
    stack.store(0)
    settle(stack)
    stack.movers[0 if fault == "read" else 1].fail_keys.add(key(0))
    stack.store(1)  # the primary evicted 0; mem0 evicts it for 1: staged, and the copy fails
    settle(stack)
    assert 0 not in stack.held(1)
    mem0 = stack.lower[0]
    assert isinstance(mem0, HandingMemoryTier) and not mem0.handed
    assert key(0) not in mem0.store.objects, "a failed demotion kept the evicted object"
    assert stack.primary.get_stats()["held_slots"] == 0
    assert stack.primary.free_slots + stack.primary.get_stats()["chunks"] == 1
    assert stack.manager.get_stats()["demotion_failures"] == 1
    assert stack.lower[1].index.usage == 0, "the failed copy's reservation was kept"
    assert stack.manager.lookup(key(0), ReqContext(req_id="x")) is MISS


def test_no_slot_to_stage_through_drops_the_chunk_counted(stacks: list[Stack]) -> None:
    stacks.append(stack := hop_stack(slots=1, above=2))
    stack.store(0)
    settle(stack)
    assert stack.manager.lookup(key(0), CTX) is LookupResult.HIT
    stack.manager.prepare_load([key(0)], CTX)  # the only slot: pinned, nothing to evict
    mem0 = stack.lower[0]
    assert mem0.prepare_store([key(1)], CTX) == [key(1)]
    mem0.store.put(key(1), conformance_payload(1, CHUNK))
    mem0.complete_store([key(1)], CTX)
    mem0.touch([key(0)], CTX)
    assert mem0.prepare_store([key(2)], CTX) == [key(2)]  # evicts 1, which needs staging
    mem0.complete_store([key(2)], CTX, success=False)
    stack.manager.on_schedule_end(ScheduleEndContext())
    stack.manager.wait_idle()
    assert stack.manager.get_stats()["demotions_dropped"] == 1
    assert 1 not in stack.held(1)
    assert isinstance(mem0, HandingMemoryTier)
    assert key(1) not in mem0.store.objects and not mem0.handed
    stack.manager.complete_load([key(0)], CTX)
    assert stack.primary.get_stats()["held_slots"] == 0


# -- end to end: a real file tier above an object tier ------------------------------
FILE_CHUNK = 8192  # offloading_config()'s chunk


@pytest.fixture
def built(tmp_path: Path) -> Iterator[list[BuiltStack]]:
    made: list[BuiltStack] = []
    yield made
    for stack in made:
        stack.shutdown()


def build(made: list[BuiltStack], root: Path, url: str) -> BuiltStack:
    description = {"tiers": [
        {"kind": "cpu", "capacity": 2 * FILE_CHUNK},
        # 4 chunks of header + payload.
        {"kind": "file", "root": str(root), "capacity": 4 * (4096 + FILE_CHUNK)},
        {"kind": "fsspec", "url": url, "write": "back"},
    ]}
    stack = load_stack(description, offloading_config())
    made.append(stack)
    return stack


def test_s3_gets_nothing_while_the_file_tier_holds_every_chunk_and_each_evicted_one_after(
    built: list[BuiltStack], tmp_path: Path,
) -> None:
    stack = build(built, tmp_path / "file", f"memory://kvtiers-{uuid.uuid4().hex}/hop")
    manager, region = stack.manager, stack.tiers[0].region
    assert region is not None
    file = stack.tiers[1].manager
    assert isinstance(file, FileTierManager)
    objects = stack.tiers[2].manager

    def store(i: int) -> None:
        keys = [conformance_key(i)]
        assert manager.prepare_store(keys, CTX) == keys
        spec = manager.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        region.view(int(spec.slot_ids[0]))[:FILE_CHUNK] = conformance_payload(i, FILE_CHUNK)
        manager.complete_store(keys, CTX)
        manager.wait_idle()
        manager.on_schedule_end(ScheduleEndContext())
        manager.wait_idle()

    def in_objects() -> set[int]:
        return {i for i in range(8)
                if objects.lookup(conformance_key(i), CTX) is LookupResult.HIT}

    for i in range(4):
        store(i)
    assert in_objects() == set(), "write-back wrote chunks the file tier still holds"
    assert manager.get_stats()["file.evictions"] == 0
    for i in range(4, 8):
        store(i)
        assert in_objects() == set(range(i - 3)), f"after chunk {i}"
    file.wait_deletions()
    for i in range(4):
        assert not file.mapper.path(conformance_key(i)).exists(), "an evicted file stayed"
    # Each one comes back, byte for byte, from the object tier.
    probe = ReqContext(req_id="probe")
    for i in range(4):
        k = conformance_key(i)
        assert manager.lookup(k, probe) is PENDING
        manager.wait_idle()
        assert manager.lookup(k, probe) is LookupResult.HIT
        manager.prepare_load([k], probe)
        spec = manager.get_spec([k])
        assert isinstance(spec, CPULoadStoreSpec)
        assert bytes(region.view(int(spec.slot_ids[0]))[:FILE_CHUNK]) == conformance_payload(
            i, FILE_CHUNK)
        manager.complete_load([k], probe)
        manager.on_request_finished(probe)


def test_first_hop_counts_chunks_the_primary_dropped_by_itself(stacks: list[Stack]) -> None:
    """Directly below the primary: a store that needs more room than was kept free makes
    the primary evict by itself, and that chunk is never demoted (counted as dropped)."""
    stacks.append(stack := Stack(BACK, slots=2))
    stack.store(0, 1)  # no step yet: no free room kept
    stack.store(2)
    settle(stack)
    stats = stack.manager.get_stats()
    assert stats["demotions_dropped"] == 1
    assert len(stack.held(0)) + stats["demotions_dropped"] + stats["cpu.chunks"] == 3
