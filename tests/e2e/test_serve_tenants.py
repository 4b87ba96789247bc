"""Tenants through a real ``vllm serve`` (route 1): two tenants sending the same prompt,
named by ``kv_transfer_params`` in the completions request body.

vLLM's own GPU prefix cache is tenant-blind, so each request runs on a server of its own
over one cpu + file stack (the file root outlives them, as in tests/e2e/test_serve.py):
tenant ``search`` stores the prompt; on a new server tenant ``batch`` sends the same tokens
and loads nothing from the stack (and stores its own copy, under its scoped keys); on a
third server ``search`` loads every full block back.
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
FULL_BLOCKS = 8
PROMPT = [random.Random(7).randrange(len(SPECIALS), VOCAB) for _ in range(FULL_BLOCKS * BLOCK + 5)]

pytestmark = pytest.mark.timeout(600)


def _serve(model: Path, workdir: Path, name: str, root: Path, tenant: str) -> dict[str, Any]:
    """A server over the stack on ``root`` answers ``PROMPT`` once as ``tenant`` and
    stops; what it answered and both counters."""
    port = free_port()
    stack = workdir / f"{name}.yaml"
    stack.write_text(json.dumps({
        "tiers": [
            {"kind": "cpu", "capacity": "64MiB"},
            {"kind": "file", "root": str(root), "threads": 2},
        ],
        "tenants": {"members": [{"name": "search"}, {"name": "batch"}]},
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
        body = json.dumps({
            "model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "kv_transfer_params": {"kvtiers_tenant": tenant},
        }).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        vllm = server.metrics()
        kvtiers = scrape(f"http://127.0.0.1:{port}/metrics")
    return {"text": text, "vllm": vllm, "kvtiers": kvtiers}


def _hits(result: dict[str, Any]) -> float:
    return float(result["vllm"].get("vllm:external_prefix_cache_hits_total", 0))


def test_a_tenant_never_loads_another_tenants_prompt_and_loads_its_own(
    model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    first = _serve(model_dir, tmp_path, "search-1", root, "search")
    assert _hits(first) == 0
    assert len(list(root.rglob("*.kvc"))) == FULL_BLOCKS

    other = _serve(model_dir, tmp_path, "batch", root, "batch")
    assert _hits(other) == 0, "the other tenant loaded the first tenant's chunks"
    assert other["text"] == first["text"]
    # Its own copy, under its own keys, beside the first tenant's.
    assert len(list(root.rglob("*.kvc"))) == 2 * FULL_BLOCKS

    again = _serve(model_dir, tmp_path, "search-2", root, "search")
    assert _hits(again) == FULL_BLOCKS * BLOCK
    assert again["text"] == first["text"]
