"""``kvtiers demo``: the main job. A simulated engine drives a real tier stack end to end.

Phase 1 (cold) runs a multi-turn conversation workload through a fresh stack: chunks are
stored in the CPU tier, cascaded to the persistent tiers, evicted from the small CPU tier
and promoted back. Phase 2 (warm) shuts the stack down, builds it again from the same
YAML (new managers, indexes rebuilt from disk and from the bucket) and replays the
workload: its prefixes now come from the persistent tiers. Every loaded block is checked
byte for byte; the run fails if one is wrong.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvtiers.config import FileTierConfig, StackConfig, load_stack_config
from kvtiers.config.sizes import format_size
from kvtiers.engine.simulator import RequestReport, SimulatedEngine
from kvtiers.engine.workload import Request, WorkloadSpec, conversation_requests
from kvtiers.errors import KVTiersError
from kvtiers.stack.builder import Stack, load_stack

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
NUM_GPU_BLOCKS = 1024


@dataclass
class PhaseResult:
    """One phase's requests, per-request sources and the stack's final stats."""

    name: str
    reports: list[RequestReport] = field(default_factory=list)
    # Per request: chunks loaded from each source ("cpu" or a lower tier's name).
    sources: list[dict[str, int]] = field(default_factory=list)
    finished_at: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    tiers: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verification_failures(self) -> int:
        return sum(r.verification_failures for r in self.reports)


def _lower_names(stack: Stack) -> list[str]:
    return [tier.name for tier in stack.tiers[1:]]


def run_phase(
    name: str,
    stack: Stack,
    requests: Sequence[Request],
    progress: Callable[[int], None],
) -> PhaseResult:
    """Run ``requests`` through a simulated engine over ``stack``."""
    phase = PhaseResult(name, tiers=[(t.name, type(t.manager).__name__) for t in stack.tiers])
    engine = SimulatedEngine(stack, num_gpu_blocks=NUM_GPU_BLOCKS)
    lower = _lower_names(stack)
    chunk_tokens = stack.offloading.tokens_per_chunk(0)
    start = time.perf_counter()
    try:
        for request in requests:
            before = stack.manager.get_stats()
            report = engine.run_request(request.req_id, request.token_ids)
            after = stack.manager.get_stats()
            promoted = {t: int(after.get(f"{t}.promoted", 0) - before.get(f"{t}.promoted", 0))
                        for t in lower}
            loaded_chunks = -(-report.reused_tokens // chunk_tokens)
            sources = {"cpu": max(0, loaded_chunks - sum(promoted.values())), **promoted}
            phase.reports.append(report)
            phase.sources.append(sources)
            phase.finished_at.append(time.perf_counter() - start)
            progress(1)
        stack.manager.wait_idle()
    finally:
        engine.shutdown()
    phase.seconds = time.perf_counter() - start
    phase.stats = dict(stack.manager.get_stats())
    return phase


def _mb_per_s(num_bytes: float, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e6:,.1f}" if seconds > 0 and num_bytes else "-"


def render_phase(phase: PhaseResult, stack_names: Sequence[str]) -> str:
    """A plain-text summary table of one phase.

    Per tier: chunks held at the end, chunks it served to loads, bytes written into and
    read out of it, and those bytes as an average rate over the phase's wall time (lower
    tiers work in the background, so a per-job rate would count queueing). The GPU ⇄ cpu
    worker's own rate per transfer is given on its own line."""
    reports = phase.reports
    prompt = sum(r.prompt_tokens for r in reports)
    reused = sum(r.reused_tokens for r in reports)
    served: dict[str, int] = {}
    for sources in phase.sources:
        for source, count in sources.items():
            served[source] = served.get(source, 0) + count
    stats = phase.stats
    store_bytes = sum(r.stored_bytes for r in reports)
    load_bytes = sum(r.loaded_bytes for r in reports)
    store_s = sum(r.store_s for r in reports)
    load_s = sum(r.load_s for r in reports)
    lines = [
        f"{phase.name}: {len(reports)} requests in {phase.seconds:.1f} s, "
        f"{prompt:,} prompt tokens, {reused:,} reused from the tiers "
        f"({100 * reused / max(prompt, 1):.1f}%)",
        f"  verified {sum(r.verified_blocks for r in reports):,} loaded blocks "
        f"({format_size(load_bytes)}): {phase.verification_failures} verification failures",
        f"  GPU ⇄ {stack_names[0]} worker: store {_mb_per_s(store_bytes, store_s)} MB/s, "
        f"load {_mb_per_s(load_bytes, load_s)} MB/s per transfer",
        "",
        f"  {'tier':<8}{'chunks':>9}{'served':>9}{'written':>12}{'read':>12}"
        f"{'write MB/s':>12}{'read MB/s':>11}{'corrupt':>9}{'failed':>8}",
    ]
    written: float
    read: float
    for index, name in enumerate(stack_names):
        if index == 0:
            written, read = store_bytes, load_bytes
            failed = sum(r.load_failures + r.store_failures for r in reports)
        else:
            written = stats.get(f"{name}.cascaded_bytes", 0)
            read = stats.get(f"{name}.promoted_bytes", 0)
            failed = int(stats.get(f"{name}.store_failures", 0))
        lines.append(
            f"  {name:<8}{int(stats.get(f'{name}.chunks', 0)):>9,}{served.get(name, 0):>9,}"
            f"{format_size(int(written)):>12}{format_size(int(read)):>12}"
            f"{_mb_per_s(written, phase.seconds):>12}{_mb_per_s(read, phase.seconds):>11}"
            f"{int(stats.get(f'{name}.corrupt_chunks', 0)):>9}{failed:>8}"
        )
    lines += [
        "  (MB/s: average over the phase's wall time)",
        "",
        f"  promotions {int(stats.get('promotions', 0)):,} (failed "
        f"{int(stats.get('promotion_failures', 0))}, refused "
        f"{int(stats.get('promotions_refused', 0))}), cascades "
        f"{int(stats.get('cascades', 0)):,} (failed {int(stats.get('cascade_failures', 0))}), "
        f"corrupt chunks {int(stats.get('corrupt_chunks', 0))}",
    ]
    return "\n".join(lines)


def plot_phases(phases: Sequence[PhaseResult], names: Sequence[str], path: Path) -> None:
    """Chunks loaded per request by source, and load/store throughput over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    offset = 0
    colors = dict(zip(names, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"),
                      strict=False))
    for phase in phases:
        xs = list(range(offset, offset + len(phase.reports)))
        bottom = [0] * len(xs)
        for name in names:
            values = [s.get(name, 0) for s in phase.sources]
            axes[0].bar(xs, values, bottom=bottom, color=colors.get(name), width=1.0,
                        label=name if offset == 0 else None)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        for moved, took, color, label in (
            ("loaded_bytes", "load_s", "#4c72b0", "load (GPU ⇐ cpu)"),
            ("stored_bytes", "store_s", "#dd8452", "store (GPU ⇒ cpu)"),
        ):
            points = [(x, getattr(r, moved) / getattr(r, took) / 1e9)
                      for x, r in zip(xs, phase.reports, strict=True) if getattr(r, took) > 0]
            axes[1].plot([p[0] for p in points], [p[1] for p in points], ".", color=color,
                         label=label if not offset else None)
        axes[0].axvline(offset - 0.5, color="grey", linestyle=":")
        axes[0].text(offset, axes[0].get_ylim()[1] * 0.95, phase.name, va="top")
        offset += len(xs)
    axes[0].set_ylabel("chunks loaded (group 0)")
    axes[0].legend(loc="upper right")
    axes[0].set_title("Where each request's prefix came from")
    axes[1].set_ylabel("GB/s per transfer")
    axes[1].set_xlabel("request")
    axes[1].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fresh_roots(config: StackConfig) -> None:
    for tier in config.tiers:
        if isinstance(tier, FileTierConfig) and tier.root_path.exists():
            shutil.rmtree(tier.root_path)


def run_demo(
    config_source: str | Path | Mapping[str, object] = DEFAULT_CONFIG,
    *,
    workload: WorkloadSpec | None = None,
    plot: Path | None = None,
    fresh: bool = True,
    out: TextIO = sys.stdout,
    show_progress: bool = True,
) -> list[PhaseResult]:
    """Run both phases; print their tables; raise if any loaded byte was wrong."""
    config = load_stack_config(config_source)
    if config.model is None:
        raise KVTiersError("the demo needs a stack file with a model: section")
    if fresh:
        _fresh_roots(config)
    requests = conversation_requests(workload or WorkloadSpec())
    phases = []
    names: list[str] = [tier.name for tier in config.tiers]
    bar = _progress(2 * len(requests), show_progress)
    try:
        for name in ("phase 1 (cold start)", "phase 2 (after restart)"):
            bar.set_description(name)
            with load_stack(config) as stack:
                phases.append(run_phase(name, stack, requests, bar.update))
    finally:
        bar.close()
    for phase in phases:
        print(render_phase(phase, names), file=out)
        print(file=out)
    if plot is not None:
        plot_phases(phases, names, plot)
        print(f"plot written to {plot}", file=out)
    failures = sum(p.verification_failures for p in phases)
    if failures:
        raise KVTiersError(f"{failures} loaded blocks did not hold the bytes that were stored")
    return phases


class _NoProgress:
    def update(self, n: int = 1) -> None:
        """Progress is not shown."""

    def set_description(self, text: str) -> None:
        """Progress is not shown."""

    def close(self) -> None:
        """Progress is not shown."""


def _progress(total: int, show: bool) -> _NoProgress:
    if not show:
        return _NoProgress()
    from tqdm import tqdm

    bar: _NoProgress = tqdm(total=total, unit="req", file=sys.stderr)
    return bar
