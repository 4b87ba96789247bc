"""Write-back under faults: a demotion the tier refuses or fails at submit gives its held
slots back (and never frees one another tier's copy still reads), a promotion landing
during ``wait_idle`` is drained too, and a promoted chunk its back tier dropped meanwhile is
written back when the primary evicts it."""

from __future__ import annotations

from collections.abc import Collection, Iterator

import pytest

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import ReqContext, ScheduleEndContext
from kvtiers.core.tier import WriteRules
from kvtiers.testing.conformance import conformance_payload
from kvtiers.testing.doubles import MemoryObjectStore
from tests.test_placement import CHUNK, CTX, MISS, PENDING, Stack, key


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        for mover in stack.movers:
            mover.gate.set()
        stack.manager.shutdown()


def _refuse_submits(stack: Stack, tier: int) -> None:
    """Tier ``tier``'s mover refuses every job from now on (as a closed backend does):
    each job ends, failed, inside its submit."""
    stack.movers[tier]._accepting = lambda: False  # type: ignore[method-assign]


def test_a_refused_demotion_releases_its_slot(stacks: list[Stack]) -> None:
    stacks.append(stack := Stack(WriteRules("back"), slots=2))
    stack.store(0, 1)
    _refuse_submits(stack, 0)
    stack.manager.on_schedule_end(ScheduleEndContext())
    stack.manager.wait_idle()
    assert stack.primary.get_stats()["held_slots"] == 0
    assert stack.primary.free_slots == 2


def test_a_refused_demotion_to_one_tier_keeps_the_slot_another_tier_reads(
    stacks: list[Stack],
) -> None:
    stacks.append(stack := Stack(WriteRules("back"), WriteRules("back"), slots=2))
    stack.store(0, 1)
    stack.movers[0].gate.clear()  # tier 0's copy waits before reading the held slots
    _refuse_submits(stack, 1)
    stack.manager.on_schedule_end(ScheduleEndContext())
    assert stack.primary.free_slots == 0, "a held slot was freed while tier 0 reads it"
    stack.movers[0].gate.set()
    stack.manager.wait_idle()
    assert stack.held(0) == {0, 1}
    assert stack.primary.get_stats()["held_slots"] == 0


def test_a_demotion_whose_tier_raises_in_prepare_store_releases_its_slots(
    stacks: list[Stack],
) -> None:
    stacks.append(stack := Stack(WriteRules("back"), slots=2))
    stack.store(0, 1)

    def broken(keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        raise OSError("tier index unavailable")

    stack.lower[0].prepare_store = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="tier index unavailable"):
        stack.manager.on_schedule_end(ScheduleEndContext())
    assert stack.primary.get_stats()["held_slots"] == 0, "held slots stranded"
    assert stack.primary.free_slots == 2


def test_wait_idle_also_drains_a_cascade_a_landing_promotion_starts(
    stacks: list[Stack],
) -> None:
    """Tier 0 drains before tier 1; the promotion from tier 1 lands during tier 1's drain
    and cascades into tier 0 (``write_promoted``): wait_idle goes round again."""
    below = MemoryObjectStore()
    below.put(key(3), conformance_payload(3, CHUNK))
    stacks.append(stack := Stack(WriteRules(promoted=True), WriteRules(),
                                 stores=[MemoryObjectStore(), below]))
    assert stack.manager.lookup(key(3), CTX) is PENDING
    stack.manager.wait_idle()
    assert not stack.manager.has_pending_work(), "a job is still in flight after wait_idle"
    assert stack.held(0) == {3}


def test_a_promoted_chunk_its_back_tier_dropped_is_written_back_at_eviction(
    stacks: list[Stack],
) -> None:
    """Chunk 0 is demoted to a 3-chunk back tier, promoted, kept hot in the primary while
    the back tier evicts it, then evicted from the primary: it is demoted again, not lost."""
    stacks.append(stack := Stack(WriteRules("back"), lower_chunks=3))
    stack.store(0, 1)
    stack.step()
    stack.store(2, 3)
    stack.step()
    assert 0 in stack.held(0)
    promoting = ReqContext(req_id="p")
    assert stack.manager.lookup(key(0), promoting) is PENDING
    stack.step()
    assert stack.load(0) == conformance_payload(0, CHUNK)
    stack.manager.on_request_finished(promoting)
    for first in (4, 6, 8):
        stack.store(first, first + 1)
        stack.load(0)
        stack.step()
    assert 0 not in stack.held(0) and stack.primary.slot_of(key(0)) is not None
    for first in (10, 12):
        stack.store(first, first + 1)
        stack.step()
    assert stack.primary.slot_of(key(0)) is None
    assert stack.manager.lookup(key(0), ReqContext(req_id="q")) is not MISS, (
        "write-back lost chunk 0: evicted from the primary, never written back"
    )
