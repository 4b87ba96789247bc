"""The scheduler's time per step through ``kvtiers serve`` beside in-process route 1 and
vLLM's own ``CPUOffloadingManager`` (docs/service.md).

Three vLLM-facing managers see the same calls in the same order, their steps interleaved
(the order rotates every step), so all meet the same machine load:

* ``vllm``: vLLM's ``CPUOffloadingManager`` (lru);
* ``route1``: the manager of a ``KVTiersOffloadingSpec`` over an in-process cpu tier;
* ``service``: the same spec over a ``kind: service`` tier, the service running in its own
  process (started here, ``python -m kvtiers serve``).

A step with ``R`` running requests: each running request stores one new chunk
(``prepare_store`` + ``complete_store`` of one key: the worst case, every request filling
a chunk in the same step), and one new request arrives whose 16-key prefix is resident
(16 ``lookup`` calls, ``prepare_load`` + ``complete_load`` of the 16 keys), then
``on_schedule_end``. Reported per side and ``R``: the median and p99 over steps of the
wall-clock time of the step's calls (what a scheduler step sees, a round trip's wait
included) and the median per key (stored + looked-up keys), and the service's added time
(its p99 minus route 1's) against the targets of issue 41: p99 added ≤ 1 ms a step at
256 requests, and per key at most 2x route 1.

Run: ``.venv/bin/python benchmarks/bench_service.py [--steps N] [--quick] [--out DIR]``.
Writes ``service.md`` and ``service.json`` (the harness's schema) under ``--out``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (
    bench_parser,
    finish_note,
    machine_note,
    machine_sentence,
    percentile,
    to_document,
    write_result,
)
from route1 import SLOT_BYTES, job_keys

LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("command", "steps"),
    "tables": ("rows",),
}
RUNNING = (1, 64, 256)
PREFIX_KEYS = 16
CHUNKS = 20_000


def vllm_manager(stack: dict[str, Any] | None) -> Any:
    """vLLM's CPU manager (``stack`` None) or a ``KVTiersOffloadingSpec`` manager."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if stack is None:
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        return CPUOffloadingManager(CHUNKS, cache_policy="lru")
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=64,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "KVTiersOffloadingSpec",
            "spec_module_path": "kvtiers.integrations.vllm",
            "kvtiers": stack,
            "kvtiers_identity": "offloading-config-only",
        },
        engine_id=f"bench-service-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
    return OffloadingSpecFactory.create_spec(config).get_manager()


class Side:
    """One manager driven through steps; ``step`` returns the step's seconds."""

    def __init__(self, name: str, manager: Any, close: Callable[[], None]) -> None:
        from vllm.v1.kv_offload import base as vbase

        self.name = name
        self.manager = manager
        self.close = close
        self.vbase = vbase
        self.counter = 0
        prefix_ctx = vbase.ReqContext(req_id=f"{name}-prefix")
        manager.on_new_request(prefix_ctx)
        self.prefix = [self.key() for _ in range(PREFIX_KEYS)]
        out = manager.prepare_store(self.prefix, prefix_ctx)
        manager.complete_store(job_keys(out.keys_to_store), prefix_ctx)
        manager.on_request_finished(prefix_ctx)
        self.end_step()
        primary = self._primary()
        if primary is not None:
            # The service: the prefix's commits went in the step's end write; wait until
            # it has taken them in, so that the first step's lookups find the prefix.
            primary.flush(wait=True)
        self._waits = self.waits()

    def waits(self) -> tuple[float, float]:
        """The service tier's round trips and step ends that waited for owed replies, so
        far less at the steps' start (zeros for the other sides)."""
        primary = self._primary()
        if primary is None:
            return 0.0, 0.0
        stats = primary.get_stats()
        start = getattr(self, "_waits", (0.0, 0.0))
        return stats["round_trips"] - start[0], stats["owed_waits"] - start[1]

    def _primary(self) -> Any:
        tiers = getattr(getattr(self.manager, "stack", None), "manager", None)
        primary = tiers.tiers[0].manager if tiers is not None else None
        return primary if hasattr(primary, "flush") else None

    def key(self) -> Any:
        self.counter += 1
        return self.vbase.make_offload_key(self.counter.to_bytes(16, "little"), 0)

    def end_step(self) -> None:
        on_end = getattr(self.manager, "on_schedule_end", None)
        if on_end is not None:
            on_end(self.vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def step(self, running: list[Any]) -> tuple[float, float]:
        manager = self.manager
        fresh = [self.key() for _ in running]
        arriving = self.vbase.ReqContext(req_id=f"{self.name}-new-{self.counter}")
        start, start_cpu = time.perf_counter(), time.thread_time()
        for ctx, key in zip(running, fresh, strict=True):
            out = manager.prepare_store([key], ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(job_keys(out.keys_to_store), ctx)
        manager.on_new_request(arriving)
        hit = self.vbase.LookupResult.HIT
        hits = [k for k in self.prefix if manager.lookup(k, arriving) is hit]
        assert len(hits) == PREFIX_KEYS, f"{self.name}: the resident prefix missed"
        manager.prepare_load(hits, arriving)
        manager.complete_load(job_keys(hits), arriving)
        manager.on_request_finished(arriving)
        self.end_step()
        return time.perf_counter() - start, time.thread_time() - start_cpu


def start_service(directory: Path) -> tuple[subprocess.Popen[str], Path, str]:
    pool = f"kvtiers-bench-{os.getpid()}"
    config = directory / "serve.yaml"
    config.write_text(f"tiers:\n  - kind: cpu\n    capacity: {CHUNKS * SLOT_BYTES}\n"
                      f"    shared_memory_name: {pool}\n")
    sock = directory / "serve.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtiers", "serve", "--config", str(config), "--socket",
         str(sock), "--slot-bytes", str(SLOT_BYTES), "--fresh"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    if not proc.stdout.readline().startswith("kvtiers serve: ready"):
        raise SystemExit("kvtiers serve did not start")
    return proc, sock, pool


def round_trips(sock: Path, count: int) -> dict[str, float]:
    """p50 and p99 of one bare round trip (a one-key ``Lookup``) to the service."""
    from kvtiers.service import protocol as p
    from kvtiers.service.client import ServiceClient

    client = ServiceClient(sock, b'{"model_name":"bench/ping"}', SLOT_BYTES)
    values = []
    for _ in range(count * 5):
        start = time.perf_counter()
        client.call([p.Lookup(client.next_seq(), client.ns, [b"k" * 20])])
        values.append(time.perf_counter() - start)
    client.close()
    return {"p50": statistics.median(values) * 1e6, "p99": percentile(values, 99) * 1e6}


def run(steps: int) -> dict[str, Any]:
    note = machine_note(steps=steps)
    results: dict[str, Any] = {"rows": [], "steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock, pool = start_service(Path(tmp))
        try:
            for count in RUNNING:
                sides = [
                    Side("vllm", vllm_manager(None), lambda: None),
                    Side("route1", m := vllm_manager(
                        {"tiers": [{"kind": "cpu", "capacity": CHUNKS * SLOT_BYTES}]}),
                        m.shutdown),
                    Side("service", s := vllm_manager(
                        {"tiers": [{"kind": "service", "socket": str(sock)}]}), s.shutdown),
                ]
                times: dict[str, list[float]] = {side.name: [] for side in sides}
                cpu: dict[str, list[float]] = {side.name: [] for side in sides}
                running = {side.name: [side.vbase.ReqContext(req_id=f"{side.name}-r{i}")
                                       for i in range(count)] for side in sides}
                for side in sides:
                    for ctx in running[side.name]:
                        side.manager.on_new_request(ctx)
                for index in range(steps):
                    shift = index % len(sides)
                    for side in sides[shift:] + sides[:shift]:
                        wall, busy = side.step(running[side.name])
                        times[side.name].append(wall)
                        cpu[side.name].append(busy)
                keys_per_step = count + PREFIX_KEYS
                if count == RUNNING[0]:
                    results["round_trip_us"] = round_trips(sock, steps)
                for side in sides:
                    values = times[side.name][2:]  # the first steps warm the caches
                    used = cpu[side.name][2:]
                    results["rows"].append({
                        "running": count,
                        "side": side.name,
                        "step_p50_us": statistics.median(values) * 1e6,
                        "step_p99_us": percentile(values, 99) * 1e6,
                        "per_key_us": statistics.median(values) * 1e6 / keys_per_step,
                        "cpu_p50_us": statistics.median(used) * 1e6,
                        "cpu_p99_us": percentile(used, 99) * 1e6,
                        "round_trips": side.waits()[0] / steps,
                        "owed_waits": side.waits()[1] / steps,
                    })
                    side.close()
        finally:
            proc.terminate()
            proc.wait()
            Path("/dev/shm", pool).unlink(missing_ok=True)
    results["machine"] = finish_note(note)
    return results


def render(results: dict[str, Any]) -> str:
    rows = results["rows"]
    by = {(r["running"], r["side"]): r for r in rows}
    lines = [
        "# kvtiers serve: the scheduler's time per step",
        "",
        "`benchmarks/bench_service.py` (see its docstring for the step). Wall-clock per step "
        "(a round trip's wait included), median and p99 over steps; per key: the median step "
        "over its keys (one stored key per running request + 16 looked-up keys); CPU: the "
        "scheduler thread's CPU time in the step's calls (what the engine pays in work; "
        "wall-clock adds the time the thread waited or was not running).",
        "",
        "| running | side | step p50 (us) | step p99 (us) | per key (us) | vs route 1 per key "
        "| CPU p50 (us) | CPU p99 (us) | CPU vs route 1 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = by[(r["running"], "route1")]
        lines.append(f"| {r['running']} | {r['side']} | {r['step_p50_us']:.0f} | "
                     f"{r['step_p99_us']:.0f} | {r['per_key_us']:.2f} | "
                     f"{r['per_key_us'] / base['per_key_us']:.2f}x | {r['cpu_p50_us']:.0f} | "
                     f"{r['cpu_p99_us']:.0f} | {r['cpu_p50_us'] / base['cpu_p50_us']:.2f}x |")
    lines += ["", "Targets (issue 41) at 256 running requests:", ""]
    service, route1 = by[(256, "service")], by[(256, "route1")]
    added = service["step_p99_us"] - route1["step_p99_us"]
    ratio = service["per_key_us"] / route1["per_key_us"]
    lines.append(f"- p99 added time per step: {added:.0f} us (target <= 1000 us): "
                 f"{'met' if added <= 1000 else 'missed'}")
    lines.append(f"- per key vs in-process route 1: {ratio:.2f}x (target <= 2x): "
                 f"{'met' if ratio <= 2 else 'missed'}")
    cpu_added = service["cpu_p99_us"] - route1["cpu_p99_us"]
    cpu_ratio = service["cpu_p50_us"] / route1["cpu_p50_us"]
    lines.append(f"- in CPU time: p99 added {cpu_added:.0f} us a step, "
                 f"{cpu_ratio:.2f}x route 1 at the median")
    trip = results["round_trip_us"]
    lines += ["", "One bare round trip to the service (a one-key Lookup): "
              f"p50 {trip['p50']:.0f} us, p99 {trip['p99']:.0f} us. A step through the "
              "service makes no round trip (one when its stores outrun the lease): "
              "lookups and prepare_load read the pool's mirror and slot headers; the "
              "step's Commit/Pin/Unpin/Lease go in one write at on_schedule_end that "
              "waits for nothing, their replies taken in as they arrive."]
    service_rows = [r for r in rows if r["side"] == "service"]
    lines += ["", "Per step on the service side (its client's counts), by running requests: "
              "round trips " + ", ".join(f"{r['running']}: {r['round_trips']:.2f}"
                                         for r in service_rows)
              + "; step ends that waited for replies owed past the bound "
              + ", ".join(f"{r['running']}: {r['owed_waits']:.2f}" for r in service_rows)
              + "."]
    lines += ["", f"Machine: {machine_sentence(results['machine'])}; "
              f"{results['steps']} steps per row."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, quick="10 steps a row, nothing written")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    results = run(10 if args.quick else args.steps)
    results["command"] = " ".join(sys.argv)
    text = render(results)
    print(text)
    if not (args.quick or args.no_write):
        write_result(to_document("service", results, **LAYOUT), args.out, "service", text)


if __name__ == "__main__":
    main()
