"""Chunks written per tier and tokens reused under each lower tier's write rules.

The demo's stack (``kvtiers/configs/demo.yaml``: 16 MiB CPU tier, 32 MiB file tier, S3 on
the embedded local server) runs the demo's traces (``kvtiers/engine/workload.py``: multi-
turn conversations sharing system prompts) through the simulated engine twice, as
``kvtiers demo`` does: phase 1 from cold, phase 2 after a restart (the CPU tier empty,
the file tier and the bucket kept). Only the S3 tier's write rules change between runs
(the file tier writes through):

* ``through`` — every stored chunk is written (the baseline);
* ``back`` — written when the file tier above it evicts it (the second hop: copied from
  the CPU slot while the CPU tier holds the chunk, else staged from the file through one);
* ``hits-N`` — write-through after N loads from the CPU tier (frequency admission);
* ``back+hits-1`` / ``back+hits-2`` — written at the file tier's eviction, if referenced
  at least once / twice.

Two stacks: the demo's as shipped (its file tier holds about half the trace, so S3 serves
what the file tier evicted) and the same with a 128 MiB file tier that holds the whole
trace (a deployment's proportions: local NVMe far larger than host memory, S3 behind it
for other machines and for losing the disk).

Reported per stack and policy: chunks written to S3 and to the file tier, the baseline's S3 writes
over this policy's, and prompt tokens reused in each phase and both together, with the
change against the baseline. Counts, not timings (every request settles its copies before
the next, as the demo does); repeated runs differed by a few file-tier writes. Run from
the repository root: ``.venv/bin/python benchmarks/bench_placement.py [--conversations N]
[--turns N] [--no-write]``;
writes ``benchmarks/results/placement.md`` and ``placement.json``.
"""

from __future__ import annotations

import io
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    bench_parser,
    finish_note,
    machine_note,
    markdown_table,
    to_document,
    write_result,
)

from kvtiers.config.examples import example_path
from kvtiers.engine.demo import run_demo
from kvtiers.engine.workload import WorkloadSpec
from kvtiers.optional import require

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("workload",),
    "tables": ("rows",),
}

#: Stack name → the file tier's capacity (``None``: the demo's own, 32 MiB).
STACKS: dict[str, str | None] = {"demo stack": None, "file tier holds the trace": "128MiB"}

#: Policy name → the S3 tier's write keys.
POLICIES: dict[str, dict[str, Any]] = {
    "through": {},
    "back": {"write": "back"},
    "hits-1": {"write_after_hits": 1},
    "hits-2": {"write_after_hits": 2},
    "back+hits-1": {"write": "back", "write_after_hits": 1},
    "back+hits-2": {"write": "back", "write_after_hits": 2},
}


@dataclass
class Row:
    stack: str
    policy: str
    s3_writes_cold: int
    s3_writes: int
    file_writes: int
    prompt_tokens: int
    reused_cold: int
    reused_warm: int

    @property
    def reused(self) -> int:
        return self.reused_cold + self.reused_warm


def _writes(stats: dict[str, float], tier: str) -> int:
    return int(stats.get(f"{tier}.cascaded", 0) + stats.get(f"{tier}.demoted", 0))


def run_policy(stack: str, policy: str, spec: WorkloadSpec, scratch: Path) -> Row:
    import yaml

    demo = example_path("demo")
    assert demo is not None
    config = yaml.safe_load(demo.read_text())
    run = f"{len(list(scratch.iterdir()))}-{policy}"
    out = scratch / run
    for tier in config["tiers"]:
        if tier["kind"] == "file":
            tier["root"] = str(out / "file")
            if STACKS[stack] is not None:
                tier["capacity"] = STACKS[stack]
        if tier["kind"] == "s3":
            # One prefix per run: the embedded server outlives the stacks of this process.
            tier["prefix"] = f"placement-{run}"
            tier.update(POLICIES[policy])
    cold, warm = run_demo(config, out_dir=out, workload=spec, plot=None,
                          out=io.StringIO(), show_progress=False)
    return Row(stack, policy, _writes(cold.stats, "s3"),
               _writes(cold.stats, "s3") + _writes(warm.stats, "s3"),
               _writes(cold.stats, "file") + _writes(warm.stats, "file"),
               cold.prompt_tokens + warm.prompt_tokens, cold.reused_tokens,
               warm.reused_tokens)


def render(rows: list[Row], spec: WorkloadSpec, note: dict[str, str]) -> str:
    lines = [
        "# Write rules: chunks written per tier vs tokens reused",
        "",
        f"Machine: {note['cpu']}, {note['cores']} cores, Python {note['python']}, load "
        f"average {note['load']} at the start; {note['date']}; `{note['command']}`. Counts, "
        "not timings; two runs differed by a few file-tier writes (the order mover threads "
        "finish copies in).",
        "",
        "The demo's stack (cpu 16 MiB arc, file writing through, s3 on the embedded "
        f"server) and traces ({spec.conversations} conversations of {spec.turns} turns over "
        f"{spec.system_prompts} system prompts), run twice as `kvtiers demo` does: cold, "
        "then after a restart. Only the s3 tier's write rules change. Writes: chunks "
        "written into the tier (cascaded + demoted), in the cold phase (the trace once) "
        "and over both phases (the restart replays the trace, so every chunk is "
        "referenced again there). `fewer`: the baseline's s3 writes over this policy's. "
        f"Reused: prompt tokens loaded from the tiers, of {rows[0].prompt_tokens // 2:,} "
        "per phase; `Δ` against the baseline (through).",
    ]
    for stack, capacity in STACKS.items():
        stack_rows = [row for row in rows if row.stack == stack]
        base = stack_rows[0]
        lines += [
            "",
            f"## {stack} (file tier {capacity or '32MiB'})",
            "",
            *markdown_table(
                ["s3 policy", "s3 writes cold", "fewer", "Δ reused cold", "s3 writes both",
                 "fewer", "file writes both", "reused warm", "Δ reused both"],
                ([row.policy, f"{row.s3_writes_cold:,}",
                  _ratio(base.s3_writes_cold, row.s3_writes_cold),
                  _change(base.reused_cold, row.reused_cold), f"{row.s3_writes:,}",
                  _ratio(base.s3_writes, row.s3_writes), f"{row.file_writes:,}",
                  f"{row.reused_warm:,}", _change(base.reused, row.reused)]
                 for row in stack_rows)),
        ]
    return "\n".join(lines) + "\n"


def _ratio(base: int, value: int) -> str:
    return f"{base / value:.1f}x" if value else "-"


def _change(base: int, value: int) -> str:
    return f"{100 * (value - base) / max(base, 1):+.1f}%"


def main() -> None:
    parser = bench_parser(__doc__, quick="4 conversations of 2 turns")
    parser.add_argument("--conversations", type=int, default=None,
                        help="conversations in the trace (default: the demo's)")
    parser.add_argument("--turns", type=int, default=None)
    args = parser.parse_args()
    require("moto", purpose="the embedded S3 server of the benchmark's stack")
    conversations = args.conversations or (4 if args.quick else WorkloadSpec.conversations)
    turns = args.turns or (2 if args.quick else WorkloadSpec.turns)
    spec = WorkloadSpec(conversations=conversations, turns=turns)
    started = time.perf_counter()
    command = "benchmarks/bench_placement.py"
    if (conversations, turns) != (WorkloadSpec.conversations, WorkloadSpec.turns):
        command += f" --conversations {conversations} --turns {turns}"
    note = machine_note(command=command)
    with tempfile.TemporaryDirectory(prefix="kvtiers-placement-") as scratch:
        rows = [run_policy(stack, policy, spec, Path(scratch))
                for stack in STACKS for policy in POLICIES]
    report = render(rows, spec, note)
    print(report)
    print(f"({time.perf_counter() - started:.0f} s)")
    if not (args.quick or args.no_write):
        name = "placement" if command == "benchmarks/bench_placement.py" else "placement-custom"
        payload = {"machine": finish_note(note), "workload": spec.__dict__,
                   "rows": [row.__dict__ for row in rows]}
        write_result(to_document("placement", payload, **LAYOUT), args.out, name, report)


if __name__ == "__main__":
    main()
