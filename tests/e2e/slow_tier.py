"""A real ``vllm serve`` over S3 behind a slow server: each request's time to first token
against recomputing its prompt, for tests/e2e/test_serve_slow_tier.py and the real-server
rows of benchmarks/results/promotion.md (``python -m tests.e2e.slow_tier``).

A first server (route 1, a cpu + s3 stack with ``promotion:`` and no seed for S3) answers
the *stored* prompts, writing their chunks to S3, and is stopped (its drain finishes the
cascades). A second server on the same bucket, its CPU tier empty, then answers each
stored prompt right after a *fresh* one of the same length (stored nowhere: its time to
first token is recomputing, measured in the same run, under the same load), while a
loopback proxy (tests/s3_fault_proxy.py) holds every S3 answer ``delay_s`` seconds.
Requests are streamed (time to first token: to the first streamed chunk) and carry
``kvtiers_promotion_deadline_s``; their texts must be the first server's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtiers.stack.cost import DEADLINE_PARAM
from kvtiers.testing.serve import VllmServer, free_port, kv_transfer_config, scrape
from tests.e2e.conftest import ENGINE_ENV, SERVER_ENV
from tests.e2e.tiny_model import SPECIALS, VOCAB
from tests.s3_fault_proxy import FaultProxy

BLOCK = 32
#: Full blocks per prompt (each prompt has 5 tokens more).
FULL_BLOCKS = 8
#: The deadline every request carries, seconds.
DEADLINE_S = 0.25
#: The prefill rate the stack file declares, tokens per second (recomputing a prompt's 256
#: stored tokens is taken to cost 0.128 s: the wait bound is that, below the deadline).
PREFILL_TOKENS_PER_S = 2000.0
#: Tokens generated per request.
MAX_TOKENS = 8


def prompt(seed: int) -> list[int]:
    """A prompt of ``FULL_BLOCKS`` blocks and 5 tokens, its own for each seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(len(SPECIALS), VOCAB) for _ in range(FULL_BLOCKS * BLOCK + 5)]


@dataclass
class SlowTierRun:
    """What one run measured: per stored prompt, the first server's text and the second's,
    and the second server's time to first token for it and for the fresh prompt sent just
    before it; kvtiers' counters on the second server."""

    delay_s: float
    first_texts: list[str] = field(default_factory=list)
    second_texts: list[str] = field(default_factory=list)
    ttft_stored_s: list[float] = field(default_factory=list)
    ttft_fresh_s: list[float] = field(default_factory=list)
    kvtiers: dict[str, float] = field(default_factory=dict)

    @property
    def worst_excess_s(self) -> float:
        """The slowest stored prompt's time to first token past the slowest fresh one's."""
        return max(self.ttft_stored_s) - max(self.ttft_fresh_s)

    def summary(self) -> dict[str, Any]:
        stored, fresh = sorted(self.ttft_stored_s), sorted(self.ttft_fresh_s)
        return {
            "delay_s": self.delay_s,
            "requests": len(stored),
            "stored_worst_s": stored[-1],
            "stored_p99_s": _p99(stored),
            "stored_median_s": statistics.median(stored),
            "recompute_worst_s": fresh[-1],
            "recompute_p99_s": _p99(fresh),
            "recompute_median_s": statistics.median(fresh),
            "same_texts": self.first_texts == self.second_texts,
            "waits_abandoned": self.kvtiers.get("kvtiers_stack_promotion_waits_abandoned_total", 0),
            "promotions_abandoned": self.kvtiers.get(
                'kvtiers_stack_promotions_total{outcome="abandoned"}', 0),
            "promotions_done": self.kvtiers.get(
                'kvtiers_stack_promotions_total{outcome="done"}', 0),
        }


def _p99(ordered: list[float]) -> float:
    """The 99th percentile by the nearest rank (the worst of fewer than 100)."""
    rank = max(1, -(-99 * len(ordered) // 100))
    return ordered[rank - 1]


def stream(server: VllmServer, tokens: list[int]) -> tuple[float, str]:
    """Send one streamed completion; its time to the first streamed chunk and its text."""
    body = json.dumps({
        "model": server.model, "prompt": tokens, "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "kv_transfer_params": {DEADLINE_PARAM: DEADLINE_S},
    }).encode()
    request = urllib.request.Request(f"{server.url}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    first: float | None = None
    pieces: list[str] = []
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            if first is None:
                first = time.monotonic() - started
            pieces.append(json.loads(data)["choices"][0]["text"])
    if first is None:
        raise RuntimeError(f"the server streamed nothing for a prompt; see {server.log}")
    return first, "".join(pieces)


def _server(model: Path, workdir: Path, name: str, endpoint: str, bucket: str,
            prefix: str) -> tuple[VllmServer, int]:
    """A server over a cpu + s3 stack (``promotion:`` on, S3 unseeded) and the port of
    kvtiers' metrics."""
    port = free_port()
    stack = workdir / f"{name}.yaml"
    stack.write_text(json.dumps({
        "tiers": [
            {"kind": "cpu", "capacity": "64MiB"},
            {"kind": "s3", "bucket": bucket, "prefix": prefix, "endpoint_url": endpoint},
        ],
        "promotion": {"prefill_tokens_per_s": PREFILL_TOKENS_PER_S},
        "metrics": {"port": port, "refresh_s": 0},
    }))
    server = VllmServer(
        model,
        ["--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "1024",
         "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
         "--shutdown-timeout", "120", "--kv-transfer-config", kv_transfer_config(stack)],
        log=workdir / f"{name}.log", env=SERVER_ENV,
    )
    return server, port


def run(model: Path, workdir: Path, s3_endpoint: str, bucket: str, *, delay_s: float,
        prompts: int, prefix: str) -> SlowTierRun:
    """One run (see the module docstring) with ``prompts`` stored prompts, their chunks
    under ``prefix`` in ``bucket``."""
    upstream = urllib.parse.urlsplit(s3_endpoint)
    assert upstream.hostname is not None and upstream.port is not None
    proxy = FaultProxy(upstream.hostname, upstream.port)
    stored = [prompt(1000 + i) for i in range(prompts)]
    fresh = [prompt(2000 + i) for i in range(prompts)]
    result = SlowTierRun(delay_s)
    try:
        server, _ = _server(model, workdir, f"{prefix}-first", proxy.endpoint_url, bucket,
                            prefix)
        with server:
            result.first_texts = [stream(server, tokens)[1] for tokens in stored]
        server, port = _server(model, workdir, f"{prefix}-second", proxy.endpoint_url,
                               bucket, prefix)
        with server:
            proxy.delay_s = delay_s  # from now on: the S3 server is slow
            for recompute, tokens in zip(fresh, stored, strict=True):
                result.ttft_fresh_s.append(stream(server, recompute)[0])
                ttft, text = stream(server, tokens)
                result.ttft_stored_s.append(ttft)
                result.second_texts.append(text)
            result.kvtiers = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        proxy.close()
    return result


def main() -> None:
    """Runs at several delays and prints each one's summary (a JSON line)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.5, 2.0, 4.0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None, help="write the summaries here")
    args = parser.parse_args()
    import os

    import boto3

    from kvtiers.testing.s3 import MotoProcess
    from tests.e2e.tiny_model import make_tiny_llama

    os.environ.update(ENGINE_ENV)
    summaries = []
    with tempfile.TemporaryDirectory() as tmp, MotoProcess() as moto:
        work = Path(tmp)
        model = make_tiny_llama(work / "model")
        boto3.client("s3", endpoint_url=moto.endpoint_url).create_bucket(Bucket="slow")
        for index, delay in enumerate(args.delays):
            started = time.monotonic()
            measured = run(model, work, moto.endpoint_url, "slow", delay_s=delay,
                           prompts=args.prompts, prefix=f"run{index}")
            summary = {**measured.summary(), "run_s": round(time.monotonic() - started, 1),
                       "ttft_stored_s": measured.ttft_stored_s,
                       "ttft_fresh_s": measured.ttft_fresh_s}
            print(json.dumps(summary), flush=True)
            summaries.append(summary)
    if args.out is not None:
        args.out.write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
