"""Cost-aware promotion: the transfer estimate, the cut a plan picks, and the composite's
answers (deferred first pass, then a prefix trimmed to what pays, never a hole)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.cost import (
    DEADLINE_PARAM,
    MAX_REPLANS,
    ChunkShape,
    CostModel,
    TransferEstimate,
)
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import (
    BytearrayRegion,
    MemoryMover,
    MemoryObjectStore,
    MemoryObjectTier,
)
from kvtiers.testing.memory_tier import InMemoryTier

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
MB = 1_000_000


# -- the estimate ------------------------------------------------------------------------
def test_seeds_predict_before_any_job() -> None:
    estimate = TransferEstimate(0.2, 50 * MB)
    assert estimate.seconds(0) == 0
    assert estimate.seconds(5 * MB) == pytest.approx(0.3)


def test_a_tier_with_no_seed_and_no_job_costs_nothing() -> None:
    estimate = TransferEstimate(None, None)
    assert estimate.unknown
    assert estimate.seconds(10 * MB) == 0


def test_jobs_of_varied_sizes_find_latency_and_bandwidth() -> None:
    estimate = TransferEstimate(0.001, 2000 * MB)  # a fast seed; the tier is slow S3
    for i in range(60):
        size = (1 + i % 7) * MB
        estimate.observe(size, 0.2 + size / (50 * MB))
    assert estimate.latency_s == pytest.approx(0.2, rel=0.01)
    assert estimate.bytes_per_s == pytest.approx(50 * MB, rel=0.01)


def test_jobs_of_one_size_refit_the_level_and_keep_the_slope() -> None:
    estimate = TransferEstimate(0.0, 100 * MB)
    for _ in range(40):
        estimate.observe(2 * MB, 0.5)
    assert estimate.seconds(2 * MB) == pytest.approx(0.5, rel=0.01)
    assert estimate.bytes_per_s == pytest.approx(100 * MB)
    assert estimate.latency_s == pytest.approx(0.48, rel=0.01)


def test_jobs_faster_than_the_seeded_latency_put_all_time_in_bandwidth() -> None:
    estimate = TransferEstimate(1.0, 100 * MB)
    for _ in range(40):
        estimate.observe(MB, 0.002)
    assert estimate.latency_s == pytest.approx(0, abs=1e-9)
    assert estimate.seconds(MB) == pytest.approx(0.002, rel=0.01)


def test_bad_seeds_are_refused() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        TransferEstimate(-1.0, None)
    with pytest.raises(ValueError, match="bytes_per_s"):
        TransferEstimate(None, 0.0)
    with pytest.raises(ValueError, match="weight"):
        TransferEstimate(None, None, weight=0.0)


# -- the plan: driven through the hook as the composite calls it ----------------------
TOKENS = 32  # per chunk
CHUNK = 128 * 1024  # bytes per chunk: 4 KiB per token, about 80 us per token at 50 MB/s


def model(rate: float = 2000.0, *, tiers: dict[str, TransferEstimate] | None = None,
          shapes: Sequence[ChunkShape] = (ChunkShape(TOKENS, CHUNK),)) -> CostModel:
    if tiers is None:
        tiers = {"s3": TransferEstimate(0.2, 50 * MB)}
    return CostModel(prefill_tokens_per_s=rate, shapes=shapes, tiers=tiers)


def key(i: int, group: int = 0) -> OffloadKey:
    return conformance_key(i, group)


def run_pass(cost: CostModel, layout: Sequence[str | None], ctx: ReqContext,
             group: int = 0) -> list[LookupResult]:
    """One scheduler step's lookups as the composite makes them: ``layout[i]`` is where
    chunk ``i`` is (``"cpu"``: the primary, a lower tier's name, ``None``: nowhere); stops
    at a MISS."""
    answers = []
    for i, where in enumerate(layout):
        k = key(i, group)
        if where == "cpu":
            result = HIT
        elif where is None:
            result = MISS
        else:
            held = cost.hold(k, where, ctx)
            result = PENDING if held is None else held
        cost.looked_up(k, ctx, result)
        answers.append(result)
        if result is MISS:
            break
    cost.end_step()
    return answers


def promoted(cost: CostModel, layout: Sequence[str | None], ctx: ReqContext) -> int:
    """Chunks the second pass promotes (the first only defers)."""
    first = run_pass(cost, layout, ctx)
    assert MISS not in first[: layout.index(None) if None in layout else len(layout)]
    second = run_pass(cost, layout, ctx)
    return sum(1 for i, a in enumerate(second) if a is PENDING and layout[i] not in ("cpu",))


def test_the_first_pass_defers_every_lower_hit_without_deciding() -> None:
    cost = model()
    ctx = ReqContext("r")
    assert run_pass(cost, ["cpu", "s3", "s3"], ctx) == [HIT, PENDING, PENDING]
    assert cost.stats["promotion_plans"] == 0


def test_a_long_run_from_a_slow_tier_pays_and_is_promoted_whole() -> None:
    # 40 chunks: 1280 tokens = 0.64 s of prefill; 5.2 MB at 50 MB/s + 0.2 s = 0.31 s.
    cost = model()
    assert promoted(cost, ["s3"] * 40, ReqContext("r")) == 40
    decision = cost.decisions["r"]
    assert decision.cut_tokens == 40 * TOKENS
    assert decision.load_s == pytest.approx(0.2 + 40 * CHUNK / (50 * MB))


def test_a_short_run_does_not_pay_its_latency_and_is_recomputed() -> None:
    # 8 chunks: 256 tokens = 0.128 s of prefill < 0.2 s of latency alone.
    cost = model()
    ctx = ReqContext("r")
    run_pass(cost, ["cpu", "cpu"] + ["s3"] * 8, ctx)
    second = run_pass(cost, ["cpu", "cpu"] + ["s3"] * 8, ctx)
    assert second == [HIT, HIT, MISS]
    assert cost.decisions["r"].cut_tokens == 2 * TOKENS
    assert cost.stats["promotions_declined"] == 1


def test_when_a_chunk_moves_slower_than_it_computes_nothing_is_promoted() -> None:
    # At 20k tokens/s a chunk computes in 1.6 ms and moves in 2.6 ms: no run ever pays.
    cost = model(20_000.0)
    assert promoted(cost, ["s3"] * 400, ReqContext("r")) == 0


def test_the_deadline_in_the_transfer_params_trims_the_prefix() -> None:
    ctx = ReqContext("r", kv_transfer_params={DEADLINE_PARAM: 0.25})
    cost = model()
    # Without a deadline 40 chunks pay (0.31 s); within 0.25 s only 19 arrive.
    assert promoted(cost, ["s3"] * 40, ctx) == 19
    assert cost.decisions["r"].load_s <= 0.25


def test_a_bad_deadline_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    ctx = ReqContext("r", kv_transfer_params={DEADLINE_PARAM: "soon"})
    assert promoted(model(), ["s3"] * 40, ctx) == 40
    assert DEADLINE_PARAM in caplog.text


@pytest.mark.parametrize("value", [
    pytest.param(10**400, id="401 digits"),
    -1, -0.5, math.nan, math.inf, -math.inf, True, False, "0.25", None, [0.25],
    # Values whose repr raises: Python writes no integer of more than 4,300 digits as
    # text (sys.get_int_max_str_digits), and a Fraction's repr writes its numerator.
    pytest.param(10**5000, id="5001 digits"),
    pytest.param(Fraction(10**5000, 3), id="a fraction of 5001 digits"),
], ids=repr)
def test_a_bad_deadline_of_any_kind_is_ignored_with_one_warning(
    value: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A deadline no float holds (a 401-digit integer) must not raise out of a lookup (the
    scheduler would die); nor may any other bad value, one too long to write in the
    warning included. One warning per request, however many lookups and plans it
    makes."""
    ctx = ReqContext("r", kv_transfer_params={DEADLINE_PARAM: value})
    cost = model()
    with caplog.at_level("WARNING", logger="kvtiers.stack.cost"):
        assert promoted(cost, ["s3"] * 40, ctx) == 40
        run_pass(cost, ["s3"] * 40, ctx)
    warnings = [r for r in caplog.records if DEADLINE_PARAM in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert len(warnings[0].getMessage()) < 200


def test_a_large_finite_deadline_is_no_limit() -> None:
    ctx = ReqContext("r", kv_transfer_params={DEADLINE_PARAM: 10**300})
    assert promoted(model(), ["s3"] * 40, ctx) == 40


def test_tiers_copy_in_parallel() -> None:
    # Alternating chunks of two tiers of 0.2 s latency: 0.2 s + half the bytes each, not
    # twice the latency.
    tiers = {"a": TransferEstimate(0.2, 50 * MB), "b": TransferEstimate(0.2, 50 * MB)}
    cost = model(tiers=tiers)
    layout = ["a", "b"] * 15
    assert promoted(cost, layout, ReqContext("r")) == 30
    assert cost.decisions["r"].load_s == pytest.approx(0.2 + 15 * CHUNK / (50 * MB))


def test_a_group_that_misses_early_limits_every_group() -> None:
    shapes = (ChunkShape(TOKENS, CHUNK), ChunkShape(2 * TOKENS, CHUNK // 4))
    cost = model(shapes=shapes)
    ctx = ReqContext("r")
    for _ in range(2):
        run_pass(cost, ["s3"] * 40, ctx, group=0)
        answers = run_pass(cost, ["cpu", None], ctx, group=1)
    # Group 1 reaches 64 tokens: two s3 chunks of group 0 cannot pay 0.2 s.
    assert answers == [HIT, MISS]
    assert cost.decisions["r"].cut_tokens == 0


def test_positions_come_from_the_engine_not_the_lookup_order() -> None:
    """An engine that records where each key's chunk ends (vLLM does) may look a prefix up
    in any order: the plan places chunks by those positions. Here the head (8 chunks) is
    in s3 and the rest (32) in the primary, looked up tail first: promoting the head pays
    (0.64 s of prefill saved for 0.22 s), stopping before it would leave the whole prompt
    to recompute."""
    cost = model()
    ctx = ReqContext("r")
    ends = {key(i): (i + 1) * TOKENS for i in range(40)}
    ctx.key_position = ends.get

    def tail_first() -> list[LookupResult]:
        answers: list[LookupResult] = []
        for i in reversed(range(40)):
            if i >= 8:
                answers.append(HIT)
            else:
                held = cost.hold(key(i), "s3", ctx)
                answers.append(PENDING if held is None else held)
            cost.looked_up(key(i), ctx, answers[-1])
        cost.end_step()
        return answers[32:]

    assert tail_first() == [PENDING] * 8  # deferred
    assert tail_first() == [PENDING] * 8, "the head must be promoted"
    assert cost.decisions["r"].cut_tokens == 40 * TOKENS


def test_chunks_before_a_groups_first_lookup_limit_nothing() -> None:
    """The engine asks from the first chunk it lacks (its own prefix cache has the
    ones before) and, for a sliding-window group, for the window only: chunks never
    asked for neither shorten the usable prefix nor cost a promotion."""
    shapes = (ChunkShape(TOKENS, CHUNK), ChunkShape(TOKENS, CHUNK))
    cost = model(shapes=shapes)
    ctx = ReqContext("r")
    ends = {key(i, g): (i + 1) * TOKENS for i in range(40) for g in range(2)}
    ctx.key_position = ends.get

    def step() -> None:
        for i in range(4, 40):  # chunks 0-3 are in the engine's own cache
            held = cost.hold(key(i), "s3", ctx)
            cost.looked_up(key(i), ctx, PENDING if held is None else held)
        for i in reversed(range(36, 40)):  # the window of 4 chunks at the end
            held = cost.hold(key(i, 1), "s3", ctx)
            cost.looked_up(key(i, 1), ctx, PENDING if held is None else held)
        cost.end_step()

    step()
    step()
    decision = cost.decisions["r"]
    assert decision.cut_tokens == 40 * TOKENS
    assert decision.load_s == pytest.approx(0.2 + 40 * CHUNK / (50 * MB))


def test_a_chunk_that_appears_past_the_cut_opens_the_plan_again() -> None:
    cost = model()
    ctx = ReqContext("r")
    # Decided while the head was nowhere: the cut is 0.
    run_pass(cost, [None], ctx)
    run_pass(cost, ["s3", None], ctx)
    assert run_pass(cost, ["s3", None], ctx) == [MISS]
    # Another request stored the prefix meanwhile: 40 chunks, which pay.
    layout = ["s3"] * 40
    assert run_pass(cost, layout, ctx)[0] is MISS  # chunk 0 was in s3 at the last cut
    cost.forget(ctx)
    run_pass(cost, [None] * 1, ctx)
    assert run_pass(cost, layout, ctx) == [PENDING] * 40  # first seen: deferred
    assert run_pass(cost, layout, ctx) == [PENDING] * 40  # decided: promoted
    assert cost.decisions["r"].cut_tokens == 40 * TOKENS


def test_a_plan_opens_again_a_bounded_number_of_times() -> None:
    cost = model()
    ctx = ReqContext("r")
    run_pass(cost, ["cpu", None], ctx)
    answers = []
    for _ in range(2 * (MAX_REPLANS + 2)):
        # Chunk 1 comes and goes: each time it is back past the cut, the plan reopens.
        answers.append(run_pass(cost, ["cpu", "s3", None], ctx)[1])
        run_pass(cost, ["cpu", None], ctx)
    assert answers.count(PENDING) <= 1 + MAX_REPLANS
    assert answers[-1] is MISS


def test_a_finished_request_plans_afresh() -> None:
    cost = model()
    ctx = ReqContext("r")
    promoted(cost, ["s3"] * 40, ctx)
    cost.forget(ctx)
    assert run_pass(cost, ["s3"] * 3, ctx) == [PENDING] * 3
    assert "r" not in cost.decisions


@given(layout=st.lists(st.sampled_from(["cpu", "s3", "file", None]), max_size=60),
       rate=st.sampled_from([500.0, 2000.0, 8000.0, 50_000.0]))
def test_the_answers_are_a_prefix_and_never_lose_to_recompute(
    layout: list[str | None], rate: float
) -> None:
    tiers = {"s3": TransferEstimate(0.2, 50 * MB), "file": TransferEstimate(0.0005, 2000 * MB)}
    cost = model(rate, tiers=tiers)
    ctx = ReqContext("r")
    run_pass(cost, layout, ctx)
    second = run_pass(cost, layout, ctx)
    usable = second.index(MISS) if MISS in second else len(second)
    # A prefix: past the first MISS nothing is looked up, so nothing is promoted there.
    assert all(a is not MISS for a in second[:usable])
    decision = cost.decisions.get("r")
    if decision is None:  # no lower-tier hit: nothing deferred, nothing decided
        assert PENDING not in second
        return
    sent: dict[str, int] = {}
    for where in layout[:usable]:
        if where not in ("cpu", None):
            sent[where] = sent.get(where, 0) + CHUNK
    def saved(chunks: int) -> float:
        """Predicted prefill saved, net of the promotions, by a prefix of ``chunks``."""
        sent: dict[str, int] = {}
        for where in layout[:chunks]:
            if where not in ("cpu", None):
                sent[where] = sent.get(where, 0) + CHUNK
        load = max((tiers[t].seconds(b) for t, b in sent.items()), default=0.0)
        return chunks * TOKENS / rate - load

    # Never worse than recomputing the prompt, than the primary's chunks alone, or than
    # promoting every chunk found.
    primary_head = next((i for i, w in enumerate(layout) if w != "cpu"), len(layout))
    found = layout.index(None) if None in layout else len(layout)
    assert usable >= primary_head
    assert saved(usable) >= 0
    assert saved(usable) >= saved(primary_head) - 1e-12
    assert saved(usable) >= saved(found) - 1e-12


# -- the composite ----------------------------------------------------------------------
GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(CHUNK,))


class Stack:
    """A reference primary over a bytearray region, one in-memory lower tier named s3,
    and a cost model over both."""

    def __init__(self, rate: float, primary_chunks: int = 64) -> None:
        self.region = BytearrayRegion(primary_chunks, GEOMETRY.slot_bytes)
        self.lower = MemoryObjectTier(256, MemoryObjectStore())
        self.manager = TieredManager([
            BuiltTier("cpu", InMemoryTier(primary_chunks), region=self.region),
            BuiltTier("s3", self.lower,
                      mover=MemoryMover(self.region, GEOMETRY, self.lower)),
        ])
        self.manager.cost = model(rate)

    def put_lower(self, ids: Sequence[int]) -> None:
        """Store chunks in the lower tier only (through the primary, then evicted there
        by a reset of the primary)."""
        ctx = ReqContext("writer")
        keys = [key(i) for i in ids]
        accepted = self.manager.prepare_store(keys, ctx)
        assert accepted == keys
        spec = self.manager.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        for i, slot in zip(ids, spec.slot_ids, strict=True):
            payload = conformance_payload(i, CHUNK)
            self.region.view(int(slot))[: len(payload)] = payload
        self.manager.complete_store(keys, ctx)
        self.manager.wait_idle()
        self.manager.reset_cache()
        self.manager.on_reset_flushed()

    def lookups(self, n: int, ctx: ReqContext) -> list[LookupResult]:
        answers = []
        for i in range(n):
            answers.append(self.manager.lookup(key(i), ctx))
            if answers[-1] is MISS:
                break
        self.manager.on_schedule_end(ScheduleEndContext())
        return answers


@pytest.fixture
def stack() -> Iterator[Stack]:
    built = Stack(2000.0)
    yield built
    built.manager.shutdown()


def test_composite_defers_then_promotes_a_run_that_pays(stack: Stack) -> None:
    stack.put_lower(range(40))
    ctx = ReqContext("r")
    assert stack.lookups(40, ctx) == [PENDING] * 40
    stack.manager.wait_idle()
    assert stack.manager.get_stats()["promotions"] == 0  # the first pass moved nothing
    assert stack.lookups(40, ctx) == [PENDING] * 40
    stack.manager.wait_idle()
    assert stack.lookups(40, ctx) == [HIT] * 40
    assert stack.manager.get_stats()["promotions"] == 40


def test_composite_answers_miss_for_a_run_that_does_not_pay(stack: Stack) -> None:
    stack.put_lower(range(8))
    ctx = ReqContext("r")
    assert stack.lookups(8, ctx) == [PENDING] * 8
    assert stack.lookups(8, ctx) == [MISS]
    stack.manager.wait_idle()
    stats = stack.manager.get_stats()
    assert stats["promotions"] == 0
    assert stats["promotions_declined"] == 1
    # The chunks stay in the lower tier for a request that would profit.
    assert stack.lookups(8, ReqContext("other")) == [PENDING] * 8


def test_composite_learns_a_tier_slower_than_its_seed() -> None:
    stack = Stack(2000.0)
    cost = stack.manager.cost
    assert cost is not None
    cost.tiers["s3"] = TransferEstimate(0.0, 10_000 * MB)  # seeded as fast
    cost.transfer_time = lambda tier, n: 0.2 + n / (50 * MB)  # truly slow S3
    try:
        stack.put_lower(range(8))
        first = ReqContext("first")
        stack.lookups(8, first)
        assert stack.lookups(8, first) == [PENDING] * 8  # believed fast: promoted
        stack.manager.wait_idle()
        assert cost.tiers["s3"].seconds(8 * CHUNK) == pytest.approx(0.2 + 8 * CHUNK / (50 * MB))
        stack.manager.reset_cache()
        stack.manager.on_reset_flushed()
        second = ReqContext("second")
        stack.lookups(8, second)
        assert stack.lookups(8, second) == [MISS]  # now known to be slow
    finally:
        stack.manager.shutdown()


def test_a_fresh_context_per_lookup_still_decides(stack: Stack) -> None:
    """An adapter that builds a new ReqContext per call (same request id) must not keep
    a request deferred forever: plans are kept by request id."""
    stack.put_lower(range(40))
    assert stack.lookups(40, ReqContext("r")) == [PENDING] * 40
    assert stack.lookups(40, ReqContext("r")) == [PENDING] * 40
    stack.manager.wait_idle()
    assert stack.lookups(40, ReqContext("r")) == [HIT] * 40
    assert math.isclose(stack.manager.get_stats()["promotion_plans"], 1)


# -- a hybrid model, looked up in vLLM's order ---------------------------------------------
WINDOW = 4  # the sliding-window group's window, in chunks
HYBRID = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(CHUNK, CHUNK))


def vllm_lookup(manager: TieredManager, ctx: ReqContext, chunks: int) -> int | None:
    """The usable prefix in tokens of a prompt of ``chunks`` full chunks and one token
    more, as vLLM 0.33's scheduler finds it (``OffloadingConnectorScheduler.
    _lookup_complete_chunks``), ``None`` when deferred: group 0 (full attention) forward
    from its first chunk until a ``MISS``, then group 1 (a sliding window of
    :data:`WINDOW` chunks) backward from the end of the prefix group 0 allows until
    :data:`WINDOW` consecutive hits; both again while one shortens it."""
    limit = chunks * TOKENS  # the prompt's last token is always computed
    hit = 0
    deferred = False
    groups: tuple[int, ...] = (0, 1)
    while groups:
        todo, groups = groups, ()
        for group in todo:
            end = -(-limit // TOKENS)
            found: int | None = 0
            if group == 0:
                for i in range(end):
                    result = manager.lookup(key(i, 0), ctx)
                    if result is MISS:
                        break
                    if result is not HIT:
                        deferred = True
                    found += 1  # type: ignore[operator]
            else:
                found, pending, run = None, False, 0
                for i in reversed(range(end)):
                    result = manager.lookup(key(i, 1), ctx)
                    run = run + 1 if result in (HIT, PENDING) else 0
                    pending = (pending or result is PENDING) and run > 0
                    if run == WINDOW:
                        found = i + WINDOW
                        break
                deferred = deferred or pending
                found = run if found is None else found
            if found == 0:
                return 0
            limit = min(limit, found * TOKENS)  # type: ignore[operator]
            if limit < hit and not deferred:
                groups = (1,)
            hit = limit
    return None if deferred else hit


def test_a_hybrid_model_looked_up_in_vllm_order_loads_its_whole_prefix() -> None:
    """vLLM scans a sliding-window group backwards from the end: the plan must place its
    chunks where they are in the prompt, or the cut stops at the window's length and the
    request crawls a window per replan."""
    chunks = 24
    region = BytearrayRegion(128, HYBRID.slot_bytes)
    lower = MemoryObjectTier(256, MemoryObjectStore())
    manager = TieredManager([
        BuiltTier("cpu", InMemoryTier(128), region=region),
        BuiltTier("s3", lower, mover=MemoryMover(region, HYBRID, lower)),
    ])
    manager.cost = model(shapes=(ChunkShape(TOKENS, CHUNK), ChunkShape(TOKENS, CHUNK)))
    try:
        writer = ReqContext("writer")
        keys = [key(i, g) for g in range(2) for i in range(chunks)]
        assert manager.prepare_store(keys, writer) == keys
        spec = manager.get_spec(keys)
        assert isinstance(spec, CPULoadStoreSpec)
        for k, slot in zip(keys, spec.slot_ids, strict=True):
            region.view(int(slot))[:CHUNK] = conformance_payload(k[0], CHUNK)
        manager.complete_store(keys, writer)
        manager.wait_idle()
        manager.reset_cache()
        manager.on_reset_flushed()

        ctx = ReqContext("r")
        # vLLM records each key's end token as it makes the key.
        ends = {key(i, g): (i + 1) * TOKENS for g in range(2) for i in range(chunks)}
        ctx.key_position = ends.get
        usable = None
        for _ in range(3):  # deferred, promoted, landed
            usable = vllm_lookup(manager, ctx, chunks)
            manager.on_schedule_end(ScheduleEndContext())
            manager.wait_idle()
            if usable is not None:
                break
        assert usable == chunks * TOKENS
        # Group 0's 24 chunks and group 1's window: nothing else was promoted.
        assert manager.get_stats()["promotions"] == chunks + WINDOW
    finally:
        manager.shutdown()
