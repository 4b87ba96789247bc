"""KVTiersFileTier / KVTiersS3Tier under vLLM 0.33.0's real ``TieringOffloadingManager``.

vLLM's ``TieringOffloadingSpec`` builds its own CPU primary (a shared-memory region) and
loads the kvtiers tier from ``secondary_tiers``. The test plays vLLM's GPU worker by
writing chunk bytes into the primary rows ``prepare_store`` hands out, lets vLLM cascade
them into the kvtiers tier, then starts a second engine over the same storage and checks
that vLLM promotes the chunks back with every byte intact.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from kvtiers.integrations.vllm import KVTiersFileTier, KVTiersS3Tier
from kvtiers.testing.s3 import BUCKET, MotoServer

F = 2
WORKER_BYTES_PER_BLOCK = 1000
CHUNK_BYTES = WORKER_BYTES_PER_BLOCK * F
NO_STEP_CONTEXT = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def tiering_manager(tier: dict[str, Any]) -> Any:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",), group_id=0),),
        worker_kv_bytes_per_block=WORKER_BYTES_PER_BLOCK,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [tier],
            # Built outside a connector: no engine configs to read.
            "kvtiers_identity": "offloading-config-only",
        },
        engine_id=f"test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="org/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=F),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    assert isinstance(manager.secondary_tiers[0], (KVTiersFileTier, KVTiersS3Tier))
    return manager


def settle(manager: Any) -> None:
    """Step the engine until no transfer is in flight (each tier drained, then polled)."""
    for _ in range(10):
        if not manager.has_pending_work():
            return
        for tier in manager.secondary_tiers:
            tier.drain_jobs()
        manager.on_schedule_end(NO_STEP_CONTEXT)
    raise AssertionError("transfers still pending after 10 steps")


def primary_rows(manager: Any) -> np.ndarray:
    return np.asarray(manager.primary_tier.get_kv_memoryview())


@pytest.fixture(params=["file", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    base = {"module_path": "kvtiers.integrations.vllm", "threads": 2}
    if request.param == "file":
        return {**base, "type": "KVTiersFileTier", "root": str(tmp_path), "io": "posix"}
    s3: MotoServer = request.getfixturevalue("s3_endpoint")
    return {**base, "type": "KVTiersS3Tier", "bucket": BUCKET, "endpoint_url": s3.endpoint_url}


def test_cascade_then_warm_promotion_in_a_new_engine(tier: dict[str, Any]) -> None:
    rng = np.random.default_rng(0)
    keys = [vbase.make_offload_key(rng.bytes(16), 0) for _ in range(3)]
    payloads = [rng.integers(-128, 128, CHUNK_BYTES, dtype=np.int8) for _ in keys]

    cold = tiering_manager(tier)
    try:
        ctx = vbase.ReqContext(req_id="cold")
        cold.on_new_request(ctx)
        out = cold.prepare_store(keys, ctx)
        rows = primary_rows(cold)
        for chunk, payload in zip(out.store_spec.block_ids, payloads, strict=True):
            rows[chunk, :CHUNK_BYTES] = payload  # what vLLM's GPU worker would write
        cold.complete_store(keys, ctx)
        cold.on_request_finished(ctx)
        settle(cold)
        for key in keys:
            assert cold.secondary_tiers[0].lookup(key, ctx) is vbase.LookupResult.HIT
    finally:
        cold.shutdown()

    warm = tiering_manager(tier)
    try:
        ctx = vbase.ReqContext(req_id="warm")
        warm.on_new_request(ctx)
        for key in keys:
            assert warm.lookup(key, ctx) is vbase.LookupResult.HIT_PENDING
        warm.on_schedule_end(NO_STEP_CONTEXT)  # submits the promotion
        settle(warm)
        for key in keys:
            assert warm.lookup(key, ctx) is vbase.LookupResult.HIT
        spec = warm.prepare_load(keys, ctx)
        rows = primary_rows(warm)
        for chunk, payload in zip(spec.block_ids, payloads, strict=True):
            assert np.array_equal(rows[chunk, :CHUNK_BYTES], payload)
        warm.complete_load(keys, ctx)
        warm.on_request_finished(ctx)
    finally:
        warm.shutdown()
