"""A Hypothesis state machine over the composite (a CPU primary and an in-memory lower
tier) with faults, driven the way an engine drives it that drops stale completions, or
delivers them with their generation, or both.

Rules: engine stores and loads (prepared, then completed or, after a reset, dropped or
completed late with their generation), lookups that start promotions, scheduler steps,
lower-tier copy failures switched on and off, copies held in flight, resets with late
writes into the memory of jobs from before them, and the flush that lifts the reset fence.
A store's worker writes its slots when the job ends and a load's reads them then, so a slot
completed or reused too early shows as wrong bytes. Acceptance: no key pending or pinned
forever, usage equal to the sum of chunk sizes, nothing pinned after ``wait_idle``, no slot
fenced once every job from before a reset ended; and no wrong bytes, ever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import KeyFormat, OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.policies import load_policy
from kvtiers.stack.composite import TieredManager
from kvtiers.testing.doubles import (
    BytearrayRegion,
    MemoryMover,
    MemoryObjectStore,
    MemoryObjectTier,
)
from kvtiers.tiers.cpu.manager import CpuTierManager, SlotState

GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(4096,))
SLOTS = 4
LOWER_CHUNKS = 6
KEYS = [make_offload_key(bytes([i + 1]) * 16, 0) for i in range(8)]
CHUNK = GEOMETRY.chunk_bytes(0)
HIT, MISS, PENDING, RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                             LookupResult.RETRY)


class _Gate(threading.Event):
    """The mover's gate: opening it runs the copies queued while it was shut."""

    def __init__(self, opened: Callable[[], None]) -> None:
        super().__init__()
        self._opened = opened

    def set(self) -> None:
        super().set()
        self._opened()


class StepMover(MemoryMover):
    """A :class:`MemoryMover` that copies on the machine's own thread: at submit while
    the gate is open, else when it next opens. Hypothesis replays a run's steps and needs
    the same draws each time; with pool threads, whether a promotion had landed by the
    next lookup (a HIT, so a load job, so a ``finish_load`` draw) depended on timing."""

    def __init__(self, region: BytearrayRegion, geometry: ChunkGeometry,
                 tier: MemoryObjectTier) -> None:
        super().__init__(region, geometry, tier, threads=1)
        self._queued: list[Callable[[], None]] = []
        self.gate = _Gate(self._run_queued)
        self.gate.set()

    def _start_task(self, task: Callable[[], None]) -> None:
        if self.gate.is_set():
            task()
        else:
            self._queued.append(task)

    def _run_queued(self) -> None:
        while self._queued:
            self._queued.pop(0)()


def payload(key: OffloadKey) -> bytes:
    """The only bytes ever right for ``key``."""
    return (key * (CHUNK // len(key) + 1))[:CHUNK]


@dataclass
class Job:
    """An engine job: its keys, the primary slots the manager gave them and the manager's
    generation it was planned in."""

    keys: list[OffloadKey]
    slots: list[int]
    ctx: ReqContext
    generation: int
    stale: bool = field(default=False)


class CompositeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.region = BytearrayRegion(SLOTS, GEOMETRY.slot_bytes)
        # Staging, as the stack builder makes a primary over a tier written through.
        self.primary = CpuTierManager(SLOTS, GEOMETRY.slot_bytes, load_policy("lru")(SLOTS),
                                      staging=True)
        self.lower = MemoryObjectTier(LOWER_CHUNKS, MemoryObjectStore(), persistent=True)
        self.mover = StepMover(self.region, GEOMETRY, self.lower)
        self.manager = TieredManager(
            [BuiltTier("cpu", self.primary, region=self.region),
             BuiltTier("mem", self.lower, mover=self.mover)],
            keys=KeyFormat(1, 16),
        )
        self.ctxs = [ReqContext(req_id=f"r{i}") for i in range(2)]
        self.stores: list[Job] = []
        self.loads: list[Job] = []
        self.fenced_jobs = 0

    def teardown(self) -> None:
        self.mover.gate.set()
        self.manager.shutdown()

    # -- the engine's jobs -----------------------------------------------------------
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5), r=st.integers(0, 1))
    def begin_store(self, keys: list[OffloadKey], r: int) -> None:
        self._begin_store(keys, self.ctxs[r])

    @precondition(lambda self: any(not j.stale for j in self.stores))
    @rule(data=st.data(), success=st.booleans(), named=st.booleans())
    def finish_store(self, data: st.DataObject, success: bool, named: bool) -> None:
        """The worker writes the job's slots, then the engine completes it (naming its
        generation or not: both are right for a job since the last reset)."""
        job = data.draw(st.sampled_from([j for j in self.stores if not j.stale]))
        self._finish_store(job, success, job.generation if named else None)

    @rule(key=st.sampled_from(KEYS), r=st.integers(0, 1))
    def lookup_and_load(self, key: OffloadKey, r: int) -> None:
        self._load(key, self.ctxs[r])

    @precondition(lambda self: any(not j.stale for j in self.loads))
    @rule(data=st.data(), named=st.booleans())
    def finish_load(self, data: st.DataObject, named: bool) -> None:
        """The worker reads the job's slot, then the engine completes it."""
        job = data.draw(st.sampled_from([j for j in self.loads if not j.stale]))
        self.loads.remove(job)
        read = bytes(self.region.view(job.slots[0])[:CHUNK])
        assert read == payload(job.keys[0]), "wrong bytes: the slot changed under a load"
        generation = job.generation if named else None
        self.manager.complete_load(job.keys, job.ctx, generation=generation)

    @precondition(lambda self: self.fenced_jobs > 0)
    @rule(data=st.data(), success=st.booleans(), again=st.booleans(), r=st.integers(0, 1))
    def finish_stale(self, data: st.DataObject, success: bool, again: bool, r: int) -> None:
        """A job from before a reset ends late (a store writes its old slots) and the
        engine delivers its completion with its generation. With ``again`` the engine
        first stored the job's keys anew (and, for a load job, loads them again from their
        new slots). The late completion frees only its own fenced slots: the newer jobs
        keep their reservations and pins (see the invariants)."""
        job = data.draw(st.sampled_from([j for j in self.stores + self.loads if j.stale]))
        if again:
            ctx = self.ctxs[r]
            anew = self._begin_store(job.keys, ctx)
            if anew is not None and job in self.loads:
                self._finish_store(anew, True, anew.generation)
                for key in job.keys:
                    self._load(key, ctx)
        self.fenced_jobs -= 1
        if job in self.stores:
            self.stores.remove(job)
            for slot in job.slots:
                self.region.view(slot)[:CHUNK] = b"\xee" * CHUNK
            self.manager.complete_store(job.keys, job.ctx, success=success,
                                        generation=job.generation)
        else:
            self.loads.remove(job)
            self.manager.complete_load(job.keys, job.ctx, generation=job.generation)

    def _begin_store(self, keys: list[OffloadKey], ctx: ReqContext) -> Job | None:
        accepted = self.manager.prepare_store(keys, ctx)
        if not accepted:
            return None
        spec = self.manager.get_spec(accepted)
        assert isinstance(spec, CPULoadStoreSpec)
        job = Job(accepted, [int(s) for s in spec.slot_ids], ctx, self.manager.generation)
        self.stores.append(job)
        return job

    def _finish_store(self, job: Job, success: bool, generation: int | None) -> None:
        self.stores.remove(job)
        if success:
            for key, slot in zip(job.keys, job.slots, strict=True):
                self.region.view(slot)[:CHUNK] = payload(key)
        self.manager.complete_store(job.keys, job.ctx, success=success, generation=generation)

    def _load(self, key: OffloadKey, ctx: ReqContext) -> None:
        """Look ``key`` up; when it is a HIT, pin it and check its slot's bytes."""
        result = self.manager.lookup(key, ctx)
        assert result is not RETRY
        if result is not HIT:
            return
        self.manager.prepare_load([key], ctx)
        spec = self.manager.get_spec([key])
        assert isinstance(spec, CPULoadStoreSpec)
        slot = int(spec.slot_ids[0])
        assert bytes(self.region.view(slot)[:CHUNK]) == payload(key), "wrong bytes"
        self.loads.append(Job([key], [slot], ctx, self.manager.generation))

    @rule(r=st.integers(0, 1))
    def finish_request(self, r: int) -> None:
        self.manager.on_request_finished(self.ctxs[r])

    # -- steps, faults, resets -------------------------------------------------------
    @rule()
    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext())

    @rule(key=st.sampled_from(KEYS), fail=st.booleans())
    def fault(self, key: OffloadKey, fail: bool) -> None:
        if fail:
            self.mover.fail_keys.add(key)
        else:
            self.mover.fail_keys.discard(key)

    @rule(hold=st.booleans())
    def gate(self, hold: bool) -> None:
        """Hold copies in flight (a slow lower tier) or let them run."""
        if hold:
            self.mover.gate.clear()
        else:
            self.mover.gate.set()

    @rule()
    def reset(self) -> None:
        self.mover.gate.set()  # reset_cache drains the movers
        self.manager.reset_cache()
        for job in self.stores + self.loads:
            if not job.stale:
                job.stale = True
                self.fenced_jobs += 1

    @precondition(lambda self: self.fenced_jobs > 0)
    @rule()
    def late_writes_then_flush(self) -> None:
        """The dropped jobs' workers finish: stores write their slots late (a late DMA),
        then the engine reports the flush. A slot reused before the flush would now hold
        another key with these bytes, which a load would catch."""
        for job in self.stores:
            if job.stale:
                for slot in job.slots:
                    self.region.view(slot)[:CHUNK] = b"\xee" * CHUNK
        self.stores = [j for j in self.stores if not j.stale]
        self.loads = [j for j in self.loads if not j.stale]
        self.fenced_jobs = 0
        self.manager.on_reset_flushed()
        assert self.primary.get_stats()["fenced_slots"] == 0

    @rule()
    def settle(self) -> None:
        """Let every copy finish: nothing stays pinned, no key stays pending."""
        self.mover.gate.set()
        self.manager.wait_idle()
        self.manager.on_schedule_end(ScheduleEndContext())
        assert all(not e.pins for _, e in self.lower.index.items()), "lower tier pinned"
        live_pins = sum(1 for j in self.loads if not j.stale)
        assert self.primary.get_stats()["pinned_chunks"] <= live_pins
        # Keys whose copies still fail may be promoted anew each time (backing off from a
        # failed promotion is the lower tier's business); once the fault ends, every key
        # resolves.
        self._resolve(skip=set(self.mover.fail_keys))
        self.mover.fail_keys.clear()
        self._resolve(skip=set())

    def _resolve(self, skip: set[OffloadKey]) -> None:
        """Every key not being stored by a live job and not in ``skip`` is HIT or MISS,
        or a promotion its lookup started lands within one step."""
        being_stored = {k for j in self.stores if not j.stale for k in j.keys}
        probe = ReqContext(req_id="probe")
        for key in KEYS:
            if key in being_stored or key in skip:
                continue
            first = self.manager.lookup(key, probe)
            if first is PENDING:
                self.manager.wait_idle()
                self.manager.on_schedule_end(ScheduleEndContext())
                assert self.manager.lookup(key, probe) in (HIT, MISS), "pending forever"
            else:
                assert first in (HIT, MISS)
        self.manager.on_request_finished(probe)
        self.manager.wait_idle()
        assert all(not e.pins for _, e in self.lower.index.items()), "lower tier pinned"

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def jobs_since_the_last_reset_hold_their_slots(self) -> None:
        """A key a store writes stays reserved in its slot until that store ends; a key a
        load reads stays pinned in its slot until that load ends (whatever a job from
        before a reset completes meanwhile)."""
        readers: dict[OffloadKey, int] = {}
        for job in self.stores + self.loads:
            if job.stale:
                continue
            for key, slot in zip(job.keys, job.slots, strict=True):
                assert self.primary.slot_of(key) == slot, "a job's slot was given away"
                if job in self.stores:
                    assert self.primary.slot_state(key) is SlotState.WRITING, "stored early"
                else:
                    readers[key] = readers.get(key, 0) + 1
        for key, count in readers.items():
            # (Cascades pin the primary's slots too, while their movers read them.)
            assert self.primary.pin_count(key) >= count, "a reader's pin was dropped"

    @invariant()
    def usage_is_the_sum_of_chunk_sizes(self) -> None:
        index = self.lower.index
        assert index.usage == sum(entry.size for _, entry in index.items())
        assert index.usage <= LOWER_CHUNKS
        stats = self.primary.get_stats()
        assert stats["usage_bytes"] == stats["chunks"] * GEOMETRY.slot_bytes
        assert stats["chunks"] + stats["fenced_slots"] <= SLOTS
        if self.fenced_jobs == 0:
            assert stats["fenced_slots"] == 0, "a slot fenced after its job ended"


TestCompositeMachine = CompositeMachine.TestCase
TestCompositeMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
