"""Issue 11's scenarios for prefixes larger than the primary, ``reset_cache`` with engines
that drop stale completions or deliver them with their generation, and API misuse; issue
17's keys checked at the door.

Each scenario is one the issue observed on the project's own simulator, composite or vLLM
adapter: a prefix that never became ready, a store that stored nothing, keys pending or
pinned forever after a reset, a never-prepared completion that left a reservation behind,
a silent HIT after shutdown, bad keys accepted deep inside.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core.keys import KeyFormat, make_offload_key
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.mover import HostRegion
from kvtiers.engine import simulator
from kvtiers.engine.scheduler import OffloadScheduler
from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.errors import ClosedError, InvalidKeyError, UnknownKeyError
from kvtiers.policies import load_policy
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.tiers.cpu.manager import CpuTierManager

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
KIB = 1024
TOKENS_PER_CHUNK = 16
ONE_GROUP = {
    "name": "test/fence",
    "tokens_per_hash": 16,
    "blocks_per_chunk": 1,
    "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}],
}
# Chunks of 16 and 32 tokens, 4 KiB each (one CPU slot): a 320-token prompt is 20 + 10 = 30 chunks.
HYBRID = {
    **ONE_GROUP,
    "groups": [
        {"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"},
        {"tokens_per_block": 32, "num_layers": 1, "page_bytes": "4KiB"},
    ],
}


def build(root: Path, slots: int, model: dict[str, Any] = ONE_GROUP) -> Stack:
    """A cpu → file stack over ``root``, the chunks already there indexed."""
    stack = load_stack({
        "tiers": [
            {"kind": "cpu", "capacity": f"{slots * 4}KiB"},
            {"kind": "file", "root": str(root), "io": "posix", "threads": 2},
        ],
        "model": model,
    })
    stack.wait_index()
    return stack


def prompt(chunks_of_16: int) -> list[int]:
    """Tokens filling ``chunks_of_16`` 16-token chunks, plus the one an engine recomputes."""
    return list(range(1000, 1000 + chunks_of_16 * TOKENS_PER_CHUNK + 1))


@pytest.fixture
def few_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefix still pending after 30 steps is one that never resolves."""
    monkeypatch.setattr(simulator, "MAX_WAIT_STEPS", 30)


def run(stack: Stack, req_id: str, tokens: list[int]) -> simulator.RequestReport:
    engine = SimulatedEngine(stack, num_gpu_blocks=128)
    try:
        return engine.run_request(req_id, tokens)
    finally:
        engine.shutdown()


def seed(root: Path, tokens: list[int], model: dict[str, Any] = ONE_GROUP) -> None:
    """Put every chunk of ``tokens`` in the file tier under ``root`` (a roomy primary)."""
    stack = build(root, 64, model)
    try:
        run(stack, "seed", tokens)
        stack.manager.wait_idle()
    finally:
        stack.shutdown()


# -- prefixes larger than the primary --------------------------------------------------
@pytest.mark.usefixtures("few_steps")
@pytest.mark.parametrize(
    ("model", "chunks_of_16", "slots", "usable"),
    [
        pytest.param(ONE_GROUP, 10, 9, 9 * 16, id="one-group-10-chunks-9-slots"),
        # Group 0 takes 20 slots, group 1 the other 9 of its 10: 9 x 32 tokens usable.
        pytest.param(HYBRID, 20, 29, 9 * 32, id="hybrid-30-chunks-29-slots"),
    ],
)
def test_a_prefix_larger_than_the_primary_is_trimmed_to_what_fits(
    tmp_path: Path, model: dict[str, Any], chunks_of_16: int, slots: int, usable: int
) -> None:
    tokens = prompt(chunks_of_16)
    seed(tmp_path, tokens, model)
    stack = build(tmp_path, slots, model)
    try:
        report = run(stack, "again", tokens)
    finally:
        stack.shutdown()
    assert report.reused_tokens == usable
    assert report.verification_failures == 0
    assert report.wait_steps <= 2


def test_a_store_larger_than_the_primary_stores_its_head_through_every_tier(
    tmp_path: Path,
) -> None:
    tokens = prompt(30)
    stack = build(tmp_path, 29)
    try:
        report = run(stack, "long", tokens)
        stack.manager.wait_idle()
        stats = stack.manager.get_stats()
    finally:
        stack.shutdown()
    assert report.store_failures == 0
    assert stats["cpu.stores"] == 29
    assert stats["cascades"] == 29
    # The head reached the file tier: a fresh stack over it reuses those 29 chunks.
    fresh = build(tmp_path, 64)
    try:
        again = run(fresh, "again", tokens)
    finally:
        fresh.shutdown()
    assert again.reused_tokens == 29 * 16
    assert again.verification_failures == 0


@pytest.mark.parametrize(
    ("lower", "stores", "evictions"),
    [
        # Written through to the file tier: what the primary evicts lives on below, and
        # the prompt's head reaches the file tier through it.
        pytest.param({"io": "posix"}, 29, 29, id="cpu+file-through"),
        # Nothing below keeps what it would evict; the file tier takes only chunks loaded
        # once (so not every victim is there either).
        pytest.param({"io": "posix", "write_after_hits": 1}, 0, 0, id="cpu+file-after-hits"),
        pytest.param(None, 0, 0, id="cpu-alone"),
    ],
)
def test_a_prompt_larger_than_a_full_primary_evicts_for_its_head_only_above_a_written_through_tier(
    tmp_path: Path, lower: dict[str, Any] | None, stores: int, evictions: int
) -> None:
    tiers: list[dict[str, Any]] = [{"kind": "cpu", "capacity": f"{29 * 4}KiB"}]
    if lower is not None:
        tiers.append({"kind": "file", "root": str(tmp_path), "threads": 2, **lower})
    stack = load_stack({"tiers": tiers, "model": ONE_GROUP})
    try:
        run(stack, "fill", list(range(5000, 5000 + 29 * TOKENS_PER_CHUNK + 1)))
        stack.manager.wait_idle()
        before = stack.manager.get_stats()
        report = run(stack, "long", prompt(30))
        stack.manager.wait_idle()
        stats = stack.manager.get_stats()
    finally:
        stack.shutdown()
    assert before["cpu.chunks"] == 29
    assert report.store_failures == 0
    assert stats["cpu.stores"] - before["cpu.stores"] == stores
    assert stats["cpu.evictions"] - before["cpu.evictions"] == evictions
    assert stats["cpu.chunks"] == 29


def test_a_requests_own_prefix_is_never_evicted_by_its_own_promotions(
    tmp_path: Path,
) -> None:
    tokens = prompt(10)
    seed(tmp_path, tokens)
    stack = build(tmp_path, 9)
    glue = OffloadScheduler(stack.manager, stack.offloading)
    try:
        glue.add_request("r", tokens)
        first = glue.match_prefix("r", max_tokens=len(tokens) - 1)
        assert first.pending and first.promoted == 9
        glue.end_step()
        stack.manager.wait_idle()
        # The ninth slot's chunks are ready; the tenth chunk does not fit and is recomputed.
        second = glue.match_prefix("r", max_tokens=len(tokens) - 1)
        assert not second.pending and second.tokens == 9 * 16
        primary = stack.tiers[0].manager
        keys = glue.chunk_keys("r", 0)
        assert [primary.lookup(k, ReqContext("probe")) for k in keys[:9]] == [HIT] * 9
        glue.finish_request("r")
    finally:
        stack.shutdown()


# -- reset_cache with engines that drop stale completions -------------------------------
def test_after_a_reset_keys_being_stored_or_loaded_are_miss_and_storable(
    tmp_path: Path,
) -> None:
    stack = build(tmp_path, 8)
    manager = stack.manager
    primary = stack.tiers[0].manager
    assert isinstance(primary, CpuTierManager)
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(4)]
    ctx = ReqContext("r")
    try:
        assert manager.prepare_store(keys[:2], ctx) == keys[:2]
        manager.complete_store(keys[:2], ctx)
        manager.wait_idle()
        manager.prepare_load(keys[:1], ctx)  # a load in flight
        assert manager.prepare_store(keys[2:], ctx) == keys[2:]  # a store in flight
        manager.reset_cache()  # the engine drops both jobs' completions
        # (The primary answers: the composite would promote the file tier's copies.)
        assert [primary.lookup(k, ctx) for k in keys] == [MISS] * 4
        # A new store of them is accepted at once; the old slots stay fenced meanwhile.
        assert manager.prepare_store(keys, ctx) == keys
        assert primary.get_stats()["fenced_slots"] == 3
        manager.complete_store(keys, ctx)
        manager.wait_idle()
        assert [manager.lookup(k, ctx) for k in keys] == [HIT] * 4
        manager.on_reset_flushed()
        assert primary.get_stats()["fenced_slots"] == 0
        assert primary.get_stats()["pinned_chunks"] == 0
    finally:
        stack.shutdown()


def test_a_stale_completion_through_the_glue_frees_its_slots_not_the_new_ones(
    tmp_path: Path,
) -> None:
    stack = build(tmp_path, 16)
    glue = OffloadScheduler(stack.manager, stack.offloading)
    primary = stack.tiers[0].manager
    tokens = prompt(4)
    try:
        glue.add_request("r", tokens)
        plan = glue.plan_store("r", len(tokens), [list(range(8))])
        assert plan is not None
        glue.reset_cache()
        assert glue.match_prefix("r").tokens == 0
        again = glue.plan_store("r", len(tokens), [list(range(8))])
        assert again is not None and again.keys == plan.keys
        assert primary.get_stats()["fenced_slots"] == 4
        glue.complete(plan.job_id, success=True)  # stale: frees its slots, the fence lifts
        assert primary.get_stats()["fenced_slots"] == 0
        assert [stack.manager.lookup(k, ReqContext("p")) for k in plan.keys] == [PENDING] * 4
        glue.complete(again.job_id, success=True)
        assert glue.match_prefix("r", max_tokens=len(tokens) - 1).tokens == 4 * 16
        glue.finish_request("r")
    finally:
        stack.shutdown()


# -- reset_cache with engines that deliver stale completions ----------------------------
def fill(region: HostRegion, slot: int, byte: int) -> None:
    view = region.view(slot)
    view[:] = bytes([byte]) * len(view)


def test_a_stale_store_completion_leaves_the_keys_new_reservation_alone(
    tmp_path: Path,
) -> None:
    """The old job's completion arrives while the key's new store is still being written:
    it frees the old slot only, so the unwritten slot is never served nor cascaded (with a
    valid checksum) into the file tier."""
    stack = build(tmp_path, 8)
    manager = stack.manager
    primary = stack.tiers[0].manager
    region = stack.tiers[0].region
    assert isinstance(primary, CpuTierManager) and region is not None
    key = make_offload_key(b"\x01" * 16, 0)
    ctx = ReqContext("r")
    try:
        old = manager.generation
        assert manager.prepare_store([key], ctx) == [key]
        manager.reset_cache()
        assert manager.prepare_store([key], ctx) == [key]
        new_slot = primary.slot_of(key)
        assert new_slot is not None
        fill(region, new_slot, 0xEE)  # the new job has not written yet
        manager.complete_store([key], ctx, generation=old)
        manager.wait_idle()
        assert primary.lookup(key, ctx) is PENDING
        assert primary.get_stats()["fenced_slots"] == 0
        assert stack.tiers[1].manager.get_stats()["chunks"] == 0
        fill(region, new_slot, 0x42)  # now it has
        manager.complete_store([key], ctx, generation=manager.generation)
        manager.wait_idle()
        assert stack.tiers[1].manager.get_stats()["chunks"] == 1
    finally:
        stack.shutdown()
    # What the file tier holds is the new job's bytes.
    again = build(tmp_path, 8)
    try:
        assert again.manager.lookup(key, ctx) is PENDING
        again.manager.wait_idle()
        assert again.manager.lookup(key, ctx) is HIT
        again.manager.prepare_load([key], ctx)
        primary, region = again.tiers[0].manager, again.tiers[0].region
        assert isinstance(primary, CpuTierManager) and region is not None
        slot = primary.slot_of(key)
        assert slot is not None
        view = region.view(slot)
        assert bytes(view) == b"\x42" * len(view)
        again.manager.complete_load([key], ctx)
    finally:
        again.shutdown()


def test_a_stale_load_completion_never_drops_a_newer_pin() -> None:
    """The old load's completion arrives while a new load of the key reads its new slot:
    the new pin holds, so no store takes that slot from under the reader."""
    tier = CpuTierManager(2, 4 * KIB, load_policy("lru")(2))
    key, x, y = (make_offload_key(bytes([i]) * 16, 0) for i in (1, 2, 3))
    ctx = ReqContext("r")
    assert tier.prepare_store([key], ctx) == [key]
    tier.complete_store([key], ctx)
    old = tier.generation
    tier.prepare_load([key], ctx)  # a load in flight at the reset
    tier.reset_cache()
    assert tier.prepare_store([key], ctx) == [key]
    tier.complete_store([key], ctx, generation=tier.generation)
    tier.prepare_load([key], ctx)  # the new load, reading the new slot
    reading = tier.slot_of(key)
    tier.complete_load([key], ctx, generation=old)
    assert tier.pin_count(key) == 1
    assert tier.get_stats()["fenced_slots"] == 0
    # Two stores want both slots: only the old load's (now free) one is theirs.
    assert tier.prepare_store([x, y], ctx) == [x]
    assert tier.slot_of(key) == reading and tier.slot_of(x) != reading
    tier.complete_load([key], ctx, generation=tier.generation)
    assert tier.pin_count(key) == 0


def test_completions_that_name_a_wrong_generation_are_refused() -> None:
    tier = CpuTierManager(2, 4 * KIB, load_policy("lru")(2))
    key = make_offload_key(b"\x01" * 16, 0)
    ctx = ReqContext("r")
    assert tier.prepare_store([key], ctx) == [key]
    tier.reset_cache()
    with pytest.raises(ValueError, match="generation 2 is not one this CPU tier has had"):
        tier.complete_store([key], ctx, generation=2)
    with pytest.raises(ValueError, match="generation -1"):
        tier.complete_load([key], ctx, generation=-1)
    # The key was forgotten by the reset: no job of the current generation holds it.
    with pytest.raises(UnknownKeyError, match="in generation 1"):
        tier.complete_store([key], ctx, generation=1)
    with pytest.raises(UnknownKeyError, match="pinned 0 times"):
        tier.complete_load([key], ctx, generation=1)
    assert tier.get_stats()["fenced_slots"] == 1
    tier.complete_store([key], ctx, generation=0)
    assert tier.get_stats()["fenced_slots"] == 0
    tier.complete_store([key], ctx, generation=0)  # its slot is free already: nothing happens
    assert tier.free_slots == 2


@pytest.mark.parametrize("named", [False, True], ids=["no-generation", "generation"])
def test_a_store_completed_while_the_fence_is_up_counts_no_cpu_hit(
    tmp_path: Path, named: bool
) -> None:
    stack = build(tmp_path, 8)
    manager = stack.manager
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in (1, 2)]
    ctx = ReqContext("r")
    try:
        assert manager.prepare_store(keys[:1], ctx) == keys[:1]  # fenced by the reset
        manager.reset_cache()
        assert manager.prepare_store(keys, ctx) == keys
        before = manager.get_stats()["cpu.hits"]
        if named:
            manager.complete_store(keys, ctx, generation=manager.generation)
        else:
            manager.complete_store(keys, ctx)
        manager.wait_idle()
        stats = manager.get_stats()
        assert stats["cpu.hits"] == before
        assert stats["cascades"] == 2
    finally:
        stack.shutdown()


def test_the_glue_hands_each_stale_completion_its_generation(tmp_path: Path) -> None:
    """Two jobs in flight at a reset: each one's completion frees its own fenced slots at
    once (not at the last one's), never the keys' new reservations; the last one also
    signals the flush."""
    stack = build(tmp_path, 16)
    glue = OffloadScheduler(stack.manager, stack.offloading)
    primary = stack.tiers[0].manager
    tokens = prompt(4)
    try:
        glue.add_request("r", tokens)
        first = glue.plan_store("r", 2 * 16, [list(range(8))])
        second = glue.plan_store("r", len(tokens), [list(range(8))])
        assert first is not None and second is not None
        glue.reset_cache()
        again = glue.plan_store("r", len(tokens), [list(range(8))])
        assert again is not None and again.keys == first.keys + second.keys
        assert primary.get_stats()["fenced_slots"] == 4
        glue.complete(first.job_id, success=True)
        assert primary.get_stats()["fenced_slots"] == 2
        glue.complete(second.job_id, success=True)
        assert primary.get_stats()["fenced_slots"] == 0
        probe = ReqContext("p")
        assert [primary.lookup(k, probe) for k in again.keys] == [PENDING] * 4
        glue.complete(again.job_id, success=True)
        assert glue.match_prefix("r", max_tokens=len(tokens) - 1).tokens == 4 * 16
        glue.finish_request("r")
    finally:
        stack.shutdown()


# -- API misuse -------------------------------------------------------------------------
@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    built = build(tmp_path, 8)
    yield built
    built.shutdown()


def test_completing_a_store_never_prepared_raises_and_changes_nothing(stack: Stack) -> None:
    key = make_offload_key(b"\x01" * 16, 0)
    ctx = ReqContext("r")
    before = dict(stack.manager.get_stats())
    with pytest.raises(UnknownKeyError, match="never reserved"):
        stack.manager.complete_store([key], ctx)
    stack.manager.wait_idle()
    assert dict(stack.manager.get_stats()) == before
    assert stack.manager.lookup(key, ctx) is MISS
    assert stack.tiers[1].manager.get_stats()["chunks"] == 0


def test_completing_a_load_never_prepared_raises(stack: Stack) -> None:
    key = make_offload_key(b"\x01" * 16, 0)
    with pytest.raises(UnknownKeyError):
        stack.manager.complete_load([key], ReqContext("r"))


def test_use_after_shutdown_is_a_clear_error(tmp_path: Path) -> None:
    built = build(tmp_path, 8)
    key = make_offload_key(b"\x01" * 16, 0)
    ctx = ReqContext("r")
    assert built.manager.prepare_store([key], ctx) == [key]
    built.manager.complete_store([key], ctx)
    built.shutdown()
    with pytest.raises(ClosedError, match="shut down"):
        built.manager.lookup(key, ctx)
    with pytest.raises(ClosedError):
        built.manager.prepare_store([make_offload_key(b"\x02" * 16, 0)], ctx)
    built.manager.shutdown()  # still idempotent


# -- keys at the door (issue 17) ---------------------------------------------------------
GOOD = make_offload_key(b"\x07" * 16, 0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        pytest.param("k" * 20, "must be bytes", id="str"),
        pytest.param(None, "must be bytes", id="none"),
        pytest.param(make_offload_key(b"\x07" * 296, 0), "300 bytes", id="300-bytes"),
        pytest.param(make_offload_key(b"\x07" * 8, 0), "12 bytes", id="short"),
        pytest.param(make_offload_key(b"\x07" * 16, 1), "group 1", id="group-out-of-range"),
    ],
)
def test_a_batch_with_a_bad_key_is_rejected_whole(stack: Stack, bad: Any, message: str) -> None:
    ctx = ReqContext("r")
    before = dict(stack.manager.get_stats())
    with pytest.raises(InvalidKeyError, match=message):
        stack.manager.prepare_store([GOOD, bad], ctx)
    with pytest.raises(InvalidKeyError, match=message):
        stack.manager.lookup(bad, ctx)
    with pytest.raises(InvalidKeyError, match=message):
        stack.manager.complete_store([GOOD, bad], ctx)
    assert dict(stack.manager.get_stats()) == before
    assert stack.manager.lookup(GOOD, ctx) is MISS


def test_a_context_that_is_not_one_is_refused(stack: Stack) -> None:
    with pytest.raises(TypeError, match="ReqContext"):
        stack.manager.prepare_store([GOOD], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReqContext"):
        stack.manager.lookup(GOOD, None)  # type: ignore[arg-type]


def test_a_key_format_learns_an_engine_hash_length_from_its_first_key() -> None:
    keys = KeyFormat.for_algorithm(2, "vllm:sha256_cbor")
    keys.check_all([make_offload_key(b"\x01" * 32, 1)], "here")
    with pytest.raises(InvalidKeyError, match="36"):
        keys.check(make_offload_key(b"\x01" * 16, 0), "here")
    with pytest.raises(InvalidKeyError, match="collection"):
        keys.check_all(b"\x01" * 36, "here")

