"""vLLM's reset fence and keys checked at the door, through KVTiersOffloadingSpec's manager
driven as vLLM 0.33's connector drives it (see tests/test_vllm_spec.py for the setup), and
as vLLM 0.32's drives it with steps in flight."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import AttentionConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.core.keys import get_offload_group_idx
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.errors import ClosedError, InvalidKeyError, UnknownKeyError
from kvtiers.integrations.vllm import compat
from kvtiers.integrations.vllm import manager as vmanager
from kvtiers.integrations.vllm.engine import EngineConfigs
from tests.test_vllm_contract import SLOT_BYTES, prefix, request, route1, route1_config
from tests.test_vllm_contract import store as store_keys
from tests.test_vllm_identity import Engine, kv_cache_config
from tests.test_vllm_identity import vllm_config as engine_vllm_config
from tests.test_vllm_spec import ctx, engine, kv, make_request, store, vllm_config

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


def test_a_completion_from_vllm_never_frees_fenced_slots(
    engine: tuple[Any, Any, Any],
) -> None:
    """vLLM completes only jobs planned since the last reset: a completion naming a key
    the reset forgot is refused, and the slot fenced for the old job stays fenced (its
    worker may still write it) until the flush."""
    _, manager, _ = engine
    req = make_request(1, first_block=0)
    keys = req.keys[0][:1]
    assert manager.prepare_store(keys, ctx()) is not None
    manager.reset_cache()
    primary = manager.stack.tiers[0].manager
    with pytest.raises(UnknownKeyError, match="never reserved"):
        manager.complete_store(keys, ctx())
    with pytest.raises(UnknownKeyError, match="pinned 0 times"):
        manager.complete_load(keys, ctx())
    assert primary.get_stats()["fenced_slots"] == 1
    manager.on_reset_flushed()
    assert primary.get_stats()["fenced_slots"] == 0


def test_without_a_flush_signal_the_slots_come_back_after_the_grace_steps(
    engine: tuple[Any, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler, manager, _ = engine
    monkeypatch.setattr(compat, "FLUSH_SIGNAL", False)  # vLLM 0.32
    req = make_request(1, first_block=0)
    assert manager.prepare_store(req.keys[0][:2], ctx()) is not None
    manager.reset_cache()
    primary = manager.stack.tiers[0].manager
    end = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    # No engine config here: pipeline_parallel_size + 1 steps.
    assert scheduler.reset_grace_steps == 2
    for _ in range(scheduler.reset_grace_steps - 1):
        # An idle engine steps on until the flush has reached its workers.
        assert manager.has_pending_work()
        manager.on_schedule_end(end)
        assert primary.get_stats()["fenced_slots"] == 2
    manager.on_schedule_end(end)
    assert primary.get_stats()["fenced_slots"] == 0
    assert not manager.has_pending_work()


def _engine_config(pp: int, async_scheduling: bool) -> Any:
    """vLLM's own config with the fields its in-flight depth reads."""
    config = VllmConfig.__new__(VllmConfig)
    scheduler = SchedulerConfig(
        max_model_len=1024, is_encoder_decoder=False, async_scheduling=async_scheduling
    )
    object.__setattr__(config, "parallel_config", ParallelConfig(pipeline_parallel_size=pp))
    object.__setattr__(config, "scheduler_config", scheduler)
    object.__setattr__(config, "attention_config", AttentionConfig())
    return config


@pytest.mark.parametrize(
    ("pp", "async_scheduling", "v2", "steps"),
    [
        pytest.param(1, False, False, 1, id="one-step"),
        pytest.param(1, True, False, 2, id="async"),
        pytest.param(3, False, False, 3, id="pp3"),
        # vLLM 0.34 keeps one more step in flight with asynchronous scheduling under
        # pipeline parallelism, whichever model runner.
        pytest.param(4, True, False, 5 if compat.RELEASE >= (0, 34, 0) else 4,
                     id="pp4-async"),
        pytest.param(2, True, True, 3, id="pp2-async-v2-runner"),
    ],
)
def test_the_grace_steps_are_the_steps_the_engine_keeps_in_flight(
    monkeypatch: pytest.MonkeyPatch, pp: int, async_scheduling: bool, v2: bool, steps: int
) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2 else "0")
    engine = EngineConfigs(vllm=_engine_config(pp, async_scheduling), kv_cache=None)
    assert engine.vllm.max_concurrent_batches == steps
    assert vmanager.reset_grace_steps(engine, pp) == steps
    # Without the engine's config: the most either vLLM keeps in flight.
    assert vmanager.reset_grace_steps(None, pp) == pp + 1


def test_the_spec_reads_the_grace_steps_from_the_connectors_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built by vLLM's connector as its engine core builds it: a synchronous engine (one
    step in flight) lifts the fence after one step, not the two of an unknown engine."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    model = Engine(model="org/fence")
    config = engine_vllm_config(model, "spec", tmp_path)
    object.__setattr__(config, "scheduler_config", SchedulerConfig(
        max_model_len=1024, is_encoder_decoder=False, async_scheduling=False
    ))
    connector = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(model))
    try:
        manager = connector.connector_scheduler.manager
        assert isinstance(manager, vmanager.KVTiersManager)
        monkeypatch.setattr(compat, "FLUSH_SIGNAL", False)
        keys = [vbase.make_offload_key(b"\x05" * 32, 0)]
        assert manager.prepare_store(keys, ctx()) is not None
        manager.reset_cache()
        primary = manager.stack.tiers[0].manager
        assert primary.get_stats()["fenced_slots"] == 1
        manager.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert primary.get_stats()["fenced_slots"] == 0
    finally:
        connector.shutdown()


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_on_vllm_032_no_promotion_lands_where_a_store_from_before_the_reset_still_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """vLLM 0.32 with ``depth`` steps in flight (its batch queue): the reset's flush of the
    jobs in flight travels with step 1 after it, whose workers run it (here: the late
    writes of a store from before the reset into its old slots) only once step 1 left the
    queue, i.e. before step ``depth + 1`` is scheduled. Every step looks up chunks the
    file tier holds, which the stack promotes into free primary slots. Whatever lands there
    must still be intact after the flush."""
    monkeypatch.setattr(compat, "FLUSH_SIGNAL", False)
    spec = OffloadingSpecFactory.create_spec(vllm_config(tmp_path / "kv"))
    spec.reset_grace_steps = depth  # what the spec reads from such an engine (see above)
    manager = spec.get_manager()
    primary = manager.stack.tiers[0].manager
    region = manager.stack.tiers[0].region
    offloading = manager.stack.offloading
    end = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def slot(key: Any) -> int | None:
        found: int | None = primary.slot_of(spec.keys.to_kvtiers(key))
        return found

    def chunk(key: Any) -> int:
        return offloading.chunk_bytes(get_offload_group_idx(spec.keys.to_kvtiers(key)))

    try:
        first, second = make_request(1, first_block=0), make_request(2, first_block=12)
        promoted = first.keys[0][:2] + first.keys[1][:2]  # fills the 4 slots
        late = second.keys[0][:2] + second.keys[1][:2]
        out = manager.prepare_store(promoted, ctx("a"))
        assert out is not None and list(out.keys_to_store) == promoted
        payload = {key: bytes([i + 1]) * chunk(key) for i, key in enumerate(promoted)}
        for key in promoted:
            region.view(slot(key))[: chunk(key)] = payload[key]
        manager.complete_store(promoted, ctx("a"))
        manager.stack.manager.wait_idle()  # in the file tier now
        # A store in flight at the reset takes all 4 slots (evicting the chunks above).
        assert manager.prepare_store(late, ctx("b")) is not None
        old_slots = [slot(key) for key in late]
        manager.reset_cache()
        executed = 0  # the last step whose execution started on the workers

        def run_up_to(step: int) -> None:
            nonlocal executed
            while executed < step:
                executed += 1
                if executed == 1:  # the flush: the old store writes its slots late
                    for old in old_slots:
                        region.view(old)[:] = b"\xee" * len(region.view(old))

        for step in range(1, depth + 3):
            run_up_to(step - depth)  # the batch queue holds at most depth - 1 steps
            for key in promoted:
                manager.lookup(key, ctx("c"))
            manager.on_schedule_end(end)
            manager.stack.manager.wait_idle()  # promotions land
        run_up_to(depth + 3)
        landed = [key for key in promoted if slot(key) is not None]
        assert landed == promoted  # the fence lifted and every chunk was promoted
        for key in landed:
            assert bytes(region.view(slot(key))[: chunk(key)]) == payload[key], "wrong bytes"
    finally:
        manager.shutdown()


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


@pytest.mark.parametrize("tiers", ["cpu", "cpu-no-events", "cpu+file"])
def test_a_found_key_survives_the_same_requests_store(tiers: str, tmp_path: Path) -> None:
    """A request's lookup puts what it finds in its keep set: its own store evicts
    something else (the one-call lookup of a one-tier stack as the composite's)."""
    cpu = {"kind": "cpu", "capacity": 2 * SLOT_BYTES, "policy": "lru"}
    lower = [{"kind": "file", "root": str(tmp_path), "io": "posix"}] if tiers == "cpu+file" else []
    config = route1_config([cpu, *lower], events=tiers != "cpu-no-events")
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
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


@pytest.mark.parametrize("events", [True, False])
def test_a_waiting_requests_finds_stay_kept_across_steps_and_are_held_once(events: bool) -> None:
    """A request vLLM looks up again every step while it waits keeps its found keys from
    its own store, and holds each of them once however many steps it waits."""
    manager = route1(2, "lru", events=events)
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


# -- the direct calls of a one-tier cpu stack: the composite's rules without the composite --
@pytest.mark.parametrize("events", [True, False])
def test_a_one_tier_route1_refuses_every_call_once_its_stack_is_shut_down(events: bool) -> None:
    """Shut down under the adapter (the stack's own shutdown), every call that names keys
    raises as the composite's door does."""
    manager = route1(2, "lru", events=events)
    stored, fresh = prefix(4, 2)
    store_keys(manager, "a", [stored])
    ctx = request(manager, "b", [stored, fresh])
    manager.stack.shutdown()
    calls = {
        "prepare_store": lambda: manager.prepare_store([fresh], ctx),
        "complete_store": lambda: manager.complete_store({fresh}, ctx),
        "prepare_load": lambda: manager.prepare_load([stored], ctx),
        "complete_load": lambda: manager.complete_load({stored}, ctx),
        "on_request_finished": lambda: manager.on_request_finished(ctx),
    }
    for where, call in calls.items():
        with pytest.raises(ClosedError, match=f"{where}: this stack was shut down"):
            call()


@pytest.mark.parametrize("events", [True, False])
@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("k" * 20, id="str"),
        pytest.param(b"\x01\x02", id="short"),
        pytest.param(vbase.make_offload_key(b"\x07" * 16, 1), id="group-out-of-range"),
    ],
)
def test_a_one_tier_route1_refuses_a_bad_key_at_every_call_that_names_keys(
    events: bool, bad: Any
) -> None:
    manager = route1(2, "lru", events=events)
    try:
        good = prefix(5, 1)
        store_keys(manager, "a", good)  # the cache learns its key length
        ctx = request(manager, "b", good)
        before = dict(manager.stack.manager.get_stats())
        calls = [
            lambda: manager.prepare_store([good[0], bad], ctx),
            lambda: manager.complete_store([good[0], bad], ctx),
            lambda: manager.prepare_load([good[0], bad], ctx),
            lambda: manager.complete_load([good[0], bad], ctx),
        ]
        for call in calls:
            with pytest.raises(InvalidKeyError):
                call()
        assert dict(manager.stack.manager.get_stats()) == before
        assert manager.lookup(good[0], ctx) is vbase.LookupResult.HIT
    finally:
        manager.shutdown()


@pytest.mark.parametrize("events", [True, False])
def test_a_one_tier_route1_reports_each_removal_once_in_the_next_store_output(
    events: bool,
) -> None:
    """Published or not as events, the primary's removals reach vLLM in the next
    PrepareStoreOutput, once each, never one of the keys it stores: a store's own
    evictions, and a reset's removals at the store after it."""
    manager = route1(2, "lru", events=events)
    try:
        head, tail, other = prefix(6, 3)
        store_keys(manager, "a", [head, tail])
        ctx = request(manager, "b", [other])
        out = manager.prepare_store([other], ctx)
        assert out is not None and out.evicted_keys == [tail]  # a prefix loses its tail first
        manager.complete_store({other}, ctx)
        manager.on_request_finished(ctx)
        manager.reset_cache()  # removes head and other; no store is under way to say so
        ctx = request(manager, "c", [head, tail])
        out = manager.prepare_store([head, tail], ctx)
        assert out is not None and list(out.keys_to_store) == [head, tail]
        assert out.evicted_keys == [other]  # head is stored again: not evicted
        manager.complete_store({head, tail}, ctx)
        out = manager.prepare_store([head], ctx)
        assert out is not None and out.evicted_keys == []
        published = [e for e in manager.take_events() if e.removed]
        assert bool(published) is events
    finally:
        manager.shutdown()
