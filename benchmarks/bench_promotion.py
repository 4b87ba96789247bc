"""Simulated time-to-first-token with a slow lower tier: recompute, promote everything,
cost-aware promotion.

The demo's simulated engine replays the demo's conversation traces
(``kvtiers/engine/workload.py``) over a stack of a 16 MiB CPU tier (ARC) and a slow lower
tier named ``s3``: 200 ms latency, 50 MB/s per promotion job (the engine's
:class:`~kvtiers.engine.simulator.TimeModel`; the bytes really go through a file tier in
a temporary directory, whose wall-clock speed does not enter the numbers). Each trace runs
twice per mode, as the demo does: cold, then after a restart (every prefix then comes
from ``s3``). Modes:

* ``recompute`` — no offloading: every prompt is prefilled (``tokens / rate``);
* ``promote-all`` — no ``promotion:`` section: every lower-tier hit is promoted;
* ``cost`` — ``promotion:`` with the tier's true latency and bandwidth as seeds;
* ``cost-learned`` — seeds that believe the tier fast (1 ms, 2 GB/s): the estimate must
  learn the truth from the tier's own promotion jobs.

Per trace, prefill rate, phase and mode: TTFT mean, p50, p90, max (seconds), requests
slower than recomputing them, share of prompt tokens reused, bytes promoted from ``s3``.
Counts and simulated time only: the machine's load does not change them. Run from the
repository root: ``.venv/bin/python benchmarks/bench_promotion.py [--quick]
[--no-write]``; writes ``benchmarks/results/promotion.md`` and ``promotion.json``.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (
    bench_parser,
    finish_note,
    kept_section,
    machine_note,
    machine_sentence,
    markdown_table,
    percentile,
    to_document,
    write_result,
)

from kvtiers.config import PromotionConfig, StackConfig, load_stack_config
from kvtiers.config.examples import example_path
from kvtiers.engine.simulator import RequestReport, SimulatedEngine, TierTime, TimeModel
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.stack.builder import load_stack

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("quick", "command"),
    "tables": ("rows",),
    "summary": ("seconds",),
}
#: The heading of promotion.md's section this benchmark does not write.
REAL_SERVER = "## A real server"
LATENCY_S = 0.2
BYTES_PER_S = 50_000_000
SLOW = TierTime(LATENCY_S, BYTES_PER_S)
TRACES = {
    "conversations": WorkloadSpec(),
    "long-systems": WorkloadSpec(conversations=24, system_prompts=4, turns=4,
                                 system_tokens=(256, 3072), seed=1),
}
RATES = (1000.0, 2000.0, 5000.0, 20000.0)
MODES = ("recompute", "promote-all", "cost", "cost-learned")
PHASES = ("cold", "after restart")


def stack_config(root: Path, mode: str, rate: float) -> StackConfig:
    seeds = {"load_latency_s": 0.001, "load_bytes_per_s": "2GB"} if mode == "cost-learned" \
        else {"load_latency_s": LATENCY_S, "load_bytes_per_s": BYTES_PER_S}
    config = load_stack_config({"tiers": [
        {"kind": "cpu", "capacity": "16MiB", "policy": "arc"},
        {"kind": "file", "name": "s3", "root": str(root), **seeds},
    ]})
    demo = example_path("demo")
    assert demo is not None
    config = dataclasses.replace(config, model=load_stack_config(demo).model)
    if mode.startswith("cost"):
        config = dataclasses.replace(config, promotion=PromotionConfig(prefill_tokens_per_s=rate))
    return config


def run_mode(spec: WorkloadSpec, mode: str, rate: float) -> list[list[RequestReport]]:
    """Reports per phase."""
    requests = conversation_requests(spec)
    time_model = TimeModel(rate, {"s3": SLOW})
    if mode == "recompute":
        reports = []
        for request in requests:
            report = RequestReport(request.req_id, len(request.token_ids))
            report.ttft_s = report.recompute_s = time_model.prefill_s(report.prompt_tokens)
            reports.append(report)
        return [reports for _ in PHASES]
    phases: list[list[RequestReport]] = []
    with tempfile.TemporaryDirectory(prefix="kvtiers-bench-promotion-") as root:
        config = stack_config(Path(root), mode, rate)
        for _ in PHASES:
            with load_stack(config) as stack:
                engine = SimulatedEngine(stack, num_gpu_blocks=1024, time_model=time_model)
                try:
                    reports = [engine.run_request(r.req_id, r.token_ids) for r in requests]
                finally:
                    engine.shutdown()
            failures = sum(r.verification_failures for r in reports)
            assert failures == 0, f"{failures} loaded blocks held wrong bytes"
            phases.append(reports)
    return phases


def summarise(reports: list[RequestReport]) -> dict[str, float]:
    ttft = sorted(r.ttft_s for r in reports)
    return {
        "mean": statistics.mean(ttft),
        "p50": percentile(ttft, 50),
        "p90": percentile(ttft, 90),
        "max": ttft[-1],
        "slower_than_recompute": sum(1 for r in reports if r.ttft_s > r.recompute_s + 1e-12),
        "reused": sum(r.reused_tokens for r in reports) / sum(r.prompt_tokens for r in reports),
        "promoted_bytes": sum(r.promoted_bytes.get("s3", 0) for r in reports),
        "requests": len(reports),
    }


def acceptance(rows: list[dict[str, object]]) -> list[str]:
    """Issue 19's acceptance over every (trace, rate, phase): ``cost`` is never slower
    than recompute on any request, and its mean TTFT is below ``promote-all``'s."""
    cells: dict[tuple[object, ...], dict[str, dict[str, float]]] = {}
    for row in rows:
        summary = row["summary"]
        assert isinstance(summary, dict)
        cell = (row["trace"], row["rate"], row["phase"])
        cells.setdefault(cell, {})[str(row["mode"])] = summary
    modes = list(cells.values())
    slower = sum(m["cost"]["slower_than_recompute"] for m in modes)
    requests = sum(m["cost"]["requests"] for m in modes)
    better = [m for m in modes if m["cost"]["mean"] < m["promote-all"]["mean"]]
    gains = [1 - m["cost"]["mean"] / m["promote-all"]["mean"] for m in modes]
    return [
        f"Acceptance: `cost` was slower than recomputing on {slower:.0f} of {requests:.0f} "
        f"requests; its mean TTFT was below `promote-all`'s in {len(better)} of "
        f"{len(modes)} (trace, rate, phase) cells, by {100 * min(gains):.1f}% to "
        f"{100 * max(gains):.1f}% (median {100 * statistics.median(gains):.1f}%).",
    ]


def render(data: dict[str, Any]) -> str:
    """The simulated part of the page for ``data``, the flat dict :data:`LAYOUT` maps
    onto the schema."""
    rows = data["rows"]
    lines = [
        "# Simulated TTFT: recompute vs promote everything vs cost-aware promotion",
        "",
        f"Machine: {machine_sentence(data['machine'])}; `{data['command']}` "
        f"({data['seconds']:.0f} s). Simulated time and counts only: the machine's load "
        "does not change them.",
        "",
        f"Stack: cpu 16 MiB (arc) over a slow tier `s3` of {LATENCY_S * 1000:.0f} ms latency "
        f"and {BYTES_PER_S / 1e6:.0f} MB/s per promotion job; the demo's model (two groups, "
        "4.6 KB of KV per token). TTFT = the slowest tier's promotion job + prefill of the "
        "tokens not loaded. `slower` = requests whose TTFT exceeds recomputing their whole "
        "prompt; `reused` = prompt tokens loaded; `promoted` = bytes read from `s3`. "
        "`cost-learned` seeds the estimate with 1 ms / 2 GB/s and learns from its jobs.",
        "",
        *markdown_table(
            ["trace", "tokens/s", "phase", "mode", "mean s", "p50 s", "p90 s", "max s",
             "slower", "reused", "promoted"],
            ([row["trace"], f"{row['rate']:,.0f}", row["phase"], row["mode"],
              *(f"{row['summary'][key]:.3f}" for key in ("mean", "p50", "p90", "max")),
              row["summary"]["slower_than_recompute"],
              f"{100 * row['summary']['reused']:.1f}%",
              f"{row['summary']['promoted_bytes'] / 2**20:,.1f} MiB"] for row in rows),
            align="lrllrrrrrrr"),
    ]
    lines[4:4] = [*acceptance(rows), ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_parser(__doc__, quick="one trace, two rates")
    args = parser.parse_args()
    note = machine_note()
    traces = dict(list(TRACES.items())[:1]) if args.quick else TRACES
    rates = RATES[1:3] if args.quick else RATES
    start = time.perf_counter()
    rows: list[dict[str, object]] = []
    for trace, spec in traces.items():
        for rate in rates:
            for mode in MODES:
                for phase, reports in zip(PHASES, run_mode(spec, mode, rate), strict=True):
                    rows.append({"trace": trace, "rate": rate, "phase": phase, "mode": mode,
                                 "summary": summarise(reports)})
    data = {
        "machine": finish_note(note), "quick": args.quick,
        "command": " ".join(["benchmarks/bench_promotion.py", *sys.argv[1:]]),
        "seconds": time.perf_counter() - start, "rows": rows,
    }
    text = render(data)
    print(text)
    if not (args.quick or args.no_write):
        # The real-server section below the simulated table is written by another run
        # (python -m tests.e2e.slow_tier): kept as it is.
        kept = kept_section(args.out / "promotion.md", REAL_SERVER)
        write_result(to_document("promotion", data, **LAYOUT), args.out, "promotion",
                     text + ("\n" + kept if kept else ""))


if __name__ == "__main__":
    main()
