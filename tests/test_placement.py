"""Write rules of lower tiers (docs/architecture.md, "Placement"): write-through,
write-back by demotion, frequency admission, promoted chunks written into the tiers above
their source; over a CPU primary and in-memory lower tiers."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtiers.config import load_stack_config
from kvtiers.config.tiers import LowerTierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import KeyFormat, OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier, WriteRules
from kvtiers.errors import ConfigError
from kvtiers.policies import load_policy
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.placement import BoundedTable, Headroom
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import (
    BytearrayRegion,
    HandingMemoryTier,
    MemoryMover,
    MemoryObjectStore,
    MemoryObjectTier,
)
from kvtiers.testing.memory_tier import InMemoryTier
from kvtiers.tiers.cpu.manager import CpuTierManager

GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(4096,))
CHUNK = GEOMETRY.chunk_bytes(0)
CTX = ReqContext(req_id="r")
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(i: int) -> OffloadKey:
    return conformance_key(i)


class Stack:
    """A CPU primary of ``slots`` slots (evicting by ``policy``) over a bytearray and
    in-memory lower tiers of ``lower_chunks`` chunks (or one count per tier), one per
    write rules given (over ``stores``, when given, which they index at start);
    ``handing``: tiers that can hand their evictions over."""

    def __init__(
        self, *writes: WriteRules, slots: int = 4,
        stores: list[MemoryObjectStore] | None = None,
        lower_chunks: int | tuple[int, ...] = 64, handing: bool = False, policy: str = "lru",
    ) -> None:
        self.region = BytearrayRegion(slots, GEOMETRY.slot_bytes)
        # Staging as the stack builder decides it: some tier takes every chunk through.
        staging = any(w.mode == "through" and not w.after_hits for w in writes)
        self.primary = CpuTierManager(slots, GEOMETRY.slot_bytes, load_policy(policy)(slots),
                                      staging=staging)
        self.lower: list[MemoryObjectTier] = []
        self.movers: list[MemoryMover] = []
        tiers: list[BuiltTier] = [BuiltTier("cpu", self.primary, region=self.region)]
        for index, write in enumerate(writes):
            kind = HandingMemoryTier if handing else MemoryObjectTier
            chunks = lower_chunks if isinstance(lower_chunks, int) else lower_chunks[index]
            lower = kind(chunks, stores[index] if stores else MemoryObjectStore())
            mover = MemoryMover(self.region, GEOMETRY, lower)
            self.lower.append(lower)
            self.movers.append(mover)
            tiers.append(BuiltTier(f"mem{index}", lower, mover=mover, write=write))
        self.manager = TieredManager(tiers)

    def store(self, *ids: int) -> None:
        keys = [key(i) for i in ids]
        accepted = self.manager.prepare_store(keys, CTX)
        assert accepted == keys
        spec = self.manager.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        for i, slot in zip(ids, spec.slot_ids, strict=True):
            self.region.view(int(slot))[:CHUNK] = conformance_payload(i, CHUNK)
        self.manager.complete_store(keys, CTX)

    def load(self, i: int) -> bytes:
        assert self.manager.lookup(key(i), CTX) is HIT
        self.manager.prepare_load([key(i)], CTX)
        spec = self.manager.get_spec([key(i)])
        assert isinstance(spec, CPULoadStoreSpec)
        data = bytes(self.region.view(int(spec.slot_ids[0]))[:CHUNK])
        self.manager.complete_load([key(i)], CTX)
        return data

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext())
        self.manager.wait_idle()

    def held(self, tier: int) -> set[int]:
        """Ids 0..15 of the chunks lower tier ``tier`` holds, each checked byte for byte."""
        found = set()
        for i in range(16):
            stored = self.lower[tier].store.objects.get(key(i))
            if stored is not None:
                assert stored[0] == conformance_payload(i, CHUNK), f"wrong bytes for {i}"
                found.add(i)
        return found


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        for mover in stack.movers:
            mover.gate.set()
        stack.manager.shutdown()


def test_write_through_writes_every_stored_chunk(stacks: list[Stack]) -> None:
    stacks.append(stack := Stack(WriteRules()))
    stack.store(0, 1)
    stack.manager.wait_idle()
    assert stack.held(0) == {0, 1}


def test_write_back_writes_a_chunk_when_the_primary_evicts_it(stacks: list[Stack]) -> None:
    stacks.append(stack := Stack(WriteRules("back")))
    stack.store(0, 1)
    stack.manager.wait_idle()
    assert stack.held(0) == set(), "write-back wrote before any eviction"
    stack.step()  # the step reserved 2 slots, 2 are free: nothing to evict
    assert stack.held(0) == set()
    stack.store(2, 3)
    stack.step()  # 2 slots kept free: the 2 least recent chunks are demoted
    assert stack.held(0) == {0, 1}
    assert stack.primary.slot_of(key(0)) is None and stack.primary.slot_of(key(1)) is None
    stats = stack.manager.get_stats()
    assert (stats["demotions"], stats["mem0.demoted"], stats["cascades"]) == (2, 2, 0)
    assert stats["cpu.held_slots"] == 0 and stack.primary.free_slots == 2
    # A demoted chunk comes back by promotion, intact.
    assert stack.manager.lookup(key(0), ReqContext(req_id="p")) is PENDING
    stack.step()
    assert stack.load(0) == conformance_payload(0, CHUNK)


def test_a_demoted_slot_is_not_reused_until_its_copy_ended(stacks: list[Stack]) -> None:
    stacks.append(stack := Stack(WriteRules("back"), slots=2))
    stack.store(0, 1)
    stack.movers[0].gate.clear()  # the demotion's copy waits before reading
    stack.manager.on_schedule_end(ScheduleEndContext())
    assert stack.primary.get_stats()["held_slots"] == 2
    # Every slot is either held or free: a store cannot take a held one.
    assert stack.manager.prepare_store([key(5), key(6), key(7)], CTX) is None
    stack.movers[0].gate.set()
    stack.manager.wait_idle()
    assert stack.held(0) == {0, 1}
    assert stack.primary.get_stats()["held_slots"] == 0 and stack.primary.free_slots == 2


def test_a_failed_demotion_leaves_the_chunk_simply_gone(stacks: list[Stack]) -> None:
    stacks.append(stack := Stack(WriteRules("back"), slots=2))
    stack.store(0, 1)
    stack.movers[0].fail_keys.add(key(0))
    stack.step()
    assert stack.held(0) == {1}
    assert stack.lower[0].lookup(key(0), CTX) is MISS
    assert stack.manager.lookup(key(0), CTX) is MISS
    stats = stack.manager.get_stats()
    assert (stats["demotions"], stats["demotion_failures"], stats["cpu.held_slots"]) == (1, 1, 0)


def test_frequency_admission_writes_at_the_load_that_reaches_the_count(
    stacks: list[Stack],
) -> None:
    stacks.append(stack := Stack(WriteRules(after_hits=2)))
    stack.store(0, 1)
    stack.manager.wait_idle()
    assert stack.held(0) == set()
    assert stack.load(0) == conformance_payload(0, CHUNK)
    stack.manager.wait_idle()
    assert stack.held(0) == set(), "written after one load of two"
    stack.load(0)
    stack.manager.wait_idle()
    assert stack.held(0) == {0}
    assert stack.manager.get_stats()["mem0.cascaded"] == 1


def test_frequency_admission_under_write_back(stacks: list[Stack]) -> None:
    stacks.append(stack := Stack(WriteRules("back", after_hits=1), slots=2))
    stack.store(0, 1)
    stack.load(1)
    stack.step()  # both evicted to keep 2 free; only the loaded one is written
    assert stack.held(0) == {1}


@pytest.mark.parametrize("policy", ["arc", "s3fifo"])
def test_a_loaded_chunk_the_primary_keeps_long_is_written_back_when_it_goes(
    stacks: list[Stack], policy: str
) -> None:
    """A frequency-keeping policy keeps a chunk loaded thrice while many more are stored
    than the reference table holds (4 x 4 slots); its count must still be there when the
    primary finally demotes it."""
    stacks.append(stack := Stack(WriteRules("back", after_hits=1), policy=policy))
    stack.store(0)
    stack.step()
    for _ in range(3):
        stack.load(0)
    stack.step()
    for i in range(100, 140):  # one-time prompts, far more than the table remembers
        stack.store(i)
        stack.step()
    assert stack.primary.slot_of(key(0)) is not None, "the policy kept the loaded chunk"
    for _ in range(6):  # a new working set, reused: the loaded chunk goes at last
        for i in range(200, 206):
            if stack.manager.lookup(key(i), CTX) is HIT:
                stack.load(i)
            elif stack.primary.slot_of(key(i)) is None and stack.primary.free_slots:
                stack.store(i)
            stack.step()
    assert stack.primary.slot_of(key(0)) is None
    assert 0 in stack.held(0), "a chunk loaded three times was dropped uncounted"


def test_demotions_dropped_counts_only_chunks_a_back_tier_would_take_and_lacks(
    stacks: list[Stack],
) -> None:
    """The primary evicting by itself (a store that needs more than the free room) drops a
    chunk only if a write-back tier would have been written and does not hold it."""
    stacks.append(stack := Stack(WriteRules("back", after_hits=1), slots=2))
    stack.store(0, 1)
    stack.load(0)
    stack.store(2, 3)  # no step: no free room was kept, the primary evicts 0 and 1 itself
    assert stack.manager.get_stats()["demotions_dropped"] == 1, "1 was never referenced"


def test_a_chunk_the_back_tier_still_holds_is_not_counted_dropped(stacks: list[Stack]) -> None:
    stacks.append(back := Stack(WriteRules("back"), slots=2))
    back.store(0, 1)
    back.step()  # 0 and 1 are demoted to keep 2 slots free
    assert back.held(0) == {0, 1}
    assert back.manager.lookup(key(0), ReqContext(req_id="p")) is PENDING
    back.step()
    assert back.load(0) == conformance_payload(0, CHUNK)  # promoted from mem0, still there
    stats = back.manager.get_stats()
    evictions, dropped = stats["cpu.evictions"], stats["demotions_dropped"]
    back.store(4, 5)  # one slot free: the primary evicts 0 by itself
    assert back.primary.slot_of(key(0)) is None and 0 in back.held(0)
    stats = back.manager.get_stats()
    assert stats["cpu.evictions"] == evictions + 1
    assert stats["demotions_dropped"] == dropped, "a chunk mem0 still holds counted dropped"


@pytest.mark.parametrize("promoted", [True, False])
def test_promoted_chunks_reach_the_tiers_above_that_take_them(
    stacks: list[Stack], promoted: bool
) -> None:
    below = MemoryObjectStore()
    below.put(key(3), conformance_payload(3, CHUNK))
    stacks.append(stack := Stack(WriteRules(promoted=promoted), WriteRules(),
                                 stores=[MemoryObjectStore(), below]))
    assert stack.manager.lookup(key(3), CTX) is PENDING
    stack.step()
    assert stack.load(3) == conformance_payload(3, CHUNK)
    stack.manager.wait_idle()
    assert stack.held(0) == ({3} if promoted else set())


def test_write_back_needs_a_primary_that_holds_slots() -> None:
    region = BytearrayRegion(2, GEOMETRY.slot_bytes)
    lower = MemoryObjectTier(4, MemoryObjectStore())
    mover = MemoryMover(region, GEOMETRY, lower)
    with pytest.raises(ConfigError, match="needs a primary that can hold") as caught:
        TieredManager([BuiltTier("cpu", InMemoryTier(2), region=region),
                       BuiltTier("mem", lower, mover=mover, write=WriteRules("back"))],
                      keys=KeyFormat(1, 16))
    assert caught.value.path == "tiers[1].write"
    mover.shutdown()


def test_the_yaml_write_rules_parse() -> None:
    config = load_stack_config({"tiers": [
        {"kind": "cpu", "capacity": "1MiB"},
        {"kind": "fsspec", "url": "memory://placement", "write": "back",
         "write_after_hits": 2, "write_promoted": True},
    ]})
    lower = config.tiers[1]
    assert isinstance(lower, LowerTierConfig)
    assert (lower.write, lower.write_after_hits, lower.write_promoted) == ("back", 2, True)


def test_bounded_table_forgets_the_oldest() -> None:
    table = BoundedTable(2)
    assert table.add([key(0), key(0), key(1)]) == [1, 1]
    assert table.add([key(0)]) == [2]
    table.add([key(2)])  # key 1 was set longest ago
    assert (table.get(key(0)), table.get(key(1)), table.get(key(2))) == (2, 0, 1)
    with pytest.raises(ValueError, match="at least 1"):
        BoundedTable(0)


def test_headroom_is_the_busiest_recent_step() -> None:
    headroom = Headroom(steps=2)
    headroom.reserved(5)
    assert headroom.end_step() == 5
    headroom.reserved(1)
    assert headroom.end_step() == 5
    assert headroom.end_step() == 1


@pytest.mark.slow
@pytest.mark.parametrize("example", ["cpu-file-s3-writeback", "cpu-file-s3-frequency"])
def test_the_demo_runs_each_write_rule_and_shows_writes_per_tier(
    tmp_path: Path, example: str
) -> None:
    """``kvtiers demo --config <example>``: every loaded byte verified, and the table's
    writes column counts each tier's chunks written (S3 fewer than the file tier)."""
    import yaml

    from kvtiers.config.examples import example_path
    from kvtiers.engine.demo import run_demo
    from kvtiers.engine.workload import WorkloadSpec

    # The example at demo scale, as `--config <name>` runs it, but under a prefix of its
    # own: the embedded S3 server outlives the stacks of this process.
    stack = yaml.safe_load(example_path(example).read_text())  # type: ignore[union-attr]
    cpu, file, s3 = stack["tiers"]
    # Write-back reaches S3 when the file tier evicts: a file tier smaller than this
    # shortened trace (the demo's 32 MiB holds all of it) makes it evict.
    cpu["capacity"], file["capacity"] = "16MiB", "12MiB" if "writeback" in example else "32MiB"
    file["root"] = str(tmp_path / "out" / "file")
    s3["prefix"] = f"test-{example}"
    out = io.StringIO()
    phases = run_demo(stack, out_dir=tmp_path / "out", workload=WorkloadSpec(
        conversations=6, turns=3), plot=None, out=out, show_progress=False)
    text = out.getvalue()
    assert text.splitlines()[-1].startswith("verdict: ok: "), text
    header = next(line for line in text.splitlines() if line.strip().startswith("tier "))
    assert header.split()[:4] == ["tier", "chunks", "tokens", "writes"]
    cold = phases[0].stats
    file_writes = cold["file.cascaded"] + cold.get("file.demoted", 0)
    s3_writes = cold.get("s3.cascaded", 0) + cold.get("s3.demoted", 0)
    assert 0 < s3_writes < file_writes, (s3_writes, file_writes)
    row = next(line for line in text.splitlines() if line.strip().startswith("s3 "))
    assert int(row.split()[3].replace(",", "")) == s3_writes


def test_a_finished_request_no_longer_shields_its_keys_from_demotion(
    stacks: list[Stack],
) -> None:
    """A request's looked-up keys are never demoted while it runs; once it finishes (even
    named by another context object of the same id, as an adapter may pass) they are."""
    stacks.append(stack := Stack(WriteRules("back"), slots=2))
    stack.store(0, 1)
    stack.manager.wait_idle()
    running = ReqContext(req_id="running")
    assert stack.manager.lookup(key(0), running) is HIT
    assert stack.manager.lookup(key(1), running) is HIT
    stack.step()  # 2 slots to keep free, but both chunks are the running request's
    assert stack.held(0) == set()
    stack.manager.on_request_finished(ReqContext(req_id="running"))
    stack.step()
    assert stack.held(0) == {0, 1}
