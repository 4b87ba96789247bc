"""vLLM's reset fence and keys checked at the door, through KVTiersOffloadingSpec's manager
driven as vLLM 0.33's connector drives it (see tests/test_vllm_spec.py for the setup)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.kv_offload import base as vbase

from kvtiers.core.manager import LookupResult
from kvtiers.errors import InvalidKeyError
from kvtiers.integrations.vllm import spec as vspec
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
