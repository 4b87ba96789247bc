"""KVTiersOffloadingSpec driven through vLLM 0.33.0's own classes.

The spec is created by vLLM's ``OffloadingSpecFactory`` from a real vLLM
``OffloadingConfig`` with two KV-cache groups of different ``tokens_per_block`` (group ids
0 and 2, so keys are rewritten at the boundary) and ``blocks_per_chunk`` 2. As in vLLM,
the scheduler and the worker each get their own spec instance, and specs travel between
them pickled; one test runs the worker in a spawned process of its own. KV tensors are
CPU tensors shared by both groups' layers, the way vLLM's hybrid allocator shares them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.integrations.vllm import KVTiersOffloadingSpec, translate
from kvtiers.integrations.vllm.worker import shared_memory_name

F = 2  # blocks_per_chunk
TOKENS_PER_HASH = 16
TOKENS_PER_BLOCK = (16, 32)
GROUP_IDS = (0, 2)
PAGE_BYTES = 256
NUM_BLOCKS = 64
NUM_TOKENS = 128  # 8 block hashes; group 0: 8 blocks / 4 chunks, group 1: 4 blocks / 2 chunks


def vllm_config(
    root: Path, *, engine_id: str | None = None, world_size: int = 1, **extra: Any
) -> OffloadingConfig:
    stack = {
        "tiers": [
            {"kind": "cpu", "capacity": "16KiB"},  # 4 slots of 4 KiB
            {"kind": "file", "root": str(root), "io": "posix", "threads": 2},
        ]
    }
    extra_config = {
        "spec_name": "KVTiersOffloadingSpec",
        "spec_module_path": "kvtiers.integrations.vllm",
        "kvtiers": stack,
        # Built outside a connector: no engine configs to read.
        "kvtiers_identity": "offloading-config-only",
        **extra,
    }
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(
                tokens_per_block=tpb, layer_names=(f"l{gid}.a", f"l{gid}.b"), group_id=gid
            )
            for tpb, gid in zip(TOKENS_PER_BLOCK, GROUP_IDS, strict=True)
        ),
        worker_kv_bytes_per_block=2 * PAGE_BYTES,
        enable_kv_cache_events=True,
        extra_config=extra_config,
        engine_id=engine_id or f"test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_HASH, blocks_per_chunk=F),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=world_size, tp_size=world_size, pp_size=1, pcp_size=1,
            dcp_size=1, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=None, is_parallelism_agnostic=False,
        ),
    )


def canonical_kv(tensors: list[torch.Tensor], group_page_bytes: int = PAGE_BYTES) -> Any:
    """Two int8 tensors of (NUM_BLOCKS, PAGE_BYTES), each holding one layer of each group."""
    return vbase.CanonicalKVCaches(
        tensors=[vbase.CanonicalKVCacheTensor(t, PAGE_BYTES) for t in tensors],
        group_data_refs=[
            [vbase.CanonicalKVCacheRef(i, group_page_bytes) for i in range(len(tensors))]
            for _ in GROUP_IDS
        ],
    )


@dataclass
class Request:
    """One request's keys and GPU blocks, per group (index = position in the config)."""

    keys: list[list[bytes]]
    blocks: list[list[int]]


def make_request(seed: int, first_block: int) -> Request:
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(16) for _ in range(NUM_TOKENS // TOKENS_PER_HASH)]
    keys, blocks = [], []
    next_block = first_block
    for tpb, gid in zip(TOKENS_PER_BLOCK, GROUP_IDS, strict=True):
        hashes_per_chunk = tpb * F // TOKENS_PER_HASH
        keys.append([
            vbase.make_offload_key(hashes[(c + 1) * hashes_per_chunk - 1], gid)
            for c in range(NUM_TOKENS // (tpb * F))
        ])
        count = NUM_TOKENS // tpb
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    return Request(keys, blocks)


def ctx(req_id: str = "req") -> Any:
    return vbase.ReqContext(req_id=req_id)


def gpu_spec(parts: list[tuple[list[int], int]]) -> Any:
    """Packed GPU spec from per-group (block ids, block index of the first)."""
    ids = [b for blocks, _ in parts for b in blocks]
    return vbase.GPULoadStoreSpec(
        ids, group_sizes=[len(b) for b, _ in parts], block_indices=[i for _, i in parts]
    )


def run(worker: Any, job_id: int, submit: Any) -> None:
    assert submit(job_id)
    worker.wait({job_id})
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(job_id, True)]
    assert results[0].transfer_size and results[0].transfer_size > 0


def make_kv() -> list[torch.Tensor]:
    """The engine's KV tensors; every call (in any process) returns the same bytes."""
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE_BYTES), dtype=torch.int8, generator=gen)
        for _ in range(2)
    ]


@pytest.fixture
def kv() -> list[torch.Tensor]:
    return make_kv()


@pytest.fixture
def engine(tmp_path: Path, kv: list[torch.Tensor]) -> Iterator[tuple[Any, Any, Any]]:
    """(scheduler spec, its manager, the worker of a second spec instance)."""
    config = vllm_config(tmp_path / "kv")
    scheduler = OffloadingSpecFactory.create_spec(config)
    manager = scheduler.get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    yield scheduler, manager, worker
    worker.shutdown()
    manager.shutdown()


def store(manager: Any, worker: Any, req: Request, chunks: list[range], job_id: int) -> Any:
    """Store ``chunks[g]`` of each group; the spec crosses a pickle like vLLM's metadata."""
    keys = [req.keys[g][c] for g, rng in enumerate(chunks) for c in rng]
    out = manager.prepare_store(keys, ctx())
    assert out is not None and out.keys_to_store == keys
    gpu = gpu_spec([
        (req.blocks[g][rng.start * F : rng.stop * F], rng.start * F)
        for g, rng in enumerate(chunks)
    ])
    run(worker, job_id, lambda j: worker.submit_store(j, gpu, pickle.loads(pickle.dumps(
        out.store_spec))))
    manager.complete_store(keys, ctx())
    return out


def load_and_check(
    manager: Any, worker: Any, req: Request, kv: list[torch.Tensor], originals: list[torch.Tensor],
    first_blocks: list[int], job_id: int,
) -> None:
    """Load each group from logical block ``first_blocks[g]`` to its end into fresh GPU
    blocks and check every byte against the original blocks."""
    keys = [k for g, first in enumerate(first_blocks) for k in req.keys[g][first // F:]]
    src = manager.prepare_load(keys, ctx())
    dst_blocks = []
    next_free = NUM_BLOCKS - sum(len(req.blocks[g]) - f for g, f in enumerate(first_blocks))
    for g, first in enumerate(first_blocks):
        count = len(req.blocks[g]) - first
        dst_blocks.append(list(range(next_free, next_free + count)))
        next_free += count
    for t in kv:
        t[NUM_BLOCKS - 12 :] = 0
    gpu = gpu_spec([(dst_blocks[g], first) for g, first in enumerate(first_blocks)])
    run(worker, job_id, lambda j: worker.submit_load(j, pickle.loads(pickle.dumps(src)), gpu))
    manager.complete_load(keys, ctx())
    for g, first in enumerate(first_blocks):
        for src_block, dst_block in zip(req.blocks[g][first:], dst_blocks[g], strict=True):
            for t, original in zip(kv, originals, strict=True):
                assert torch.equal(t[dst_block], original[src_block]), (g, src_block)


def test_store_lookup_load_moves_exactly_the_right_bytes(
    engine: tuple[Any, Any, Any], kv: list[torch.Tensor]
) -> None:
    scheduler, manager, worker = engine
    assert isinstance(scheduler, KVTiersOffloadingSpec)
    req = make_request(1, first_block=0)
    originals = [t.clone() for t in kv]
    assert manager.on_new_request(ctx()).policy is vbase.OffloadPolicy.CHUNK_LEVEL

    # Chunks 1..3 of group 0 and chunk 1 of group 1: GPU blocks from index 2 on.
    store(manager, worker, req, [range(1, 4), range(1, 2)], job_id=1)
    for key in req.keys[0][1:] + req.keys[1][1:]:
        assert manager.lookup(key, ctx()) is vbase.LookupResult.HIT
    for key in (req.keys[0][0], req.keys[1][0]):
        assert manager.lookup(key, ctx()) is vbase.LookupResult.MISS

    # Unaligned start in group 0 (block 3: skip the first sub-block of chunk 1).
    load_and_check(manager, worker, req, kv, originals, first_blocks=[3, 2], job_id=2)
    stored = [e for e in manager.take_events() if not e.removed]
    assert [k for e in stored for k in e.keys] == req.keys[0][1:] + req.keys[1][1:]
    manager.on_request_finished(ctx())


def test_a_store_that_evicts_reports_the_evicted_keys(
    engine: tuple[Any, Any, Any], kv: list[torch.Tensor]
) -> None:
    scheduler, manager, worker = engine
    first, second = make_request(1, first_block=0), make_request(2, first_block=12)
    store(manager, worker, first, [range(0, 3), range(0, 1)], job_id=1)  # fills 4 slots
    manager.stack.manager.wait_idle()  # cascades release their pins on the primary
    manager.take_events()
    out = store(manager, worker, second, [range(0, 1), range(0, 1)], job_id=2)
    assert len(out.evicted_keys) == 2
    assert set(out.evicted_keys) <= set(first.keys[0][:3] + first.keys[1][:1])
    removed = [k for e in manager.take_events() if e.removed and e.ownership is None
               for k in e.keys]
    assert removed == out.evicted_keys
    primary = manager.stack.tiers[0].manager
    for key in out.evicted_keys:
        assert primary.slot_of(scheduler.keys.to_kvtiers(key)) is None


def test_removals_outside_a_store_reach_the_next_store_output(
    engine: tuple[Any, Any, Any],
) -> None:
    _, manager, worker = engine
    req = make_request(1, first_block=0)
    held = req.keys[0][:3] + req.keys[1][:1]
    store(manager, worker, req, [range(0, 3), range(0, 1)], job_id=1)  # fills 4 slots
    manager.stack.manager.wait_idle()  # cascades release their pins on the primary
    manager.reset_cache()  # the primary drops all four; no store is under way to report it
    removed = [k for e in manager.take_events() if e.removed and e.ownership is None
               for k in e.keys]
    assert sorted(removed) == sorted(held)
    # Stored again, the first two are no longer evicted; the other two are, exactly once.
    out = store(manager, worker, req, [range(0, 2), range(0, 0)], job_id=2)
    assert out.evicted_keys == [k for k in removed if k not in req.keys[0][:2]]
    out = store(manager, worker, req, [range(2, 3), range(0, 0)], job_id=3)
    assert out.evicted_keys == []


def test_a_new_engine_over_the_same_root_hits_warm(
    tmp_path: Path, kv: list[torch.Tensor]
) -> None:
    root = tmp_path / "kv"
    req = make_request(3, first_block=0)
    originals = [t.clone() for t in kv]
    config = vllm_config(root)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    store(manager, worker, req, [range(0, 2), range(0, 1)], job_id=1)
    manager.stack.manager.wait_idle()  # cascades to the file tier are written
    worker.shutdown()
    manager.shutdown()

    config = vllm_config(root)  # a new engine id: new primary memory
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    manager.stack.wait_index()  # the restart's index is built in the background
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    try:
        keys = req.keys[0][:2] + req.keys[1][:1]
        for key in keys:
            assert manager.lookup(key, ctx()) is vbase.LookupResult.HIT_PENDING
        manager.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        manager.stack.manager.wait_idle()
        for key in keys:
            assert manager.lookup(key, ctx()) is vbase.LookupResult.HIT
        for t in kv:
            t.zero_()
        src = manager.prepare_load(keys, ctx())
        dst = [[40, 41, 42, 43], [50, 51]]
        run(worker, 9, lambda j: worker.submit_load(j, src, gpu_spec([(dst[0], 0), (dst[1], 0)])))
        for g, blocks in enumerate(dst):
            for src_block, dst_block in zip(req.blocks[g][: len(blocks)], blocks, strict=True):
                for t, original in zip(kv, originals, strict=True):
                    assert torch.equal(t[dst_block], original[src_block])
    finally:
        worker.shutdown()
        manager.shutdown()


def test_identity_is_translated_from_vllm(tmp_path: Path) -> None:
    spec = OffloadingSpecFactory.create_spec(
        vllm_config(tmp_path, model_revision="abc123", kvtiers_salt="blue")
    )
    identity = NamespaceIdentity.from_config(spec.offloading)
    assert (identity.engine, identity.model_name, identity.model_revision) == (
        "vllm", "org/model", "abc123"
    )
    # vLLM reported no resolved layout: the identity says so rather than guess one.
    assert (identity.kv_dtype, identity.kv_layout, identity.salt) == (
        "bfloat16", "unresolved", "blue"
    )
    assert identity.hash_algorithm == "vllm:sha256"
    assert [(g.tokens_per_block, g.bytes_per_block, g.layer_names) for g in identity.groups] == [
        (16, 512, ("l0.a", "l0.b")), (32, 512, ("l2.a", "l2.b"))
    ]
    assert (identity.tokens_per_hash, identity.blocks_per_chunk) == (TOKENS_PER_HASH, F)
    other = OffloadingSpecFactory.create_spec(
        vllm_config(tmp_path, prefix_caching_hash_algo="sha256_cbor")
    )
    assert NamespaceIdentity.from_config(other.offloading).digest != identity.digest


def test_unstable_block_hashes_warn_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(translate, "_warned_unstable", False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING, logger=translate.__name__):
        for _ in range(2):
            OffloadingSpecFactory.create_spec(
                vllm_config(tmp_path, prefix_caching_hash_algo="xxhash")
            )
    warnings = [r for r in caplog.records if "PYTHONHASHSEED" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("algorithm", "seed", "stable"),
    [("sha256", None, True), ("sha256_cbor", None, True), ("xxhash", None, False),
     ("xxhash_cbor", None, False), ("xxhash", "0", True)],
)
def test_which_hash_settings_are_stable(
    monkeypatch: pytest.MonkeyPatch, algorithm: str, seed: str | None, stable: bool
) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    assert translate.hashes_stable_across_processes(algorithm) is stable


def test_worker_rejects_tensors_the_scheduler_did_not_expect(
    tmp_path: Path, kv: list[torch.Tensor]
) -> None:
    config = vllm_config(tmp_path)
    spec = OffloadingSpecFactory.create_spec(config)
    with pytest.raises(ConfigError, match=r"kvtiers_group_bytes_per_block: \[400, 400\]"):
        spec.get_worker(canonical_kv(kv, group_page_bytes=200))
    fixed = replace(config, extra_config={
        **config.extra_config, "kvtiers_group_bytes_per_block": [400, 400]
    })
    worker = OffloadingSpecFactory.create_spec(fixed).get_worker(
        canonical_kv(kv, group_page_bytes=200)
    )
    worker.shutdown()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"world_size": 2, "kvtiers": {"tiers": [
                {"kind": "file", "root": "/nonexistent/kv", "gds": True}
            ]}},
            "with 2 ranks .* the first tier must be a cpu or service tier",
        ),
        ({"kvtiers_config": "stack.yaml"}, "exactly one of kvtiers_config"),
        ({"prefix_caching_hash_algo": "md5"}, "unknown block-hash algorithm"),
        ({"kvtiers_group_bytes_per_block": [1]}, "expected 2 positive integers"),
    ],
)
def test_bad_settings_fail_at_start_up(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        OffloadingSpecFactory.create_spec(vllm_config(tmp_path, **change))


def _store_in_a_worker_process(
    config: OffloadingConfig, job_id: int, gpu: Any, store_spec: Any
) -> list[tuple[int, bool]]:
    """Worker side, in a spawned process: store ``gpu``'s blocks of :func:`make_kv`."""
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(make_kv()))
    try:
        assert worker.submit_store(job_id, gpu, store_spec)
        worker.wait({job_id})
        return [(r.job_id, r.success) for r in worker.get_finished()]
    finally:
        worker.shutdown()


def test_worker_in_its_own_process_attaches_to_the_shared_primary(
    tmp_path: Path, kv: list[torch.Tensor]
) -> None:
    config = vllm_config(tmp_path)
    scheduler = OffloadingSpecFactory.create_spec(config)
    name = scheduler.stack_config.tiers[0].shared_memory_name
    assert name == shared_memory_name(config.engine_id)
    assert name.startswith(f"kvtiers-{os.geteuid()}-") and config.engine_id not in name
    manager = scheduler.get_manager()
    assert os.path.exists(f"/dev/shm/{name}")
    req = make_request(4, first_block=0)
    keys = req.keys[0][:2] + req.keys[1][:1]
    out = manager.prepare_store(keys, ctx())
    assert out is not None and out.keys_to_store == keys
    gpu = gpu_spec([(req.blocks[0][:4], 0), (req.blocks[1][:2], 0)])
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        results = pool.apply(_store_in_a_worker_process, (config, 1, gpu, out.store_spec))
    assert results == [(1, True)]
    manager.complete_store(keys, ctx())
    assert os.path.exists(f"/dev/shm/{name}")  # the worker process only attached to it

    # The bytes the other process wrote reach this process's engine through the primary.
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    try:
        originals = [t.clone() for t in kv]
        for t in kv:
            t.zero_()
        src = manager.prepare_load(keys, ctx())
        dst = [[40, 41, 42, 43], [50, 51]]
        run(worker, 2, lambda j: worker.submit_load(j, src, gpu_spec([(dst[0], 0), (dst[1], 0)])))
        manager.complete_load(keys, ctx())
        for g, blocks in enumerate(dst):
            for src_block, dst_block in zip(req.blocks[g][: len(blocks)], blocks, strict=True):
                for t, original in zip(kv, originals, strict=True):
                    assert torch.equal(t[dst_block], original[src_block]), (g, src_block)
    finally:
        worker.shutdown()
    assert os.path.exists(f"/dev/shm/{name}")  # the creator (the scheduler) still maps it
    manager.shutdown()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_requests_key_positions_are_the_end_tokens_vllm_recorded(tmp_path: Path) -> None:
    """The cost model places chunks by where they end in the prompt: the contexts the
    adapter hands the stack read vLLM's record, through the key map (group ids 0 and 2
    are positions 0 and 1)."""
    req = make_request(5, first_block=0)
    vctx = ctx()
    ends = {}
    for g, group_keys in enumerate(req.keys):
        for c, key in enumerate(group_keys):
            ends[key] = (c + 1) * TOKENS_PER_BLOCK[g] * F
            vctx.set_offload_key_position(key, ends[key])
    keys = translate.KeyMap(GROUP_IDS)
    ours = translate.kvtiers_context(vctx, keys)
    assert ours.key_position is not None
    for key, end in ends.items():
        assert ours.key_position(keys.to_kvtiers(key)) == end
    manager = OffloadingSpecFactory.create_spec(vllm_config(tmp_path / "kv")).get_manager()
    seen: list[Any] = []
    composite = manager.stack.manager
    real_lookup, real_new = composite.lookup, composite.on_new_request

    def lookup(key: Any, c: Any) -> Any:
        seen.append(c)
        return real_lookup(key, c)

    def on_new_request(c: Any) -> Any:
        seen.append(c)
        return real_new(c)

    composite.lookup = lookup
    composite.on_new_request = on_new_request
    try:
        key = req.keys[1][1]
        manager.lookup(key, vctx)  # not announced yet
        manager.on_new_request(vctx)
        manager.lookup(key, vctx)
        assert len(seen) == 3
        for c in seen:
            assert c.key_position is not None and c.key_position(keys.to_kvtiers(key)) == ends[key]
    finally:
        manager.shutdown()
