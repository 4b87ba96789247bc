"""vLLM route 1 through ``kvtiers serve``: two ``KVTiersOffloadingSpec`` managers (two
engines) with a ``kind: service`` stack, the service in its own process, driven as
vLLM's connector drives them (docs/service.md)."""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.service.worker import CheckedSlots
from kvtiers.testing.service import ServiceProcess, remove_pool
from tests.test_vllm_contract import prefix, request, route1_config

END = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    pool = f"kvtiers-vllm-test-{os.getpid()}-{tmp_path.name}"
    config = tmp_path / "serve.yaml"
    config.write_text(f"tiers:\n  - kind: cpu\n    capacity: 1MiB\n"
                      f"    shared_memory_name: {pool}\n")
    proc = ServiceProcess(config, tmp_path / "serve.sock")
    proc.start(fresh=True)
    yield proc
    proc.stop()
    remove_pool(pool)


def engine(service: ServiceProcess) -> Any:
    tier = {"kind": "service", "socket": str(service.socket), "retry_s": 0.001}
    return OffloadingSpecFactory.create_spec(route1_config([tier])).get_manager()


def test_a_chunk_stored_through_one_engine_is_a_hit_in_another(
    service: ServiceProcess,
) -> None:
    first, second = engine(service), engine(service)
    try:
        keys = prefix(1, 4)
        ctx = request(first, "a", keys)
        out = first.prepare_store(keys, ctx)
        assert list(out.keys_to_store) == keys
        slots = sorted(out.store_spec.groups[0].block_ids)  # pool slots the worker fills
        assert len(slots) == len(keys)
        first.complete_store(tuple(keys), ctx)
        first.on_request_finished(ctx)
        first.on_schedule_end(END)  # the step's commits are written...
        first.shutdown()  # ...and taken in before it detaches

        ctx = request(second, "b", keys)
        assert [second.lookup(k, ctx) for k in keys] == [vbase.LookupResult.HIT] * 4
        load = second.prepare_load(keys, ctx)
        assert sorted(load.groups[0].block_ids) == slots  # the same slots
        # No round trip: each slot's generation travels to the worker with the spec
        # (pickled when the worker runs in another process; copied by the adapter's split).
        checked = load.groups[0]
        assert isinstance(checked, CheckedSlots) and len(checked.generations) == 4
        assert [second.stack.manager.tiers[0].manager.region.stamp(s)[0]
                for s in checked.block_ids] == checked.generations
        assert pickle.loads(pickle.dumps(load)).groups[0].generations == checked.generations
        copied = copy.copy(checked).set_gpu_block_offset(1)
        assert isinstance(copied, CheckedSlots) and copied.generations == checked.generations
        second.complete_load(tuple(keys), ctx)
        second.on_request_finished(ctx)
        # Present already: nothing to store again.
        ctx = request(second, "c", keys)
        again = second.prepare_store(keys, ctx)
        assert again is not None and list(again.keys_to_store) == []
        second.on_request_finished(ctx)
    finally:
        second.shutdown()


def test_a_dead_service_makes_lookups_miss(service: ServiceProcess) -> None:
    manager = engine(service)
    try:
        keys = prefix(2, 2)
        ctx = request(manager, "a", keys)
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(tuple(out.keys_to_store), ctx)
        manager.on_request_finished(ctx)
        manager.on_schedule_end(END)
        manager.stack.manager.tiers[0].manager.flush(wait=True)
        ctx = request(manager, "b", keys)
        assert manager.lookup(keys[0], ctx) is vbase.LookupResult.HIT
        service.kill()
        tier = manager.stack.manager.tiers[0].manager
        tier._checked_at = -1.0  # the next lookup polls the socket (no clock waited on)
        assert manager.lookup(keys[0], ctx) is vbase.LookupResult.MISS
        assert manager.prepare_store(prefix(3, 1), ctx) is None
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()
