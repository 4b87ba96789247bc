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
from kvtiers.core.tier import WriteRules
from kvtiers.stack.builder import Stack as BuiltStack
from kvtiers.stack.builder import load_stack
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import HandingMemoryTier
from kvtiers.testing.objects import offloading_config
from kvtiers.tiers.file.manager import FileTierManager
from tests.test_file_support import open_tier
from tests.test_placement import CHUNK, CTX, MISS, PENDING, Stack, key

THROUGH, BACK = WriteRules(), WriteRules("back")


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


# -- frequency admission below a handing tier -----------------------------------------
BACK_HITS = WriteRules("back", after_hits=1)


def counted_hop(slots: int = 2, above: int = 40) -> Stack:
    """cpu (``slots``: the reference counts are a table of 4 x ``slots``) → mem0 (through,
    ``above`` chunks, hands evictions over) → mem1 (back, after one load)."""
    return Stack(THROUGH, BACK_HITS, slots=slots, lower_chunks=(above, 256), handing=True)


def in_tier(stack: Stack, tier: int, i: int) -> bool:
    stored = stack.lower[tier].store.objects.get(key(i))
    assert stored is None or stored[0] == conformance_payload(i, CHUNK), f"wrong bytes, {i}"
    return stored is not None


def test_a_used_chunk_the_tier_above_keeps_past_the_count_table_reaches_the_back_tier(
    stacks: list[Stack],
) -> None:
    """mem0 holds chunk 0 while far more chunks pass than the reference table remembers (8):
    the admission decided at its load must still hold when mem0 evicts it."""
    stacks.append(stack := counted_hop(slots=2, above=40))
    stack.store(0)
    settle(stack)
    stack.load(0)
    for i in range(1, 60):
        stack.store(i)
        settle(stack)
    assert not in_tier(stack, 0, 0), "mem0 was to evict chunk 0"
    assert in_tier(stack, 1, 0), "a loaded chunk was lost, uncounted"
    # Chunks never loaded are not written below, and mem0 kept none of their objects.
    assert not any(in_tier(stack, 1, i) for i in range(1, 20))
    mem0 = stack.lower[0]
    assert isinstance(mem0, HandingMemoryTier) and not mem0.handed
    assert len(mem0.store.objects) == len(mem0.index) == 40


def test_a_chunk_the_tier_above_evicted_before_its_load_is_written_at_the_load(
    stacks: list[Stack],
) -> None:
    """mem0 evicted chunk 0 while nothing wanted it below; the primary still holds it when
    it is loaded: the primary's copy is the last one, written to mem1 then."""
    stacks.append(stack := counted_hop(slots=4, above=1))
    stack.store(0)
    settle(stack)
    stack.store(1)  # mem0 evicts 0, not wanted below: deleted
    settle(stack)
    assert not in_tier(stack, 0, 0) and not in_tier(stack, 1, 0)
    stack.load(0)
    settle(stack)
    assert in_tier(stack, 1, 0), "a loaded chunk only the primary held was never written"
    assert stack.manager.get_stats()["mem1.demoted"] == 1


def test_a_chunk_the_back_tier_holds_is_not_staged_nor_counted_dropped(
    stacks: list[Stack],
) -> None:
    """As test_no_slot_to_stage_through_drops_the_chunk_counted, but mem1 holds chunk 1
    already: nothing is lost, nothing needs copying."""
    stacks.append(stack := hop_stack(slots=1, above=2))
    mem0, mem1 = stack.lower
    assert mem1.prepare_store([key(1)], CTX) == [key(1)]
    mem1.store.put(key(1), conformance_payload(1, CHUNK))
    mem1.complete_store([key(1)], CTX)
    stack.store(0)
    settle(stack)
    stack.manager.lookup(key(0), CTX)
    stack.manager.prepare_load([key(0)], CTX)  # the only slot: pinned
    assert mem0.prepare_store([key(1)], CTX) == [key(1)]
    mem0.store.put(key(1), conformance_payload(1, CHUNK))
    mem0.complete_store([key(1)], CTX)
    mem0.touch([key(0)], CTX)
    assert mem0.prepare_store([key(2)], CTX) == [key(2)]  # evicts 1
    mem0.complete_store([key(2)], CTX, success=False)
    stack.manager.on_schedule_end(ScheduleEndContext())
    stack.manager.wait_idle()
    assert stack.manager.get_stats()["demotions_dropped"] == 0, "mem1 holds chunk 1"
    assert in_tier(stack, 1, 1)
    stack.manager.complete_load([key(0)], CTX)


# -- end to end: a real file tier above an object tier ------------------------------
FILE_CHUNK = 8192  # offloading_config()'s chunk


@pytest.fixture
def built(tmp_path: Path) -> Iterator[list[BuiltStack]]:
    made: list[BuiltStack] = []
    yield made
    for stack in made:
        stack.shutdown()


def build(made: list[BuiltStack], root: Path, url: str, *, file_chunks: int = 4,
          **back: object) -> BuiltStack:
    """cpu (2 chunks) → file (``file_chunks`` chunks of header + payload) → fsspec (write
    back, with ``back``'s further write keys)."""
    description = {"tiers": [
        {"kind": "cpu", "capacity": 2 * FILE_CHUNK},
        {"kind": "file", "root": str(root), "capacity": file_chunks * (4096 + FILE_CHUNK)},
        {"kind": "fsspec", "url": url, "write": "back", **back},
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


def test_a_real_file_tier_keeps_a_used_chunk_wanted_below_past_the_count_table(
    built: list[BuiltStack], tmp_path: Path,
) -> None:
    """Write-back after one load under a file tier of 12 chunks, with a reference table of
    8 (4 x 2 primary slots): the loaded chunk reaches the object tier when the file tier
    evicts it, the others are deleted without being written below."""
    stack = build(built, tmp_path / "file", f"memory://kvtiers-{uuid.uuid4().hex}/hop",
                  file_chunks=12, write_after_hits=1)
    manager, region = stack.manager, stack.tiers[0].region
    assert region is not None
    file = stack.tiers[1].manager
    assert isinstance(file, FileTierManager)
    objects = stack.tiers[2].manager

    def step() -> None:
        manager.wait_idle()
        manager.on_schedule_end(ScheduleEndContext())
        manager.wait_idle()

    def store(i: int) -> None:
        keys = [conformance_key(i)]
        assert manager.prepare_store(keys, CTX) == keys
        spec = manager.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        region.view(int(spec.slot_ids[0]))[:FILE_CHUNK] = conformance_payload(i, FILE_CHUNK)
        manager.complete_store(keys, CTX)
        step()

    store(0)
    assert manager.lookup(conformance_key(0), CTX) is LookupResult.HIT
    manager.prepare_load([conformance_key(0)], CTX)
    manager.complete_load([conformance_key(0)], CTX)
    for i in range(1, 16):
        store(i)
    assert file.lookup(conformance_key(0), CTX) is MISS, "the file tier was to evict 0"
    found = {i for i in range(16)
             if objects.lookup(conformance_key(i), CTX) is LookupResult.HIT}
    assert found == {0}
    file.wait_deletions()
    assert not any(file.mapper.path(conformance_key(i)).exists() for i in range(4))


def test_the_file_tier_hands_over_only_the_wanted_chunks_and_forgets_a_mark_with_its_chunk(
    tmp_path: Path,
) -> None:
    tier = open_tier(tmp_path, capacity_chunks=2)
    manager = tier.manager
    k = [conformance_key(i) for i in range(10)]
    try:
        manager.hand_over_evictions(wanted_only=True)
        tier.store([0, 1])
        assert manager.want_evictions([k[0], k[5]]) == [k[5]]  # 5 is not held
        assert manager.prepare_store([k[9]], CTX) == [k[9]]  # evicts 0 (wanted), no more
        assert manager.want_evictions([k[9]]) == []  # being written: held
        manager.complete_store([k[9]], CTX, success=False)  # ... and its mark goes with it
        tier.store([2, 3])  # evicts 1, not wanted
        assert manager.take_evicted() == [k[0]]
        manager.wait_deletions()
        assert manager.mapper.path(k[0]).exists(), "a handed-over file was deleted"
        assert not manager.mapper.path(k[1]).exists(), "an unwanted evicted file was kept"
        manager.release_evicted([k[0]])
        for i in (9, 5, 6):  # evict 2, 3 and 9: none wanted now
            tier.store([i])
        assert manager.take_evicted() == []
        manager.wait_deletions()
        assert not any(manager.mapper.path(k[i]).exists() for i in (0, 2, 3, 9))
    finally:
        tier.close()


def test_a_failed_store_over_a_handed_over_file_hands_it_over_again(tmp_path: Path) -> None:
    """A key stored again while its evicted file waits for the composite takes the name
    back; if that store fails the file is the composite's again, not left unindexed."""
    tier = open_tier(tmp_path, capacity_chunks=1)
    manager = tier.manager
    key0, key1 = conformance_key(0), conformance_key(1)
    try:
        manager.hand_over_evictions()
        tier.store([0])
        tier.store([1])  # evicts 0: handed over
        assert manager.take_evicted() == [key0]
        assert manager.prepare_store([key0], CTX) == [key0]  # evicts 1, takes 0's name
        manager.complete_store([key0], CTX, success=False)
        assert sorted(manager.take_evicted()) == sorted([key0, key1])
        manager.release_evicted([key0, key1])
        manager.wait_deletions()
        assert not manager.mapper.path(key0).exists(), "an unindexed chunk file was left"
        assert not manager.mapper.path(key1).exists()
    finally:
        tier.close()
