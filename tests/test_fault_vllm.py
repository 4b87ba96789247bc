"""vLLM's route 1 (``KVTiersOffloadingSpec``, driven class-level as in
``tests/test_vllm_spec.py``) over a file tier whose chunk became unreadable: vLLM's lookup
of the key resolves to ``MISS`` one step after the failed promotion, is not promoted again
while it backs off, and is served again once the fault ends (docs/architecture.md,
"Liveness")."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.test_fault_matrix import FakeClock
from tests.test_vllm_spec import canonical_kv, ctx, make_kv, make_request, store, vllm_config


@pytest.fixture
def kv() -> list[torch.Tensor]:
    return make_kv()


def _step(manager: Any) -> None:
    manager.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    manager.stack.manager.wait_idle()


def test_an_unreadable_chunk_resolves_to_miss_and_heals(
    tmp_path: Path, kv: list[torch.Tensor]
) -> None:
    root = tmp_path / "kv"
    req = make_request(3, first_block=0)
    config = vllm_config(root)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    store(manager, worker, req, [range(0, 2), range(0, 1)], job_id=1)
    manager.stack.manager.wait_idle()
    worker.shutdown()
    manager.shutdown()

    spec = OffloadingSpecFactory.create_spec(vllm_config(root))
    manager = spec.get_manager()
    manager.stack.wait_index()  # the restart's index is built in the background
    try:
        file_tier = manager.stack.tiers[1].manager
        clock = FakeClock()
        file_tier.backoff.clock = clock
        keys = req.keys[0][:2] + req.keys[1][:1]
        bad = keys[1]
        path = Path(file_tier.mapper.path(spec.keys.to_kvtiers(bad)))
        saved = path.with_name(path.name + ".saved")
        os.replace(path, saved)
        path.mkdir()

        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT_PENDING] * 3
        _step(manager)
        after = [manager.lookup(k, ctx()) for k in keys]
        assert after == [vbase.LookupResult.HIT, vbase.LookupResult.MISS, vbase.LookupResult.HIT]
        _step(manager)
        assert manager.lookup(bad, ctx()) is vbase.LookupResult.MISS  # backing off
        assert file_tier.get_stats()["load_failures"] == 1

        shutil.rmtree(path)
        os.replace(saved, path)
        clock.now += 3600.0
        assert manager.lookup(bad, ctx()) is vbase.LookupResult.HIT_PENDING
        _step(manager)
        assert manager.lookup(bad, ctx()) is vbase.LookupResult.HIT
    finally:
        manager.shutdown()
