"""Real vLLM engines (the CPU build) with ``KVTiersOffloadingSpec``: tokens, restarts, damage.

Two engine processes serve every test (engine start-ups are the cost here):

* ``first``: an engine without offloading (the reference tokens), then a cpu + file and
  a cpu + file + s3 engine, each on an empty file root, all on the same prompts;
* ``second`` (a restart): cpu + file on the first file root; the same on a copy of it
  through ``KVTiersConnector`` (the connector that hands kvtiers the engine's configs: the
  same identity as vLLM's own connector gives); the same on another copy, with the prefix
  cache and kvtiers' cache reset while the requests load and run; cpu + file + s3 on an
  EMPTY file root (so hits must come from the bucket); cpu + file on a copy of the first
  root with every chunk damaged; and cpu + file on the first root with the block size, the
  dtype, the revision, the load format (random weights) or the model config
  (``--hf-config-path`` with another ``rms_norm_eps``) changed.

Prompts are 320 tokens (10 blocks of 32): 9 blocks of their own, then one block every
prompt shares, so a prompt's output depends on KV that only its own prefix produced (the
reference test checks the outputs differ), and "identical tokens" means the loaded KV was
the right KV.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import result, run_engines, summarize
from tests.e2e.tiny_model import SPECIALS, VOCAB

BLOCK = 32
PROMPTS = 4
BLOCKS_PER_PROMPT = 10
CHUNKS = PROMPTS * BLOCKS_PER_PROMPT
#: Bytes of one chunk of the tiny model: 2 layers x (K, V) x 2 KV heads x 32 dims x 4 B
#: per token, 32 tokens.
CHUNK_PAYLOAD = 2 * 2 * 2 * 32 * 4 * BLOCK
#: Every persisted chunk starts with a header of this size (docs/on-disk-format.md).
HEADER = 4096

# The first test of each process group waits for all of its engines (about 10 s each).
pytestmark = pytest.mark.timeout(1200)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIALS), VOCAB) for _ in range(n)]


SHARED_TAIL = _ids(1000, BLOCK)
PROMPT_IDS = [
    _ids(i, (BLOCKS_PER_PROMPT - 1) * BLOCK) + SHARED_TAIL for i in range(PROMPTS)
]


def _engine(name: str, model: Path, stack: dict[str, Any] | None, **overrides: Any) -> dict:
    return {
        "name": name,
        "model": str(model),
        "revision": None,
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": 1024,
        "stack": stack,
        "prompts": PROMPT_IDS,
        "max_tokens": 16,
        **overrides,
    }


def _cpu_file(root: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"kind": "cpu", "capacity": "64MiB", "policy": "arc"},
            {"kind": "file", "root": str(root), "threads": 2},
        ]
    }


#: One cpu tier: the vLLM adapter calls it directly (no composite in the way).
CPU_ONLY: dict[str, Any] = {"tiers": [{"kind": "cpu", "capacity": "64MiB", "policy": "arc"}]}


def _cpu_file_s3(root: Path, s3: tuple[str, str]) -> dict[str, Any]:
    endpoint, bucket = s3
    stack = _cpu_file(root)
    stack["tiers"].append(
        {"kind": "s3", "bucket": bucket, "prefix": "e2e", "endpoint_url": endpoint,
         "threads": 2}
    )
    return stack


def _damage_every_chunk(root: Path) -> int:
    """Flip one payload byte of every chunk file under ``root``; how many were damaged."""
    chunks = sorted(root.rglob("*.kvc"))
    for path in chunks:
        with path.open("r+b") as f:
            f.seek(HEADER + 100)
            byte = f.read(1)
            f.seek(HEADER + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
    return len(chunks)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def first(workdir: Path, model_dir: Path, s3_bucket: tuple[str, str]) -> dict[str, Any]:
    return run_engines(
        workdir,
        "first",
        [
            _engine("reference", model_dir, None),
            _engine("file_cold", model_dir, _cpu_file(workdir / "root-file")),
            _engine("s3_cold", model_dir, _cpu_file_s3(workdir / "root-s3", s3_bucket)),
            _engine("cpu_cold", model_dir, CPU_ONLY),
            _engine(
                "cpu_reset_mid_run", model_dir, CPU_ONLY, reset_after_steps=1,
                reset_max_steps=5000,
            ),
        ],
    )


@pytest.fixture(scope="module")
def reference(first: dict[str, Any]) -> list[list[int]]:
    return result(first, "reference")["tokens"]


@pytest.fixture(scope="module")
def second(
    workdir: Path, model_dir: Path, s3_bucket: tuple[str, str], first: dict[str, Any]
) -> dict[str, Any]:
    root = workdir / "root-file"
    damaged = workdir / "root-damaged"
    shutil.copytree(root, damaged)
    shutil.copytree(root, workdir / "root-reset")
    shutil.copytree(root, workdir / "root-connector")
    first["_damaged_chunks"] = _damage_every_chunk(damaged)
    other_config = workdir / "hf-config"
    other_config.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 1000
    (other_config / "config.json").write_text(json.dumps(config))
    return run_engines(
        workdir,
        "second",
        [
            _engine("file_restart", model_dir, _cpu_file(root)),
            _engine(
                "connector_restart", model_dir, _cpu_file(workdir / "root-connector"),
                connector="KVTiersConnector",
            ),
            _engine(
                "reset_mid_run", model_dir, _cpu_file(workdir / "root-reset"),
                reset_after_steps=1, reset_max_steps=5000,
            ),
            _engine("s3_restart", model_dir, _cpu_file_s3(workdir / "root-empty", s3_bucket)),
            _engine("damaged", model_dir, _cpu_file(damaged)),
            _engine("block_size_64", model_dir, _cpu_file(root), block_size=64),
            _engine("bfloat16", model_dir, _cpu_file(root), dtype="bfloat16"),
            _engine("revision_r2", model_dir, _cpu_file(root), revision="r2"),
            _engine("dummy_weights", model_dir, _cpu_file(root), load_format="dummy"),
            _engine(
                "hf_config_path", model_dir, _cpu_file(root), hf_config_path=str(other_config)
            ),
        ],
    )


def test_reference_outputs_depend_on_each_prompts_own_prefix(
    first: dict[str, Any], reference: list[list[int]]
) -> None:
    summarize("reference", result(first, "reference"), None)
    # Every prompt ends with the same block: different outputs come from the prefixes.
    assert len({tuple(tokens) for tokens in reference}) == PROMPTS
    assert all(len(tokens) == 16 for tokens in reference)


@pytest.mark.parametrize("name", ["file_cold", "s3_cold"])
def test_cold_engine_gives_reference_tokens_and_writes_every_tier(
    first: dict[str, Any], reference: list[list[int]], name: str
) -> None:
    res = result(first, name)
    summarize(name, res, reference)
    assert res["tokens"] == reference
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == 0
    assert res["vllm"]["vllm:kv_offload_store_bytes"] == CHUNKS * CHUNK_PAYLOAD
    kv = res["kvtiers"]
    assert kv["cpu.stores"] == CHUNKS
    assert kv["file.stores"] == CHUNKS
    if name == "s3_cold":
        assert kv["s3.stores"] == CHUNKS
    assert kv["cascade_failures"] == 0


def test_a_one_tier_cpu_engine_gives_reference_tokens_and_stores_every_chunk(
    first: dict[str, Any], reference: list[list[int]]
) -> None:
    res = result(first, "cpu_cold")
    summarize("cpu_cold", res, reference)
    assert res["tokens"] == reference
    assert res["vllm"]["vllm:kv_offload_store_bytes"] == CHUNKS * CHUNK_PAYLOAD
    kv = res["kvtiers"]
    assert kv["cpu.stores"] == CHUNKS
    assert kv["cpu.store_failures"] == 0


def test_a_reset_mid_run_of_a_one_tier_cpu_engine_leaves_no_request_stuck(
    first: dict[str, Any], reference: list[list[int]]
) -> None:
    res = result(first, "cpu_reset_mid_run")
    summarize("cpu_reset_mid_run", res, reference)
    reset = res["reset"]
    assert reset["unfinished_at_reset"] == PROMPTS
    assert not reset["unfinished"], f"requests still unfinished after the reset: {reset}"
    assert res["tokens"] == reference
    assert res["kvtiers"]["cpu.fenced_slots"] == 0


@pytest.mark.parametrize("name", ["file_restart", "connector_restart"])
def test_restart_loads_every_prefix_from_the_file_tier(
    second: dict[str, Any], reference: list[list[int]], name: str
) -> None:
    res = result(second, name)
    summarize(name, res, reference)
    assert res["tokens"] == reference
    # vLLM's side: every prompt token of every request came from the connector.
    assert res["num_cached_tokens"] == [BLOCKS_PER_PROMPT * BLOCK] * PROMPTS
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == CHUNKS * BLOCK
    assert res["vllm"]["vllm:kv_offload_load_bytes"] == CHUNKS * CHUNK_PAYLOAD
    # kvtiers' side: the CPU tier started empty; every chunk was promoted from files.
    kv = res["kvtiers"]
    assert kv["file.promoted"] == CHUNKS
    assert kv["promotion_failures"] == 0
    assert kv["corrupt_chunks"] == 0


def test_reset_prefix_cache_mid_run_leaves_no_request_stuck(
    second: dict[str, Any], reference: list[list[int]]
) -> None:
    res = result(second, "reset_mid_run")
    summarize("reset_mid_run", res, reference)
    reset = res["reset"]
    assert reset["unfinished_at_reset"] == PROMPTS
    assert not reset["unfinished"], f"requests still unfinished after the reset: {reset}"
    assert res["tokens"] == reference


def test_restart_on_an_empty_file_root_loads_from_s3(
    second: dict[str, Any], reference: list[list[int]]
) -> None:
    res = result(second, "s3_restart")
    summarize("s3_restart", res, reference)
    assert res["tokens"] == reference
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == CHUNKS * BLOCK
    kv = res["kvtiers"]
    assert kv["s3.promoted"] == CHUNKS
    assert kv.get("file.promoted", 0) == 0
    assert kv["corrupt_chunks"] == 0


def test_every_chunk_damaged_is_recomputed_with_identical_tokens(
    first: dict[str, Any], second: dict[str, Any], reference: list[list[int]]
) -> None:
    res = result(second, "damaged")
    summarize("damaged", res, reference)
    assert first["_damaged_chunks"] == CHUNKS
    assert res["tokens"] == reference
    kv = res["kvtiers"]
    assert kv["file.corrupt_chunks"] > 0
    assert kv["corrupt_chunks"] > 0
    assert kv.get("file.promoted", 0) == 0


@pytest.mark.parametrize(
    "name",
    [
        "block_size_64",
        "bfloat16",
        "revision_r2",
        "dummy_weights",
        "hf_config_path",
    ],
)
def test_identity_change_is_a_cold_miss(second: dict[str, Any], name: str) -> None:
    res = result(second, name)
    summarize(name, res, None)
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == 0
    kv = res["kvtiers"]
    assert kv["file.hits"] == 0
    assert kv.get("file.promoted", 0) == 0
    # The file tier opened an empty namespace: all it holds is what this engine stored.
    assert kv["file.stores"] > 0
    assert kv["file.chunks"] == kv["file.stores"]
