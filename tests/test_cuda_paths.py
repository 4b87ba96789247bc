"""The GPU paths on a CUDA device; the whole module skips (one line) without one.

``benchmarks/gpu_check.py`` runs it on a GPU machine: tests whose names hold ``kvikio`` in
its kvikio step, the rest in its CUDA step.

* The CPU worker with KV tensors on the GPU: the slot region is host-registered (pinned);
  per-group transfers at random offsets, over the layouts and page sizes of
  ``tests/test_cpu_worker.py`` (padded rows, 1-4 blocks per chunk, one to three groups,
  pages forcing 16- down to 1-byte elements) and a realistic geometry, round-trip byte
  for byte; a store waits for the kernels that wrote its blocks on the submitting stream;
  ids out of range fail the job and leave the CUDA context usable.
* The GDS primary worker with KV tensors on the GPU, through the POSIX backend (device
  staging, then host) and through kvikio (device memory straight to the file), at every
  load offset; and the kvikio backend moving a device buffer by itself.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, OffloadingWorker
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.tiers.cpu.region import SlotRegion
from kvtiers.tiers.cpu.worker import CpuWorker
from kvtiers.tiers.file.gds_worker import FileWorker
from kvtiers.tiers.file.io import (
    IOBackend,
    KvikioBackend,
    PosixBackend,
    PublishSettings,
    kvikio_status,
)
from tests.test_cpu_worker import (
    Setup,
    expected_pages,
    make_setup,
    random_transfers,
    run_job,
    runs_of,
)
from tests.test_file_gds import CTX, GROUP_PAGES, NUM_BLOCKS, _chunk_key, _config, _kv, _stack

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run benchmarks/gpu_check.py on one)",
                allow_module_level=True)

DEVICE = torch.device("cuda", 0)
LAYOUTS = ("scattered", "sorted", "runs", "consecutive_blocks", "consecutive_slots")


def on_gpu(setup: Setup) -> tuple[Setup, list[torch.Tensor]]:
    """``setup`` with its KV tensors moved to the GPU, and host copies of them."""
    host = [t.clone() for t in setup.kv.tensors]
    kv = KVCacheTensors([t.to(DEVICE) for t in host], setup.kv.groups)
    return Setup(kv, setup.region, setup.geometry), host


def test_the_slot_region_is_host_registered() -> None:
    region = SlotRegion(8, 1 << 20)
    try:
        assert region.pinned
        assert region.tensor().is_pinned()
    finally:
        region.close()
    # Unregistered on close: the same memory size registers again.
    again = SlotRegion(8, 1 << 20)
    assert again.pinned
    again.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(6))
def test_store_then_load_round_trip_through_pinned_slots(seed: int, layout: str) -> None:
    """Per-group transfers at random offsets, store then load into other blocks: every
    slot byte and every block byte is the expected one (untouched ones unchanged)."""
    rng = random.Random(seed)
    setup, host = on_gpu(make_setup(rng))
    worker = CpuWorker(setup.kv, setup.region, setup.geometry,
                       batch_bytes=rng.choice((64, 4096, 1 << 20)))
    try:
        assert setup.region.pinned and not worker.uses_kernel
        free_slots = rng.sample(range(setup.region.num_slots), setup.region.num_slots)
        free_blocks = rng.sample(range(48), 48)
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
        setup.region.tensor().fill_(0xA5)
        expected_region = region.copy()
        pages = expected_pages(setup, transfers)
        for tensor, block, start, size in pages:
            expected_region[start : start + size] = host[tensor][block, :size].numpy()
        result = run_job(worker, 1, True, transfers)
        assert result.success
        assert result.transfer_bytes == sum(
            len(t.gpu_spec) * setup.geometry.group_bytes_per_block[g]
            for g, t in enumerate(transfers)
        )
        np.testing.assert_array_equal(region, expected_region)

        loads = [
            GroupTransfer(GPULoadStoreSpec([free_blocks.pop() for _ in range(len(t.gpu_spec))]),
                          t.offload_spec)
            for t in transfers
        ]
        assert run_job(worker, 2, False, loads).success
        expected = [t.clone() for t in host]
        for (tensor, block, _, size), (_, new_block, _, _) in zip(
            pages, expected_pages(setup, loads), strict=True
        ):
            expected[tensor][new_block, :size] = host[tensor][block, :size]
        for got, want in zip(setup.kv.tensors, expected, strict=True):
            assert torch.equal(got.cpu(), want)
    finally:
        worker.shutdown()
        setup.region.close()


@pytest.mark.parametrize(("page_kib", "per_chunk"), [(64, 16), (16, 4), (2, 1)])
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-slots", "scattered-slots"])
def test_realistic_geometry_round_trip(page_kib: int, per_chunk: int, fresh: bool) -> None:
    """32 layers, engine-sized pages, jobs of several chunks over the default batch."""
    layers, page = 32, page_kib << 10
    blocks = 4 * per_chunk
    tensors = [torch.randint(0, 256, (3 * blocks, page), dtype=torch.uint8, device=DEVICE)
               for _ in range(layers)]
    kv = KVCacheTensors(tensors, [[KVTensorRef(i, page) for i in range(layers)]])
    geometry = ChunkGeometry(per_chunk, (layers * page,))
    region = SlotRegion(8, geometry.slot_bytes)
    worker = CpuWorker(kv, region, geometry)
    gen = np.random.default_rng(page_kib + per_chunk)
    order = gen.permutation(3 * blocks)
    slots = np.arange(4) if fresh else gen.permutation(8)[:4]
    try:
        spec = CPULoadStoreSpec(slots)
        store = GroupTransfer(GPULoadStoreSpec(order[:blocks]), spec)
        assert run_job(worker, 1, True, [store]).success
        # Load back the last 3 chunks' blocks less the first one: a mid-chunk start.
        skip = per_chunk + (1 if per_chunk > 1 else 0)
        load_spec = CPULoadStoreSpec(slots[skip // per_chunk :]).set_gpu_block_offset(skip)
        target = order[blocks : 2 * blocks - skip]
        load = GroupTransfer(GPULoadStoreSpec(target), load_spec)
        assert run_job(worker, 2, False, [load]).success
        source = torch.as_tensor(order[skip:blocks], device=DEVICE)
        loaded = torch.as_tensor(target, device=DEVICE)
        for tensor in tensors:
            assert torch.equal(tensor[loaded], tensor[source])
    finally:
        worker.shutdown()
        region.close()


def test_a_store_waits_for_the_kernels_that_wrote_its_blocks() -> None:
    """The blocks are written on the submitting stream behind a long kernel; the store,
    submitted at once, must copy the new bytes, not the old ones."""
    page = 4096
    tensor = torch.zeros((8, page), dtype=torch.uint8, device=DEVICE)
    kv = KVCacheTensors([tensor], [[KVTensorRef(0, page)]])
    geometry = ChunkGeometry(2, (page,))
    region = SlotRegion(4, geometry.slot_bytes)
    worker = CpuWorker(kv, region, geometry)
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time on the current stream
        tensor[2:4].fill_(7)
        transfer = GroupTransfer(GPULoadStoreSpec([2, 3]), CPULoadStoreSpec([1]))
        assert run_job(worker, 1, True, [transfer]).success
        slot = region.tensor()[geometry.slot_bytes : geometry.slot_bytes + 2 * page]
        assert bool((slot == 7).all())
    finally:
        worker.shutdown()
        region.close()


@pytest.mark.parametrize(
    ("blocks", "slots"),
    [([0, 1], [99]), ([0, 1], [-1]), ([0, 8], [1]), ([-1, 0], [1])],
    ids=["slot-past-end", "negative-slot", "block-past-end", "negative-block"],
)
def test_ids_out_of_range_fail_the_job_and_cuda_stays_usable(
    blocks: list[int], slots: list[int]
) -> None:
    tensor = torch.randint(0, 256, (8, 64), dtype=torch.uint8, device=DEVICE)
    kv = KVCacheTensors([tensor], [[KVTensorRef(0, 64)]])
    geometry = ChunkGeometry(2, (64,))
    region = SlotRegion(4, geometry.slot_bytes)
    worker = CpuWorker(kv, region, geometry)
    try:
        before = tensor.clone()
        outside = GroupTransfer(GPULoadStoreSpec(blocks), CPULoadStoreSpec(slots))
        assert not run_job(worker, 1, True, [outside]).success
        assert not run_job(worker, 2, False, [outside]).success
        torch.cuda.synchronize()  # raises if a device-side assert fired
        assert torch.equal(tensor, before)
        good = GroupTransfer(GPULoadStoreSpec([0, 1]), CPULoadStoreSpec([0]))
        assert run_job(worker, 3, True, [good]).success
    finally:
        worker.shutdown()
        region.close()


# -- the GDS primary worker ------------------------------------------------------------
KVIKIO_UNUSABLE = kvikio_status(Path(tempfile.gettempdir()))


def _backend(name: str) -> IOBackend:
    if name == "kvikio":
        if KVIKIO_UNUSABLE is not None:
            pytest.skip(f"kvikio unusable: {KVIKIO_UNUSABLE}")
        return KvikioBackend()
    return PosixBackend()


def _gpu_kv(num_groups: int, seed: int) -> tuple[KVCacheTensors, KVCacheTensors]:
    """The same random KV cache on the GPU and on the host."""
    host = _kv(num_groups, seed)
    return KVCacheTensors([t.to(DEVICE) for t in host.tensors], host.groups), host


def _file_worker(
    kv: KVCacheTensors, offloading: OffloadingConfig, backend: IOBackend
) -> FileWorker:
    identity = NamespaceIdentity.from_config(offloading)
    geometry = ChunkGeometry.from_config(offloading)
    worker = FileWorker(kv, geometry, identity.digest, backend)
    assert worker.backend is backend
    return worker


def _run(worker: OffloadingWorker, job: int, groups: list[GroupTransfer], store: bool) -> bool:
    submit = worker.submit_store if store else worker.submit_load
    assert submit(job, groups)
    worker.wait([job])
    (result,) = worker.get_finished()
    return result.success


@pytest.mark.parametrize("backend_name", ["posix", "kvikio"])
@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("blocks_per_chunk", [1, 3, 4])
def test_gds_worker_round_trip_on_cuda_tensors(
    tmp_path: Path, backend_name: str, num_groups: int, blocks_per_chunk: int
) -> None:
    """Store whole chunks from GPU blocks, load them back at every offset 0-7 into other
    GPU blocks; pages compared with the host copy of the source."""
    backend = _backend(backend_name)
    per_chunk = blocks_per_chunk
    offloading = _config(per_chunk, num_groups)
    manager, _ = _stack(tmp_path, offloading)
    source, source_host = _gpu_kv(num_groups, seed=per_chunk)
    rng = np.random.default_rng(per_chunk * 10 + num_groups)
    num_chunks = 12 // per_chunk + 1
    logical = num_chunks * per_chunk
    src_ids = {g: rng.permutation(NUM_BLOCKS)[:logical] for g in range(num_groups)}
    keys = {g: [_chunk_key(c, g) for c in range(num_chunks)] for g in range(num_groups)}
    writer = _file_worker(source, offloading, backend)
    try:
        all_keys = [k for g in range(num_groups) for k in keys[g]]
        assert manager.prepare_store(all_keys, CTX) == all_keys
        transfers = [GroupTransfer(GPULoadStoreSpec(src_ids[g]), manager.get_spec(keys[g]))
                     for g in range(num_groups)]
        assert _run(writer, 0, transfers, store=True)
        manager.complete_store(all_keys, CTX)
    finally:
        writer.shutdown()
    target, _ = _gpu_kv(num_groups, seed=999)
    reader = _file_worker(target, offloading, backend)
    try:
        for job, offset in enumerate(range(min(8, logical)), start=1):
            count = int(rng.integers(1, logical - offset + 1))
            first, last = offset // per_chunk, (offset + count - 1) // per_chunk
            load_keys = {g: keys[g][first : last + 1] for g in range(num_groups)}
            dst_ids = {g: rng.permutation(NUM_BLOCKS)[:count] for g in range(num_groups)}
            pinned = [k for g in range(num_groups) for k in load_keys[g]]
            manager.prepare_load(pinned, CTX)
            transfers = [
                GroupTransfer(GPULoadStoreSpec(dst_ids[g]),
                              manager.get_spec(load_keys[g]).set_gpu_block_offset(offset))
                for g in range(num_groups)
            ]
            assert _run(reader, job, transfers, store=False)
            manager.complete_load(pinned, CTX)
            for g in range(num_groups):
                for layer, ref in enumerate(target.groups[g]):
                    page = GROUP_PAGES[g][layer]
                    src = torch.as_tensor(src_ids[g][offset : offset + count])
                    want = source_host.tensors[ref.tensor_idx][src]
                    got = target.tensors[ref.tensor_idx][torch.as_tensor(dst_ids[g])].cpu()
                    assert torch.equal(got[:, :page], want[:, :page]), (offset, g, layer)
    finally:
        reader.shutdown()
        manager.shutdown()


@pytest.mark.parametrize("backend_name", ["posix", "kvikio"])
def test_gds_worker_block_ids_out_of_range_fail_the_job(tmp_path: Path,
                                                        backend_name: str) -> None:
    backend = _backend(backend_name)
    offloading = _config(2, 1)
    manager, _ = _stack(tmp_path, offloading)
    kv, _ = _gpu_kv(1, seed=4)
    worker = _file_worker(kv, offloading, backend)
    key = _chunk_key(0, 0)
    try:
        manager.prepare_store([key], CTX)
        spec = manager.get_spec([key])
        assert not _run(worker, 0, [GroupTransfer(GPULoadStoreSpec([1, NUM_BLOCKS]), spec)],
                        store=True)
        manager.complete_store([key], CTX, success=False)
        torch.cuda.synchronize()  # raises if a device-side assert fired
        assert not any(tmp_path.rglob("*.kvc"))
    finally:
        worker.shutdown()
        manager.shutdown()


def test_kvikio_backend_moves_a_device_buffer(tmp_path: Path) -> None:
    backend = _backend("kvikio")
    payload = torch.randint(0, 256, (3 * 4096 + 100,), dtype=torch.uint8, device=DEVICE)
    header = bytes(range(256)) * 16
    path = tmp_path / "chunk.kvc"
    backend.write(path, header, payload, PublishSettings(root=tmp_path))
    header_back = memoryview(bytearray(4096))
    payload_back = torch.zeros_like(payload)
    got, size = backend.read(path, header_back, payload_back)
    assert (got, size) == (4096 + payload.numel(), 4096 + payload.numel())
    assert bytes(header_back) == header
    assert torch.equal(payload_back, payload)
