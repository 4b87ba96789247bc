"""Tenants under vLLM's route 1 (kvtiers.integrations.vllm.tenants), through vLLM's own
classes as tests/test_vllm_spec.py drives them: two KV-cache groups (keys rewritten at the
boundary), a 4-slot cpu primary over a file tier, a worker moving real bytes.

Two requests of two tenants (named by ``kv_transfer_params``) with the same token ids never
hit each other's chunks in either tier, a tenant hits its own (the bytes loaded are the
ones it stored, from the primary and after a promotion from the file tier), a tenant's
quota holds, and a stack without a ``tenants:`` section is driven as before.

On a sharded engine (two tensor-parallel rank workers in this process, different bytes
per rank, sharing the primary): each tenant's chunks are stored by both ranks and load
byte-exact on each rank for that tenant only, and a chunk a rank failed to write is
published for no tenant, also when two tenants store the same vLLM keys in one step (the
shard check goes by each tenant's scoped key)."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtiers.integrations.vllm import KVTiersDirectManager, KVTiersManager
from kvtiers.integrations.vllm.translate import KeyMap
from tests.test_vllm_contract import prefix, route1_config
from tests.test_vllm_spec import (
    GROUP_IDS,
    NUM_BLOCKS,
    F,
    Request,
    canonical_kv,
    gpu_spec,
    make_request,
    run,
    vllm_config,
)
from tests.test_vllm_tp import _fail_job as fail_job
from tests.test_vllm_tp import rank_config, rank_kv

SLOT = 4096  # the primary's slot (16 KiB: 4 slots)
TENANTS: dict[str, Any] = {
    "members": [{"name": "search"}, {"name": "batch", "quota": {"cpu": 2 * SLOT}}],
}
HIT, MISS, PENDING = (vbase.LookupResult.HIT, vbase.LookupResult.MISS,
                      vbase.LookupResult.HIT_PENDING)


def config(root: Path, tenants: dict[str, Any] | None = TENANTS, *, lower: bool = True,
           world_size: int = 1) -> Any:
    made = vllm_config(root, world_size=world_size)
    stack = made.extra_config["kvtiers"]
    if not lower:
        del stack["tiers"][1:]
    if tenants is not None:
        stack["tenants"] = tenants
    return made


def tenant_ctx(tenant: str | None, req_id: str) -> Any:
    """vLLM's request context of a request naming ``tenant`` (``None``: names none)."""
    params = None if tenant is None else {"kvtiers_tenant": tenant}
    return vbase.ReqContext(req_id=req_id, kv_transfer_params=params)


def started(manager: Any, tenant: str | None, req_id: str) -> Any:
    ctx = tenant_ctx(tenant, req_id)
    manager.on_new_request(ctx)
    return ctx


def chunk_keys(req: Request, chunks: list[range]) -> list[bytes]:
    return [req.keys[g][c] for g, rng in enumerate(chunks) for c in rng]


def store(manager: Any, worker: Any, req: Request, chunks: list[range], ctx: Any,
          job_id: int) -> Any:
    """Store ``chunks[g]`` of each group as vLLM does; the spec crosses a pickle."""
    keys = chunk_keys(req, chunks)
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    stored = set(out.keys_to_store)
    parts = [([b for c in rng if req.keys[g][c] in stored
               for b in req.blocks[g][c * F:(c + 1) * F]], 0) for g, rng in enumerate(chunks)]
    gpu = gpu_spec(parts)
    run(worker, job_id, lambda j: worker.submit_store(j, gpu, pickle.loads(pickle.dumps(
        out.store_spec))))
    manager.complete_store(out.keys_to_store, ctx)
    return out


def load_and_check(manager: Any, worker: Any, req: Request, chunks: list[range], ctx: Any,
                   kv: list[torch.Tensor], originals: list[torch.Tensor], job_id: int) -> None:
    """Load ``chunks[g]`` of each group into zeroed blocks at the end of the KV tensors
    and check every byte against the blocks they were stored from."""
    keys = chunk_keys(req, chunks)
    src = manager.prepare_load(keys, ctx)
    dst: list[list[int]] = []
    next_free = NUM_BLOCKS - 12
    for rng in chunks:
        dst.append(list(range(next_free, next_free + len(rng) * F)))
        next_free += len(rng) * F
    for t in kv:
        t[NUM_BLOCKS - 12:] = 0
    gpu = gpu_spec([(blocks, 0) for blocks in dst])
    run(worker, job_id, lambda j: worker.submit_load(j, pickle.loads(pickle.dumps(src)), gpu))
    manager.complete_load(keys, ctx)
    for g, rng in enumerate(chunks):
        sources = [b for c in rng for b in req.blocks[g][c * F:(c + 1) * F]]
        for src_block, dst_block in zip(sources, dst[g], strict=True):
            for t, original in zip(kv, originals, strict=True):
                assert torch.equal(t[dst_block], original[src_block]), (g, src_block)


def step_end(manager: Any) -> None:
    manager.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


@pytest.fixture
def kv() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(-128, 128, (NUM_BLOCKS, 256), dtype=torch.int8, generator=gen)
            for _ in range(2)]


def engine(made: Any, kv: list[torch.Tensor]) -> tuple[Any, Any]:
    manager = OffloadingSpecFactory.create_spec(made).get_manager()
    worker = OffloadingSpecFactory.create_spec(made).get_worker(canonical_kv(kv))
    return manager, worker


@pytest.fixture
def tenanted(tmp_path: Path, kv: list[torch.Tensor]) -> Iterator[tuple[Any, Any]]:
    manager, worker = engine(config(tmp_path / "kv"), kv)
    yield manager, worker
    worker.shutdown()
    manager.shutdown()


def test_two_tenants_with_the_same_tokens_hit_only_their_own_chunks(
    tenanted: tuple[Any, Any], kv: list[torch.Tensor]
) -> None:
    manager, worker = tenanted
    assert not isinstance(manager, KVTiersDirectManager)
    req = make_request(1, first_block=0)  # both tenants send these token ids
    chunks = [range(0, 2), range(0, 1)]
    keys = chunk_keys(req, chunks)
    originals = [t.clone() for t in kv]
    search = started(manager, "search", "s1")
    store(manager, worker, req, chunks, search, job_id=1)

    batch, plain = started(manager, "batch", "b1"), started(manager, None, "p1")
    assert [manager.lookup(key, batch) for key in keys] == [MISS] * 3
    assert [manager.lookup(key, plain) for key in keys] == [MISS] * 3
    reader = started(manager, "search", "s2")
    assert [manager.lookup(key, reader) for key in keys] == [HIT] * 3
    load_and_check(manager, worker, req, chunks, reader, kv, originals, job_id=2)
    # The primary holds the tenant's scoped keys, never vLLM's own.
    primary = manager.stack.tiers[0].manager
    scope = manager.stack.tenants.keys.scope
    for key in manager_keys(keys):
        assert primary.slot_of(key) is None
        assert primary.slot_of(scope(key, "search")) is not None
    for ctx in (search, batch, plain, reader):
        manager.on_request_finished(ctx)

    # Down in the file tier only: the other tenant still misses; the owner's lookup
    # promotes the scoped chunk and names the file tier as the hit's source.
    manager.stack.manager.wait_idle()  # the cascades to the file tier are written
    manager.reset_cache()
    manager.on_reset_flushed()
    batch = started(manager, "batch", "b2")
    assert [manager.lookup(key, batch) for key in keys] == [MISS] * 3
    reader = started(manager, "search", "s3")
    assert [manager.lookup(key, reader) for key in keys] == [PENDING] * 3
    assert [manager.get_load_source(key, reader) for key in keys] == [CacheHitSource.DISK] * 3
    step_end(manager)
    manager.stack.manager.wait_idle()
    assert [manager.lookup(key, reader) for key in keys] == [HIT] * 3
    load_and_check(manager, worker, req, chunks, reader, kv, originals, job_id=3)


def manager_keys(keys: list[bytes]) -> list[Any]:
    """vLLM's ``keys`` as kvtiers' stack names them (the two groups' ids differ)."""
    return [KeyMap(list(GROUP_IDS)).to_kvtiers(key) for key in keys]


def test_a_tenants_quota_on_the_primary_holds_and_spares_the_other_tenant(
    tenanted: tuple[Any, Any],
) -> None:
    manager, worker = tenanted
    cpu = manager.stack.tiers[0].name
    tenants = manager.stack.tenants
    first, second, other = (make_request(seed, first_block=block)
                            for seed, block in ((1, 0), (2, 12), (3, 24)))
    batch = started(manager, "batch", "b1")
    # Three chunks asked, two stored: the leading ones fill the quota.
    out = store(manager, worker, first, [range(0, 2), range(0, 1)], batch, job_id=1)
    assert out.keys_to_store == first.keys[0][:2]
    manager.stack.manager.wait_idle()  # cascades release their pins on the primary
    search = started(manager, "search", "s1")
    store(manager, worker, other, [range(0, 1), range(0, 0)], search, job_id=2)
    manager.stack.manager.wait_idle()
    assert tenants.usage()[cpu] == {"default": 0, "search": SLOT, "batch": 2 * SLOT}
    # The next burst evicts the tenant's own chunks, never the other tenant's.
    out = store(manager, worker, second, [range(0, 2), range(0, 0)], batch, job_id=3)
    assert out.keys_to_store == second.keys[0][:2]
    # (Reported in the scoped keys, which vLLM never saw: it only publishes them.)
    assert sorted(out.evicted_keys) == sorted(
        KeyMap(list(GROUP_IDS)).to_vllm(tenants.keys.scope(key, "batch"))
        for key in manager_keys(first.keys[0][:2]))
    manager.stack.manager.wait_idle()
    assert tenants.usage()[cpu] == {"default": 0, "search": SLOT, "batch": 2 * SLOT}
    reader = started(manager, "search", "s2")
    assert manager.lookup(other.keys[0][0], reader) is HIT


def test_without_tenants_the_manager_drives_the_stack_as_before(
    tmp_path: Path, kv: list[torch.Tensor]
) -> None:
    """No ``tenants:`` section: ``kv_transfer_params`` name no one, keys are vLLM's own in
    every tier, and a one-tier cpu stack still gets the direct manager."""
    manager, worker = engine(config(tmp_path / "kv", None), kv)
    try:
        assert manager.stack.tenants is None
        req = make_request(1, first_block=0)
        chunks = [range(0, 2), range(0, 1)]
        keys = chunk_keys(req, chunks)
        store(manager, worker, req, chunks, started(manager, "search", "s1"), job_id=1)
        batch = started(manager, "batch", "b1")
        assert [manager.lookup(key, batch) for key in keys] == [HIT] * 3
        primary = manager.stack.tiers[0].manager
        assert all(primary.slot_of(key) is not None for key in manager_keys(keys))
    finally:
        worker.shutdown()
        manager.shutdown()
    manager = one_tier(None)
    assert isinstance(manager, KVTiersDirectManager)
    manager.shutdown()


def one_tier(tenants: dict[str, Any] | None) -> Any:
    """Route 1's manager over one cpu tier of 4 slots, every group offloaded (vLLM's keys
    are kvtiers' keys: what the direct manager needs)."""
    made = route1_config([{"kind": "cpu", "capacity": 4 * SLOT}])
    if tenants is not None:
        made.extra_config["kvtiers"]["tenants"] = tenants
    return OffloadingSpecFactory.create_spec(made).get_manager()


def test_a_one_tier_stack_with_tenants_is_not_driven_directly() -> None:
    manager = one_tier(TENANTS)
    try:
        assert type(manager) is KVTiersManager
        keys = prefix(1, 2)
        batch = started(manager, "batch", "b1")
        out = manager.prepare_store(keys, batch)
        assert out is not None and out.keys_to_store == keys
        manager.complete_store(set(keys), batch)
        search = started(manager, "search", "s1")
        assert [manager.lookup(key, search) for key in keys] == [MISS] * 2
        assert [manager.lookup(key, started(manager, "batch", "b2")) for key in keys] == [
            HIT] * 2
    finally:
        manager.shutdown()


# -- a sharded engine: two tensor-parallel ranks sharing the primary ----------------------
RANKS = 2
#: Two tenants with no quota (a sharded chunk is RANKS times a one-rank slot).
SHARDED_TENANTS: dict[str, Any] = {"members": [{"name": "search"}, {"name": "batch"}]}


@dataclass
class Sharded:
    """A two-rank engine in this process: the scheduler's manager and each rank's worker
    over its own KV tensors (different bytes per rank, as tensor-parallel shards are)."""

    manager: Any
    workers: list[Any]
    kv: list[list[torch.Tensor]]
    originals: list[list[torch.Tensor]]

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.manager.shutdown()


def sharded_engine(made: Any) -> Sharded:
    """``made``'s scheduler and its :data:`RANKS` rank workers, as vLLM builds them."""
    manager = OffloadingSpecFactory.create_spec(made).get_manager()
    kv = [rank_kv(rank) for rank in range(RANKS)]
    workers = [OffloadingSpecFactory.create_spec(rank_config(made, rank)).get_worker(
        canonical_kv(kv[rank])) for rank in range(RANKS)]
    return Sharded(manager, workers, kv, [[t.clone() for t in tensors] for tensors in kv])


@pytest.fixture
def sharded(tmp_path: Path) -> Iterator[Sharded]:
    made = config(tmp_path / "kv", SHARDED_TENANTS, world_size=RANKS)
    made.extra_config["kvtiers"]["tiers"][0]["capacity"] = "64KiB"
    engine = sharded_engine(made)
    yield engine
    engine.shutdown()


def on_blocks(req: Request, first_block: int) -> Request:
    """``req``'s keys over GPU blocks from ``first_block`` on: the same prompt, other bytes
    (what another tenant's request computed for it, in this test's terms)."""
    shift = first_block - req.blocks[0][0]
    return Request(req.keys, [[b + shift for b in blocks] for blocks in req.blocks])


def prepare_sharded(manager: Any, req: Request, chunks: list[range], ctx: Any) -> Any:
    """vLLM's ``prepare_store`` of every key of ``chunks``, all accepted."""
    keys = chunk_keys(req, chunks)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    return out


def run_sharded_store(engine: Sharded, req: Request, chunks: list[range], out: Any,
                      job_id: int, failing_rank: int | None = None) -> None:
    """Every rank runs the store job of ``out`` (its copy fails on ``failing_rank``), and
    each reports it finished, as vLLM's ranks do even for a failed store."""
    gpu = gpu_spec([(req.blocks[g][rng.start * F:rng.stop * F], rng.start * F)
                    for g, rng in enumerate(chunks)])
    for rank, worker in enumerate(engine.workers):
        if rank == failing_rank:
            fail_job(worker.worker, job_id)
        assert worker.submit_store(job_id, gpu, pickle.loads(pickle.dumps(out.store_spec)))
        worker.wait({job_id})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(job_id, True)]


def sharded_store(engine: Sharded, req: Request, chunks: list[range], ctx: Any,
                  job_id: int, failing_rank: int | None = None) -> list[Any]:
    """Store ``chunks`` on every rank and complete the job once both reported it."""
    out = prepare_sharded(engine.manager, req, chunks, ctx)
    run_sharded_store(engine, req, chunks, out, job_id, failing_rank)
    engine.manager.complete_store(out.keys_to_store, ctx)
    return list(out.keys_to_store)


def sharded_load(engine: Sharded, req: Request, chunks: list[range], ctx: Any,
                 job_id: int) -> None:
    """Load ``chunks`` on every rank into zeroed blocks at the end of its KV tensors; each
    rank's bytes must be the ones that rank stored from ``req``'s blocks."""
    keys = chunk_keys(req, chunks)
    src = engine.manager.prepare_load(keys, ctx)
    dst: list[list[int]] = []
    next_free = NUM_BLOCKS - 12
    for rng in chunks:
        dst.append(list(range(next_free, next_free + len(rng) * F)))
        next_free += len(rng) * F
    gpu = gpu_spec([(blocks, 0) for blocks in dst])
    for rank, worker in enumerate(engine.workers):
        for t in engine.kv[rank]:
            t[NUM_BLOCKS - 12:] = 0
        run(worker, job_id, lambda j, w=worker: w.submit_load(
            j, pickle.loads(pickle.dumps(src)), gpu))
    engine.manager.complete_load(keys, ctx)
    for rank in range(RANKS):
        for g, rng in enumerate(chunks):
            sources = [b for c in rng for b in req.blocks[g][c * F:(c + 1) * F]]
            for src_block, dst_block in zip(sources, dst[g], strict=True):
                for t, original in zip(engine.kv[rank], engine.originals[rank], strict=True):
                    assert torch.equal(t[dst_block], original[src_block]), (rank, g, src_block)


def test_two_tenants_on_a_sharded_engine_load_only_their_own_chunks_byte_exact(
    sharded: Sharded,
) -> None:
    """Both tenants store the same prompt's keys from different blocks on both ranks: each
    loads back its own bytes on each rank, from the primary and after a promotion from
    the file tier; the default tenant hits neither."""
    manager = sharded.manager
    assert type(manager) is KVTiersManager and manager.stack.tenants is not None
    req = make_request(1, first_block=0)
    theirs = on_blocks(req, first_block=24)
    chunks = [range(0, 2), range(0, 1)]
    keys = chunk_keys(req, chunks)
    sharded_store(sharded, req, chunks, started(manager, "search", "s1"), job_id=1)
    plain = started(manager, None, "p1")
    assert [manager.lookup(key, plain) for key in keys] == [MISS] * 3
    assert [manager.lookup(key, started(manager, "batch", "b0")) for key in keys] == [
        MISS] * 3
    sharded_store(sharded, theirs, chunks, started(manager, "batch", "b1"), job_id=2)
    assert manager.torn_chunks == 0
    for tenant, stored, job_id in (("search", req, 3), ("batch", theirs, 4)):
        reader = started(manager, tenant, f"{tenant}-r")
        assert [manager.lookup(key, reader) for key in keys] == [HIT] * 3
        sharded_load(sharded, stored, chunks, reader, job_id=job_id)
    assert [manager.lookup(key, plain) for key in keys] == [MISS] * 3

    manager.stack.manager.wait_idle()  # both tenants' chunks are in the file tier
    manager.reset_cache()
    manager.on_reset_flushed()
    assert [manager.lookup(key, started(manager, None, "p2")) for key in keys] == [MISS] * 3
    readers = {tenant: started(manager, tenant, f"{tenant}-p") for tenant in ("search", "batch")}
    for reader in readers.values():
        assert [manager.lookup(key, reader) for key in keys] == [PENDING] * 3
    step_end(manager)
    manager.stack.manager.wait_idle()
    for (tenant, reader), stored, job_id in zip(readers.items(), (req, theirs), (5, 6),
                                                strict=True):
        assert [manager.lookup(key, reader) for key in keys] == [HIT] * 3, tenant
        sharded_load(sharded, stored, chunks, reader, job_id=job_id)


def test_a_chunk_one_rank_failed_to_write_is_published_for_no_tenant(
    sharded: Sharded,
) -> None:
    """Two tenants store the same vLLM keys in one step, each in its own slots; rank 1
    fails the later store. The earlier tenant's chunks are whole and published, the later
    tenant's are torn and published for neither tenant; stored again, they are."""
    manager = sharded.manager
    req = make_request(2, first_block=0)
    theirs = on_blocks(req, first_block=24)
    chunks = [range(0, 2), range(0, 1)]
    keys = chunk_keys(req, chunks)
    search, batch = started(manager, "search", "s1"), started(manager, "batch", "b1")
    first = prepare_sharded(manager, req, chunks, search)
    second = prepare_sharded(manager, theirs, chunks, batch)
    run_sharded_store(sharded, req, chunks, first, job_id=1)
    run_sharded_store(sharded, theirs, chunks, second, job_id=2, failing_rank=1)
    manager.complete_store(first.keys_to_store, search)
    manager.complete_store(second.keys_to_store, batch)
    assert manager.torn_chunks == 3

    assert [manager.lookup(key, started(manager, "batch", "b2")) for key in keys] == [
        MISS] * 3
    assert [manager.lookup(key, started(manager, None, "p1")) for key in keys] == [MISS] * 3
    reader = started(manager, "search", "s2")
    assert [manager.lookup(key, reader) for key in keys] == [HIT] * 3
    sharded_load(sharded, req, chunks, reader, job_id=3)
    manager.stack.manager.wait_idle()
    # Nothing of the torn store reached the file tier: only the whole tenant's chunks.
    lower = manager.stack.tenants.usage()[manager.stack.tiers[1].name]
    assert lower["batch"] == 0 and lower["search"] > 0

    # A tenant's store of keys nobody else holds, rank 0 failing: published for no one.
    other = make_request(3, first_block=36)
    solo = started(manager, "search", "s3")
    sharded_store(sharded, other, [range(0, 1), range(0, 0)], solo, job_id=4,
                  failing_rank=0)
    assert manager.torn_chunks == 4
    for tenant in ("search", "batch", None):
        assert manager.lookup(other.keys[0][0], started(manager, tenant, f"{tenant}-o")) is MISS

    # Stored again with both ranks well, the torn tenant's chunks are published.
    batch = started(manager, "batch", "b3")
    sharded_store(sharded, theirs, chunks, batch, job_id=5)
    assert manager.torn_chunks == 4
    reader = started(manager, "batch", "b4")
    assert [manager.lookup(key, reader) for key in keys] == [HIT] * 3
    sharded_load(sharded, theirs, chunks, reader, job_id=6)


def test_salt_selected_tenants_warn_that_vllm_names_tenants_by_params(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    salted = {"members": [{"name": "search", "salts": ["s"]}]}
    with caplog.at_level(logging.WARNING, "kvtiers.integrations.vllm.tenants"):
        manager = OffloadingSpecFactory.create_spec(
            config(tmp_path / "kv", salted, lower=False)).get_manager()
    manager.shutdown()
    assert any("cache_salt" in r.getMessage() and "kvtiers_tenant" in r.getMessage()
               for r in caplog.records)
