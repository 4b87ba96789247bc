"""A Hypothesis state machine over a CPU primary with a write-back lower tier and a
frequency-admission (write-through after one load) lower tier, with faults in both
movers, copies held in flight and demotions at every step.

What must hold (issue 19): no wrong bytes, ever, in the primary or in a lower tier (a
chunk reaches a lower tier intact or not at all); no pin lost (after settling nothing is
pinned or held); no slot reused before the demotion reading it ended — a store writes its
slot at once, so a reused held slot would put another key's bytes into the lower tier,
which the byte check catches.

``SecondHopMachine`` runs the same rules over a write-through tier that hands its
evictions over and a write-back tier below it (the second hop): besides the above, no
evicted chunk's object is deleted before the demotion reading it ended (a staging read that
finds its object gone is recorded), and the handed-over objects are all released once
settled.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import KeyFormat, OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier, WritePolicy
from kvtiers.policies import load_policy
from kvtiers.stack.composite import TieredManager
from kvtiers.testing.doubles import (
    BytearrayRegion,
    HandingMemoryTier,
    InjectedFailure,
    MemoryMover,
    MemoryObjectStore,
    MemoryObjectTier,
)
from kvtiers.tiers.cpu.manager import CpuTierManager
from kvtiers.tiers.fanout import ChunkCopy, FanOutJob

GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(4096,))
SLOTS = 4
LOWER_CHUNKS = 6
KEYS = [make_offload_key(bytes([i + 1]) * 16, 0) for i in range(8)]
CHUNK = GEOMETRY.chunk_bytes(0)
HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)
#: Steps within which a pending key resolves (a demotion, then a promotion, then HIT).
PENDING_STEPS = 3
WRITES = (WritePolicy("back"), WritePolicy("through", after_hits=1))


def payload(key: OffloadKey) -> bytes:
    """The only bytes ever right for ``key``."""
    return (key * (CHUNK // len(key) + 1))[:CHUNK]


@dataclass
class Job:
    keys: list[OffloadKey]
    ctx: ReqContext


class _WatchedMover(MemoryMover):
    """Records a read whose object is gone (a handed-over object deleted too early); reads
    of keys in ``fail_reads`` fail (a chunk that went in intact and cannot be read)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.vanished: list[OffloadKey] = []
        self.fail_reads: set[OffloadKey] = set()

    def _copy(self, job: FanOutJob, chunk: ChunkCopy) -> int:
        if not job.store and chunk.key in self.fail_reads:
            raise InjectedFailure(f"reading {chunk.address} is in fail_reads")
        try:
            return super()._copy(job, chunk)
        except KeyError:
            self.vanished.append(chunk.key)
            raise


class PlacementMachine(RuleBasedStateMachine):
    #: Each lower tier's write policy, capacity in chunks and whether it hands evictions.
    writes: tuple[WritePolicy, ...] = WRITES
    lower_chunks: tuple[int, ...] = (LOWER_CHUNKS, LOWER_CHUNKS)
    handing: tuple[bool, ...] = (False, False)

    def __init__(self) -> None:
        super().__init__()
        self.region = BytearrayRegion(SLOTS, GEOMETRY.slot_bytes)
        self.primary = CpuTierManager(SLOTS, GEOMETRY.slot_bytes, load_policy("lru")(SLOTS))
        self.lower: list[MemoryObjectTier] = []
        self.movers: list[_WatchedMover] = []
        tiers: list[BuiltTier] = [BuiltTier("cpu", self.primary, region=self.region)]
        for index, write in enumerate(self.writes):
            kind = HandingMemoryTier if self.handing[index] else MemoryObjectTier
            lower = kind(self.lower_chunks[index], MemoryObjectStore())
            mover = _WatchedMover(self.region, GEOMETRY, lower)
            self.lower.append(lower)
            self.movers.append(mover)
            tiers.append(BuiltTier(f"mem{index}", lower, mover=mover, write=write))
        self.manager = TieredManager(tiers, keys=KeyFormat(1, 16))
        self.ctxs = [ReqContext(req_id=f"r{i}") for i in range(2)]
        self.stores: list[Job] = []
        self.loads: list[Job] = []

    def teardown(self) -> None:
        for mover in self.movers:
            mover.gate.set()
        self.manager.shutdown()

    # -- the engine's jobs -----------------------------------------------------------
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), r=st.integers(0, 1))
    def begin_store(self, keys: list[OffloadKey], r: int) -> None:
        """Reserve slots and write them at once (as a fast worker would)."""
        ctx = self.ctxs[r]
        accepted = self.manager.prepare_store(keys, ctx)
        if not accepted:
            return
        spec = self.manager.get_spec(accepted)
        assert isinstance(spec, CPULoadStoreSpec)
        for key, slot in zip(accepted, spec.slot_ids, strict=True):
            self.region.view(int(slot))[:CHUNK] = payload(key)
        self.stores.append(Job(accepted, ctx))

    @precondition(lambda self: bool(self.stores))
    @rule(data=st.data(), success=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool) -> None:
        job = data.draw(st.sampled_from(self.stores))
        self.stores.remove(job)
        self.manager.complete_store(job.keys, job.ctx, success=success)

    @rule(key=st.sampled_from(KEYS), r=st.integers(0, 1))
    def lookup_and_load(self, key: OffloadKey, r: int) -> None:
        ctx = self.ctxs[r]
        result = self.manager.lookup(key, ctx)
        assert result is not RETRY
        if result is not HIT:
            return
        self.manager.prepare_load([key], ctx)
        spec = self.manager.get_spec([key])
        assert isinstance(spec, CPULoadStoreSpec)
        data = bytes(self.region.view(int(spec.slot_ids[0]))[:CHUNK])
        assert data == payload(key), "wrong bytes in the primary"
        self.loads.append(Job([key], ctx))

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        job = data.draw(st.sampled_from(self.loads))
        self.loads.remove(job)
        self.manager.complete_load(job.keys, job.ctx)

    @rule(r=st.integers(0, 1))
    def finish_request(self, r: int) -> None:
        self.manager.on_request_finished(self.ctxs[r])

    # -- steps and faults ------------------------------------------------------------
    @rule()
    def step(self) -> None:
        """The end of a scheduler step: completions polled, demotions started."""
        self.manager.on_schedule_end(ScheduleEndContext())

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), r=st.integers(0, 1))
    def slow_step_then_store(self, keys: list[OffloadKey], r: int) -> None:
        """A step's demotions wait in slow movers while the next step's stores write every
        slot they get: a held slot handed out here would send these bytes down."""
        for mover in self.movers:
            mover.gate.clear()
        self.manager.on_schedule_end(ScheduleEndContext())
        self.begin_store(keys, r)

    @rule(tier=st.integers(0, len(WRITES) - 1), key=st.sampled_from(KEYS), fail=st.booleans())
    def fault(self, tier: int, key: OffloadKey, fail: bool) -> None:
        if fail:
            self.movers[tier].fail_keys.add(key)
        else:
            self.movers[tier].fail_keys.discard(key)

    @rule(tier=st.integers(0, len(WRITES) - 1), key=st.sampled_from(KEYS), fail=st.booleans())
    def read_fault(self, tier: int, key: OffloadKey, fail: bool) -> None:
        if fail:
            self.movers[tier].fail_reads.add(key)
        else:
            self.movers[tier].fail_reads.discard(key)

    @rule(tier=st.integers(0, len(WRITES) - 1), hold=st.booleans())
    def gate(self, tier: int, hold: bool) -> None:
        """Hold a tier's copies in flight (a slow lower tier) or let them run."""
        if hold:
            self.movers[tier].gate.clear()
        else:
            self.movers[tier].gate.set()

    @rule()
    def settle(self) -> None:
        """Let every copy finish: nothing stays pinned or held, no key stays pending."""
        for mover in self.movers:
            mover.gate.set()
        self.manager.wait_idle()
        self.manager.on_schedule_end(ScheduleEndContext())
        self.manager.wait_idle()
        stats = self.primary.get_stats()
        assert stats["held_slots"] == 0, "a demoted slot was never released"
        for lower in self.lower:
            assert not isinstance(lower, HandingMemoryTier) or not lower.handed, (
                "an evicted object was never released"
            )
        assert stats["pinned_chunks"] <= len(self.loads), "a pin was lost"
        for lower in self.lower:
            assert all(not e.pins for _, e in lower.index.items()), "lower tier pinned"
        # Keys whose copies still fail may be promoted anew each time (backing off from
        # a failed promotion is a real lower tier's business); once the faults end, every
        # key resolves.
        self._resolve(skip={k for mover in self.movers for k in mover.fail_keys | mover.fail_reads})
        for mover in self.movers:
            mover.fail_keys.clear()
            mover.fail_reads.clear()
        self._resolve(skip=set())

    def _resolve(self, skip: set[OffloadKey]) -> None:
        """Every key not being stored by a live job and not in ``skip`` resolves to HIT
        or MISS within :data:`PENDING_STEPS` steps."""
        being_stored = {k for j in self.stores for k in j.keys}
        probe = ReqContext(req_id="probe")
        for key in KEYS:
            if key in being_stored or key in skip:
                continue
            # A key may be pending twice: its demotion is in flight, then the promotion
            # its next lookup starts (which keeps it in the primary for this request).
            for _ in range(PENDING_STEPS):
                if self.manager.lookup(key, probe) is not PENDING:
                    break
                self.manager.wait_idle()
                self.manager.on_schedule_end(ScheduleEndContext())
            else:
                raise AssertionError(f"{key.hex()} pending after {PENDING_STEPS} steps")
        self.manager.on_request_finished(probe)
        self.manager.wait_idle()

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def lower_tiers_hold_only_right_bytes(self) -> None:
        for lower in self.lower:
            with lower.store.lock:
                objects = dict(lower.store.objects)
            for key, (data, _) in objects.items():
                assert data == payload(key), "wrong bytes reached a lower tier"

    @invariant()
    def no_object_deleted_before_its_demotion_read_it(self) -> None:
        for mover in self.movers:
            assert not mover.vanished, "a handed-over object was deleted before it was read"

    @invariant()
    def lower_usage_is_exact(self) -> None:
        for lower in self.lower:
            assert lower.index.usage == len(lower.index), "a lower tier's usage drifted"

    @invariant()
    def slots_are_accounted_for(self) -> None:
        stats = self.primary.get_stats()
        assert stats["chunks"] + stats["held_slots"] + self.primary.free_slots == SLOTS


TestPlacementMachine = PlacementMachine.TestCase
TestPlacementMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class SecondHopMachine(PlacementMachine):
    """cpu → mem0 (write-through, 3 chunks, hands its evictions over) → mem1 (write-back:
    receives what mem0 evicts)."""

    writes = (WritePolicy("through"), WritePolicy("back"))
    lower_chunks = (3, LOWER_CHUNKS)
    handing = (True, False)


TestSecondHopMachine = SecondHopMachine.TestCase
TestSecondHopMachine.settings = settings(max_examples=60, stateful_step_count=80,
                                         deadline=None)
