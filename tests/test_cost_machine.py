"""The composite's state machine (faults, held copies, resets, late writes) with a cost
model deciding promotions: a deferred first pass, declined chunks and promotions abandoned
in flight (time passes on the composite's clock while copies are held) keep every
invariant of tests/test_composite_machine.py, every key still resolves to HIT or MISS,
and every slot an abandoned promotion held is free once the copies end."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.stack.cost import ChunkShape, CostModel, TransferEstimate
from tests.test_composite_machine import (
    CHUNK,
    HIT,
    KEYS,
    MISS,
    PENDING,
    SLOTS,
    CompositeMachine,
    payload,
)

# A chunk of 16 tokens promotes in 1 ms + 4 us. At 8,000 tokens/s it computes in 2 ms
# (promoted); at 16,000 in 1 ms (alone it never pays, two in a row do); at 64,000 never.
TOKENS = 16
RATES = (8_000.0, 16_000.0, 64_000.0)


class CostMachine(CompositeMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager.cost = CostModel(
            prefill_tokens_per_s=RATES[0],
            shapes=[ChunkShape(TOKENS, CHUNK)],
            tiers={"mem": TransferEstimate(0.001, 1e9)},
        )
        self.now = 0.0
        self.manager.clock = lambda: self.now

    @rule(seconds=st.sampled_from((0.0005, 0.002, 1.0)))
    def time_passes(self, seconds: float) -> None:
        """Time passes: waits for promotions still in flight may run out."""
        self.now += seconds

    @rule(n=st.integers(1, len(KEYS)), r=st.integers(0, 1))
    def give_up_a_slow_prefix(self, n: int, r: int) -> None:
        """A request's prefix is promoted while copies are held (a slow tier), then it
        waits past its bound and looks the prefix up again: what is still arriving is
        abandoned."""
        self.mover.gate.clear()
        for _ in range(2):  # the plan's first step, then its promotions
            self.lookup_prefix(n, r)
            self.step()
        self.now += 1.0
        self.lookup_prefix(n, r)

    @rule()
    def settle(self) -> None:
        super().settle()
        assert self.primary.get_stats()["held_slots"] == 0, "an abandoned slot stayed held"

    @rule(n=st.integers(1, len(KEYS)), r=st.integers(0, 1))
    def lookup_prefix(self, n: int, r: int) -> None:
        """A request's prefix, looked up in order as the scheduler does (positions in
        the plan follow the keys' order), loading and checking what hits."""
        for key in KEYS[:n]:
            self.lookup_and_load(key, r)

    @rule(n=st.integers(SLOTS + 1, len(KEYS)))
    def store_prefix(self, n: int) -> None:
        """Another request stores ``KEYS[:n]`` a primary-full at a time and its cascades
        land: the head of the prefix is then in the lower tier only."""
        self.mover.gate.set()  # the cascades must land
        writer = ReqContext(req_id="writer")
        for start in range(0, n, SLOTS):
            accepted = self.manager.prepare_store(KEYS[start:min(n, start + SLOTS)], writer)
            if not accepted:
                continue
            spec = self.manager.get_spec(accepted)
            assert isinstance(spec, CPULoadStoreSpec)
            for key, slot in zip(accepted, spec.slot_ids, strict=True):
                self.region.view(int(slot))[:CHUNK] = payload(key)
            self.manager.complete_store(accepted, writer)
            self.manager.wait_idle()
        self.manager.on_request_finished(writer)

    @rule(rate=st.sampled_from(RATES))
    def prefill_rate(self, rate: float) -> None:
        """The engine's prefill rate changes (plans decided later see it)."""
        assert self.manager.cost is not None
        self.manager.cost.prefill_tokens_per_s = rate

    def _resolve(self, skip: set[OffloadKey]) -> None:
        """As the base machine's, with the cost model's extra pass: a lower-tier hit is
        deferred once (no promotion), then promoted or declined, then it lands."""
        being_stored = {k for j in self.stores if not j.stale for k in j.keys}
        probe = ReqContext(req_id="probe")
        for key in KEYS:
            if key in being_stored or key in skip:
                continue
            result = self.manager.lookup(key, probe)
            for _ in range(2):
                if result is not PENDING:
                    break
                self.manager.wait_idle()
                self.manager.on_schedule_end(ScheduleEndContext())
                result = self.manager.lookup(key, probe)
            assert result in (HIT, MISS), "pending forever"
        self.manager.on_request_finished(probe)
        self.manager.wait_idle()
        assert all(not e.pins for _, e in self.lower.index.items()), "lower tier pinned"


TestCostMachine = CostMachine.TestCase
TestCostMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
