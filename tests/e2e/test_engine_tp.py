"""Real vLLM engines (the CPU build) with ``KVTiersOffloadingSpec`` over two tensor-parallel
ranks: each rank a worker process of vLLM's multiprocessing executor, both copying their
shard of every chunk into the shared CPU tier, one scheduler-side stack cascading and
promoting whole chunks.

Two engine processes, the prompts and geometry of ``tests/e2e/test_engine.py``:

* ``tp_first``: a two-rank engine without offloading (the reference tokens: two ranks sum
  their partial results in another order than one rank, so one rank's tokens are not the
  reference), then a two-rank cpu + file engine on an empty file root;
* ``tp_second`` (a restart): a two-rank cpu + file engine on that root, then a one-rank
  engine on it (another tensor-parallel size: a cold miss).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import result, run_engines, summarize
from tests.e2e.test_engine import (
    BLOCK,
    BLOCKS_PER_PROMPT,
    CHUNK_PAYLOAD,
    CHUNKS,
    HEADER,
    PROMPTS,
    _cpu_file,
    _engine,
)

RANKS = 2
#: Prompt tokens every restarted engine should load: every block of every prompt.
PROMPT_TOKENS = BLOCKS_PER_PROMPT * BLOCK

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines-tp")


@pytest.fixture(scope="module")
def first(workdir: Path, model_dir: Path) -> dict[str, Any]:
    return run_engines(
        workdir,
        "tp_first",
        [
            _engine("tp2_reference", model_dir, None, tensor_parallel_size=RANKS),
            _engine("tp2_cold", model_dir, _cpu_file(workdir / "root"),
                    tensor_parallel_size=RANKS),
        ],
    )


@pytest.fixture(scope="module")
def second(workdir: Path, model_dir: Path, first: dict[str, Any]) -> dict[str, Any]:
    root = workdir / "root"
    return run_engines(
        workdir,
        "tp_second",
        [
            _engine("tp2_restart", model_dir, _cpu_file(root), tensor_parallel_size=RANKS),
            _engine("tp1_on_tp2", model_dir, _cpu_file(root)),
        ],
    )


def test_two_ranks_store_every_chunk_whole_with_reference_tokens(
    first: dict[str, Any], workdir: Path
) -> None:
    reference = result(first, "tp2_reference")["tokens"]
    res = result(first, "tp2_cold")
    summarize("tp2_cold", res, reference)
    assert len({tuple(tokens) for tokens in reference}) == PROMPTS
    assert res["tokens"] == reference
    # vLLM adds up both ranks' bytes: every chunk, both shards.
    assert res["vllm"]["vllm:kv_offload_store_bytes"] == CHUNKS * CHUNK_PAYLOAD
    kv = res["kvtiers"]
    assert (kv["cascades"], kv["corrupt_chunks"]) == (CHUNKS, 0)
    # One blob per chunk, holding both ranks' shards.
    files = sorted((workdir / "root").rglob("*.kvc"))
    assert len(files) == CHUNKS
    assert {f.stat().st_size for f in files} == {HEADER + CHUNK_PAYLOAD}


def test_a_restart_on_two_ranks_loads_every_prefix_with_reference_tokens(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    reference = result(first, "tp2_reference")["tokens"]
    res = result(second, "tp2_restart")
    summarize("tp2_restart", res, reference)
    assert res["tokens"] == reference
    assert res["num_cached_tokens"] == [PROMPT_TOKENS] * PROMPTS
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == PROMPTS * PROMPT_TOKENS
    assert res["vllm"]["vllm:kv_offload_load_bytes"] == CHUNKS * CHUNK_PAYLOAD
    assert (res["kvtiers"]["promotions"], res["kvtiers"]["corrupt_chunks"]) == (CHUNKS, 0)


def test_a_tensor_parallel_change_is_a_cold_miss(second: dict[str, Any]) -> None:
    res = result(second, "tp1_on_tp2")
    summarize("tp1_on_tp2", res, None)
    assert res["vllm"].get("vllm:external_prefix_cache_hits", 0) == 0
    assert res["kvtiers"]["promotions"] == 0
    assert res["vllm"]["vllm:kv_offload_store_bytes"] == CHUNKS * CHUNK_PAYLOAD
