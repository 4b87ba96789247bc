"""``kvtiers demo``: the main job. A simulated engine drives a real tier stack end to end.

Phase 1 (cold) runs a multi-turn conversation workload through a fresh stack: chunks are
stored in the CPU tier, cascaded to the persistent tiers, evicted from the small CPU tier
and promoted back. Phase 2 (warm) shuts the stack down, builds it again from the same
configuration (new managers, indexes rebuilt from disk and from the bucket) and replays
the workload: its prefixes now come from the persistent tiers. Every loaded block is
checked byte for byte; the run fails if one is wrong. The last line printed is a one-line
verdict.

Safety, because the demo may be pointed at any stack file:

* Everything it writes goes under its output directory (``--out``) or a file tier's root.
* A directory it creates gets a marker file (:data:`MARKER`). It uses a directory only if
  it is new, empty, or carries the marker; a non-empty directory without the marker is
  refused with a :class:`~kvtiers.errors.ConfigError` before anything is built.
* Starting fresh removes only kvtiers namespaces (directories holding a ``manifest.json``)
  from a marked root: never a file it did not create.

A shipped example named instead of a path (``--config cpu-file``) runs at demo scale: its
tier kinds, policies and options, with capacities capped, file roots placed under the
output directory, S3 on the embedded server and fsspec in memory.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvtiers.config import (
    CPUTierConfig,
    FileTierConfig,
    FsspecTierConfig,
    S3TierConfig,
    StackConfig,
    TierConfig,
    load_stack_config,
)
from kvtiers.config.examples import DEMO_EXAMPLE, example_names, example_path
from kvtiers.config.sizes import Size, format_size
from kvtiers.errors import ConfigError, KVTiersError
from kvtiers.optional import require

if TYPE_CHECKING:
    from kvtiers.engine.simulator import RequestReport
    from kvtiers.engine.workload import Request, WorkloadSpec
    from kvtiers.stack.builder import Stack

DEFAULT_OUT = Path("kvtiers-demo")
MARKER = ".kvtiers-demo"
NUM_GPU_BLOCKS = 1024
# Demo-scale caps for a shipped example: small enough for a laptop, small enough that
# chunks are evicted from the CPU tier and promoted back.
CPU_CAP = 16 << 20
FILE_CAP = 32 << 20
RECOMPUTED = "recomputed"


@dataclass
class PhaseResult:
    """One phase's requests, where each request's prompt tokens came from, and stats."""

    name: str
    reports: list[RequestReport] = field(default_factory=list)
    # Per request: prompt tokens by source, "recomputed" or a tier's name.
    tokens: list[dict[str, int]] = field(default_factory=list)
    # Per request: seconds since the demo started when it finished.
    finished_at: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def verification_failures(self) -> int:
        return sum(r.verification_failures for r in self.reports)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.reports)

    @property
    def reused_tokens(self) -> int:
        return sum(r.reused_tokens for r in self.reports)

    def served_tokens(self, source: str) -> int:
        return sum(t.get(source, 0) for t in self.tokens)


# -- configuration ---------------------------------------------------------------------
def resolve_config(config: str | Path | Mapping[str, object], out_dir: Path) -> StackConfig:
    """The stack the demo runs: ``config`` is an example's name, a file, or a mapping.

    A named example is brought to demo scale (see the module docstring). A stack without
    a ``model:`` section gets the default demo's model, which stands in for an engine."""
    if isinstance(config, Mapping):
        stack = load_stack_config(config)
    else:
        example = example_path(str(config))
        if example is not None:
            stack = _demo_scale(load_stack_config(example), out_dir)
        elif isinstance(config, str) and "/" not in config and not Path(config).exists():
            raise ConfigError(
                f"no example named {config!r} and no such file; name one of "
                f"{', '.join(example_names())} or pass a stack file's path",
                path="--config",
            )
        else:
            stack = load_stack_config(config)
    if stack.model is None:
        demo = example_path(DEMO_EXAMPLE)
        assert demo is not None, "the demo example ships with the package"
        stack = dataclasses.replace(stack, model=load_stack_config(demo).model)
    return stack


def _demo_scale(stack: StackConfig, out_dir: Path) -> StackConfig:
    tiers: list[TierConfig] = []
    for tier in stack.tiers:
        if isinstance(tier, CPUTierConfig):
            tier = dataclasses.replace(tier, capacity=Size(min(tier.capacity, CPU_CAP)),
                                       shared_memory_name=None)
        elif isinstance(tier, FileTierConfig):
            capacity = Size(FILE_CAP if tier.capacity is None else min(tier.capacity, FILE_CAP))
            tier = dataclasses.replace(tier, root=str(out_dir.absolute() / tier.name),
                                       capacity=capacity)
        elif isinstance(tier, S3TierConfig):
            tier = dataclasses.replace(tier, endpoint_url="embedded", region=None)
        elif isinstance(tier, FsspecTierConfig):
            tier = dataclasses.replace(tier, url=f"memory://kvtiers-demo/{tier.name}",
                                       storage_options={})
        tiers.append(tier)
    return dataclasses.replace(stack, tiers=tuple(tiers), metrics=None)


# -- the directories the demo may write ------------------------------------------------
def check_directory(path: Path, *, what: str) -> None:
    """Raise :class:`ConfigError` unless the demo may use ``path``: it is missing, empty,
    or carries the demo's marker. ``what`` names where it came from (``--out``)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is not a directory; point {what} at a new directory",
                          path=what)
    if path.is_dir() and not (path / MARKER).exists() and any(path.iterdir()):
        raise ConfigError(
            f"{path} is not empty and was not created by kvtiers demo; the demo never "
            f"touches files it did not create: point {what} at a new or empty directory",
            path=what,
        )


def claim_directory(path: Path) -> None:
    """Make the checked ``path`` the demo's: create it if missing, and mark it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("made by kvtiers demo; it may remove namespaces in here\n")


def clear_namespaces(root: Path) -> list[Path]:
    """Remove the kvtiers namespaces in the marked directory ``root``; returns them."""
    assert (root / MARKER).exists(), f"{root} is not the demo's"
    removed = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and (entry / "manifest.json").is_file():
            shutil.rmtree(entry)
            removed.append(entry)
    return removed


def _file_roots(stack: StackConfig) -> list[tuple[str, Path]]:
    return [(f"tiers[{index}].root", tier.root_path) for index, tier in enumerate(stack.tiers)
            if isinstance(tier, FileTierConfig)]


# -- running ---------------------------------------------------------------------------
def run_phase(
    name: str,
    stack: Stack,
    requests: Sequence[Request],
    progress: Callable[[int], None],
    *,
    clock_start: float,
) -> PhaseResult:
    """Run ``requests`` through a simulated engine over ``stack``."""
    from kvtiers.engine.simulator import SimulatedEngine, TimeModel

    phase = PhaseResult(name)
    engine = SimulatedEngine(stack, num_gpu_blocks=NUM_GPU_BLOCKS,
                             time_model=TimeModel.from_stack(stack.config))
    lower = [tier.name for tier in stack.tiers[1:]]
    primary = stack.tiers[0].name
    config = stack.offloading
    start = time.perf_counter()
    try:
        for request in requests:
            before = stack.manager.get_stats()
            report = engine.run_request(request.req_id, request.token_ids)
            after = stack.manager.get_stats()
            promoted = {t: after.get(f"{t}.promoted", 0) - before.get(f"{t}.promoted", 0)
                        for t in lower}
            # Chunks of every group were loaded; a lower tier's share of them is its
            # share of the prefix's tokens, the primary served the rest.
            chunks = sum(-(-report.reused_tokens // config.tokens_per_chunk(g))
                         for g in range(len(config.groups)))
            tokens = {RECOMPUTED: report.prompt_tokens - report.reused_tokens}
            for tier, count in promoted.items():
                tokens[tier] = min(report.reused_tokens, round(
                    report.reused_tokens * count / chunks)) if chunks else 0
            tokens[primary] = max(0, report.reused_tokens - sum(tokens[t] for t in lower))
            phase.reports.append(report)
            phase.tokens.append(tokens)
            phase.finished_at.append(time.perf_counter() - clock_start)
            progress(1)
        stack.manager.wait_idle()
    finally:
        engine.shutdown()
    phase.seconds = time.perf_counter() - start
    phase.stats = dict(stack.manager.get_stats())
    return phase


def _rate(num_bytes: float, seconds: float) -> str:
    return f"{format_size(int(num_bytes / seconds))}/s" if seconds > 0 and num_bytes else "-"


def render_phase(phase: PhaseResult, stack_names: Sequence[str]) -> str:
    """A plain-text summary of one phase, within 80 columns.

    Per tier: chunks held at the end, prompt tokens it served, chunks written into it (the
    primary's stores; a lower tier's cascades and demotions, as its write rules decide),
    bytes written into and read out of it, those bytes as an average rate over the phase's
    wall time (lower tiers work in the background, so a per-job rate would count
    queueing), and errors (corrupt chunks plus failed transfers). The GPU ⇄ primary
    worker's own rate per transfer is given on its own line."""
    reports = phase.reports
    prompt, reused = phase.prompt_tokens, phase.reused_tokens
    stats = phase.stats
    store_bytes = sum(r.stored_bytes for r in reports)
    load_bytes = sum(r.loaded_bytes for r in reports)
    store_s = sum(r.store_s for r in reports)
    load_s = sum(r.load_s for r in reports)
    lines = [
        f"{phase.name}: {len(reports)} requests in {phase.seconds:.1f} s",
        f"  {prompt:,} prompt tokens: {reused:,} loaded from the tiers "
        f"({100 * reused / max(prompt, 1):.1f}%), {prompt - reused:,} recomputed",
        f"  verified {sum(r.verified_blocks for r in reports):,} loaded blocks "
        f"({format_size(load_bytes)}): {phase.verification_failures} verification failures",
        *_ttft_lines(reports),
        f"  GPU ⇄ {stack_names[0]} worker, per transfer: store {_rate(store_bytes, store_s)}, "
        f"load {_rate(load_bytes, load_s)}",
        "",
        f"  {'tier':<6}{'chunks':>7}{'tokens':>7}{'writes':>7}{'written':>10}{'read':>10}"
        f"{'write/s':>12}{'read/s':>12}{'errors':>7}",
    ]
    written: float
    read: float
    for index, name in enumerate(stack_names):
        if index == 0:
            written, read = store_bytes, load_bytes
            writes = stats.get(f"{name}.stores", 0)
            failed = sum(r.load_failures + r.store_failures for r in reports)
        else:
            written = (stats.get(f"{name}.cascaded_bytes", 0)
                       + stats.get(f"{name}.demoted_bytes", 0))
            writes = stats.get(f"{name}.cascaded", 0) + stats.get(f"{name}.demoted", 0)
            read = stats.get(f"{name}.promoted_bytes", 0)
            failed = int(stats.get(f"{name}.store_failures", 0))
        errors = failed + int(stats.get(f"{name}.corrupt_chunks", 0))
        lines.append(
            f"  {name[:6]:<6}{int(stats.get(f'{name}.chunks', 0)):>7,}"
            f"{phase.served_tokens(name):>7,}{int(writes):>7,}{format_size(int(written)):>10}"
            f"{format_size(int(read)):>10}{_rate(written, phase.seconds):>12}"
            f"{_rate(read, phase.seconds):>12}{errors:>7}"
        )
    lines += [
        "  (rates: bytes over the phase's wall time; errors: corrupt chunks and failed",
        "  transfers)",
        f"  promotions {int(stats.get('promotions', 0)):,} (failed "
        f"{int(stats.get('promotion_failures', 0))}, refused "
        f"{int(stats.get('promotions_refused', 0))}), cascades "
        f"{int(stats.get('cascades', 0)):,} (failed {int(stats.get('cascade_failures', 0))})",
        f"  demotions {int(stats.get('demotions', 0)):,} (failed "
        f"{int(stats.get('demotion_failures', 0))}, refused "
        f"{int(stats.get('demotions_refused', 0))}, dropped "
        f"{int(stats.get('demotions_dropped', 0))})",
    ]
    return "\n".join(lines)


def _ttft_lines(reports: Sequence[RequestReport]) -> list[str]:
    """The simulated time to first token over the phase's requests, next to recomputing
    every prompt; nothing when the stack declares no prefill rate (``promotion:``)."""
    if not any(r.recompute_s for r in reports):
        return []

    def spread(values: Sequence[float]) -> str:
        ordered = sorted(values)
        p50 = ordered[len(ordered) // 2]
        p90 = ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)]
        return (f"mean {sum(ordered) / len(ordered):.3f} p50 {p50:.3f} p90 {p90:.3f} "
                f"max {ordered[-1]:.3f}")

    ttft = [r.ttft_s for r in reports]
    recompute = [r.recompute_s for r in reports]
    slower = sum(1 for r in reports if r.ttft_s > r.recompute_s)
    return [
        f"  simulated TTFT s: {spread(ttft)}",
        f"    recompute all: {spread(recompute)}; {slower} requests slower than recompute",
    ]


def verdict(phases: Sequence[PhaseResult], names: Sequence[str]) -> tuple[bool, str]:
    """Whether the run passed, and the one line that says so."""
    failures = sum(p.verification_failures for p in phases)
    checked = sum(r.verified_blocks for p in phases for r in p.reports)
    if failures:
        return False, (f"verdict: FAILED: {failures} of {checked:,} loaded blocks did not "
                       "hold the bytes that were stored")
    cold, warm = phases[0], phases[-1]
    return True, (
        f"verdict: ok: {checked:,} blocks verified; tokens loaded after the restart "
        f"{_percent(warm)}, cold {_percent(cold)}"
    )


def _percent(phase: PhaseResult) -> str:
    return f"{100 * phase.reused_tokens / max(phase.prompt_tokens, 1):.0f}%"


def plot_phases(phases: Sequence[PhaseResult], names: Sequence[str], path: Path) -> None:
    """Prompt tokens recomputed vs loaded from each tier: per request, and cumulative over
    time, so the gain after the restart is visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = [RECOMPUTED, *names]
    palette = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
    colors = {RECOMPUTED: "#b0b0b0", **dict(zip(names, palette, strict=False))}
    fig, (per_request, cumulative) = plt.subplots(2, 1, figsize=(11, 7))
    offset = 0
    for phase in phases:
        xs = list(range(offset, offset + len(phase.tokens)))
        bottom = [0] * len(xs)
        for source in sources:
            values = [t.get(source, 0) for t in phase.tokens]
            per_request.bar(xs, values, bottom=bottom, color=colors.get(source), width=1.0,
                            label=source if offset == 0 else None)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        if offset:
            per_request.axvline(offset - 0.5, color="black", linestyle=":")
        per_request.annotate(phase.name, (offset, 1.0), xycoords=("data", "axes fraction"),
                             va="top", xytext=(3, -3), textcoords="offset points")
        offset += len(xs)
    per_request.set_ylabel("prompt tokens")
    per_request.set_xlabel("request")
    per_request.set_title("Where each request's prompt tokens came from")
    per_request.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))

    times = [0.0] + [t for phase in phases for t in phase.finished_at]
    rows = [t for phase in phases for t in phase.tokens]
    totals = {source: [0] for source in sources}
    for row in rows:
        for source in sources:
            totals[source].append(totals[source][-1] + row.get(source, 0))
    cumulative.stackplot(times, *(totals[s] for s in sources), labels=sources,
                         colors=[colors.get(s) for s in sources], step="post")
    if len(phases) > 1 and phases[0].finished_at:
        cumulative.axvline(phases[0].finished_at[-1], color="black", linestyle=":",
                           label="restart")
    cumulative.set_ylabel("prompt tokens, cumulative")
    cumulative.set_xlabel("seconds since start")
    cumulative.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(
    config_source: str | Path | Mapping[str, object] = DEMO_EXAMPLE,
    *,
    out_dir: Path = DEFAULT_OUT,
    workload: WorkloadSpec | None = None,
    plot: Path | None = None,
    fresh: bool = True,
    out: TextIO = sys.stdout,
    show_progress: bool = True,
) -> list[PhaseResult]:
    """Run both phases, print their tables and the verdict; raise if a byte was wrong.

    ``config_source`` is an example's name, a stack file or a mapping. Raises
    :class:`ConfigError` before building anything if a directory the demo would write is
    not its own (see the module docstring)."""
    from kvtiers.engine.workload import WorkloadSpec, conversation_requests
    from kvtiers.stack.builder import load_stack

    if plot is not None:
        # Checked first: a missing package should not cost a whole run.
        require("matplotlib", purpose="the demo's plot (or pass --no-plot)")
    config = resolve_config(config_source, out_dir)
    roots = _file_roots(config)
    # Every directory is checked before any is created: a refusal leaves no trace.
    directories = [("--out", out_dir), *roots]
    for what, path in directories:
        check_directory(path, what=what)
    for _, path in directories:
        claim_directory(path)
    if fresh:
        for _, root in roots:
            clear_namespaces(root)
    requests = conversation_requests(workload or WorkloadSpec())
    phases = []
    names: list[str] = [tier.name for tier in config.tiers]
    bar = _progress(2 * len(requests), show_progress)
    clock_start = time.perf_counter()
    try:
        for name in ("phase 1 (cold start)", "phase 2 (after restart)"):
            bar.set_description(name)
            with load_stack(config) as stack:
                phases.append(run_phase(name, stack, requests, bar.update,
                                        clock_start=clock_start))
    finally:
        bar.close()
    print("stack:", file=out)
    for tier in config.tiers:
        print(f"  {tier.name}: {tier.describe()}", file=out)
    if config.promotion is not None:
        print(f"  promotion: cost-aware, prefill {config.promotion.prefill_tokens_per_s:g} "
              "tokens/s (TTFT below is simulated from the tiers' load_* numbers)", file=out)
    print(file=out)
    for phase in phases:
        print(render_phase(phase, names), file=out)
        print(file=out)
    if plot is not None:
        plot_phases(phases, names, plot)
        print(f"plot: {plot}", file=out)
    passed, line = verdict(phases, names)
    print(line, file=out)
    if not passed:
        raise KVTiersError(line.removeprefix("verdict: FAILED: "))
    return phases


class _NoProgress:
    def update(self, n: int = 1) -> None:
        """Progress is not shown."""

    def set_description(self, text: str) -> None:
        """Progress is not shown."""

    def close(self) -> None:
        """Progress is not shown."""


def _progress(total: int, show: bool) -> _NoProgress:
    """A progress bar on stderr when asked for, stderr is a terminal and tqdm is there
    (it is only decoration: without tqdm the demo runs without a bar)."""
    if not (show and sys.stderr.isatty()):
        return _NoProgress()
    try:
        from tqdm import tqdm
    except ModuleNotFoundError:
        return _NoProgress()
    bar: _NoProgress = tqdm(total=total, unit="req", file=sys.stderr)
    return bar
