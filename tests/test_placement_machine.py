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
from kvtiers.core.tier import BuiltTier, WriteRules
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
from kvtiers.tiers.cpu.manager import CpuTierManager, SlotState
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
WRITES = (WriteRules("back"), WriteRules("through", after_hits=1))


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
    #: Each lower tier's write rules, capacity in chunks and whether it hands evictions.
    writes: tuple[WriteRules, ...] = WRITES
    lower_chunks: tuple[int, ...] = (LOWER_CHUNKS, LOWER_CHUNKS)
    handing: tuple[bool, ...] = (False, False)
    #: Primary slots, and its eviction policy.
    slots = SLOTS
    policy = "lru"
    #: Whether every chunk loaded since it was last stored must end in some tier, or be
    #: counted as not written (the lowest tier then holds every key).
    keeps_used = False

    def __init__(self) -> None:
        super().__init__()
        slots = self.slots
        self.region = BytearrayRegion(slots, GEOMETRY.slot_bytes)
        # Staging as the stack builder decides it: some tier takes every chunk through.
        staging = any(w.mode == "through" and not w.after_hits for w in self.writes)
        self.primary = CpuTierManager(slots, GEOMETRY.slot_bytes, load_policy(self.policy)(slots),
                                      staging=staging)
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
        #: Keys loaded since they were last stored into the primary.
        self.used: set[OffloadKey] = set()

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
        self.used.difference_update(accepted)

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
        self.used.add(key)

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

    @invariant()
    def used_chunks_are_kept_or_counted(self) -> None:
        """A chunk loaded since it was last stored is in the primary or a lower tier (an
        object handed over or being written included), or a counter says it was not
        written (each such chunk is counted at least once)."""
        if not self.keeps_used:
            return
        bottom = f"mem{len(self.writes) - 1}"
        for event in self.manager.take_events():
            if event.removed and not event.metadata_only and event.ownership == bottom:
                # The lowest tier evicted them: gone by its own capacity, as designed.
                self.used.difference_update(event.keys)
        lost = {
            key for key in self.used
            if self.primary.slot_of(key) is None
            and not any(key in lower.index or key in lower.store.objects
                        for lower in self.lower)
        }
        stats = self.manager.get_stats()
        counted = sum(stats[name] for name in (
            "demotions_dropped", "demotions_refused", "demotion_failures",
            "cascades_refused", "cascade_failures",
        ))
        assert len(lost) <= counted, (
            f"{len(lost)} used chunks in no tier, {counted} counted as not written"
        )

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
        assert stats["chunks"] + stats["held_slots"] + self.primary.free_slots == self.slots


TestPlacementMachine = PlacementMachine.TestCase
TestPlacementMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class _StepsSeeEveryCopy(PlacementMachine):
    """Copies that are not held back by a gate have all ended when a step polls, so which
    rules can run next never depends on thread timing (Hypothesis replays a run exactly);
    copies a gate holds stay in flight as before."""

    def _drain_open(self) -> None:
        for mover in self.movers:
            if mover.gate.is_set():
                mover.drain()

    @rule()
    def step(self) -> None:
        self._drain_open()
        super().step()

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3), r=st.integers(0, 1))
    def slow_step_then_store(self, keys: list[OffloadKey], r: int) -> None:
        self._drain_open()
        super().slow_step_then_store(keys, r)

    @rule(tier=st.integers(0, len(WRITES) - 1), hold=st.booleans())
    def gate(self, tier: int, hold: bool) -> None:
        if hold and self.movers[tier].gate.is_set():
            self.movers[tier].drain()
        super().gate(tier, hold)


class SecondHopMachine(_StepsSeeEveryCopy):
    """cpu → mem0 (write-through, 3 chunks, hands its evictions over) → mem1 (write-back:
    receives what mem0 evicts). Its steps see every copy not held back by a gate (which
    rules can run next must not depend on thread timing: on a loaded machine Hypothesis
    found it did)."""

    writes = (WriteRules("through"), WriteRules("back"))
    lower_chunks = (3, LOWER_CHUNKS)
    handing = (True, False)


TestSecondHopMachine = SecondHopMachine.TestCase
TestSecondHopMachine.settings = settings(max_examples=60, stateful_step_count=80,
                                         deadline=None)


class CountedSecondHopMachine(SecondHopMachine):
    """cpu (1 slot: the reference counts are a table of 4) → mem0 (write-through, 5
    chunks, hands over the evictions wanted below) → mem1 (write-back after one load, 3
    chunks): a chunk loaded since it was stored reaches mem1 when mem0 evicts it, however
    long mem0 kept it, or is counted (unless mem1 evicted it since)."""

    writes = (WriteRules("through"), WriteRules("back", after_hits=1))
    lower_chunks = (5, 3)
    slots = 1
    keeps_used = True

    @rule(r=st.integers(0, 1))
    def load_a_chunk_the_primary_holds(self, r: int) -> None:
        """A request reuses a prefix the primary holds (a random key rarely is one)."""
        held = [key for key in KEYS if self.primary.slot_state(key) is SlotState.READY]
        if held:
            self.lookup_and_load(held[0], r)

    @rule(start=st.integers(0, len(KEYS) - 1), n=st.integers(4, len(KEYS) - 1))
    def store_a_stream(self, start: int, n: int) -> None:
        """Other requests store ``n`` chunks one step each, none of them one loaded since it
        was stored (new prompts streaming by): the counts of the loaded chunks are
        forgotten while mem0 still holds them."""
        writer = ReqContext(req_id="stream")
        others = [key for key in KEYS[start:] + KEYS[:start] if key not in self.used]
        for key in others[:n]:
            accepted = self.manager.prepare_store([key], writer)
            if accepted:
                spec = self.manager.get_spec(accepted)
                assert isinstance(spec, CPULoadStoreSpec)
                self.region.view(int(spec.slot_ids[0]))[:CHUNK] = payload(key)
                self.manager.complete_store(accepted, writer)
                self.used.difference_update(accepted)
            self.step()
        self.manager.on_request_finished(writer)


TestCountedSecondHopMachine = CountedSecondHopMachine.TestCase
TestCountedSecondHopMachine.settings = settings(max_examples=150, stateful_step_count=100,
                                                deadline=None)


class CountedFirstHopMachine(_StepsSeeEveryCopy):
    """cpu (2 slots, ARC) → mem0 (write-back after one load) → mem1 (write-through): a
    chunk loaded since it was stored reaches mem0 or mem1, or is counted (unless mem1, the
    lowest tier, evicted it since): a chunk the primary evicts by itself counts as
    dropped exactly when mem0 would have been written and does not hold it."""

    writes = (WriteRules("back", after_hits=1), WriteRules("through"))
    lower_chunks = (LOWER_CHUNKS, 3)
    slots = 2
    policy = "arc"
    keeps_used = True


TestCountedFirstHopMachine = CountedFirstHopMachine.TestCase
TestCountedFirstHopMachine.settings = settings(max_examples=60, stateful_step_count=80,
                                               deadline=None)
