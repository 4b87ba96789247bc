"""``benchmarks/gpu_check.py``'s ``vllm-worker`` child where no GPU is: route 1's worker
driven the way the installed vLLM's connector drives it (vLLM 0.34: ``DevicePointers``
from vLLM's own ``resolve_device_pointers``; 0.32 and 0.33: ``GPULoadStoreSpec``) on CPU
tensors, whose host addresses the pointers then carry. The
class-level vLLM tests run on every vLLM release kvtiers supports (``make test``: 0.33 and
0.34; ``make e2e``: 0.32), so each release's submission is checked here. The rest of the
script is in ``tests/test_gpu_check.py``; the CUDA half of the step needs a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def test_the_vllm_worker_child_round_trips_route1_the_way_this_vllm_submits(
    tmp_path: Path,
) -> None:
    """On CPU tensors here (cuda:0 in virtual memory on a GPU machine): vLLM 0.34 hands
    the worker DevicePointers from its own resolve_device_pointers, 0.33 a
    GPULoadStoreSpec; either way every loaded byte is checked and a job outside the KV
    cache fails. kvikio is a skip line off CUDA."""
    from vllm.v1.kv_offload import base as vbase

    data = gpu_check.child_vllm_worker(tmp_path, device="cpu")
    assert data["allocation"] == "torch tensors on cpu"
    worker = data["worker"]
    assert worker["status"] == "passed", worker
    pointers = hasattr(vbase, "DevicePointers")
    assert worker["interface"] == ("DevicePointers" if pointers else "GPULoadStoreSpec")
    assert "every byte as stored; a job outside the KV cache failed" in worker["summary"]
    assert data["kvikio"] == {"status": "skipped", "summary": "skipped: the KV cache is on cpu"}
    result = gpu_check.judge_vllm_worker(data)
    assert result.status == "passed" and result.summary.startswith(
        "allocation: torch tensors on cpu; worker: vLLM ")


def _connector_swapping_the_loads(real: Any) -> Any:
    """A resolution that addresses the stores right and swaps group 0's first two blocks
    in every later job: what a worker moving bytes to the wrong blocks looks like."""
    from vllm.v1.kv_offload import base as vbase

    calls: list[Any] = []

    def resolve(spec: Any, kv_caches: Any) -> Any:
        calls.append(spec)
        if len(calls) > 1:
            ids = list(spec.block_ids)
            ids[0], ids[1] = ids[1], ids[0]
            spec = vbase.GPULoadStoreSpec(ids, group_sizes=list(spec.group_sizes),
                                          block_indices=list(spec.block_indices))
        return spec if real is None else real(spec, kv_caches)

    return resolve


def test_loaded_bytes_in_the_wrong_blocks_fail_the_worker_part() -> None:
    import torch
    from vllm.v1.kv_offload import base as vbase

    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers as real
    except ImportError:  # vLLM 0.32 / 0.33 hand the worker the spec itself
        real = None
    page = gpu_check.VLLM_PAGE_BYTES["cpu"]
    tensors, _ = gpu_check.allocate_kv_cache("cpu", gpu_check.VLLM_LAYERS,
                                             gpu_check.VLLM_BLOCKS, page, [])
    with pytest.raises(RuntimeError, match="loaded blocks differ from the stored ones"):
        gpu_check._drive_route1(vbase, tensors, page, _connector_swapping_the_loads(real))
    assert all(t.dtype == torch.int8 for t in tensors)


def test_a_worker_that_reports_a_job_outside_the_kv_cache_done_fails_the_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses

    from kvtiers.integrations.vllm import KVTiersWorker

    finished = KVTiersWorker.get_finished
    monkeypatch.setattr(KVTiersWorker, "get_finished", lambda self: [
        dataclasses.replace(result, success=True) for result in finished(self)])
    page = gpu_check.VLLM_PAGE_BYTES["cpu"]
    tensors, _ = gpu_check.allocate_kv_cache("cpu", gpu_check.VLLM_LAYERS,
                                             gpu_check.VLLM_BLOCKS, page, [])
    found = gpu_check.route1_worker_part(tensors, page)
    assert found["status"] == "failed"
    assert "a job addressing memory outside the KV cache succeeded" in found["summary"]


def test_without_vllm_the_worker_part_is_a_skip_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    found = gpu_check.route1_worker_part([], 256)
    assert found["status"] == "skipped"
    assert found["summary"].startswith("skipped: vLLM is not usable here (ModuleNotFoundError")
    assert "carry its wheel in .whl" in found["summary"]
