"""vLLM's reset fence and keys checked at the door, through KVTiersOffloadingSpec's manager
driven as vLLM 0.33's connector drives it (see tests/test_vllm_spec.py for the setup)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.errors import ClosedError, InvalidKeyError
from kvtiers.integrations.vllm import spec as vspec
from tests.test_vllm_contract import SLOT_BYTES, prefix, request, route1, route1_config
from tests.test_vllm_contract import store as store_keys
from tests.test_vllm_spec import ctx, engine, kv, make_request, store

__all__ = ["engine", "kv"]  # fixtures


def test_a_reset_forgets_keys_in_flight_and_fences_their_slots_until_flushed(
    engine: tuple[Any, Any, Any], kv: list[torch.Tensor]
) -> None:
    _, manager, worker = engine
    req = make_request(1, first_block=0)
    store(manager, worker, req, [range(0, 1), range(0, 1)], job_id=1)
    manager.stack.manager.wait_idle()
    loading = [req.keys[0][0]]
    manager.prepare_load(loading, ctx())  # a load vLLM will never complete
    storing = [req.keys[0][1]]
    assert manager.prepare_store(storing, ctx()).keys_to_store == storing  # nor this store
    manager.reset_cache()
    primary = manager.stack.tiers[0].manager
    for key in loading + storing:
        assert primary.lookup(manager._keys.to_kvtiers(key), ctx()) is LookupResult.MISS
    # Never stored anywhere: a MISS for vLLM too (the loaded one is promoted from the file
    # tier, which kept it).
    for key in storing:
        assert manager.lookup(key, ctx()) is vbase.LookupResult.MISS
    assert primary.get_stats()["fenced_slots"] == 2
    assert primary.get_stats()["pinned_chunks"] == 0
    # A new store of the key being stored is accepted at once (2 of the 4 slots are free;
    # the other 2 stay fenced: vLLM's workers may still touch them).
    assert manager.prepare_store(storing, ctx()).keys_to_store == storing
    manager.complete_store(storing, ctx())
    # vLLM 0.33 reports the flush: the fenced slots come back.
    manager.on_reset_flushed()
    assert primary.get_stats()["fenced_slots"] == 0


def test_without_a_flush_signal_the_slots_come_back_after_the_grace_steps(
    engine: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, manager, _ = engine
    monkeypatch.setattr(vspec, "_FLUSH_SIGNAL", False)  # vLLM 0.32
    req = make_request(1, first_block=0)
    assert manager.prepare_store(req.keys[0][:2], ctx()) is not None
    manager.reset_cache()
    primary = manager.stack.tiers[0].manager
    end = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    for _ in range(vspec.RESET_GRACE_STEPS - 1):
        manager.on_schedule_end(end)
        assert primary.get_stats()["fenced_slots"] == 2
    manager.on_schedule_end(end)
    assert primary.get_stats()["fenced_slots"] == 0


@pytest.mark.parametrize("bad", ["text-key", None, b"\x01\x02"])
def test_engine_keys_are_checked_when_translated(
    engine: tuple[Any, Any, Any], bad: Any
) -> None:
    _, manager, _ = engine
    req = make_request(1, first_block=0)
    with pytest.raises(InvalidKeyError):
        manager.prepare_store([req.keys[0][0], bad], ctx())
    assert manager.stack.tiers[0].manager.get_stats()["chunks"] == 0


# -- the one-call lookup of a one-tier cpu stack: junk misses, keys are checked where they enter --
class _Equal(bytes):
    """A bytes subclass: equal to a stored key, yet not one of the cache's keys."""


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("k" * 20, id="str"),
        pytest.param(None, id="none"),
        pytest.param(b"\x01\x02", id="short"),
        pytest.param(vbase.make_offload_key(b"\x07" * 16, 1), id="group-out-of-range"),
    ],
)
def test_a_one_tier_route1_lookup_answers_miss_for_junk_and_the_door_refuses_it_later(
    bad: Any,
) -> None:
    """A key the tier does not hold is a MISS unchecked (nothing is loaded or stored for
    a miss); the same key is refused, changing nothing, where keys enter: the store, the
    load and the composite's own lookup."""
    manager = route1(2, "lru")
    try:
        good = prefix(1, 1)
        store_keys(manager, "a", good)  # the cache learns its key length
        ctx = request(manager, "b", good)
        assert manager.lookup(bad, ctx) is vbase.LookupResult.MISS
        before = dict(manager.stack.manager.get_stats())
        with pytest.raises(InvalidKeyError):
            manager.prepare_store([bad], ctx)
        with pytest.raises(InvalidKeyError):
            manager.prepare_load([bad], ctx)
        with pytest.raises(InvalidKeyError):
            manager.stack.manager.lookup(bad, ReqContext("b"))
        assert dict(manager.stack.manager.get_stats()) == before
        assert manager.lookup(good[0], ctx) is vbase.LookupResult.HIT
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([1, 2], id="unhashable"),
        pytest.param(_Equal(prefix(1, 1)[0]), id="bytes-subclass-of-a-stored-key"),
    ],
)
def test_a_one_tier_route1_lookup_refuses_a_key_no_miss_can_answer(bad: Any) -> None:
    """An unhashable key, and a key that would be found but is not one of the cache's
    (a load could follow a HIT), raise as at the composite's door, counting nothing."""
    manager = route1(2, "lru")
    try:
        good = prefix(1, 1)
        store_keys(manager, "a", good)
        ctx = request(manager, "b", good)
        before = dict(manager.stack.manager.get_stats())
        with pytest.raises(InvalidKeyError):
            manager.lookup(bad, ctx)
        assert dict(manager.stack.manager.get_stats()) == before
        assert manager.lookup(good[0], ctx) is vbase.LookupResult.HIT
    finally:
        manager.shutdown()


def test_a_one_tier_route1_lookup_after_shutdown_is_a_clear_error() -> None:
    manager = route1(2, "lru")
    stored, fresh = prefix(2, 2)
    store_keys(manager, "a", [stored])
    ctx = request(manager, "b", [stored, fresh])
    manager.shutdown()
    for key in (stored, fresh):
        with pytest.raises(ClosedError, match="shut down"):
            manager.lookup(key, ctx)


@pytest.mark.parametrize("tiers", ["cpu", "cpu+file"])
def test_a_found_key_survives_the_same_requests_store(tiers: str, tmp_path: Path) -> None:
    """A request's lookup puts what it finds in its keep set: its own store evicts
    something else (the one-call lookup of a one-tier stack as the composite's)."""
    cpu = {"kind": "cpu", "capacity": 2 * SLOT_BYTES, "policy": "lru"}
    lower = [{"kind": "file", "root": str(tmp_path), "io": "posix"}] if tiers != "cpu" else []
    manager = OffloadingSpecFactory.create_spec(route1_config([cpu, *lower])).get_manager()
    try:
        older, newer, fresh = prefix(3, 3)
        store_keys(manager, "a", [older])
        store_keys(manager, "b", [newer])  # older is now the least recently used
        manager.stack.manager.wait_idle()
        ctx = request(manager, "c", [older, fresh])
        assert manager.lookup(older, ctx) is vbase.LookupResult.HIT
        out = manager.prepare_store([fresh], ctx)
        assert out is not None and list(out.evicted_keys) == [newer]
    finally:
        manager.shutdown()


def test_a_waiting_requests_finds_stay_kept_across_steps_and_are_held_once() -> None:
    """A request vLLM looks up again every step while it waits keeps its found keys from
    its own store, and holds each of them once however many steps it waits."""
    manager = route1(2, "lru")
    try:
        older, newer, fresh = prefix(3, 3)
        store_keys(manager, "a", [older])
        store_keys(manager, "b", [newer])  # older is now the least recently used
        ctx = request(manager, "c", [older, fresh])
        end = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
        for _ in range(3):
            assert manager.lookup(older, ctx) is vbase.LookupResult.HIT
            manager.on_schedule_end(end)
        assert manager._requests["c"].found == []
        assert manager._requests["c"].ctx.keep == {older}
        out = manager.prepare_store([fresh], ctx)
        assert out is not None and list(out.evicted_keys) == [newer]
    finally:
        manager.shutdown()
