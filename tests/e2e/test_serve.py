"""A real ``vllm serve`` with route 1 over HTTP: restart, identical outputs, loads counted.

One server (vLLM's multiprocess engine core, as deployed) with a cpu + file stack
answers four prompts over the OpenAI completions API and is stopped (SIGINT with
``--shutdown-timeout``: vLLM drains, shuts the connector down, and kvtiers finishes its
cascades; with vLLM's default of 0 it kills the engine core and chunks still on their way
to the file tier are lost). A second server on the same file root answers them again: the
outputs must be identical, vLLM's Prometheus counter ``vllm:external_prefix_cache_hits``
must count every full block as loaded, and kvtiers' own exporter must count the
promotions from the file tier that served them.
"""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvtiers.testing.serve import VllmServer, free_port, kv_transfer_config, scrape
from tests.e2e.conftest import SERVER_ENV
from tests.e2e.tiny_model import SPECIALS, VOCAB

BLOCK = 32
#: Full blocks per prompt; each prompt has 5 tokens more, so all of them are computed.
FULL_BLOCKS = 8
#: Four prompts, no block shared between them.
PROMPTS = [
    [random.Random(seed).randrange(len(SPECIALS), VOCAB) for _ in range(FULL_BLOCKS * BLOCK + 5)]
    for seed in range(4)
]
CHUNKS = len(PROMPTS) * FULL_BLOCKS

pytestmark = pytest.mark.timeout(600)


def _complete(server: VllmServer, prompt: list[int]) -> str:
    body = json.dumps({
        "model": server.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True,
    }).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        text: str = json.loads(response.read())["choices"][0]["text"]
    return text


def _serve(model: Path, workdir: Path, name: str, root: Path) -> dict[str, Any]:
    """Start a server over a cpu + file stack on ``root``, send every prompt, read both
    counters, stop it; what it answered and counted."""
    port = free_port()
    stack = workdir / f"{name}.yaml"
    stack.write_text(json.dumps({
        "tiers": [
            {"kind": "cpu", "capacity": "64MiB"},
            {"kind": "file", "root": str(root), "threads": 2},
        ],
        "metrics": {"port": port, "refresh_s": 0},
    }))
    server = VllmServer(
        model,
        ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "1024",
         "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
         "--shutdown-timeout", "60", "--kv-transfer-config", kv_transfer_config(stack)],
        log=workdir / f"{name}.log", env=SERVER_ENV,
    )
    with server:
        texts = [_complete(server, prompt) for prompt in PROMPTS]
        vllm = server.metrics()
        kvtiers = scrape(f"http://127.0.0.1:{port}/metrics")
    return {"texts": texts, "vllm": vllm, "kvtiers": kvtiers}


def test_serve_restart_loads_the_prefixes(model_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = _serve(model_dir, tmp_path, "first", root)
    assert first["vllm"].get("vllm:external_prefix_cache_hits_total", 0) == 0
    assert len(set(first["texts"])) == len(PROMPTS), "prompts should give distinct outputs"
    stored = list(root.rglob("*.kvc"))
    # Every full block of every prompt is a chunk on disk once the first server stopped:
    # the drain let the last prompt's cascades finish.
    assert len(stored) == CHUNKS, f"{len(stored)} chunk files after the first server"

    second = _serve(model_dir, tmp_path, "second", root)
    assert second["texts"] == first["texts"]
    hits = second["vllm"].get("vllm:external_prefix_cache_hits_total", 0)
    assert hits == CHUNKS * BLOCK, f"vLLM counted {hits} external hit tokens"
    promotions = second["kvtiers"].get('kvtiers_stack_promotions_total{outcome="done"}', 0)
    assert promotions == CHUNKS, f"kvtiers promoted {promotions} chunks"
    assert second["kvtiers"].get("kvtiers_stack_corrupt_chunks_total", 0) == 0
