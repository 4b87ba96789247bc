"""JobDriver: every reservation and pin a job takes is given back exactly once, however the
job ends — refused or raising submission, partial failure, success — for stores and loads,
with and without a primary manager.

The managers are in-memory tiers that record their completion calls; the mover is scripted
(the test decides what it accepts and what it reports)."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.mover import Mover, MoverResult
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.errors import UnknownKeyError
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.memory_tier import InMemoryTier
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold

CTX = ReqContext("r")
K0, K1, K2 = (conformance_key(i) for i in range(3))


class RecordingTier(InMemoryTier):
    """An in-memory tier that records every completion it is given."""

    def __init__(self, capacity_chunks: int) -> None:
        super().__init__(capacity_chunks)
        self.calls: list[tuple[str, list[OffloadKey], bool]] = []

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        self.calls.append(("store", list(keys), success))
        super().complete_store(keys, ctx, success)

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        self.calls.append(("load", list(keys), True))
        super().complete_load(keys, ctx)

    def ready(self, keys: list[OffloadKey]) -> None:
        """Make ``keys`` HITs (as a finished store would), then forget those calls."""
        assert self.prepare_store(keys, CTX) == keys
        self.complete_store(keys, CTX)
        self.calls.clear()

    def held(self, key: OffloadKey) -> bool:
        """Whether ``key`` is reserved or pinned (``get_spec`` addresses nothing else)."""
        try:
            self.get_spec([key])
        except UnknownKeyError:
            return False
        return True


class SubmitFailed(Exception):
    """The scripted mover's submission failed."""


class ScriptedMover(Mover):
    """Accepts, refuses or raises on submit as told; reports what the test finishes."""

    def __init__(self) -> None:
        self.answer: bool | None = True  # None: raise
        self.submitted: list[tuple[int, LoadStoreSpec, LoadStoreSpec]] = []
        self.finished: list[MoverResult] = []

    def submit(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> bool:
        if self.answer is None:
            raise SubmitFailed(f"job {job_id}")
        if self.answer:
            self.submitted.append((job_id, src, dst))
        return self.answer

    def finish(self, job_id: int, ok: tuple[OffloadKey, ...]) -> None:
        self.finished.append(MoverResult(job_id, ok, transfer_bytes=7 * len(ok)))

    def get_finished(self) -> list[MoverResult]:
        done, self.finished = self.finished, []
        return done

    def drain(self) -> None:
        """Copies are finished by the test: nothing to wait for."""


class Stack:
    """A primary and a lower tier, a scripted mover and a driver between them."""

    def __init__(self, *, with_primary: bool = True, lower_chunks: int = 8) -> None:
        self.primary = RecordingTier(4)
        self.lower = RecordingTier(lower_chunks)
        self.mover = ScriptedMover()
        self.finished: list[FinishedJob[str]] = []
        self.jobs: JobDriver[str] = JobDriver(
            self.lower, self.mover, self.finished.append,
            primary=self.primary if with_primary else None,
        )

    def load(self, job_id: int, keys: list[OffloadKey]) -> list[OffloadKey]:
        for key in keys:
            assert self.jobs.hold_for_load(key, CTX) is LoadHold.HELD
        return self.jobs.load_held(job_id, "load")

    def settled(self) -> None:
        """Nothing is in flight and nothing is held by either tier."""
        assert not self.jobs.busy
        for key in (K0, K1, K2):
            assert not self.primary.held(key), key
            assert not self.lower.held(key), key


# -- stores -------------------------------------------------------------------------
@pytest.mark.parametrize("answer", [False, None], ids=["refused", "raises"])
def test_a_store_the_mover_does_not_take_fails_and_releases_everything(
    answer: bool | None,
) -> None:
    stack = Stack()
    stack.primary.ready([K0, K1])
    stack.mover.answer = answer
    if answer is None:
        with pytest.raises(SubmitFailed):
            stack.jobs.store(1, [K0, K1], CTX, "store")
    else:
        assert stack.jobs.store(1, [K0, K1], CTX, "store") == [K0, K1]
    assert stack.lower.calls == [("store", [], True), ("store", [K0, K1], False)]
    assert stack.primary.calls == [("load", [K0, K1], True)]
    [job] = stack.finished
    assert (job.job_id, job.load, job.succeeded, job.failed) == (1, False, (), (K0, K1))
    stack.settled()
    assert stack.lower.lookup(K0, CTX) is LookupResult.MISS


def test_a_partly_failed_store_completes_what_arrived_and_frees_the_rest() -> None:
    stack = Stack()
    stack.primary.ready([K0, K1, K2])
    assert stack.jobs.store(1, [K0, K1, K2], CTX, "store") == [K0, K1, K2]
    assert stack.jobs.in_flight == 1
    assert all(stack.primary.held(k) and stack.lower.held(k) for k in (K0, K1, K2))
    # A mover reports succeeded keys in any order: the driver completes them in job order.
    stack.mover.finish(1, (K2, K0))
    stack.jobs.poll()
    assert stack.lower.calls == [("store", [K0, K2], True), ("store", [K1], False)]
    assert stack.primary.calls == [("load", [K0, K1, K2], True)]
    [job] = stack.finished
    assert (job.succeeded, job.failed, job.result.transfer_bytes, job.tag) == (
        (K0, K2), (K1,), 14, "store")
    stack.settled()
    assert [stack.lower.lookup(k, CTX) for k in (K0, K1, K2)] == [
        LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]


def test_a_store_the_tier_refuses_holds_nothing() -> None:
    stack = Stack(lower_chunks=1)
    stack.primary.ready([K0])
    stack.lower.ready([K1])
    stack.lower.prepare_load([K1], CTX)  # the tier's one chunk is in use: no room
    assert stack.jobs.store(1, [K0], CTX, "store") is None
    assert (stack.mover.submitted, stack.finished, stack.primary.calls) == ([], [], [])
    assert not stack.primary.held(K0)


# -- loads --------------------------------------------------------------------------
@pytest.mark.parametrize("answer", [False, None], ids=["refused", "raises"])
def test_a_load_the_mover_does_not_take_fails_and_releases_everything(
    answer: bool | None,
) -> None:
    stack = Stack()
    stack.lower.ready([K0, K1])
    stack.mover.answer = answer
    if answer is None:
        with pytest.raises(SubmitFailed):
            stack.load(1, [K0, K1])
    else:
        assert stack.load(1, [K0, K1]) == [K0, K1]
    assert stack.primary.calls == [("store", [], True), ("store", [K0, K1], False)]
    assert stack.lower.calls == [("load", [K0, K1], True)]
    [job] = stack.finished
    assert (job.load, job.succeeded, job.failed) == (True, (), (K0, K1))
    stack.settled()
    assert stack.primary.lookup(K0, CTX) is LookupResult.MISS


def test_a_partly_failed_load_completes_what_arrived_and_frees_the_rest() -> None:
    stack = Stack()
    stack.lower.ready([K0, K1])
    stack.load(1, [K0, K1])
    assert stack.primary.lookup(K0, CTX) is LookupResult.HIT_PENDING
    stack.mover.finish(1, (K1,))
    stack.jobs.poll()
    assert stack.primary.calls == [("store", [K1], True), ("store", [K0], False)]
    assert stack.lower.calls == [("load", [K0, K1], True)]
    stack.settled()
    assert stack.primary.lookup(K1, CTX) is LookupResult.HIT
    assert stack.primary.lookup(K0, CTX) is LookupResult.MISS


def test_a_key_the_primary_cannot_take_is_refused_and_holds_nothing() -> None:
    stack = Stack()
    stack.lower.ready([K0])
    fill = [conformance_key(i) for i in range(10, 14)]
    stack.primary.ready(fill)
    stack.primary.prepare_load(fill, CTX)  # a full primary whose chunks are all in use
    assert stack.jobs.hold_for_load(K0, CTX) is LoadHold.REFUSED
    assert not stack.lower.held(K0)
    assert not stack.jobs.busy


def test_a_key_gone_from_the_tier_frees_its_primary_slot() -> None:
    stack = Stack()
    assert stack.jobs.hold_for_load(K0, CTX) is LoadHold.GONE
    assert stack.primary.calls == [("store", [K0], False)]
    assert not stack.jobs.busy
    assert stack.jobs.load_held(1, "load") == []
    assert stack.mover.submitted == []
    stack.settled()


# -- without a primary manager ----------------------------------------------------------
def test_without_a_primary_the_callers_slots_address_the_copy() -> None:
    stack = Stack(with_primary=False)
    assert stack.jobs.store(1, [K0, K1], CTX, "store", slots={K0: 5, K1: 3}) == [K0, K1]
    [(_, src, _)] = stack.mover.submitted
    assert isinstance(src, CPULoadStoreSpec) and src.slot_ids.tolist() == [5, 3]
    stack.mover.finish(1, (K0, K1))
    stack.jobs.poll()
    assert stack.jobs.hold_for_load(K0, CTX, slot=2) is LoadHold.HELD
    assert stack.jobs.hold_for_load(K0, CTX, slot=6) is LoadHold.HELD
    assert stack.jobs.load_held(2, "load") == [K0, K0]
    _, _, dst = stack.mover.submitted[1]
    assert isinstance(dst, CPULoadStoreSpec) and dst.slot_ids.tolist() == [2, 6]
    stack.mover.finish(2, (K0,))
    stack.jobs.poll()
    # Each occurrence was pinned, and each pin is dropped once.
    assert stack.lower.calls[-1] == ("load", [K0, K0], True)
    stack.settled()
    assert stack.primary.calls == []


def test_slots_go_with_the_driver_that_has_no_primary() -> None:
    with_primary, without = Stack(), Stack(with_primary=False)
    with pytest.raises(ValueError, match="pass none"):
        with_primary.jobs.hold_for_load(K0, CTX, slot=0)
    with pytest.raises(ValueError, match="must name each key's slot"):
        without.jobs.store(1, [K0], CTX, "store")
    with pytest.raises(ValueError, match="must name each key's slot"):
        without.jobs.hold_for_load(K0, CTX)
    assert not with_primary.lower.held(K0) and not without.lower.held(K0)


def test_a_store_whose_slots_miss_a_key_fails_and_releases_everything() -> None:
    stack = Stack(with_primary=False)
    with pytest.raises(KeyError):
        stack.jobs.store(1, [K0, K1], CTX, "store", slots={K0: 0})
    assert stack.lower.calls == [("store", [], True), ("store", [K0, K1], False)]
    stack.settled()


# -- bookkeeping errors -------------------------------------------------------------
def test_a_job_id_in_flight_cannot_be_reused() -> None:
    stack = Stack()
    stack.primary.ready([K0, K1])
    stack.jobs.store(1, [K0], CTX, "store")
    with pytest.raises(ValueError, match="already in flight"):
        stack.jobs.store(1, [K1], CTX, "store")
    assert not stack.lower.held(K1)


def test_a_result_for_no_job_in_flight_is_an_error() -> None:
    stack = Stack()
    stack.mover.finish(9, ())
    with pytest.raises(RuntimeError, match="job 9, which is not in flight"):
        stack.jobs.poll()


def test_a_store_from_held_slots_leaves_the_primary_alone() -> None:
    """A demotion copies slots the caller holds outside the primary's bookkeeping: the
    primary is neither pinned nor released, the tier's side is, exactly once."""
    stack = Stack()
    assert stack.jobs.store(1, [K0, K1], CTX, "demote", slots={K0: 7, K1: 4}) == [K0, K1]
    [(_, src, _)] = stack.mover.submitted
    assert isinstance(src, CPULoadStoreSpec) and src.slot_ids.tolist() == [7, 4]
    stack.mover.finish(1, (K1,))
    stack.jobs.poll()
    assert stack.primary.calls == []
    assert stack.lower.calls == [("store", [K1], True), ("store", [K0], False)]
    stack.settled()
