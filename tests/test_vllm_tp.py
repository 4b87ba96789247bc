"""Route 1 (``KVTiersOffloadingSpec``) with two tensor-parallel ranks on one node, driven
through vLLM's own classes.

The scheduler side (vLLM's ``OffloadingSpecFactory`` → ``get_manager``) runs in this
process. Each rank is a spawned process that builds its own spec from the engine's config
with its rank, and its worker over its own KV tensors: the ranks hold different bytes, as
tensor-parallel shards do, so a load that brings a rank another rank's shard fails the
byte checks. Specs cross the process boundary pickled, as vLLM's metadata does, and a job
is complete once both ranks reported it, as vLLM counts completions. The engine layout is
the one of ``tests/test_vllm_spec.py`` (two KV-cache groups, ids 0 and 2,
``blocks_per_chunk`` 2) with ``world_size`` 2.
"""

from __future__ import annotations

import multiprocessing
import traceback
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.filemapper import NamespaceIdentity
from tests.test_vllm_spec import (
    NUM_BLOCKS,
    PAGE_BYTES,
    F,
    Request,
    canonical_kv,
    ctx,
    gpu_spec,
    make_request,
    vllm_config,
)

RANKS = 2
#: Seconds a rank process may take to answer one command (start-up imports torch and
#: vLLM); a guard against a hung rank, never a measurement.
RANK_REPLY_S = 300

# A test starts rank processes up to twice, each importing torch and vLLM: on a loaded
# 2-core machine that alone has taken longer than the suite's 300 s default per test.
pytestmark = pytest.mark.timeout(3 * RANK_REPLY_S)


def rank_kv(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s KV tensors: the same bytes in every process, different per rank."""
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.int8, generator=gen)
        for _ in range(2)
    ]


def rank_config(config: OffloadingConfig, rank: int) -> OffloadingConfig:
    """``config`` as vLLM hands it to the worker of rank ``rank``."""
    return replace(config, parallel=replace(config.parallel, rank=rank))


def _serve(conn: Connection, config: OffloadingConfig) -> None:
    """A rank process: build the worker side, then run the parent's commands."""
    # Replicated KV (MLA's latent): every rank holds rank 0's bytes.
    replicated = config.extra_config.get("kvtiers_replicated_kv", False)
    kv = rank_kv(0 if replicated else config.parallel.rank)
    originals = [t.clone() for t in kv]
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    conn.send(("ok", None))
    while True:
        op, args = conn.recv()
        if op == "stop":
            worker.shutdown()
            conn.send(("ok", None))
            return
        if op == "store":
            job_id, gpu, spec, fail = args
            if fail:
                _fail_job(worker.worker, job_id)
            assert worker.submit_store(job_id, gpu, spec)
            worker.wait({job_id})
            conn.send(("ok", [(r.job_id, r.success) for r in worker.get_finished()]))
        elif op == "load":
            job_id, spec, gpu, pairs = args
            for t in kv:
                t[[dst for _, dst in pairs]] = 0
            assert worker.submit_load(job_id, spec, gpu)
            worker.wait({job_id})
            results = [(r.job_id, r.success) for r in worker.get_finished()]
            wrong = [
                (src, dst)
                for src, dst in pairs
                if not all(torch.equal(t[dst], o[src]) for t, o in zip(kv, originals, strict=True))
            ]
            conn.send(("ok", (results, wrong)))


def _fail_job(inner: Any, job_id: int) -> None:
    """Make the rank's kvtiers worker fail job ``job_id`` (its copy raises)."""
    execute = inner._execute

    def failing(job: Any) -> int:
        if job.job_id == job_id:
            raise OSError(f"injected failure of job {job_id}")
        return int(execute(job))

    inner._execute = failing


def _rank_main(conn: Connection, config: OffloadingConfig) -> None:
    try:
        _serve(conn, config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


class Ranks:
    """The rank processes of one engine."""

    def __init__(self, config: OffloadingConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(RANKS):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_rank_main, args=(child, rank_config(config, rank)), daemon=True
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank in range(RANKS):
            self._reply(rank)

    def _reply(self, rank: int) -> Any:
        conn = self._conns[rank]
        if not conn.poll(RANK_REPLY_S):
            raise AssertionError(f"rank {rank} did not answer within {RANK_REPLY_S} s")
        status, value = conn.recv()
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        return value

    def all(self, op: str, *args: Any, per_rank: dict[int, tuple[Any, ...]] | None = None
            ) -> list[Any]:
        """Send ``op`` to every rank (``per_rank[r]`` replaces ``args`` for rank ``r``);
        every rank's answer, by rank."""
        for rank, conn in enumerate(self._conns):
            conn.send((op, (per_rank or {}).get(rank, args)))
        return [self._reply(rank) for rank in range(RANKS)]

    def stop(self) -> None:
        self.all("stop")
        for proc in self._procs:
            proc.join()


@pytest.fixture
def started() -> Iterator[list[Ranks]]:
    """Rank processes the test starts; any still running at the end are stopped."""
    running: list[Ranks] = []
    yield running
    for ranks in running:
        for proc in ranks._procs:
            proc.kill()
            proc.join()


def store_on_ranks(
    manager: Any, ranks: Ranks, req: Request, chunks: list[range], job_id: int,
    failing_rank: int | None = None,
) -> list[Any]:
    """Store ``chunks[g]`` of each group on every rank, as vLLM does: one spec, every rank
    runs the job, ``complete_store`` once every rank reported it. The stored keys."""
    keys = [req.keys[g][c] for g, rng in enumerate(chunks) for c in rng]
    out = manager.prepare_store(keys, ctx())
    assert out is not None and out.keys_to_store == keys
    gpu = gpu_spec([
        (req.blocks[g][rng.start * F : rng.stop * F], rng.start * F)
        for g, rng in enumerate(chunks)
    ])
    results = ranks.all(
        "store", job_id, gpu, out.store_spec, False,
        per_rank={} if failing_rank is None else {
            failing_rank: (job_id, gpu, out.store_spec, True)
        },
    )
    # vLLM stops the engine on a failed job: a rank reports even a failed store finished.
    assert results == [[(job_id, True)]] * RANKS
    manager.complete_store(keys, ctx())
    return keys


def load_on_ranks(manager: Any, ranks: Ranks, req: Request, job_id: int) -> None:
    """Load the first two chunks of group 0 and the first of group 1 on every rank into
    fresh blocks; each rank checks every byte against its own original blocks."""
    keys = req.keys[0][:2] + req.keys[1][:1]
    src = manager.prepare_load(keys, ctx())
    dst = [[40, 41, 42, 43], [50, 51]]
    pairs = [
        (s, d) for g, blocks in enumerate(dst)
        for s, d in zip(req.blocks[g][: len(blocks)], blocks, strict=True)
    ]
    gpu = gpu_spec([(dst[0], 0), (dst[1], 0)])
    answers = ranks.all("load", job_id, src, gpu, pairs)
    manager.complete_load(keys, ctx())
    for rank, (results, wrong) in enumerate(answers):
        assert results == [(job_id, True)], rank
        assert wrong == [], f"rank {rank}: blocks (source, destination) differ: {wrong}"


def _step(manager: Any) -> None:
    manager.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    manager.stack.manager.wait_idle()


def _chunk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvc"))


def test_two_ranks_store_cascade_restart_promote_and_load_byte_exact(
    tmp_path: Path, started: list[Ranks]
) -> None:
    root = tmp_path / "kv"
    req = make_request(5, first_block=0)
    config = vllm_config(root, world_size=RANKS)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    ranks = Ranks(config)
    started.append(ranks)
    keys = store_on_ranks(manager, ranks, req, [range(0, 2), range(0, 1)], job_id=1)
    assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 3
    assert manager.torn_chunks == 0
    manager.stack.manager.wait_idle()  # the cascade wrote the file tier
    # One blob per chunk holding both ranks' shards: header + 2 ranks x 2 layers x F pages.
    files = _chunk_files(root)
    assert len(files) == 3
    assert {f.stat().st_size for f in files} == {HEADER_BYTES + RANKS * 2 * F * PAGE_BYTES}
    ranks.stop()
    started.remove(ranks)
    manager.shutdown()

    config = vllm_config(root, world_size=RANKS)  # a new engine id: new primary memory
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    manager.stack.wait_index()  # the restart's index is built in the background
    try:
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT_PENDING] * 3
        _step(manager)  # the promotions from the file tier land
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 3
        ranks = Ranks(config)
        started.append(ranks)
        load_on_ranks(manager, ranks, req, job_id=1)
        ranks.stop()
        started.remove(ranks)
    finally:
        manager.shutdown()


def test_replicated_kv_is_stored_once_and_every_rank_loads_that_copy(
    tmp_path: Path, started: list[Ranks]
) -> None:
    """MLA's latent is the same on every tensor-parallel rank: a chunk holds one copy
    (rank 0 writes it), and every rank loads it byte-exact, from the CPU tier and after a
    restart from the file tier."""
    root = tmp_path / "kv"
    req = make_request(5, first_block=0)
    config = vllm_config(root, world_size=RANKS, kvtiers_replicated_kv=True)
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    ranks = Ranks(config)
    started.append(ranks)
    keys = store_on_ranks(manager, ranks, req, [range(0, 2), range(0, 1)], job_id=1)
    assert manager.torn_chunks == 0
    load_on_ranks(manager, ranks, req, job_id=2)
    manager.stack.manager.wait_idle()
    # One copy per chunk: header + 2 layers x F pages (a sharded chunk holds RANKS times).
    files = _chunk_files(root)
    assert len(files) == 3
    assert {f.stat().st_size for f in files} == {HEADER_BYTES + 2 * F * PAGE_BYTES}
    ranks.stop()
    started.remove(ranks)
    manager.shutdown()

    config = vllm_config(root, world_size=RANKS, kvtiers_replicated_kv=True)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    manager.stack.wait_index()  # the restart's index is built in the background
    try:
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT_PENDING] * 3
        _step(manager)
        ranks = Ranks(config)
        started.append(ranks)
        load_on_ranks(manager, ranks, req, job_id=1)
        ranks.stop()
        started.remove(ranks)
    finally:
        manager.shutdown()


def test_replicated_kv_is_chosen_for_mla_and_refused_beside_other_sharding() -> None:
    from types import SimpleNamespace

    from kvtiers.errors import ConfigError
    from kvtiers.integrations.vllm.spec import replicated_kv

    tp2 = SimpleNamespace(world_size=2, pp_size=1, dcp_size=1, pcp_size=1)
    mla = SimpleNamespace(vllm=SimpleNamespace(model_config=SimpleNamespace(use_mla=True)))
    gqa = SimpleNamespace(vllm=SimpleNamespace(model_config=SimpleNamespace(use_mla=False)))
    assert replicated_kv({}, mla, tp2)
    assert not replicated_kv({}, gqa, tp2)
    assert not replicated_kv({}, None, tp2)
    assert not replicated_kv({"kvtiers_replicated_kv": False}, mla, tp2)
    assert replicated_kv({"kvtiers_replicated_kv": True}, None, tp2)
    one = SimpleNamespace(world_size=1, pp_size=1, dcp_size=1, pcp_size=1)
    assert not replicated_kv({}, mla, one)
    for other in ({"pp_size": 2}, {"dcp_size": 2}):
        par = SimpleNamespace(**{**vars(tp2), **other})
        assert not replicated_kv({}, mla, par)
        with pytest.raises(ConfigError, match="tensor parallelism alone"):
            replicated_kv({"kvtiers_replicated_kv": True}, None, par)
    with pytest.raises(ConfigError, match="true or false"):
        replicated_kv({"kvtiers_replicated_kv": "yes"}, None, tp2)


def test_one_ranks_failed_store_publishes_no_chunk(
    tmp_path: Path, started: list[Ranks]
) -> None:
    root = tmp_path / "kv"
    req = make_request(6, first_block=0)
    config = vllm_config(root, world_size=RANKS)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    ranks = Ranks(config)
    started.append(ranks)
    try:
        manager.take_events()
        keys = store_on_ranks(
            manager, ranks, req, [range(0, 2), range(0, 1)], job_id=1, failing_rank=1
        )
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.MISS] * 3
        assert manager.torn_chunks == 3
        manager.stack.manager.wait_idle()
        assert _chunk_files(root) == []  # nothing cascaded
        assert not [e for e in manager.take_events() if not e.removed]  # nothing announced
        primary = manager.stack.tiers[0].manager
        stats = primary.get_stats()
        assert (stats["chunks"], stats["store_failures"]) == (0, 3)

        # Stored again with both ranks well, the chunks are published and load on both.
        store_on_ranks(manager, ranks, req, [range(0, 2), range(0, 1)], job_id=2)
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT] * 3
        assert manager.torn_chunks == 3
        manager.stack.manager.wait_idle()
        assert len(_chunk_files(root)) == 3
        load_on_ranks(manager, ranks, req, job_id=3)
        ranks.stop()
        started.remove(ranks)
    finally:
        manager.shutdown()


def test_a_tensor_parallel_change_is_a_cold_miss(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    req = make_request(7, first_block=0)
    tp2 = OffloadingSpecFactory.create_spec(vllm_config(root, world_size=RANKS))
    manager = tp2.get_manager()
    workers = [
        OffloadingSpecFactory.create_spec(rank_config(tp2.config, r)).get_worker(
            canonical_kv(rank_kv(r))
        )
        for r in range(RANKS)
    ]
    try:
        keys = req.keys[0][:2]
        out = manager.prepare_store(keys, ctx())
        gpu = gpu_spec([(req.blocks[0][: 2 * F], 0), ([], 0)])
        for job_worker in workers:
            assert job_worker.submit_store(1, gpu, out.store_spec)
            job_worker.wait({1})
            assert [r.success for r in job_worker.get_finished()] == [True]
        manager.complete_store(keys, ctx())
        manager.stack.manager.wait_idle()
        assert len(_chunk_files(root)) == 2
    finally:
        for job_worker in workers:
            job_worker.shutdown()
        manager.shutdown()

    tp1 = OffloadingSpecFactory.create_spec(vllm_config(root))
    assert (
        NamespaceIdentity.from_config(tp1.offloading).namespace
        != NamespaceIdentity.from_config(tp2.offloading).namespace
    )
    manager = tp1.get_manager()
    try:
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.MISS] * 2
    finally:
        manager.shutdown()


def _agnostic(config: OffloadingConfig, bytes_per_block: int) -> OffloadingConfig:
    """``config`` with vLLM reporting a parallelism-agnostic layout and the opt-in set."""
    return replace(
        config,
        worker_kv_bytes_per_block=bytes_per_block,
        extra_config={**config.extra_config, "kvtiers_parallel_agnostic": True},
        parallel=replace(config.parallel, is_parallelism_agnostic=True),
    )


def test_with_the_opt_in_one_rank_loads_what_two_ranks_stored(tmp_path: Path) -> None:
    """Head shards: a one-rank engine's page of a block is the two ranks' pages side by
    side. With the opt-in, the one-rank engine shares the namespace and loads exactly
    those bytes from the chunks two ranks stored."""
    root = tmp_path / "kv"
    req = make_request(8, first_block=0)
    tp2 = OffloadingSpecFactory.create_spec(
        _agnostic(vllm_config(root, world_size=RANKS), 2 * PAGE_BYTES)
    )
    manager = tp2.get_manager()
    shards = [rank_kv(r) for r in range(RANKS)]
    workers = [
        OffloadingSpecFactory.create_spec(rank_config(tp2.config, r)).get_worker(
            canonical_kv(shards[r])
        )
        for r in range(RANKS)
    ]
    keys = req.keys[0][:2]
    try:
        out = manager.prepare_store(keys, ctx())
        gpu = gpu_spec([(req.blocks[0][: 2 * F], 0), ([], 0)])
        for job_worker in workers:
            assert job_worker.submit_store(1, gpu, out.store_spec)
            job_worker.wait({1})
            assert [r.success for r in job_worker.get_finished()] == [True]
        manager.complete_store(keys, ctx())
        manager.stack.manager.wait_idle()
    finally:
        for job_worker in workers:
            job_worker.shutdown()
        manager.shutdown()

    tp1 = OffloadingSpecFactory.create_spec(_agnostic(vllm_config(root), 4 * PAGE_BYTES))
    assert (
        NamespaceIdentity.from_config(tp1.offloading).namespace
        == NamespaceIdentity.from_config(tp2.offloading).namespace
    )
    whole = [torch.cat([shards[0][t], shards[1][t]], dim=1) for t in range(2)]
    expected = [t.clone() for t in whole]
    kv = vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, 2 * PAGE_BYTES) for t in whole],
        group_data_refs=[[vbase.CanonicalKVCacheRef(i, 2 * PAGE_BYTES) for i in range(2)]] * 2,
    )
    manager = tp1.get_manager()
    manager.stack.wait_index()  # the restart's index is built in the background
    worker = tp1.get_worker(kv)
    try:
        assert [manager.lookup(k, ctx()) for k in keys] == [vbase.LookupResult.HIT_PENDING] * 2
        _step(manager)
        src = manager.prepare_load(keys, ctx())
        dst = [40, 41, 42, 43]
        assert worker.submit_load(2, src, gpu_spec([(dst, 0), ([], 0)]))
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True]
        for s, d in zip(req.blocks[0][: 2 * F], dst, strict=True):
            for t, original in zip(whole, expected, strict=True):
                assert torch.equal(t[d], original[s]), (s, d)
    finally:
        worker.shutdown()
        manager.shutdown()


def test_pipeline_stages_keep_the_parallel_sizes_despite_the_opt_in(tmp_path: Path) -> None:
    """Pipeline stages hold different layers, interleaved in a chunk by rank: such chunks
    are never another layout's, whatever vLLM reports."""
    config = _agnostic(vllm_config(tmp_path, world_size=RANKS), 2 * PAGE_BYTES)
    staged = replace(config, parallel=replace(config.parallel, tp_size=1, pp_size=RANKS))
    spec = OffloadingSpecFactory.create_spec(staged)
    assert spec.offloading.parallel.is_parallelism_agnostic is False
    assert OffloadingSpecFactory.create_spec(config).offloading.parallel.is_parallelism_agnostic
