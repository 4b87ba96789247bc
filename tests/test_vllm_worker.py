"""Route 1's worker fed the way the installed vLLM's connector feeds it.

vLLM 0.34's connector resolves a job's GPU blocks to ``DevicePointers`` with its own
``resolve_device_pointers`` over the canonical KV caches and hands the worker those;
vLLM 0.32 and 0.33 hand the packed ``GPULoadStoreSpec``. :func:`engine_side` does what the
installed release's connector does, so these tests run unchanged in every test
environment and drive the path each release takes. The setup is tests/test_vllm_spec.py's:
two KV-cache groups of different block sizes sharing two int8 tensors, two blocks a chunk.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.integrations.vllm import compat
from tests.test_vllm_spec import (
    NUM_BLOCKS,
    F,
    canonical_kv,
    ctx,
    gpu_spec,
    make_kv,
    make_request,
    vllm_config,
)


def engine_side(gpu: Any, kv_caches: Any) -> Any:
    """The engine's blocks as the installed vLLM's connector hands them to the worker."""
    if compat.POINTERS is None:
        return gpu
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(gpu, kv_caches)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Any, Any, list[torch.Tensor], Any]]:
    """(manager, worker of a second spec instance, KV tensors, their canonical caches)."""
    kv = make_kv()
    caches = canonical_kv(kv)
    config = vllm_config(tmp_path / "kv")
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(caches)
    yield manager, worker, kv, caches
    worker.shutdown()
    manager.shutdown()


def finish(worker: Any, job_id: int) -> list[tuple[int, bool]]:
    worker.wait({job_id})
    return [(r.job_id, r.success) for r in worker.get_finished()]


def test_the_installed_release_addresses_the_worker_as_expected() -> None:
    """0.34 and later hand pointers; a release that does must be adapted (compat)."""
    assert (compat.POINTERS is not None) == (compat.RELEASE >= (0, 34, 0))


def test_stores_and_loads_round_trip_byte_exact_per_group_and_block(
    setup: tuple[Any, Any, list[torch.Tensor], Any],
) -> None:
    manager, worker, kv, caches = setup
    originals = [t.clone() for t in kv]
    req = make_request(5, first_block=0)
    # Group 0 from chunk 1 (block index 2), group 1 from chunk 0: non-zero and zero
    # block_indices side by side.
    chunks = [range(1, 3), range(0, 2)]  # the primary's four slots
    keys = [req.keys[g][c] for g, rng in enumerate(chunks) for c in rng]
    out = manager.prepare_store(keys, ctx())
    assert out is not None and out.keys_to_store == keys
    stored = gpu_spec([
        (req.blocks[g][rng.start * F : rng.stop * F], rng.start * F)
        for g, rng in enumerate(chunks)
    ])
    spec = pickle.loads(pickle.dumps(out.store_spec))
    assert worker.submit_store(1, engine_side(stored, caches), spec)
    assert finish(worker, 1) == [(1, True)]
    manager.complete_store(keys, ctx())

    # Load from an unaligned block of group 0 (block 3: the second of chunk 1) and all of
    # group 1, into other GPU blocks.
    firsts = [3, 0]
    load_keys = [
        k for g, first in enumerate(firsts) for k in req.keys[g][first // F : chunks[g].stop]
    ]
    src = pickle.loads(pickle.dumps(manager.prepare_load(load_keys, ctx())))
    targets = []
    free = NUM_BLOCKS - 16
    for g, first in enumerate(firsts):
        count = chunks[g].stop * F - first
        targets.append(list(range(free, free + count)))
        free += count
    for t in kv:
        t[NUM_BLOCKS - 16 :] = 0
    loaded = gpu_spec([(targets[g], first) for g, first in enumerate(firsts)])
    assert worker.submit_load(2, src, engine_side(loaded, caches))
    assert finish(worker, 2) == [(2, True)]
    manager.complete_load(load_keys, ctx())
    for g, first in enumerate(firsts):
        sources = req.blocks[g][first : chunks[g].stop * F]
        for source, target in zip(sources, targets[g], strict=True):
            for tensor, original in zip(kv, originals, strict=True):
                assert torch.equal(tensor[target], original[source]), (g, source)


def _pointers(**changes: Any) -> Any:
    """``DevicePointers`` over the canonical caches of fresh tensors, with ``changes``."""
    assert compat.POINTERS is not None
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    caches = canonical_kv(make_kv())
    found = resolve_device_pointers(gpu_spec([([0, 1], 0), ([2, 3], 0)]), caches)
    fields = {name: getattr(found, name) for name in (
        "ptrs", "sizes", "group_block_counts", "group_data_ref_counts", "block_indices"
    )}
    return compat.POINTERS(**{**fields, **changes})


def _bad_addressing(kv: list[torch.Tensor], caches: Any) -> list[tuple[str, Any]]:
    """Engine sides that do not address this worker's KV tensors, by what is wrong."""
    if compat.POINTERS is None:
        return [
            ("a block id past the tensors", gpu_spec([([0, NUM_BLOCKS], 0), ([2, 3], 0)])),
            ("one group too many", gpu_spec([([0, 1], 0), ([2, 3], 0), ([], 0)])),
        ]
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    good = resolve_device_pointers(gpu_spec([([0, 1], 0), ([2, 3], 0)]), caches)
    ptrs = np.array(good.ptrs, dtype=np.uint64)
    inside = ptrs.copy()
    inside[0] += 1  # inside a block, not at its start
    other = _pointers()  # another engine's tensors
    return [
        ("a pointer inside a block", _pointers(ptrs=inside, sizes=good.sizes)),
        ("pointers into other tensors", other),
        ("a page size the ref does not have",
         _pointers(ptrs=ptrs, sizes=np.array(good.sizes, dtype=np.uint64) * 2)),
        ("data refs naming different blocks",
         _pointers(ptrs=np.concatenate([ptrs[:2], ptrs[3:4], ptrs[2:3], ptrs[4:]]),
                   sizes=good.sizes)),
        ("fewer pointers than the counts", _pointers(ptrs=ptrs[:-1], sizes=good.sizes[:-1])),
        ("one group too many", _pointers(
            ptrs=ptrs, sizes=good.sizes, group_block_counts=(2, 2, 0),
            group_data_ref_counts=(2, 2, 2), block_indices=(0, 0, 0))),
    ]


def test_a_transfer_that_does_not_address_the_kv_tensors_fails_the_job_not_the_call(
    setup: tuple[Any, Any, list[torch.Tensor], Any],
) -> None:
    manager, worker, kv, caches = setup
    req = make_request(6, first_block=0)
    keys = [req.keys[0][0], req.keys[1][0]]
    out = manager.prepare_store(keys, ctx())
    assert out is not None
    before = [t.clone() for t in kv]
    cases = _bad_addressing(kv, caches)
    for job_id, (why, side) in enumerate(cases, start=10):
        assert worker.submit_store(job_id, side, out.store_spec), why
        assert finish(worker, job_id) == [(job_id, False)], why
        assert worker.submit_load(job_id + 100, out.store_spec, side), why
        assert finish(worker, job_id + 100) == [(job_id + 100, False)], why
    for tensor, original in zip(kv, before, strict=True):
        assert torch.equal(tensor, original)  # a refused load wrote nothing
    manager.complete_store(keys, ctx(), success=False)
