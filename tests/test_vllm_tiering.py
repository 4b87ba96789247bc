"""KVTiersFileTier / KVTiersS3Tier under vLLM's real ``TieringOffloadingManager`` (each
supported release: 0.32, 0.33, 0.34).

vLLM's ``TieringOffloadingSpec`` builds its own CPU primary (a shared-memory region) and
loads the kvtiers tier from ``secondary_tiers``. The tests play vLLM's GPU worker by
writing chunk bytes into the primary rows ``prepare_store`` hands out, let vLLM cascade
them into the kvtiers tier, and check that vLLM promotes the chunks back with every byte
intact: into a second engine over the same storage, and into the same engine once its
primary evicted them. On vLLM 0.34 a promotion past the tier's ``promotion_deadline_s``
fails and vLLM holds its rows until the tier's copies ended.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
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

from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.compat import JOB_RESULT_DEFERS_RELEASE
from kvtiers.integrations.vllm.tiers import _KVTiersSecondaryTier
from kvtiers.testing.s3 import BUCKET, MotoServer

F = 2
WORKER_BYTES_PER_BLOCK = 1000
CHUNK_BYTES = WORKER_BYTES_PER_BLOCK * F
NO_STEP_CONTEXT = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
ROW_BYTES = 4096  # vLLM's primary row of one chunk, aligned


def tiering_manager(tier: dict[str, Any], *, cpu_bytes: int = 1 << 20) -> Any:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",), group_id=0),),
        worker_kv_bytes_per_block=WORKER_BYTES_PER_BLOCK,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
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
    assert isinstance(manager.secondary_tiers[0], _KVTiersSecondaryTier)
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


def store_through_primary(manager: Any, keys: list[Any], payloads: list[np.ndarray],
                          req_id: str) -> None:
    """One request stores ``keys`` (vLLM's GPU worker writing ``payloads`` into the rows
    the primary hands out), finishes, and its chunks are cascaded into the tier."""
    ctx = vbase.ReqContext(req_id=req_id)
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    assert list(out.keys_to_store) == keys
    rows = primary_rows(manager)
    for chunk, payload in zip(out.store_spec.block_ids, payloads, strict=True):
        rows[chunk, :CHUNK_BYTES] = payload
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)
    settle(manager)


def chunks(seed: int, count: int) -> tuple[list[Any], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    keys = [vbase.make_offload_key(rng.bytes(16), 0) for _ in range(count)]
    return keys, [rng.integers(-128, 128, CHUNK_BYTES, dtype=np.int8) for _ in keys]


class BlockedLoads:
    """Holds every load copy of a kvtiers tier's mover until :meth:`release` (a copy that
    is still running); stores copy as usual."""

    def __init__(self, tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self._gate = threading.Event()
        self._copy: Callable[[Any, Any], int] = tier._mover._copy
        monkeypatch.setattr(tier._mover, "_copy", self._held_copy)

    def _held_copy(self, job: Any, chunk: Any) -> int:
        if not job.store:
            self._gate.wait()
        return self._copy(job, chunk)

    def release(self) -> None:
        self._gate.set()


@pytest.fixture(params=["file", "s3"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    base = {"module_path": "kvtiers.integrations.vllm", "threads": 2}
    if request.param == "file":
        return {**base, "type": "KVTiersFileTier", "root": str(tmp_path), "io": "posix"}
    s3: MotoServer = request.getfixturevalue("s3_endpoint")
    return {**base, "type": "KVTiersS3Tier", "bucket": BUCKET, "endpoint_url": s3.endpoint_url}


def test_cascade_then_warm_promotion_in_a_new_engine(tier: dict[str, Any]) -> None:
    keys, payloads = chunks(0, 3)
    cold = tiering_manager(tier)
    try:
        store_through_primary(cold, keys, payloads, "cold")
        for key in keys:
            assert cold.secondary_tiers[0].lookup(key, vbase.ReqContext(req_id="cold")) is (
                vbase.LookupResult.HIT
            )
    finally:
        cold.shutdown()

    warm = tiering_manager(tier)
    warm.secondary_tiers[0].manager.wait_index()  # the cold engine's chunks are indexed
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


def test_chunks_the_primary_evicted_are_promoted_back_byte_exact(tier: dict[str, Any]) -> None:
    # A primary of four rows: storing four more chunks evicts the first three, which then
    # live in the kvtiers tier only.
    manager = tiering_manager(tier, cpu_bytes=4 * ROW_BYTES)
    try:
        first, payloads = chunks(1, 3)
        store_through_primary(manager, first, payloads, "first")
        store_through_primary(manager, *chunks(2, 4), "second")
        ctx = vbase.ReqContext(req_id="again")
        manager.on_new_request(ctx)
        for key in first:
            assert manager.primary_tier.lookup(key, ctx) is vbase.LookupResult.MISS
            assert manager.lookup(key, ctx) is vbase.LookupResult.HIT_PENDING
        manager.on_schedule_end(NO_STEP_CONTEXT)  # submits the promotion
        settle(manager)
        for key in first:
            assert manager.lookup(key, ctx) is vbase.LookupResult.HIT
        spec = manager.prepare_load(first, ctx)
        rows = primary_rows(manager)
        for chunk, payload in zip(spec.block_ids, payloads, strict=True):
            assert np.array_equal(rows[chunk, :CHUNK_BYTES], payload)
        manager.complete_load(first, ctx)
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()


def test_a_late_promotion_fails_and_vllm_holds_its_rows_until_the_copies_end(
    tier: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    late = {**tier, "promotion_deadline_s": 5}
    if not JOB_RESULT_DEFERS_RELEASE:
        # vLLM 0.32 / 0.33 cannot hold a failed promotion's rows: the option is refused.
        with pytest.raises(ConfigError, match=r"needs vLLM 0\.34"):
            tiering_manager(late)
        return
    manager = tiering_manager(late, cpu_bytes=4 * ROW_BYTES)
    kvtiers_tier = manager.secondary_tiers[0]
    loads = BlockedLoads(kvtiers_tier, monkeypatch)
    try:
        now = [0.0]
        kvtiers_tier.clock = kvtiers_tier.manager.backoff.clock = lambda: now[0]
        first, payloads = chunks(3, 3)
        store_through_primary(manager, first, payloads, "first")
        store_through_primary(manager, *chunks(4, 4), "second")
        ctx = vbase.ReqContext(req_id="again")
        manager.on_new_request(ctx)
        for key in first:
            assert manager.lookup(key, ctx) is vbase.LookupResult.HIT_PENDING
        manager.on_schedule_end(NO_STEP_CONTEXT)  # submits the promotion; its copies wait
        for key in first:
            assert manager.lookup(key, ctx) is vbase.LookupResult.HIT_PENDING
        manager.on_schedule_end(NO_STEP_CONTEXT)
        assert manager.primary_tier.num_deferred_release_chunks == 0

        now[0] = 5.0  # the deadline passes with every copy still running
        manager.on_schedule_end(NO_STEP_CONTEXT)
        # vLLM failed the promotion (the keys are gone from its primary, and the tier backs
        # them off: the request recomputes them) but keeps the three rows out of its free
        # pool while the copies may still write them.
        assert manager.primary_tier.num_deferred_release_chunks == 3
        for key in first:
            assert manager.lookup(key, ctx) is vbase.LookupResult.MISS
        manager.on_schedule_end(NO_STEP_CONTEXT)
        assert manager.primary_tier.num_deferred_release_chunks == 3
        assert manager.has_pending_work()

        loads.release()
        settle(manager)
        assert manager.primary_tier.num_deferred_release_chunks == 0
        manager.on_request_finished(ctx)
        # vLLM's reset drains every tier and asserts no release is still deferred.
        manager.reset_cache()
    finally:
        loads.release()
        manager.shutdown()
