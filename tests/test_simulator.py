"""The simulated engine over a CPU-only stack: prefixes are reused, every loaded block is
verified, and the verifier really catches wrong bytes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtiers.engine.simulator import SimulatedEngine, block_seeds, page_content
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.stack.builder import Stack, load_stack

MODEL = {
    "name": "test/hybrid",
    "tokens_per_hash": 16,
    "blocks_per_chunk": 2,
    "groups": [
        {"tokens_per_block": 16, "num_layers": 2, "page_bytes": "4KiB"},
        {"tokens_per_block": 32, "num_layers": 1, "page_bytes": "2KiB"},
    ],
}
SMALL = WorkloadSpec(conversations=4, system_prompts=2, turns=2, system_tokens=(200, 300))


@pytest.fixture
def stack() -> Iterator[Stack]:
    built = load_stack({"tiers": [{"kind": "cpu", "capacity": "4MiB"}], "model": MODEL})
    yield built
    built.shutdown()


def test_prefixes_are_reused_and_verified(stack: Stack) -> None:
    engine = SimulatedEngine(stack, num_gpu_blocks=128)
    reports = [engine.run_request(r.req_id, r.token_ids) for r in conversation_requests(SMALL)]
    engine.shutdown()
    assert sum(r.reused_tokens for r in reports) > 0
    assert sum(r.verified_blocks for r in reports) > 0
    assert sum(r.verification_failures for r in reports) == 0
    # the second request of a shared system prompt reuses at least its whole chunks
    assert reports[2].reused_tokens >= 192


def test_wrong_bytes_in_a_slot_are_caught(stack: Stack) -> None:
    engine = SimulatedEngine(stack, num_gpu_blocks=128)
    tokens = conversation_requests(SMALL)[0].token_ids
    engine.run_request("first", tokens)
    region = stack.tiers[0].region
    assert region is not None
    for slot in range(region.num_slots):
        view = region.view(slot)
        view[0] ^= 0xFF
    report = engine.run_request("again", tokens)
    engine.shutdown()
    assert report.reused_tokens > 0
    assert report.verification_failures > 0


def test_block_content_names_the_prefix() -> None:
    a = block_seeds(list(range(64)), 16, 0)
    b = block_seeds([*range(63), 999], 16, 0)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert block_seeds(list(range(64)), 16, 1) != a
    page = page_content(a[0], 0, 4096)
    assert page.shape == (4096,) and not (page == page_content(a[0], 1, 4096)).all()


def test_larger_chunks_in_the_first_group_store_and_load_exactly() -> None:
    model = {**MODEL, "groups": list(reversed(MODEL["groups"]))}  # type: ignore[call-overload]
    built = load_stack({"tiers": [{"kind": "cpu", "capacity": "4MiB"}], "model": model})
    engine = SimulatedEngine(built, num_gpu_blocks=128)
    reports = [engine.run_request(r.req_id, r.token_ids) for r in conversation_requests(SMALL)]
    engine.shutdown()
    built.shutdown()
    assert sum(r.reused_tokens for r in reports) > 0
    assert sum(r.verification_failures for r in reports) == 0
