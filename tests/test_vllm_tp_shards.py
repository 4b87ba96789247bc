"""The pieces under route 1's tensor / pipeline parallel support, without rank processes:
the sharded CPU worker's slot layout (every rank's pages in one slot, rank innermost), the
shard ledger that keeps a chunk with a rank's shard missing or stale from being
published, and the start-up refusal of ranks on several nodes."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer
from kvtiers.core.worker import KVCacheTensors, KVTensorRef
from kvtiers.errors import ConfigError
from kvtiers.tiers.cpu.region import SlotRegion
from kvtiers.tiers.cpu.shards import ShardLedger, ledger_name
from kvtiers.tiers.cpu.worker import CpuWorker

PAGE = 64  # one rank's page bytes
F = 2  # blocks per chunk
NUM_BLOCKS = 16


def _kv(tensors: list[torch.Tensor], page_bytes: int) -> KVCacheTensors:
    return KVCacheTensors(
        tensors=tensors,
        groups=[[KVTensorRef(i, page_bytes) for i in range(len(tensors))]],
    )


def _run(worker: CpuWorker, job_id: int, transfer: GroupTransfer, *, store: bool) -> None:
    submit = worker.submit_store if store else worker.submit_load
    assert submit(job_id, [transfer])
    worker.wait({job_id})
    assert [r.success for r in worker.get_finished()] == [True]


@pytest.mark.parametrize("kernel", [None, False], ids=["kernel", "torch"])
def test_two_ranks_fill_one_slot_as_one_rank_holding_both_shards_would(
    kernel: bool | None,
) -> None:
    """Each rank's page of a block is half of the one-rank page (head shards): the chunk
    two sharded workers write is byte for byte the chunk one worker over the whole pages
    writes, and each rank loads back exactly its own half."""
    gen = torch.Generator().manual_seed(3)
    whole = [
        torch.randint(0, 256, (NUM_BLOCKS, 2 * PAGE), dtype=torch.uint8, generator=gen)
        for _ in range(2)
    ]
    shards = [[t[:, r * PAGE : (r + 1) * PAGE].clone() for t in whole] for r in range(2)]
    sharded, single = SlotRegion(4, 4096), SlotRegion(4, 4096)
    ranks = [
        CpuWorker(_kv(shards[r], PAGE), sharded, ChunkGeometry(F, (2 * PAGE,)),
                  shard=(r, 2), kernel=kernel)
        for r in range(2)
    ]
    one = CpuWorker(_kv(whole, 2 * PAGE), single, ChunkGeometry(F, (4 * PAGE,)), kernel=kernel)
    blocks = np.array([3, 7, 1, 9, 4], dtype=np.int64)
    slots = np.array([2, 0, 3], dtype=np.int64)
    try:
        # From logical block 1: the first chunk's first sub-block is skipped.
        offloaded = CPULoadStoreSpec(slots).set_gpu_block_offset(1)
        store = GroupTransfer(GPULoadStoreSpec(blocks), offloaded)
        for job, worker in enumerate([*ranks, one]):
            _run(worker, job, store, store=True)
        for slot in slots:
            assert bytes(sharded.view(int(slot))) == bytes(single.view(int(slot))), slot
        dst = np.arange(10, 15, dtype=np.int64)
        load = GroupTransfer(GPULoadStoreSpec(dst), offloaded)
        for rank, worker in enumerate(ranks):
            _run(worker, 9, load, store=False)
            for tensor, full in zip(shards[rank], whole, strict=True):
                assert torch.equal(tensor[dst], full[blocks][:, rank * PAGE : (rank + 1) * PAGE])
    finally:
        for worker in [*ranks, one]:
            worker.shutdown()
        sharded.close()
        single.close()


def test_a_sharded_worker_needs_room_for_every_rank() -> None:
    region = SlotRegion(2, 4096)
    kv = _kv([torch.zeros(NUM_BLOCKS, 1024, dtype=torch.uint8)], 1024)
    try:
        with pytest.raises(ConfigError, match="from each of 4 rank"):
            CpuWorker(kv, region, ChunkGeometry(F, (1024,)), shard=(0, 4))
        with pytest.raises(ConfigError, match="shard rank 2 is outside"):
            CpuWorker(kv, region, ChunkGeometry(F, (1024,)), shard=(2, 2))
    finally:
        region.close()


@pytest.fixture
def name() -> str:
    return ledger_name(f"kvtiers-test-{uuid.uuid4().hex[:12]}")


def test_a_chunk_is_whole_only_when_every_rank_stamped_it_for_its_store(
    tmp_path: Path, name: str
) -> None:
    scheduler = ShardLedger(8, 2, name, shm_dir=tmp_path)
    ranks = [ShardLedger(8, 2, name, shm_dir=tmp_path) for _ in range(2)]
    try:
        first = scheduler.next_stamp()
        for rank, ledger in enumerate(ranks):
            ledger.stamp(rank, [1, 2], first)
        assert scheduler.whole([1, 2, 3], first).tolist() == [True, True, False]

        # The slots are stored again; rank 1 fails: its stamps are stale.
        second = scheduler.next_stamp()
        assert second != first
        ranks[0].stamp(0, [1, 2], second)
        assert scheduler.whole([1, 2], second).tolist() == [False, False]
        # One stamp per slot: slot 1 of the first store, slot 2 of the second.
        assert scheduler.whole([1, 2], [first, second]).tolist() == [False, False]
        ranks[1].stamp(1, [2], second)
        assert scheduler.whole([1, 2], [second, second]).tolist() == [False, True]
    finally:
        for ledger in [scheduler, *ranks]:
            ledger.close()
    assert not (tmp_path / name).exists()  # the last one out removed it


def test_a_scheduler_attaching_late_never_reuses_a_stamp(tmp_path: Path, name: str) -> None:
    rank = ShardLedger(4, 2, name, shm_dir=tmp_path)
    try:
        rank.stamp(0, [3], 41)
        scheduler = ShardLedger(4, 2, name, shm_dir=tmp_path)
        assert scheduler.next_stamp() == 42
        scheduler.close()
    finally:
        rank.close()


def test_stamps_are_positive_and_ranks_in_range(tmp_path: Path, name: str) -> None:
    ledger = ShardLedger(4, 2, name, shm_dir=tmp_path)
    try:
        with pytest.raises(ValueError, match="rank 2 is outside"):
            ledger.stamp(2, [0], 1)
        with pytest.raises(ValueError, match="stamps are positive"):
            ledger.stamp(0, [0], 0)
    finally:
        ledger.close()
    with pytest.raises(ValueError, match="closed"):
        ledger.whole([0], 1)


def test_ranks_on_several_nodes_are_refused_naming_route_2() -> None:
    from kvtiers.integrations.vllm.worker import check_one_node

    def engine(nodes: int) -> SimpleNamespace:
        return SimpleNamespace(vllm=SimpleNamespace(
            parallel_config=SimpleNamespace(nnodes_within_dp=nodes)
        ))

    check_one_node(engine(1), 4)
    check_one_node(None, 4)  # no engine config to read: the shard ledger still guards
    with pytest.raises(ConfigError, match="span 2 nodes; use route 2") as caught:
        check_one_node(engine(2), 4)
    assert "\n" not in str(caught.value)


def test_the_spec_refuses_ranks_on_several_nodes_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtiers.integrations.vllm import spec
    from tests.test_vllm_spec import vllm_config

    engine = SimpleNamespace(vllm=SimpleNamespace(
        parallel_config=SimpleNamespace(nnodes_within_dp=2)
    ))
    monkeypatch.setattr(spec, "find_engine_configs", lambda: engine)
    with pytest.raises(ConfigError, match="span 2 nodes; use route 2"):
        OffloadingSpecFactory.create_spec(vllm_config(tmp_path, world_size=2))
