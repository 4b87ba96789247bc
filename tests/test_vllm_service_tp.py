"""Route 1 through ``kvtiers serve`` with tensor-parallel ranks and data-parallel engines,
driven through vLLM's own classes (docs/service.md, "Sharded and data-parallel engines").

The service runs in its own process. Tensor parallel: the scheduler's spec attaches the
engine's ``kind: service`` tier; each rank is a spawned process (``tests/test_vllm_tp.py``'s
:class:`Ranks`) whose spec attaches its worker to the same pool and copies its own shard
into the slots the scheduler leased, stamping the engine's shard ledger. Data parallel:
each rank is an engine of its own (its own engine id and scheduler) with the same
namespace identity, so what one stores the other finds in the pool. Tenants on a sharded
engine: the shard check goes by each tenant's scoped key in the pool too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.filemapper import NamespaceIdentity
from kvtiers.testing.service import ServiceProcess, remove_pool
from tests.test_vllm_spec import canonical_kv, ctx, gpu_spec, make_request, vllm_config
from tests.test_vllm_tenants import (
    SHARDED_TENANTS,
    chunk_keys,
    on_blocks,
    prepare_sharded,
    run_sharded_store,
    sharded_engine,
    sharded_load,
    sharded_store,
)
from tests.test_vllm_tenants import started as tenant_started
from tests.test_vllm_tp import (
    RANK_REPLY_S,
    RANKS,
    F,
    Ranks,
    load_on_ranks,
    rank_kv,
    started,
    store_on_ranks,
)

__all__ = ["started"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(3 * RANK_REPLY_S)

END = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    pool = f"kvtiers-vllm-tp-test-{os.getpid()}-{tmp_path.name}"
    config = tmp_path / "serve.yaml"
    config.write_text(f"tiers:\n  - kind: cpu\n    capacity: 1MiB\n"
                      f"    shared_memory_name: {pool}\n")
    proc = ServiceProcess(config, tmp_path / "serve.sock")
    proc.start(fresh=True)
    yield proc
    proc.stop()
    remove_pool(pool)


def service_config(service: ServiceProcess, tmp_path: Path, *, world_size: int = RANKS,
                   dp_index: int = 0) -> OffloadingConfig:
    """``tests/test_vllm_spec.py``'s engine with a ``kind: service`` stack, as data-parallel
    rank ``dp_index`` (its own engine id)."""
    config = vllm_config(tmp_path / "unused", world_size=world_size)
    tier = {"kind": "service", "socket": str(service.socket), "retry_s": 0.001}
    return replace(
        config,
        extra_config={**config.extra_config, "kvtiers": {"tiers": [tier]}},
        parallel=replace(config.parallel, data_parallel_index=dp_index, data_parallel_size=2),
    )


def _commit(manager: Any) -> None:
    """End the step and wait until the service took its commits in (the pool's mirror
    then shows the chunks)."""
    manager.on_schedule_end(END)
    manager.stack.manager.tiers[0].manager.flush(wait=True)


def test_two_ranks_store_and_load_byte_exact_through_the_service(
    tmp_path: Path, service: ServiceProcess, started: list[Ranks]
) -> None:
    req = make_request(5, first_block=0)
    config = service_config(service, tmp_path)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        ranks = Ranks(config)
        started.append(ranks)
        keys = store_on_ranks(manager, ranks, req, [range(0, 2), range(0, 1)], job_id=1)
        _commit(manager)
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 3
        assert manager.torn_chunks == 0
        load_on_ranks(manager, ranks, req, job_id=2)
        ranks.stop()
        started.remove(ranks)
    finally:
        manager.shutdown()

    # Another data-parallel engine of the same model and layout: the same namespace, so
    # the chunks both ranks stored are pool hits for it and load byte-exact on its ranks.
    peer = service_config(service, tmp_path, dp_index=1)
    spec = OffloadingSpecFactory.create_spec(peer)
    first = OffloadingSpecFactory.create_spec(config)
    assert (NamespaceIdentity.from_config(spec.offloading).namespace
            == NamespaceIdentity.from_config(first.offloading).namespace)
    manager = spec.get_manager()
    try:
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 3
        ranks = Ranks(peer)
        started.append(ranks)
        load_on_ranks(manager, ranks, req, job_id=1)
        ranks.stop()
        started.remove(ranks)
    finally:
        manager.shutdown()


def test_one_ranks_failed_store_publishes_no_chunk_in_the_pool(
    tmp_path: Path, service: ServiceProcess, started: list[Ranks]
) -> None:
    req = make_request(6, first_block=0)
    config = service_config(service, tmp_path)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        ranks = Ranks(config)
        started.append(ranks)
        keys = store_on_ranks(
            manager, ranks, req, [range(0, 2), range(0, 1)], job_id=1, failing_rank=1
        )
        _commit(manager)
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.MISS] * 3
        assert manager.torn_chunks == 3

        # Stored again with both ranks well, the chunks are published and load on both.
        store_on_ranks(manager, ranks, req, [range(0, 2), range(0, 1)], job_id=2)
        _commit(manager)
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 3
        load_on_ranks(manager, ranks, req, job_id=3)
        ranks.stop()
        started.remove(ranks)
    finally:
        manager.shutdown()


def test_two_data_parallel_engines_share_a_prefix_through_the_pool(
    tmp_path: Path, service: ServiceProcess
) -> None:
    """Two one-rank engines (data-parallel ranks 0 and 1, each with its scheduler and
    worker): a prefix stored by one loads byte-exact in the other, from the pool."""
    req = make_request(7, first_block=0)
    kv = rank_kv(0)
    originals = [t.clone() for t in kv]
    engines = []
    for dp_index in (0, 1):
        spec = OffloadingSpecFactory.create_spec(
            service_config(service, tmp_path, world_size=1, dp_index=dp_index)
        )
        manager = spec.get_manager()
        worker = spec.get_worker(canonical_kv(kv))
        engines.append((manager, worker))
    (first, first_worker), (second, second_worker) = engines
    try:
        keys = req.keys[0][:2]
        out = first.prepare_store(keys, ctx())
        assert out is not None and list(out.keys_to_store) == keys
        assert first_worker.submit_store(1, gpu_spec([(req.blocks[0][: 2 * F], 0), ([], 0)]),
                                         out.store_spec)
        first_worker.wait({1})
        assert [r.success for r in first_worker.get_finished()] == [True]
        first.complete_store(keys, ctx())
        _commit(first)

        assert [second.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 2
        src = second.prepare_load(keys, ctx())
        dst = [40, 41, 42, 43]
        for t in kv:
            t[dst] = 0
        assert second_worker.submit_load(2, src, gpu_spec([(dst, 0), ([], 0)]))
        second_worker.wait({2})
        assert [r.success for r in second_worker.get_finished()] == [True]
        second.complete_load(keys, ctx())
        for s, d in zip(req.blocks[0][: 2 * F], dst, strict=True):
            assert all(torch.equal(t[d], o[s]) for t, o in zip(kv, originals, strict=True))
    finally:
        for manager, worker in engines:
            worker.shutdown()
            manager.shutdown()


def test_two_tenants_on_two_ranks_through_the_service_are_checked_by_scoped_key(
    tmp_path: Path, service: ServiceProcess
) -> None:
    """A sharded engine with a ``tenants:`` section over the pool (two rank workers in this
    process, each attached with the engine's identity): two tenants store the same vLLM
    keys in one step, rank 1 fails the later store. The earlier tenant's chunks are
    committed to the pool and load byte-exact on both ranks for it alone; the torn ones are
    committed for neither tenant until stored again whole."""
    made = service_config(service, tmp_path)
    made.extra_config["kvtiers"]["tenants"] = SHARDED_TENANTS
    engine = sharded_engine(made)
    manager = engine.manager
    try:
        req = make_request(8, first_block=0)
        theirs = on_blocks(req, first_block=24)
        chunks = [range(0, 2), range(0, 1)]
        keys = chunk_keys(req, chunks)
        search, batch = tenant_started(manager, "search", "s1"), tenant_started(
            manager, "batch", "b1")
        first = prepare_sharded(manager, req, chunks, search)
        second = prepare_sharded(manager, theirs, chunks, batch)
        run_sharded_store(engine, req, chunks, first, job_id=1)
        run_sharded_store(engine, theirs, chunks, second, job_id=2, failing_rank=1)
        manager.complete_store(first.keys_to_store, search)
        manager.complete_store(second.keys_to_store, batch)
        _commit(manager)
        assert manager.torn_chunks == 3
        for tenant in ("batch", None):
            reader = tenant_started(manager, tenant, f"{tenant}-1")
            assert [manager.lookup(key, reader) for key in keys] == [
                vbase.LookupResult.MISS] * 3, tenant
        reader = tenant_started(manager, "search", "s2")
        assert [manager.lookup(key, reader) for key in keys] == [vbase.LookupResult.HIT] * 3
        sharded_load(engine, req, chunks, reader, job_id=3)

        sharded_store(engine, theirs, chunks, tenant_started(manager, "batch", "b2"), job_id=4)
        _commit(manager)
        assert manager.torn_chunks == 3
        reader = tenant_started(manager, "batch", "b3")
        assert [manager.lookup(key, reader) for key in keys] == [vbase.LookupResult.HIT] * 3
        sharded_load(engine, theirs, chunks, reader, job_id=5)
    finally:
        engine.shutdown()
