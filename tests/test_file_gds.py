"""The file tier as the primary (``gds: true``): a file-only stack moves KV blocks between
engine tensors and chunk files, here on CPU tensors through the POSIX staging path.

Round trips cover ``blocks_per_chunk`` 1-4, one and two groups (with page sizes that
force narrower element views), and loads starting at every offset 0-7 with partial first
and last chunks. Also: the factory's placement rules, a partial-chunk store refused, and a
corrupt chunk failing its load and turning into a miss.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvtiers.config.tiers import FileTierConfig
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.specs import GPULoadStoreSpec, GroupTransfer
from kvtiers.core.tier import BuiltTier
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, OffloadingWorker
from kvtiers.errors import ConfigError
from kvtiers.stack.composite import TieredManager
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.file.factory import build_tier

CTX = ReqContext(req_id="gds")
NUM_BLOCKS = 40
#: Page bytes of each group's layers: 8-byte multiples, then odd sizes (byte views).
GROUP_PAGES = ((256, 128), (24, 7))


def _config(blocks_per_chunk: int, num_groups: int) -> OffloadingConfig:
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=16,
            layer_names=tuple(f"g{g}.l{i}" for i in range(len(GROUP_PAGES[g]))),
            bytes_per_block=sum(GROUP_PAGES[g]),
        )
        for g in range(num_groups)
    )
    return OffloadingConfig(
        groups=groups,
        model=OffloadingModelConfig(name="org/gds"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
    )


def _kv(num_groups: int, seed: int) -> KVCacheTensors:
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    groups = []
    for g in range(num_groups):
        refs = []
        for page in GROUP_PAGES[g]:
            padded = page + 8  # rows wider than the page, as engines pad them
            tensors.append(torch.randint(0, 256, (NUM_BLOCKS, padded), dtype=torch.uint8,
                                         generator=gen))
            refs.append(KVTensorRef(len(tensors) - 1, page))
        groups.append(refs)
    return KVCacheTensors(tensors, groups)


def _stack(tmp_path: Path, offloading: OffloadingConfig) -> tuple[TieredManager, BuiltTier]:
    tier = build_tier(
        FileTierConfig(name="disk", root=str(tmp_path), gds=True),
        offloading,
        primary_region=None,
        name="disk",
    )
    assert tier.mover is None and tier.region is None and tier.make_worker is not None
    return TieredManager([tier]), tier


def _chunk_key(c: int, g: int) -> OffloadKey:
    return make_offload_key(xxhash.xxh3_128_digest(b"chunk:%d" % c), g)


def _page(kv: KVCacheTensors, g: int, layer: int, block: int) -> bytes:
    ref = kv.groups[g][layer]
    return bytes(kv.tensors[ref.tensor_idx][block, : ref.page_bytes].numpy())


def _run(worker: OffloadingWorker, job: int, groups: list[GroupTransfer], store: bool) -> bool:
    submit = worker.submit_store if store else worker.submit_load
    assert submit(job, groups)
    worker.wait([job])
    (result,) = worker.get_finished()
    assert result.job_id == job
    return result.success


@pytest.mark.parametrize("num_groups", [1, 2])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3, 4])
def test_round_trip_through_files_at_every_offset(
    tmp_path: Path, blocks_per_chunk: int, num_groups: int
) -> None:
    per_chunk = blocks_per_chunk
    offloading = _config(per_chunk, num_groups)
    manager, tier = _stack(tmp_path, offloading)
    assert tier.make_worker is not None
    source = _kv(num_groups, seed=per_chunk)
    rng = np.random.default_rng(per_chunk * 10 + num_groups)
    num_chunks = 12 // per_chunk + 1
    logical = num_chunks * per_chunk
    src_ids = {g: rng.permutation(NUM_BLOCKS)[:logical] for g in range(num_groups)}
    writer = tier.make_worker(source)
    try:
        keys = {g: [_chunk_key(c, g) for c in range(num_chunks)] for g in range(num_groups)}
        all_keys = [k for g in range(num_groups) for k in keys[g]]
        assert manager.prepare_store(all_keys, CTX) == all_keys
        transfers = [
            GroupTransfer(GPULoadStoreSpec(src_ids[g]), manager.get_spec(keys[g]))
            for g in range(num_groups)
        ]
        assert _run(writer, 0, transfers, store=True)
        manager.complete_store(all_keys, CTX)
    finally:
        writer.shutdown()

    target = _kv(num_groups, seed=999)
    reader = tier.make_worker(target)
    try:
        for job, offset in enumerate(range(8), start=1):
            if offset >= logical:
                break
            count = int(rng.integers(1, logical - offset + 1))
            first, last = offset // per_chunk, (offset + count - 1) // per_chunk
            load_keys = {g: keys[g][first : last + 1] for g in range(num_groups)}
            dst_ids = {g: rng.permutation(NUM_BLOCKS)[:count] for g in range(num_groups)}
            pinned = [k for g in range(num_groups) for k in load_keys[g]]
            assert all(manager.lookup(k, CTX) is LookupResult.HIT for k in pinned)
            manager.prepare_load(pinned, CTX)
            transfers = [
                GroupTransfer(
                    GPULoadStoreSpec(dst_ids[g]),
                    manager.get_spec(load_keys[g]).set_gpu_block_offset(offset),
                )
                for g in range(num_groups)
            ]
            assert _run(reader, job, transfers, store=False)
            manager.complete_load(pinned, CTX)
            for g in range(num_groups):
                for k in range(count):
                    for layer in range(len(GROUP_PAGES[g])):
                        want = _page(source, g, layer, int(src_ids[g][offset + k]))
                        got = _page(target, g, layer, int(dst_ids[g][k]))
                        assert got == want, (offset, g, k, layer)
    finally:
        reader.shutdown()
        manager.shutdown()


def test_chunk_written_by_the_worker_reads_back_through_a_mover(tmp_path: Path) -> None:
    """Same bytes, same layout: a GDS primary's chunk is a valid lower-tier chunk."""
    offloading = _config(2, 1)
    manager, tier = _stack(tmp_path, offloading)
    source = _kv(1, seed=5)
    assert tier.make_worker is not None
    worker = tier.make_worker(source)
    key = _chunk_key(0, 0)
    try:
        manager.prepare_store([key], CTX)
        transfer = GroupTransfer(GPULoadStoreSpec([3, 9]), manager.get_spec([key]))
        assert _run(worker, 0, [transfer], store=True)
        manager.complete_store([key], CTX)
    finally:
        worker.shutdown()
        manager.shutdown()
    region = BytearrayRegion(1, 4096)
    lower = build_tier(
        FileTierConfig(name="disk", root=str(tmp_path)), offloading,
        primary_region=region, name="disk",
    )
    lower.manager.wait_index()
    try:
        lower.manager.prepare_load([key], CTX)
        from kvtiers.core.specs import CPULoadStoreSpec

        assert lower.mover is not None
        lower.mover.submit(0, lower.manager.get_spec([key]), CPULoadStoreSpec([0]))
        lower.mover.drain()
        (result,) = lower.mover.get_finished()
        assert result.success
        expected = b"".join(
            _page(source, 0, layer, block) for layer in range(2) for block in (3, 9)
        )
        assert bytes(region.view(0)[: len(expected)]) == expected
    finally:
        lower.shutdown()


def test_partial_chunk_store_fails_the_job(tmp_path: Path) -> None:
    manager, tier = _stack(tmp_path, _config(4, 1))
    assert tier.make_worker is not None
    worker = tier.make_worker(_kv(1, seed=1))
    key = _chunk_key(0, 0)
    try:
        manager.prepare_store([key], CTX)
        spec = manager.get_spec([key]).set_gpu_block_offset(1)
        assert not _run(worker, 0, [GroupTransfer(GPULoadStoreSpec([1, 2, 3]), spec)], True)
        manager.complete_store([key], CTX, success=False)
        assert manager.lookup(key, CTX) is LookupResult.MISS
        assert not any(tmp_path.rglob("*.kvc"))
    finally:
        worker.shutdown()
        manager.shutdown()


def test_failed_store_removes_the_chunks_it_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second chunk's write fails: the first, already published, must not stay on disk
    unindexed once the job fails."""
    manager, tier = _stack(tmp_path, _config(1, 1))
    assert tier.make_worker is not None
    worker = tier.make_worker(_kv(1, seed=3))
    keys = [_chunk_key(c, 0) for c in range(2)]
    backend = worker.backend  # type: ignore[attr-defined]
    write = backend.write
    writes: list[Path] = []

    def write_once(path: Path, *args: object) -> None:
        if writes:
            raise OSError(28, "No space left on device", str(path))
        writes.append(path)
        write(path, *args)

    monkeypatch.setattr(backend, "write", write_once)
    try:
        assert manager.prepare_store(keys, CTX) == keys
        spec = manager.get_spec(keys)
        assert not _run(worker, 0, [GroupTransfer(GPULoadStoreSpec([0, 1]), spec)], True)
        manager.complete_store(keys, CTX, success=False)
        assert len(writes) == 1, "the first chunk was published before the failure"
        assert not any(tmp_path.rglob("*.kvc")), "a failed store left a chunk file behind"
    finally:
        worker.shutdown()
        manager.shutdown()


def test_corrupt_chunk_fails_the_load_and_becomes_a_miss(tmp_path: Path) -> None:
    manager, tier = _stack(tmp_path, _config(1, 1))
    assert tier.make_worker is not None
    worker = tier.make_worker(_kv(1, seed=2))
    key = _chunk_key(0, 0)
    try:
        manager.prepare_store([key], CTX)
        spec = manager.get_spec([key])
        assert _run(worker, 0, [GroupTransfer(GPULoadStoreSpec([0]), spec)], True)
        manager.complete_store([key], CTX)
        (path,) = tmp_path.rglob("*.kvc")
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
        manager.prepare_load([key], CTX)
        spec = manager.get_spec([key])
        assert not _run(worker, 1, [GroupTransfer(GPULoadStoreSpec([5]), spec)], False)
        manager.complete_load([key], CTX)
        assert manager.lookup(key, CTX) is LookupResult.MISS
        assert manager.get_stats()["disk.corrupt_chunks"] == 1
    finally:
        worker.shutdown()
        manager.shutdown()


def test_factory_placement_rules(tmp_path: Path) -> None:
    offloading = _config(1, 1)
    with pytest.raises(ConfigError, match="gds: true"):
        build_tier(FileTierConfig(name="disk", root=str(tmp_path)), offloading,
                   primary_region=None, name="disk")
    lower = build_tier(FileTierConfig(name="disk", root=str(tmp_path), admission="never"),
                       offloading, primary_region=BytearrayRegion(2, 4096), name="disk")
    try:
        assert lower.mover is not None and lower.make_worker is None
        assert lower.admission == "never"
        assert lower.manager.get_stats()["io_backend"] == 0
    finally:
        lower.shutdown()
