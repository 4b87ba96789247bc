"""GPU ⇄ CPU worker round trips over random geometries, plus its error handling.

Every round trip runs on each copy path: the fused page-copy kernel on one thread, the
kernel split over three threads with non-temporal stores (the per-thread and streaming byte
floors lowered so small jobs take them), and the pure-torch path. Block and slot ids come
scattered, sorted, in runs of consecutive ids, or consecutive on one side; transfers start
at a random GPU block offset, so leading sub-blocks of the first chunk are skipped and the
last chunk may be partial.

Expected slot contents are computed independently of the worker, straight from the layout
rule of :mod:`kvtiers.core.geometry`: chunk ``c`` of group ``g`` in slot ``s`` holds, for
each of the group's tensors in order, ``blocks_per_chunk`` pages back to back.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, TransferResult
from kvtiers.errors import ConfigError
from kvtiers.tiers.cpu import worker as worker_module
from kvtiers.tiers.cpu.pagecopy import compiler
from kvtiers.tiers.cpu.region import SlotRegion
from kvtiers.tiers.cpu.worker import CpuWorker

PAGE_SIZES = (8, 24, 36, 64, 100, 256, 1000, 4096)
COPY_PATHS = ("kernel", "kernel-threads-streaming", "torch")
HAS_COMPILER = shutil.which(compiler()[0]) is not None


def make_worker(
    setup: Setup,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
    batch_bytes: int = worker_module.DEFAULT_BATCH_BYTES,
) -> CpuWorker:
    """A worker on copy path ``path`` (one of ``COPY_PATHS``)."""
    if path == "torch":
        worker = CpuWorker(
            setup.kv, setup.region, setup.geometry, kernel=False, batch_bytes=batch_bytes
        )
        assert not worker.uses_kernel
        return worker
    if not HAS_COMPILER:
        pytest.skip(f"no C compiler ({compiler()[0]}) to build the page-copy kernel")
    threads = 1
    if path == "kernel-threads-streaming":
        monkeypatch.setattr(worker_module, "MIN_BYTES_PER_THREAD", 1)
        monkeypatch.setattr(worker_module, "STREAMING_BYTES", 1)
        threads = 3
    worker = CpuWorker(
        setup.kv,
        setup.region,
        setup.geometry,
        kernel=True,
        copy_threads=threads,
        batch_bytes=batch_bytes,
    )
    assert worker.uses_kernel
    return worker


def runs_of(rng: random.Random, ids: list[int]) -> list[int]:
    """``ids`` sorted, cut into runs of 1-4 consecutive ids, the runs shuffled."""
    ordered = sorted(ids)
    runs, begin = [], 0
    while begin < len(ordered):
        size = rng.randint(1, 4)
        runs.append(ordered[begin : begin + size])
        begin += size
    rng.shuffle(runs)
    return [i for run in runs for i in run]


@dataclass
class Setup:
    kv: KVCacheTensors
    region: SlotRegion
    geometry: ChunkGeometry


def make_setup(rng: random.Random, num_blocks: int = 48) -> Setup:
    per_chunk = rng.randint(1, 4)
    tensors: list[torch.Tensor] = []
    groups: list[list[KVTensorRef]] = []
    for _ in range(rng.randint(1, 3)):
        refs = []
        for _ in range(rng.randint(1, 3)):
            page = rng.choice(PAGE_SIZES)
            padded = page + rng.choice((0, 0, 3, 8, 16))
            data = torch.randint(0, 256, (num_blocks, padded), dtype=torch.uint8)
            refs.append(KVTensorRef(len(tensors), page))
            tensors.append(data)
        groups.append(refs)
    kv = KVCacheTensors(tensors, groups)
    geometry = ChunkGeometry(
        per_chunk, tuple(kv.group_bytes_per_block(g) for g in range(len(groups)))
    )
    region = SlotRegion(64, geometry.slot_bytes)
    return Setup(kv, region, geometry)


def page_offsets(setup: Setup, group: int) -> list[int]:
    """Byte offset of each of the group's tensors inside a slot."""
    offsets, offset = [], 0
    for ref in setup.kv.groups[group]:
        offsets.append(offset)
        offset += ref.page_bytes * setup.geometry.blocks_per_chunk
    return offsets


def random_transfers(
    rng: random.Random, setup: Setup, free_slots: list[int], free_blocks: list[int]
) -> list[GroupTransfer]:
    """One transfer per group, drawing slots and (non-contiguous) blocks from the pools."""
    per_chunk = setup.geometry.blocks_per_chunk
    transfers = []
    for _ in setup.kv.groups:
        offset = rng.randint(0, 7)
        count = rng.randint(1, 6)
        chunks = -(-(offset % per_chunk + count) // per_chunk)
        slots = [free_slots.pop() for _ in range(chunks)]
        blocks = [free_blocks.pop() for _ in range(count)]
        spec = CPULoadStoreSpec(slots).set_gpu_block_offset(offset)
        transfers.append(GroupTransfer(GPULoadStoreSpec(blocks), spec))
    return transfers


def expected_pages(setup: Setup, transfers: list[GroupTransfer]) -> list[tuple[int, int, int, int]]:
    """(tensor index, block id, region byte offset, page bytes) for every page moved."""
    per_chunk = setup.geometry.blocks_per_chunk
    pages = []
    for g, transfer in enumerate(transfers):
        skip = transfer.offload_spec.gpu_block_offset % per_chunk
        assert isinstance(transfer.offload_spec, CPULoadStoreSpec)
        slots = transfer.offload_spec.block_ids.tolist()
        for k, block in enumerate(transfer.gpu_spec.block_ids.tolist()):
            chunk, sub = divmod(skip + k, per_chunk)
            for ref, offset in zip(setup.kv.groups[g], page_offsets(setup, g), strict=True):
                start = slots[chunk] * setup.region.slot_bytes + offset + sub * ref.page_bytes
                pages.append((ref.tensor_idx, block, start, ref.page_bytes))
    return pages


def run_job(
    worker: CpuWorker, job_id: int, store: bool, transfers: list[GroupTransfer]
) -> TransferResult:
    submit = worker.submit_store if store else worker.submit_load
    assert submit(job_id, transfers)
    worker.wait([job_id])
    (result,) = worker.get_finished()
    return result


@pytest.mark.parametrize("path", COPY_PATHS)
@pytest.mark.parametrize(
    "layout", ["scattered", "sorted", "runs", "consecutive_blocks", "consecutive_slots"]
)
@pytest.mark.parametrize("seed", range(12))
def test_store_then_load_into_other_blocks(
    seed: int, layout: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the torch path scattered ids take the two-pass gather/scatter and a consecutive
    side one pass; the kernel moves every layout in one pass."""
    rng = random.Random(seed)
    setup = make_setup(rng)
    worker = make_worker(setup, path, monkeypatch, batch_bytes=rng.choice((64, 4096, 1 << 20)))
    try:
        free_slots = rng.sample(range(setup.region.num_slots), setup.region.num_slots)
        free_blocks = rng.sample(range(48), 48)
        # Ids are popped from the end of the pools, so "ascending" means reversed here.
        if layout == "consecutive_slots":
            free_slots.sort(reverse=True)
        elif layout == "consecutive_blocks":
            free_blocks.sort(reverse=True)
        elif layout == "sorted":
            free_slots.sort(reverse=True)
            free_blocks.sort(reverse=True)
        elif layout == "runs":
            free_slots = runs_of(rng, free_slots)[::-1]
            free_blocks = runs_of(rng, free_blocks)[::-1]
        transfers = random_transfers(rng, setup, free_slots, free_blocks)
        region = setup.region.tensor().numpy()
        region_before = region.copy()
        result = run_job(worker, 1, True, transfers)
        assert result.success and result.job_id == 1
        assert result.transfer_bytes == sum(
            len(t.gpu_spec) * setup.geometry.group_bytes_per_block[g]
            for g, t in enumerate(transfers)
        )

        expected_region = region_before.copy()
        pages = expected_pages(setup, transfers)
        for tensor, block, start, size in pages:
            expected_region[start : start + size] = setup.kv.tensors[tensor][block, :size].numpy()
        np.testing.assert_array_equal(region, expected_region)

        # Load every group back into blocks that were not used by the store.
        loads = []
        for transfer in transfers:
            blocks = [free_blocks.pop() for _ in range(len(transfer.gpu_spec))]
            loads.append(GroupTransfer(GPULoadStoreSpec(blocks), transfer.offload_spec))
        tensors_before = [t.clone() for t in setup.kv.tensors]
        assert run_job(worker, 2, False, loads).success
        expected = [t.clone() for t in tensors_before]
        for (tensor, _, start, size), (_, new_block, _, _) in zip(
            pages, expected_pages(setup, loads), strict=True
        ):
            expected[tensor][new_block, :size] = torch.from_numpy(region[start : start + size])
        for got, want in zip(setup.kv.tensors, expected, strict=True):
            assert torch.equal(got, want)
        # The loaded pages equal the originally stored blocks' pages.
        for (tensor, block, _, size), (_, new_block, _, _) in zip(
            pages, expected_pages(setup, loads), strict=True
        ):
            assert torch.equal(
                setup.kv.tensors[tensor][new_block, :size], tensors_before[tensor][block, :size]
            )
    finally:
        worker.shutdown()
        setup.region.close()


def simple_setup() -> Setup:
    tensor = torch.arange(8 * 64, dtype=torch.int64).to(torch.uint8).view(8, 64)
    kv = KVCacheTensors([tensor], [[KVTensorRef(0, 64)]])
    geometry = ChunkGeometry(2, (64,))
    return Setup(kv, SlotRegion(4, geometry.slot_bytes), geometry)


def test_geometry_that_disagrees_with_the_tensors_is_a_config_error() -> None:
    setup = simple_setup()
    with pytest.raises(ConfigError, match="bytes per block"):
        CpuWorker(setup.kv, setup.region, ChunkGeometry(2, (32,)))
    with pytest.raises(ConfigError, match="groups"):
        CpuWorker(setup.kv, setup.region, ChunkGeometry(2, (64, 64)))


def test_blocks_that_do_not_fill_the_chunks_are_rejected() -> None:
    setup = simple_setup()
    worker = CpuWorker(setup.kv, setup.region, setup.geometry)
    try:
        too_many = GroupTransfer(GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0]))
        with pytest.raises(ValueError, match="do not fill"):
            worker.submit_store(1, [too_many])
        too_few = GroupTransfer(GPULoadStoreSpec([0]), CPULoadStoreSpec([0, 1]))
        with pytest.raises(ValueError, match="do not fill"):
            worker.submit_store(2, [too_few])
        assert worker.get_finished() == []
    finally:
        worker.shutdown()


@pytest.mark.parametrize("path", COPY_PATHS)
@pytest.mark.parametrize(
    ("blocks", "slots"),
    [([0, 1], [99]), ([0, 1], [-1]), ([0, 8], [1]), ([-1, 0], [1])],
    ids=["slot-past-end", "negative-slot", "block-past-end", "negative-block"],
)
def test_a_copy_outside_the_memory_fails_the_job(
    path: str, blocks: list[int], slots: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = simple_setup()
    worker = make_worker(setup, path, monkeypatch)
    try:
        region_before = setup.region.tensor().clone()
        outside = GroupTransfer(GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))
        result = run_job(worker, 7, True, [outside])
        assert result == TransferResult(7, False, 0, result.transfer_s)
        tensor_before = setup.kv.tensors[0].clone()
        assert not run_job(worker, 8, False, [outside]).success
        assert torch.equal(setup.kv.tensors[0], tensor_before)
        if path != "torch":
            # The kernel path checks every id before it copies; torch's indexed copies may
            # have written some pages of the failed store before raising.
            assert torch.equal(setup.region.tensor(), region_before)
    finally:
        worker.shutdown()
        setup.region.close()


def test_kernel_required_but_not_buildable_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVTIERS_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    setup = simple_setup()
    with pytest.raises(ConfigError, match="could not be built"):
        CpuWorker(setup.kv, setup.region, setup.geometry, kernel=True)
    assert "no-such-compiler" in caplog.text
    # Without a kernel the default worker still copies, on the torch path.
    worker = CpuWorker(setup.kv, setup.region, setup.geometry)
    try:
        assert not worker.uses_kernel
        transfer = GroupTransfer(GPULoadStoreSpec([5, 2]), CPULoadStoreSpec([3]))
        assert run_job(worker, 1, True, [transfer]).success
        slot = setup.region.tensor()[3 * setup.region.slot_bytes :][:128]
        assert torch.equal(slot.view(2, 64), setup.kv.tensors[0][[5, 2]])
    finally:
        worker.shutdown()
        setup.region.close()


def test_copy_threads_below_one_is_a_config_error() -> None:
    setup = simple_setup()
    with pytest.raises(ConfigError, match="copy_threads"):
        CpuWorker(setup.kv, setup.region, setup.geometry, copy_threads=0)
    setup.region.close()


def test_wait_get_finished_and_shutdown() -> None:
    setup = simple_setup()
    worker = CpuWorker(setup.kv, setup.region, setup.geometry)
    transfer = GroupTransfer(GPULoadStoreSpec([3, 5]), CPULoadStoreSpec([2]))
    assert worker.submit_store(1, [transfer])
    assert worker.submit_load(2, [GroupTransfer(GPULoadStoreSpec([6, 7]), CPULoadStoreSpec([2]))])
    worker.wait([1, 2, 99])
    finished = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_bytes) for r in finished] == [
        (1, True, 128),
        (2, True, 128),
    ]
    assert torch.equal(setup.kv.tensors[0][6:8], setup.kv.tensors[0][[3, 5]])
    worker.wait([1])
    assert worker.get_finished() == []
    worker.shutdown()
    worker.shutdown()
    assert not worker.submit_store(3, [transfer])
