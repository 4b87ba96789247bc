"""vLLM 0.33's offloading-manager contract points, checked on the route-1 manager (a kvtiers
stack behind ``KVTiersOffloadingSpec``) beside vLLM's own ``CPUOffloadingManager``, and on
the route-2 secondary tiers.

The manager is driven as vLLM's connector drives it: one ``ReqContext`` per request with
the end-token position of every key recorded, a job's keys handed back to
``complete_store`` / ``complete_load`` as a set, no ``touch``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
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
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import ReqContext
from kvtiers.integrations.vllm import KVTiersDirectManager, compat
from kvtiers.integrations.vllm.compat import HAS_METADATA_ONLY
from kvtiers.policies import load_policy
from kvtiers.tiers.cpu.manager import CpuTierManager

TOKENS_PER_CHUNK = 16
BLOCK_BYTES = 64  # one block per chunk
SLOT_BYTES = 4096  # the CPU tier's slot: a chunk rounded up to a page


def route1_config(
    tiers: list[dict[str, Any]], *, events: bool = True, engine_id: str | None = None
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES,
        enable_kv_cache_events=events,
        extra_config={
            "spec_name": "KVTiersOffloadingSpec",
            "spec_module_path": "kvtiers.integrations.vllm",
            "kvtiers": {"tiers": tiers},
            # Built outside a connector: no engine configs to read.
            "kvtiers_identity": "offloading-config-only",
        },
        engine_id=engine_id or f"contract-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def route1(chunks: int, policy: str, **more: Any) -> Any:
    tier = {"kind": "cpu", "capacity": chunks * SLOT_BYTES, "policy": policy}
    return OffloadingSpecFactory.create_spec(route1_config([tier], **more)).get_manager()


def vllm_manager(chunks: int, policy: str) -> Any:
    return CPUOffloadingManager(chunks, cache_policy=policy, enable_events=True)


def prefix(seed: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [vbase.make_offload_key(rng.bytes(16), 0) for _ in range(count)]


def request(manager: Any, req_id: str, keys: list[bytes]) -> Any:
    """A new request whose keys sit at consecutive chunk positions, head first."""
    ctx = vbase.ReqContext(req_id=req_id)
    for index, key in enumerate(keys):
        ctx.set_offload_key_position(key, (index + 1) * TOKENS_PER_CHUNK)
    manager.on_new_request(ctx)
    return ctx


def store(manager: Any, req_id: str, keys: list[bytes]) -> None:
    ctx = request(manager, req_id, keys)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and list(out.keys_to_store) == keys
    manager.complete_store(set(out.keys_to_store), ctx)
    manager.on_request_finished(ctx)


def load(manager: Any, req_id: str, keys: list[bytes]) -> None:
    ctx = request(manager, req_id, keys)
    assert [manager.lookup(key, ctx) for key in keys] == [vbase.LookupResult.HIT] * len(keys)
    manager.prepare_load(keys, ctx)
    manager.complete_load(set(keys), ctx)
    manager.on_request_finished(ctx)


def usable(manager: Any, keys: list[bytes]) -> int:
    """How many chunks of the prefix ``keys`` a lookup would load (hits up to the first miss)."""
    ctx = vbase.ReqContext(req_id="probe")
    count = 0
    for key in keys:
        if manager.lookup(key, ctx) is not vbase.LookupResult.HIT:
            break
        count += 1
    return count


@pytest.fixture(params=["lru", "arc"])
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def side_manager(side: str, chunks: int, policy: str) -> Any:
    """vLLM's own manager, or route 1 with events published or not (its direct calls then
    forward the primary's removals instead of draining events)."""
    if side == "vllm":
        return vllm_manager(chunks, policy)
    return route1(chunks, policy, events=side == "route1")


SIDES = ["route1", "route1-no-events", "vllm"]


@pytest.mark.parametrize("side", SIDES)
def test_a_loaded_four_chunk_prefix_keeps_three_usable_chunks_after_one_eviction(
    policy: str, side: str
) -> None:
    manager = side_manager(side, 4, policy)
    try:
        keys = prefix(1, 4)
        store(manager, "a", keys)
        load(manager, "b", keys)
        store(manager, "c", prefix(2, 1))  # a full tier: evicts one chunk of the prefix
        assert usable(manager, keys) == 3
    finally:
        manager.shutdown()


@pytest.mark.parametrize("side", SIDES)
def test_a_stored_prefix_loses_its_tail_first(policy: str, side: str) -> None:
    manager = side_manager(side, 4, policy)
    try:
        keys = prefix(3, 4)
        store(manager, "a", keys)
        store(manager, "b", prefix(4, 2))
        assert usable(manager, keys) == 2
    finally:
        manager.shutdown()


def test_a_finished_request_refreshes_its_stored_keys_without_counting_a_use() -> None:
    manager = CpuTierManager(4, SLOT_BYTES, load_policy("arc")(4))
    ctx = ReqContext(req_id="a")
    manager.on_new_request(ctx)
    # vLLM's keys are kvtiers' (raw hash bytes + group index).
    head, tail = (OffloadKey(key) for key in prefix(5, 2))
    for key in (head, tail):
        assert manager.prepare_store([key], ctx) == [key]
    manager.complete_store([head, tail], ctx)  # the head entered first, so it is older
    manager.on_request_finished(ctx)  # refreshed tail first: the head is the most recent
    later = OffloadKey(prefix(6, 1)[0])
    other = ReqContext(req_id="b")
    assert manager.prepare_store([later], other) == [later]
    manager.complete_store([later], other)
    # T1 oldest first: both still in T1 (a refresh is no use, a touch would have moved them
    # to T2, after `later`), the tail older than the head.
    assert list(manager.evict_held(3)) == [tail, head, later]


def test_config_info_fills_the_labels_the_spec_declares() -> None:
    config = route1_config([{"kind": "cpu", "capacity": 8 * SLOT_BYTES}])
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    try:
        [info] = manager.config_info()
        assert tuple(info) == type(spec).config_info_keys(config.extra_config)
        assert info["cpu_num_chunks"] == 8
        assert info["cpu_kv_cache_size_bytes"] == 8 * SLOT_BYTES
        assert info["kvtiers_tiers"] == "cpu:cpu"
    finally:
        manager.shutdown()


needs_metadata_only = pytest.mark.skipif(
    not HAS_METADATA_ONLY, reason="this vLLM's events have no metadata_only (0.33 has)"
)


@needs_metadata_only
def test_a_failed_store_is_a_metadata_only_removal_and_no_eviction() -> None:
    manager = route1(2, "lru")
    try:
        keys = prefix(6, 2)
        ctx = request(manager, "a", keys)
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(set(out.keys_to_store), ctx, success=False)
        events = list(manager.take_events())
        assert [(set(e.keys), e.removed, e.metadata_only) for e in events] == [
            (set(keys), True, True)
        ]
        out = manager.prepare_store(prefix(7, 1), ctx)
        assert out is not None and out.evicted_keys == []
    finally:
        manager.shutdown()


def test_events_stay_inert_when_vllm_publishes_none() -> None:
    manager = route1(2, "lru", events=False)
    try:
        store(manager, "a", prefix(8, 2))
        store(manager, "b", prefix(9, 1))
        assert list(manager.take_events()) == []
    finally:
        manager.shutdown()


def test_a_promoted_hit_names_the_tier_that_served_it(tmp_path: Path) -> None:
    tiers = [
        {"kind": "cpu", "capacity": 4 * SLOT_BYTES},
        {"kind": "file", "root": str(tmp_path / "kv"), "io": "posix", "threads": 1},
    ]
    spec = OffloadingSpecFactory.create_spec(route1_config(tiers))
    manager = spec.get_manager()
    try:
        keys = prefix(10, 2)
        ctx = request(manager, "a", keys)
        out = manager.prepare_store(keys, ctx)
        manager.complete_store(set(out.keys_to_store), ctx)
        assert manager.get_load_source(keys[0], ctx) is CacheHitSource.HOST
        manager.on_request_finished(ctx)
        manager.stack.manager.wait_idle()
        manager.reset_cache()  # the primary forgets; the file tier keeps both chunks

        ctx = request(manager, "b", keys)
        assert manager.lookup(keys[0], ctx) is vbase.LookupResult.HIT_PENDING
        manager.stack.manager.wait_idle()
        manager.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert manager.lookup(keys[0], ctx) is vbase.LookupResult.HIT
        assert manager.get_load_source(keys[0], ctx) is CacheHitSource.DISK
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()


# -- route 2: kvtiers' tiers under vLLM's tiering manager --------------------------------

ROW_BYTES = 128
NUM_ROWS = 8


class _Spec(vbase.OffloadingSpec):
    """The smallest vLLM spec: the tiers only read its ``config``."""

    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


def secondary(
    tmp_path: Path, buffer: bytearray, *, global_events: bool, **options: Any
) -> Any:
    config = route1_config([], events=global_events)
    spec = _Spec(config)
    view = memoryview(buffer).cast("B", (NUM_ROWS, ROW_BYTES))
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
         "root": str(tmp_path / "kv"), "io": "posix", "threads": 1, **options},
        view,
        spec,
    )
    view.release()  # vLLM's own view; the tier must hold no other at shutdown
    return tier


def stored(tier: Any, job_id: int, keys: list[bytes]) -> list[Any]:
    """Store ``keys`` from the primary's rows, in turn."""
    tier.submit_store(
        TransferJob(
            job_id=job_id, keys=keys,
            chunk_ids=np.arange(len(keys), dtype=np.int32) % NUM_ROWS,
            is_promotion=False, req_context=vbase.ReqContext(req_id="r"),
        )
    )
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


@pytest.fixture
def buffer() -> Iterator[bytearray]:
    yield bytearray(NUM_ROWS * ROW_BYTES)


def test_route2_events_carry_the_configured_locality(tmp_path: Path, buffer: bytearray) -> None:
    tier = secondary(
        tmp_path, buffer, global_events=True, enable_kv_events=True, locality="REMOTE"
    )
    try:
        keys = prefix(11, 2)
        assert [r.success for r in stored(tier, 1, keys)] == [True]
        [event] = tier.take_events()
        assert (event.keys, event.removed, event.locality) == (keys, False, vbase.Locality.REMOTE)
    finally:
        tier.shutdown()


def test_route2_events_stay_inert_when_vllm_publishes_none(
    tmp_path: Path, buffer: bytearray
) -> None:
    tier = secondary(tmp_path, buffer, global_events=False, enable_kv_events=True)
    try:
        assert [r.success for r in stored(tier, 1, prefix(12, 2))] == [True]
        tier.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert list(tier.manager.take_events()) == []  # nothing piles up undrained
        assert list(tier.take_events()) == []
    finally:
        tier.shutdown()


@needs_metadata_only
def test_route2_a_failed_store_is_a_metadata_only_removal(
    tmp_path: Path, buffer: bytearray
) -> None:
    tier = secondary(tmp_path, buffer, global_events=True, enable_kv_events=True,
                     capacity="4KiB")  # far less than 256 chunks with their headers
    try:
        keys = prefix(13, 256)
        assert [r.success for r in stored(tier, 1, keys)] == [False]
        [event] = tier.take_events()
        assert (event.keys, event.removed, event.metadata_only) == (keys, True, True)
    finally:
        tier.shutdown()


def test_route2_shutdown_lets_go_of_vllms_memory(tmp_path: Path, buffer: bytearray) -> None:
    tier = secondary(tmp_path, buffer, global_events=False)
    assert [r.success for r in stored(tier, 1, prefix(14, 2))] == [True]
    with pytest.raises(BufferError):
        buffer.extend(b"x")  # still exported: the tier views it
    tier.shutdown()
    buffer.extend(b"x")  # no view of it is left


def test_a_one_tier_cpu_stack_gets_the_direct_manager_whose_stores_name_their_request() -> None:
    """``get_manager`` picks the direct manager for a one-tier cpu stack; with events
    published, its stored events carry the storing request's context where vLLM (0.34)
    reads a self-describing payload from it."""
    manager = route1(4, "lru")
    assert isinstance(manager, KVTiersDirectManager)
    keys = prefix(7, 2)
    ctx = request(manager, "r", keys)
    assert manager.prepare_store(keys, ctx) is not None
    manager.complete_store(set(keys), ctx)
    stored = [e for e in manager.take_events() if not e.removed]
    assert sorted(k for e in stored for k in e.keys) == sorted(keys)
    if compat.EVENT_CARRIES_REQ_CONTEXT:
        assert all(e.req_context is ctx for e in stored)
    manager.shutdown()
