"""Real vLLM engines (the CPU build) on models with two KV-cache groups of different kinds.

The model (:func:`~tests.e2e.tiny_model.make_tiny_gemma3`) has a sliding-window layer and
a full-attention layer, so vLLM gives it two KV-cache groups of different kinds: group 0
(sliding window, 64 tokens) and group 1 (full attention). Each format of :data:`FORMATS`
(fp8 KV in both encodings the CPU build offers, and a bfloat16 model) runs:

* ``first`` process: an engine without offloading (the reference tokens; for
  ``fp8_e5m2`` the cold engine's own tokens are the reference, an engine start saved:
  a cold engine loads nothing, and the other formats show it gives the same tokens as
  one without offloading), then a cpu + file engine on an empty file root (cold: it must
  store every group);
* ``second`` process (a restart): cpu + file on a copy of that root, in which one
  full-attention chunk of prompt 0 and one sliding-window chunk of prompt 1 were damaged
  (the first root stays as the cold engine left it, for ``kvtiers inspect``); and an engine
  with the other fp8 encoding on a copy of the e4m3 root (an identity change).

What vLLM stores of the sliding-window group is the window before a prompt's end (the
blocks still held when the prefill ends), so a prefix is loadable only in whole: a
damaged chunk of either group leaves its prompt nothing to load in ANY group (the
full-attention chunks before the damage are useless without the sliding-window KV at
that point) and the prompt is recomputed, with identical tokens. The transfer record
(``record_transfers`` in :mod:`tests.e2e.engine_run`) checks this per group: a prompt
that loads ``h`` chunks loads chunks ``0..h-1`` of the full-attention group and the
window before ``h`` of the sliding-window group, nothing else; one group's chunks never
load beside another group's recompute of the same tokens.

fp8 KV on the CPU build needs x86 with AVX-512 or AMX (vLLM refuses it otherwise): the fp8
formats skip, saying so, on other machines (docs/vllm.md, "Model shapes on the CPU build").

A Mamba-style hybrid runs the same way, in float32: a tiny LFM2
(:func:`~tests.e2e.tiny_model.make_tiny_lfm2`), whose group 0 is the short-convolution
layer's state (vLLM stores the state at one block boundary, the prompt's last full block,
and loads it there) and group 1 full attention; a cold engine and a restart with one
attention chunk of prompt 0 and the state chunk of prompt 1 damaged, against an engine
without offloading. Its prompts are
9 blocks and one token, so only one token is recomputed after a load and the next tokens
depend on the loaded state. Its prompts run one at a time: vLLM's CPU build gives LFM2
other greedy tokens for a prompt when other prompts share its batch, without offloading
as well (docs/vllm.md), so only one-prompt batches have a reference to compare with.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtiers.filemapper.mapper import key_from_chunk_name
from tests.e2e.conftest import REPO, result, run_engines, summarize
from tests.e2e.tiny_model import (
    SLIDING_WINDOW,
    SPECIALS,
    VOCAB,
    make_tiny_gemma3,
    make_tiny_lfm2,
)

BLOCK = 32
PROMPTS = 4
BLOCKS_PER_PROMPT = 10
PROMPT_TOKENS = BLOCKS_PER_PROMPT * BLOCK
#: The chunks a restart can load of a whole prompt: vLLM recomputes the last prompt token
#: when a sliding-window group is offloaded, so the hit ends at the last full chunk before
#: it.
HIT_CHUNKS = (PROMPT_TOKENS - 1) // BLOCK
WINDOW_CHUNKS = SLIDING_WINDOW // BLOCK
SLIDING, FULL = 0, 1
#: Every persisted chunk starts with a header of this size (docs/on-disk-format.md).
HEADER = 4096
#: (prompt, group, chunk position) of each chunk damaged before the restart.
DAMAGED = ((0, FULL, 4), (1, SLIDING, HIT_CHUNKS - 1))
#: name -> the engine settings of one KV format.
FORMATS: dict[str, dict[str, Any]] = {
    "fp8_e4m3": {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"},
    "fp8_e5m2": {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"},
    "bfloat16": {"dtype": "bfloat16"},
}
#: Bytes per token of one group's chunk (one layer x (K, V) x 2 KV heads x 32 dims).
BYTES_PER_ELEMENT = {"fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2}
#: The formats with an engine without offloading for their reference tokens.
REFERENCED = ("fp8_e4m3", "bfloat16")
#: The LFM2 prompts: 9 blocks and one token each, every prompt its own.
LFM2_PROMPT_TOKENS = 9 * BLOCK + 1
LFM2_HIT_CHUNKS = (LFM2_PROMPT_TOKENS - 1) // BLOCK
STATE, ATTENTION = 0, 1
#: LFM2's bytes per block of each group (the state: 2 conv positions x 128 dims x 4 B;
#: attention: (K, V) x 2 KV heads x 32 dims x 4 B x 32 tokens). Through vLLM's
#: OffloadingConnector kvtiers' scheduler side cannot derive them (docs/vllm.md).
LFM2_GROUP_BYTES = [2 * 128 * 4, 2 * 2 * 32 * 4 * BLOCK]
LFM2_DAMAGED = ((0, ATTENTION, 4), (1, STATE, LFM2_HIT_CHUNKS - 1))

pytestmark = pytest.mark.timeout(1200)


def _fp8_runs() -> bool:
    """Whether the CPU build runs fp8 KV here (x86 with AVX-512 or AMX)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def _formats() -> list[str]:
    return [name for name in FORMATS if not name.startswith("fp8") or _fp8_runs()]


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(SPECIALS), VOCAB) for _ in range(n)]


SHARED_TAIL = _ids(1000, BLOCK)
PROMPT_IDS = [_ids(i, PROMPT_TOKENS - BLOCK) + SHARED_TAIL for i in range(PROMPTS)]
LFM2_PROMPT_IDS = [_ids(100 + i, LFM2_PROMPT_TOKENS) for i in range(PROMPTS)]


def _reference(first: dict[str, Any], fmt: str) -> list[list[int]]:
    name = f"ref_{fmt}" if fmt in REFERENCED else f"cold_{fmt}"
    return result(first, name)["tokens"]


def _lfm2_engine(name: str, model: Path, root: Path) -> dict[str, Any]:
    run = _engine(name, model, "bfloat16", root)
    # One prompt at a time: the CPU build's LFM2 gives other greedy tokens for a prompt
    # when other requests share its batch, without offloading too (docs/vllm.md).
    run.update(dtype="float32", prompts=LFM2_PROMPT_IDS, one_at_a_time=True,
               extra_config={"kvtiers_group_bytes_per_block": LFM2_GROUP_BYTES})
    return run


def _engine(name: str, model: Path, fmt: str, root: Path | None) -> dict[str, Any]:
    stack = None
    if root is not None:
        stack = {
            "tiers": [
                {"kind": "cpu", "capacity": "64MiB", "policy": "arc"},
                {"kind": "file", "root": str(root), "threads": 2},
            ]
        }
    return {
        "name": name,
        "model": str(model),
        "revision": None,
        "block_size": BLOCK,
        "max_model_len": 1024,
        "stack": stack,
        "prompts": PROMPT_IDS,
        "max_tokens": 16,
        "record_transfers": True,
        **FORMATS[fmt],
    }


def _damage(root: Path, key_hex: str) -> None:
    """Flip one payload byte of the chunk file of key ``key_hex`` under ``root``."""
    paths = [
        p for p in root.rglob("*.kvc") if (key_from_chunk_name(p.name) or b"").hex() == key_hex
    ]
    assert len(paths) == 1, f"chunk {key_hex} not found once under {root}: {paths}"
    with paths[0].open("r+b") as f:
        f.seek(HEADER + 10)
        byte = f.read(1)
        f.seek(HEADER + 10)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("groups")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lfm2(tmp_path_factory.mktemp("tiny-lfm2"))


@pytest.fixture(scope="module")
def first(workdir: Path, gemma: Path, lfm2: Path) -> dict[str, Any]:
    engines = []
    for fmt in _formats():
        if fmt in REFERENCED:
            engines.append(_engine(f"ref_{fmt}", gemma, fmt, None))
        engines.append(_engine(f"cold_{fmt}", gemma, fmt, workdir / f"root-{fmt}"))
    engines.append(dict(_lfm2_engine("ref_lfm2", lfm2, workdir), stack=None))
    engines.append(_lfm2_engine("cold_lfm2", lfm2, workdir / "root-lfm2"))
    return run_engines(workdir, "groups-first", engines)


@pytest.fixture(scope="module")
def second(workdir: Path, gemma: Path, lfm2: Path, first: dict[str, Any]) -> dict[str, Any]:
    engines = []
    formats = _formats()
    if "fp8_e4m3" in formats:
        shutil.copytree(workdir / "root-fp8_e4m3", workdir / "root-identity")
        engines.append(_engine("kv_dtype_changed", gemma, "fp8_e5m2", workdir / "root-identity"))
    for fmt in formats:
        keys = result(first, f"cold_{fmt}")["transfers"]["keys"]
        restart_root = workdir / f"root-{fmt}-restart"
        shutil.copytree(workdir / f"root-{fmt}", restart_root)
        for prompt, group, position in DAMAGED:
            _damage(restart_root, keys[prompt][group][str(position)])
        engines.append(_engine(f"restart_{fmt}", gemma, fmt, restart_root))
    keys = result(first, "cold_lfm2")["transfers"]["keys"]
    shutil.copytree(workdir / "root-lfm2", workdir / "root-lfm2-restart")
    for prompt, group, position in LFM2_DAMAGED:
        _damage(workdir / "root-lfm2-restart", keys[prompt][group][str(position)])
    engines.append(_lfm2_engine("restart_lfm2", lfm2, workdir / "root-lfm2-restart"))
    return run_engines(workdir, "groups-second", engines)


def _expected_loads(hit_chunks: int, window_chunks: int = WINDOW_CHUNKS) -> list[list[int]]:
    """What a prompt whose hit is ``hit_chunks`` chunks loads of each group: the last
    ``window_chunks`` before the hit of group 0 (the sliding window; 1 for a state),
    every chunk before it of group 1 (full attention)."""
    if hit_chunks == 0:
        return [[], []]
    return [list(range(hit_chunks - window_chunks, hit_chunks)), list(range(hit_chunks))]


def test_fp8_formats_run_where_the_cpu_build_offers_them() -> None:
    if not _fp8_runs():
        pytest.skip("fp8 KV on vLLM's CPU build needs x86 with AVX-512 or AMX; this CPU has "
                    "neither (docs/vllm.md, 'Model shapes on the CPU build')")
    assert set(_formats()) == set(FORMATS)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cold_engine_gives_reference_tokens_and_stores_every_group(
    first: dict[str, Any], fmt: str
) -> None:
    if fmt not in _formats():
        pytest.skip("fp8 KV needs AVX-512 or AMX on the CPU build")
    reference = _reference(first, fmt)
    if fmt in REFERENCED:
        summarize(f"ref_{fmt}", result(first, f"ref_{fmt}"), None)
    res = result(first, f"cold_{fmt}")
    summarize(f"cold_{fmt}", res, reference)
    # Every prompt ends with the same block: different outputs come from the prefixes.
    assert len({tuple(tokens) for tokens in reference}) == PROMPTS
    assert res["tokens"] == reference
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == 0
    stores = res["transfers"]["stores"]
    for prompt in range(PROMPTS):
        # The sliding-window group: the window before the prompt's last full block is
        # what its GPU blocks still hold when the prefill ends.
        assert sorted(stores[prompt][SLIDING]) == list(
            range(BLOCKS_PER_PROMPT - 1 - WINDOW_CHUNKS, BLOCKS_PER_PROMPT - 1)
        ), stores[prompt]
        assert sorted(stores[prompt][FULL]) == list(range(BLOCKS_PER_PROMPT)), stores[prompt]
    chunks = PROMPTS * (WINDOW_CHUNKS + BLOCKS_PER_PROMPT)
    chunk_bytes = 2 * 2 * 32 * BYTES_PER_ELEMENT[fmt] * BLOCK
    assert res["vllm"]["vllm:kv_offload_store_bytes"] == chunks * chunk_bytes
    kv = res["kvtiers"]
    assert kv["cpu.stores"] == chunks
    assert kv["file.stores"] == chunks
    assert kv["cascade_failures"] == 0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_restart_loads_whole_prefixes_and_a_damaged_chunk_of_either_group_recomputes_all(
    first: dict[str, Any], second: dict[str, Any], fmt: str
) -> None:
    if fmt not in _formats():
        pytest.skip("fp8 KV needs AVX-512 or AMX on the CPU build")
    reference = _reference(first, fmt)
    res = result(second, f"restart_{fmt}")
    summarize(f"restart_{fmt}", res, reference)
    assert res["tokens"] == reference
    loads = res["transfers"]["loads"]
    damaged = {prompt for prompt, _, _ in DAMAGED}
    for prompt in range(PROMPTS):
        cached = res["num_cached_tokens"][prompt]
        assert cached % BLOCK == 0, (prompt, cached)
        # All or nothing across groups: what each group loads is exactly what the hit
        # needs of it; a chunk past the hit in any group, or one missing before it, would
        # put loaded KV beside recomputed KV for the same tokens.
        assert [sorted(group) for group in loads[prompt]] == _expected_loads(cached // BLOCK), (
            prompt, cached, loads[prompt]
        )
        assert cached == (0 if prompt in damaged else HIT_CHUNKS * BLOCK), (prompt, cached)
    intact = PROMPTS - len(damaged)
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == intact * HIT_CHUNKS * BLOCK
    kv = res["kvtiers"]
    assert kv["corrupt_chunks"] == len(DAMAGED)
    assert kv["file.promoted"] >= intact * (HIT_CHUNKS + WINDOW_CHUNKS)


def test_a_kv_dtype_change_is_a_cold_miss(second: dict[str, Any]) -> None:
    if "fp8_e4m3" not in _formats():
        pytest.skip("fp8 KV needs AVX-512 or AMX on the CPU build")
    res = result(second, "kv_dtype_changed")
    summarize("kv_dtype_changed", res, None)
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == 0
    kv = res["kvtiers"]
    assert kv["file.hits"] == 0
    assert kv.get("file.promoted", 0) == 0
    # The file tier opened a namespace of its own beside the e4m3 one.
    assert kv["file.stores"] > 0
    assert kv["file.chunks"] == kv["file.stores"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_inspect_shows_each_group(first: dict[str, Any], workdir: Path, fmt: str) -> None:
    if fmt not in _formats():
        pytest.skip("fp8 KV needs AVX-512 or AMX on the CPU build")
    result(first, f"cold_{fmt}")
    out = subprocess.run(
        [sys.executable, "-m", "kvtiers", "inspect", "--json", str(workdir / f"root-{fmt}")],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    (namespace,) = json.loads(out)["namespaces"]
    kv_dtype = FORMATS[fmt].get("kv_cache_dtype", fmt)
    assert namespace["manifest"]["identity"]["kv_dtype"] == kv_dtype
    assert namespace["groups"] == [
        {"attention": f"sliding_window:{SLIDING_WINDOW}", "layers": 1,
         "chunks": PROMPTS * WINDOW_CHUNKS},
        {"attention": "full", "layers": 1, "chunks": PROMPTS * BLOCKS_PER_PROMPT},
    ]
    text = subprocess.run(
        [sys.executable, "-m", "kvtiers", "inspect", str(workdir / f"root-{fmt}")],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout
    assert f"group 0 sliding_window:{SLIDING_WINDOW}" in text
    assert f"{PROMPTS * WINDOW_CHUNKS} chunks" in text
    assert "group 1 full" in text


def test_a_hybrid_cold_engine_stores_the_state_and_every_attention_chunk(
    first: dict[str, Any],
) -> None:
    reference = result(first, "ref_lfm2")["tokens"]
    summarize("ref_lfm2", result(first, "ref_lfm2"), None)
    res = result(first, "cold_lfm2")
    summarize("cold_lfm2", res, reference)
    assert len({tuple(tokens) for tokens in reference}) == PROMPTS
    assert res["tokens"] == reference
    assert res["vllm"]["vllm:external_prefix_cache_hits"] == 0
    for prompt, stores in enumerate(res["transfers"]["stores"]):
        # The state at the prompt's last full block; attention for every full block.
        assert sorted(stores[STATE]) == [LFM2_HIT_CHUNKS - 1], (prompt, stores)
        assert sorted(stores[ATTENTION]) == list(range(LFM2_HIT_CHUNKS)), (prompt, stores)
    kv = res["kvtiers"]
    assert kv["file.stores"] == PROMPTS * (1 + LFM2_HIT_CHUNKS)
    assert kv["cascade_failures"] == 0


def test_a_hybrid_restart_loads_state_and_attention_together_or_neither(
    first: dict[str, Any], second: dict[str, Any]
) -> None:
    reference = result(first, "ref_lfm2")["tokens"]
    res = result(second, "restart_lfm2")
    summarize("restart_lfm2", res, reference)
    assert res["tokens"] == reference
    loads = res["transfers"]["loads"]
    damaged = {prompt for prompt, _, _ in LFM2_DAMAGED}
    for prompt in range(PROMPTS):
        cached = res["num_cached_tokens"][prompt]
        assert [sorted(group) for group in loads[prompt]] == _expected_loads(
            cached // BLOCK, 1
        ), (prompt, cached, loads[prompt])
        assert cached == (0 if prompt in damaged else LFM2_HIT_CHUNKS * BLOCK), (prompt, cached)
    assert res["kvtiers"]["corrupt_chunks"] == len(LFM2_DAMAGED)
