"""The wait bound of cost-aware promotion: a request gives up promotions still in flight
once recomputing its prefix (or its deadline) would have finished, the late bytes are
discarded, and jobs in flight teach the estimate before they end.

Time is the composite's ``clock``, set by each test; a lower tier that is slow is a mover
whose copies wait on its gate. Nothing here depends on the machine's speed."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.policies import load_policy
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.cost import DEADLINE_PARAM, ChunkShape, CostModel, TransferEstimate
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import (
    BytearrayRegion,
    MemoryMover,
    MemoryObjectStore,
    MemoryObjectTier,
)
from kvtiers.tiers.cpu.manager import CpuTierManager

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
MB = 1_000_000
TOKENS = 32  # per chunk
CHUNK = 128 * 1024  # bytes per chunk
RATE = 2000.0  # prefill tokens per second: 8 chunks recompute in 0.128 s
GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(CHUNK,))
SLOTS = 32


def key(i: int) -> OffloadKey:
    return conformance_key(i, 0)


class Stack:
    """A CPU primary over a bytearray region, an in-memory lower tier ``s3`` whose mover
    waits on its gate, a cost model, and a clock the test moves."""

    def __init__(self, estimate: TransferEstimate) -> None:
        self.region = BytearrayRegion(SLOTS, GEOMETRY.slot_bytes)
        # Staging, as the stack builder makes a primary over a tier written through.
        self.primary = CpuTierManager(SLOTS, GEOMETRY.slot_bytes, load_policy("lru")(SLOTS),
                                      staging=True)
        self.lower = MemoryObjectTier(256, MemoryObjectStore())
        self.mover = MemoryMover(self.region, GEOMETRY, self.lower)
        self.manager = TieredManager([
            BuiltTier("cpu", self.primary, region=self.region),
            BuiltTier("s3", self.lower, mover=self.mover),
        ])
        self.manager.cost = CostModel(prefill_tokens_per_s=RATE,
                                      shapes=[ChunkShape(TOKENS, CHUNK)],
                                      tiers={"s3": estimate})
        self.now = 0.0
        self.manager.clock = lambda: self.now

    def put_lower(self, ids: Sequence[int]) -> None:
        """Chunks in the lower tier only (stored through the primary, which is reset)."""
        ctx = ReqContext("writer")
        self.store(ids, ctx)
        self.manager.wait_idle()
        self.manager.reset_cache()
        self.manager.on_reset_flushed()

    def store(self, ids: Sequence[int], ctx: ReqContext, marker: bytes | None = None) -> None:
        """Store chunks ``ids`` (their payload, or ``marker`` repeated) as the engine does
        after computing them; only the keys the primary accepts are written."""
        accepted = self.manager.prepare_store([key(i) for i in ids], ctx) or []
        if not accepted:
            return
        spec = self.manager.get_spec(accepted)
        assert isinstance(spec, CPULoadStoreSpec)
        for k, slot in zip(accepted, spec.slot_ids, strict=True):
            data = conformance_payload(ids[[key(i) for i in ids].index(k)], CHUNK)
            if marker is not None:
                data = marker * (len(data) // len(marker))
            self.region.view(int(slot))[: len(data)] = data
        self.manager.complete_store(accepted, ctx)

    def lookups(self, n: int, ctx: ReqContext) -> list[LookupResult]:
        """One scheduler step of the request's lookups, in prefix order, stopping at the
        first MISS as the engine does."""
        answers = []
        for i in range(n):
            answers.append(self.manager.lookup(key(i), ctx))
            if answers[-1] is MISS:
                break
        self.manager.on_schedule_end(ScheduleEndContext())
        return answers

    def slot_bytes(self, i: int) -> bytes:
        slot = self.primary.slot_of(key(i))
        assert slot is not None
        return bytes(self.region.view(slot)[:CHUNK])


@pytest.fixture
def stack() -> Iterator[Stack]:
    built = Stack(TransferEstimate(0.01, 1000 * MB))  # believed fast: 8 chunks in ~11 ms
    yield built
    built.mover.gate.set()
    built.manager.shutdown()


def start_slow_promotion(stack: Stack, ctx: ReqContext, n: int = 8, stored: int = 8) -> None:
    """Chunks ``0..stored-1`` in the lower tier only; ``ctx``'s request defers, then
    promotes the first ``n`` through a mover that does not copy until its gate opens."""
    stack.put_lower(range(stored))
    stack.mover.gate.clear()
    assert stack.lookups(n, ctx) == [PENDING] * n  # the plan's first step
    assert stack.lookups(n, ctx) == [PENDING] * n  # promoted: the job is in flight
    assert stack.manager.get_stats()["promotion_plans"] == 1


def test_a_promotion_late_past_recomputing_is_abandoned_and_its_late_bytes_discarded(
    stack: Stack,
) -> None:
    r = ReqContext("r")
    start_slow_promotion(stack, r)
    # 8 chunks of 32 tokens recompute in 0.128 s: waiting less keeps the request waiting.
    stack.now += 0.1
    assert stack.lookups(8, r) == [PENDING] * 8
    stack.now += 0.05
    assert stack.lookups(8, r) == [MISS]  # from the first chunk that has not landed
    stats = stack.manager.get_stats()
    assert stats["promotion_waits_abandoned"] == 1
    assert stats["promotions_abandoned"] == 1
    # The abandoned chunk left the primary; its slot stays held while the copy runs.
    assert stack.primary.lookup(key(0), r) is MISS
    assert stack.primary.get_stats()["held_slots"] == 1
    # The engine recomputes and stores chunk 0 into a new slot (the others are still
    # arriving, so the store takes only chunk 0).
    stack.store(range(8), r, marker=b"recomputed")
    assert stack.primary.lookup(key(0), r) is HIT
    # Then the slow copy ends: its late chunk 0 lands nowhere, its slot is freed, and
    # the chunks nobody gave up land as usual.
    stack.mover.gate.set()
    stack.manager.wait_idle()
    assert stack.primary.get_stats()["held_slots"] == 0
    assert stack.slot_bytes(0).startswith(b"recomputed")
    for i in range(1, 8):
        assert stack.slot_bytes(i) == conformance_payload(i, CHUNK)
    stats = stack.manager.get_stats()
    assert stats["promotions"] == 7
    assert stats["promotion_failures"] == 0
    assert stats["promotions_abandoned"] == 1
    assert stack.primary.get_stats()["chunks"] == 8
    assert stack.primary.free_slots == SLOTS - 8


def test_an_abandoned_chunk_is_never_a_hit_after_its_copy_lands(stack: Stack) -> None:
    r = ReqContext("r")
    start_slow_promotion(stack, r)
    stack.now += 1.0
    assert stack.lookups(8, r) == [MISS]
    stack.manager.on_request_finished(r)  # gave up: nothing of it is stored
    stack.mover.gate.set()
    stack.manager.wait_idle()
    assert stack.primary.lookup(key(0), r) is MISS
    assert stack.primary.get_stats()["held_slots"] == 0
    assert stack.primary.free_slots == SLOTS - 7
    # The chunk is still in the lower tier, for a request that can wait for it.
    assert stack.lower.lookup(key(0), r) is HIT


def test_a_request_that_gave_up_promotes_nothing_more(stack: Stack) -> None:
    r = ReqContext("r")
    start_slow_promotion(stack, r, n=4)
    stack.now += 1.0
    assert stack.lookups(4, r) == [MISS]
    # Its later lookups start no promotion, even of chunks past the abandoned one.
    assert stack.manager.lookup(key(0), r) is MISS
    stack.manager.on_schedule_end(ScheduleEndContext())
    assert stack.manager.get_stats()["promotion_waits_abandoned"] == 1


def test_a_deadline_shorter_than_recomputing_bounds_the_wait(stack: Stack) -> None:
    r = ReqContext("r", kv_transfer_params={DEADLINE_PARAM: 0.02})
    start_slow_promotion(stack, r)
    stack.now += 0.015
    assert stack.lookups(8, r) == [PENDING] * 8
    stack.now += 0.01
    assert stack.lookups(8, r) == [MISS]


def test_another_requests_promotion_counts_against_this_ones_wait(stack: Stack) -> None:
    first = ReqContext("first")
    start_slow_promotion(stack, first)
    second = ReqContext("second")
    assert stack.lookups(8, second) == [PENDING] * 8  # arriving: its wait starts now
    stack.now += 0.2
    assert stack.lookups(8, second) == [MISS]


def test_an_unseeded_tier_is_bounded_from_its_first_request_and_learns_in_flight() -> None:
    stack = Stack(TransferEstimate(None, None))  # no seed, no job: predicts 0 s
    try:
        first = ReqContext("first")
        start_slow_promotion(stack, first, n=8, stored=16)
        # The first job has run 5 s: the tier is no faster than that while it runs.
        stack.now += 5.0
        stack.manager.on_schedule_end(ScheduleEndContext())
        assert stack.manager.cost is not None
        assert stack.manager.cost.tiers["s3"].seconds(CHUNK) == pytest.approx(5.0)
        assert stack.lookups(8, first) == [MISS]  # its own wait is long over
        # A request whose prefix sits only in the slow tier is not promoted: no wait.
        second = ReqContext("second")
        answers = [stack.manager.lookup(key(i), second) for i in range(8, 16)]
        assert answers == [PENDING] * 8  # the plan's first step
        stack.manager.on_schedule_end(ScheduleEndContext())
        assert stack.manager.lookup(key(8), second) is MISS
        assert stack.manager.get_stats()["promotions_declined"] == 1
    finally:
        stack.mover.gate.set()
        stack.manager.shutdown()


def test_one_slow_job_moves_a_learned_estimate_past_a_short_deadline() -> None:
    estimate = TransferEstimate(None, None)
    for _ in range(20):
        estimate.observe(8 * CHUNK, 0.01)
    estimate.observe(8 * CHUNK, 12.0)
    assert estimate.seconds(8 * CHUNK) > 2.0


def test_a_detached_reservation_frees_its_key_and_holds_its_slot() -> None:
    primary = CpuTierManager(2, 16, load_policy("lru")(2))
    ctx = ReqContext("r")
    assert primary.prepare_store([key(0)], ctx) == [key(0)]
    slot = primary.slot_of(key(0))
    assert slot is not None
    assert primary.detach_writing([key(0), key(1)]) == {key(0): slot}
    assert primary.lookup(key(0), ctx) is MISS
    assert primary.prepare_store([key(0)], ctx) == [key(0)]
    assert primary.slot_of(key(0)) != slot  # the held slot is not reused
    assert primary.prepare_store([key(1)], ctx) is None  # nor given to another key
    primary.release_held([slot])
    assert primary.prepare_store([key(1)], ctx) == [key(1)]
