"""Two real ``vllm serve`` processes sharing one ``kvtiers serve`` pool (docs/service.md).

The service runs in its own process over a ``/dev/shm`` pool; both servers have a
one-tier stack ``kind: service``. Server A answers the prompts (its chunks go to the
pool); server B, running beside it, answers them again: every full block is an
external hit for vLLM (loaded from the pool, nothing recomputed) and the outputs are
identical. Then the service is killed (``kill -9``): B answers a new prompt (every
lookup misses, it recomputes) with no request stuck; the service is started again over
the same pool, re-adopts the chunks after checking them, and B's answers to the first
prompts are hits again, identical.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
import urllib.request
from pathlib import Path

import pytest

from kvtiers.service.client import read_status
from kvtiers.testing.serve import VllmServer, kv_transfer_config
from kvtiers.testing.service import ServiceProcess, remove_pool
from tests.e2e.conftest import SERVER_ENV, SUMMARY
from tests.e2e.tiny_model import SPECIALS, VOCAB

BLOCK = 32
FULL_BLOCKS = 6
PROMPTS = [
    [random.Random(seed).randrange(len(SPECIALS), VOCAB) for _ in range(FULL_BLOCKS * BLOCK + 5)]
    for seed in range(3)
]
FRESH = [random.Random(99).randrange(len(SPECIALS), VOCAB) for _ in range(FULL_BLOCKS * BLOCK + 5)]
HIT_TOKENS = len(PROMPTS) * FULL_BLOCKS * BLOCK

pytestmark = pytest.mark.timeout(900)


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


def _timed(server: VllmServer, prompts: list[list[int]], times: list[float]) -> list[str]:
    """Answers to ``prompts``; each request's wall time (ms) appended to ``times``."""
    answers = []
    for prompt in prompts:
        start = time.perf_counter()
        answers.append(_complete(server, prompt))
        times.append((time.perf_counter() - start) * 1e3)
    return answers


def _hits(server: VllmServer) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0)


def _reset_local(server: VllmServer) -> None:
    """Empty the server's own prefix cache (vLLM's dev endpoint; the connector's cache,
    the pool, is left alone). vLLM refuses while blocks are held: ask until it agrees."""
    for _ in range(100):
        request = urllib.request.Request(f"{server.url}/reset_prefix_cache", b"",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            if json.loads(response.read()).get("success"):
                return
    pytest.fail("vLLM refused to reset its prefix cache 100 times")


def _server(model: Path, workdir: Path, name: str, stack: Path) -> VllmServer:
    return VllmServer(
        model,
        ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "1024",
         "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
         "--shutdown-timeout", "60", "--kv-transfer-config", kv_transfer_config(stack)],
        log=workdir / f"{name}.log", env={**SERVER_ENV, "VLLM_SERVER_DEV_MODE": "1"},
    )


def test_two_servers_share_prefixes_through_the_service(model_dir: Path, tmp_path: Path
                                                         ) -> None:
    pool = f"kvtiers-e2e-{os.getpid()}"
    config = tmp_path / "serve.yaml"
    config.write_text(f"tiers:\n  - kind: cpu\n    capacity: 256MiB\n"
                      f"    shared_memory_name: {pool}\n")
    # The tiny model's chunk (one block of 32 tokens) fits a 1 MiB slot with room.
    service = ServiceProcess(config, tmp_path / "serve.sock", slot_bytes=1 << 20)
    stack = tmp_path / "engine.yaml"
    stack.write_text(json.dumps({"tiers": [{"kind": "service", "socket": str(service.socket),
                                            "retry_s": 0.05}]}))
    service.start(fresh=True)
    try:
        with _server(model_dir, tmp_path, "a", stack) as first, \
                _server(model_dir, tmp_path, "b", stack) as second:
            times: dict[str, list[float]] = {"computed": [], "local hit": [], "pool hit": [],
                                              "re-adopted hit": []}
            texts = _timed(first, PROMPTS, times["computed"])
            assert _hits(first) == 0
            assert _timed(first, PROMPTS, times["local hit"]) == texts  # vLLM's own cache
            assert _timed(second, PROMPTS, times["pool hit"]) == texts
            assert _hits(second) == HIT_TOKENS
            state = read_status(service.socket)
            assert len(state["engines"]) >= 2
            assert sum(ns["chunks"] for ns in state["namespaces"]) >= len(PROMPTS) * FULL_BLOCKS

            service.kill()
            before = _hits(second)
            # Nothing waits on the dead service: the new prompt is computed.
            fresh = _complete(second, FRESH)
            assert _hits(second) == before

            assert f"adopted {state['ready_slots']}" in service.start()
            # B forgets its own prefix cache: the prompts can only come from the pool,
            # re-adopted by the restarted service, which B reattaches to at its next call.
            _reset_local(second)
            assert _timed(second, PROMPTS, times["re-adopted hit"]) == texts
            assert _hits(second) == before + HIT_TOKENS
            # Indicative only (a tiny model on a shared CPU; requests of 8 tokens):
            SUMMARY.append("service e2e, median ms per request: " + ", ".join(
                f"{name} {statistics.median(values):.0f}" for name, values in times.items()))
            assert _complete(first, FRESH) == fresh
    finally:
        if service.proc is not None and service.proc.poll() is None:
            service.stop()
        remove_pool(pool)
