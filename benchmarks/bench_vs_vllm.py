"""kvtiers' CPU tier against vLLM's ``CPUOffloadingManager``, side by side in one process.

Runs on each vLLM release kvtiers supports (0.32-0.34); the machine note names the one
measured. Between 0.33 and 0.34 vLLM's manager and policies changed (``touch`` is gone,
a store counts a key once per request towards ``store_threshold``, stored events carry
the request's context) and so did its connector's calls: a finished job's keys reach
``complete_load`` / ``complete_store`` as a tuple in prefix order, where 0.33 handed a
set. Every vLLM-facing side here gets them as the installed release's connector hands
them (``route1.job_keys``, built inside the timed call, the same for both sides).

Three sides see the same keys in the same order, their rounds interleaved (the order of the
sides rotates every round), so all three meet the same machine load:

* ``vllm``: vLLM's ``CPUOffloadingManager`` with its ``lru`` or ``arc`` policy;
* ``direct``: kvtiers' :class:`~kvtiers.tiers.cpu.manager.CpuTierManager` called with
  kvtiers keys (no translation);
* ``route1``: the manager vLLM gets from ``KVTiersOffloadingSpec`` (a one-tier CPU stack
  behind the vLLM-facing adapter), built by vLLM's ``OffloadingSpecFactory`` and called with
  vLLM's keys and request contexts, exactly as vLLM's connector calls it.

Each tier holds ``--chunks`` chunks (100,000 by default; 400,000 as well with ``--chunks
100000 400000``) of random keys. A round is one request of 1,024 keys, split into calls of
1, 16 or 1,024 keys:

* lookup HIT / MISS: one ``lookup`` per key, resident / never-stored keys drawn at random;
* load: ``prepare_load`` + ``complete_load`` of resident keys drawn at random (kvtiers
  direct adds ``get_spec``, which vLLM's ``prepare_load`` does inside);
* store+evict: ``prepare_store`` + ``complete_store`` of fresh keys on a full tier, so every
  call evicts as many chunks as it stores (direct adds ``get_spec``);
* finish: ``on_request_finished`` and ``take_events`` once per round, per key of the round.

Reported per metric: the median over rounds of microseconds per key, each kvtiers side's
ratio to vLLM (below 1 is faster), and the worst single call of each side (per call for
load, store and finish; lookups are timed per round, so their worst is the worst round).
Per-key costs are the CPU time of the benchmark's thread (``time.thread_time``), so on a
shared machine time spent waiting for a core counts for no side; worst calls are
wall-clock, as a scheduler step would see them.
Memory per tracked chunk is measured with tracemalloc for each side alone: after filling
the tier, and again after a full turnover (as many evicting stores as the tier holds); the
key objects themselves, created by the caller, are not counted.

Run: ``.venv/bin/python benchmarks/bench_vs_vllm.py [--quick] [--chunks N ...] [--policies
P ...] [--parts lookup load store_evict]``. Writes
``benchmarks/results/vs_vllm.md`` and ``vs_vllm.json`` unless ``--no-write``. vLLM must be
importable (0.33.0 is installed without its dependencies in ``.venv``, 0.34.0 in
``.venv-vllm34``); the report names the interpreter that ran it. A report written over
one from another vLLM release keeps that release's route-1 summary in one line.
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from harness import (
    bench_parser,
    finish_note,
    from_document,
    machine_note,
    markdown_table,
    percentile,
    read_result,
    to_document,
    write_result,
)
from route1 import SLOT_BYTES, job_keys, route1_manager

from kvtiers.core.keys import make_offload_key
from kvtiers.core.manager import ReqContext
from kvtiers.policies import load_policy
from kvtiers.tiers.cpu.manager import CpuTierManager

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("python", "args", "rounds"),
    "tables": ("runs", "memory"),
}
ROUND_KEYS = 1024
BATCHES = (1, 16, 1024)
POLICIES = ("lru", "arc")
SIDES = ("vllm", "direct", "route1")
METRICS = ("lookup_hit", "lookup_miss", "load", "store_evict", "finish")
#: What ``--parts`` can pick: lookups (HIT, MISS and the finish after them), loads, stores.
PARTS = ("lookup", "load", "store_evict")
#: The slot of the one-group geometry below: the CPU tier rounds a chunk up to 4096 bytes.


class Side:
    """One manager behind a uniform driver (keys come from :func:`key_maker`). Lookups
    call ``manager.lookup`` directly, as vLLM does (see :func:`look_up`)."""

    name: str
    manager: Any

    def begin(self, req_id: str) -> Any:
        raise NotImplementedError

    def load(self, keys: list[Any], ctx: Any) -> None:
        raise NotImplementedError

    def store(self, keys: list[Any], ctx: Any) -> None:
        raise NotImplementedError

    def finish(self, ctx: Any) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release what the side holds (default: nothing)."""


class VllmSide(Side):
    """vLLM's ``CPUOffloadingManager``, or (``route1``) any vLLM-facing manager."""

    def __init__(self, name: str, manager: Any, on_shutdown: Callable[[], None] = lambda: None):
        from vllm.v1.kv_offload import base as vbase

        self.name = name
        self.manager = manager
        self._vbase = vbase
        self._on_shutdown = on_shutdown

    def begin(self, req_id: str) -> Any:
        ctx = self._vbase.ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        return ctx

    def load(self, keys: list[Any], ctx: Any) -> None:
        self.manager.prepare_load(keys, ctx)
        self.manager.complete_load(job_keys(keys), ctx)

    def store(self, keys: list[Any], ctx: Any) -> None:
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None, f"{self.name}: a store on a full tier of idle chunks failed"
        self.manager.complete_store(job_keys(out.keys_to_store), ctx)

    def finish(self, ctx: Any) -> None:
        self.manager.on_request_finished(ctx)
        self.manager.take_events()

    def shutdown(self) -> None:
        self._on_shutdown()


class DirectSide(Side):
    """kvtiers' ``CpuTierManager`` with kvtiers keys and contexts."""

    name = "direct"

    def __init__(self, chunks: int, policy: str) -> None:
        self.manager = CpuTierManager(chunks, SLOT_BYTES, load_policy(policy)(chunks))

    def begin(self, req_id: str) -> Any:
        ctx = ReqContext(req_id=req_id)
        self.manager.on_new_request(ctx)
        return ctx

    def load(self, keys: list[Any], ctx: Any) -> None:
        self.manager.prepare_load(keys, ctx)
        self.manager.get_spec(keys)
        self.manager.complete_load(keys, ctx)

    def store(self, keys: list[Any], ctx: Any) -> None:
        accepted = self.manager.prepare_store(keys, ctx)
        assert accepted is not None, "direct: a store on a full tier of idle chunks failed"
        self.manager.get_spec(accepted)
        self.manager.complete_store(accepted, ctx)

    def finish(self, ctx: Any) -> None:
        self.manager.on_request_finished(ctx)
        self.manager.take_events()


def vllm_side(chunks: int, policy: str) -> Side:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return VllmSide("vllm", CPUOffloadingManager(chunks, cache_policy=policy))


def route1_side(chunks: int, policy: str) -> Side:
    """The manager of a ``KVTiersOffloadingSpec`` over one CPU tier of ``chunks`` slots."""
    manager = route1_manager(chunks, policy, blocks_per_chunk=1, label="bench")
    return VllmSide("route1", manager, manager.shutdown)


FACTORIES: dict[str, Callable[[int, str], Side]] = {
    "vllm": vllm_side,
    "direct": lambda chunks, policy: DirectSide(chunks, policy),
    "route1": route1_side,
}


def hashes(count: int, rng: random.Random) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(count)]


def fill(side: Side, keys: Sequence[Any], request: str) -> None:
    for begin in range(0, len(keys), ROUND_KEYS):
        ctx = side.begin(f"{request}-{begin}")
        side.store(list(keys[begin : begin + ROUND_KEYS]), ctx)
        side.finish(ctx)


# -- timing --------------------------------------------------------------------------
class Collections:
    """Counts the interpreter's full (generation 2) garbage collections, so a call that one
    happened to land in can be told apart from one that is slow by itself. Young
    collections run every few hundred allocations, inside most batch calls, and are cheap."""

    count = 0

    @classmethod
    def on_gc(cls, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            cls.count += 1


gc.callbacks.append(Collections.on_gc)


class Recorder:
    """Per side and metric: microseconds per key of every round, the worst call, and the
    worst call no garbage collection ran in."""

    def __init__(self) -> None:
        self.per_key: dict[tuple[str, str], list[float]] = {}
        self.worst: dict[tuple[str, str], float] = {}
        self.worst_no_gc: dict[tuple[str, str], float] = {}

    def add(
        self, side: str, metric: str, round_s: float, keys: int, worst: tuple[float, float]
    ) -> None:
        self.per_key.setdefault((side, metric), []).append(round_s / keys * 1e6)
        self.worst[side, metric] = max(self.worst.get((side, metric), 0.0), worst[0])
        self.worst_no_gc[side, metric] = max(self.worst_no_gc.get((side, metric), 0.0), worst[1])

    def median(self, side: str, metric: str) -> float:
        return statistics.median(self.per_key[side, metric])

    def spread(self, side: str, metric: str) -> tuple[float, float]:
        """The first and third quartiles of ``side``'s cost over vLLM's, round by round
        (the sides of one round run back to back, so they meet the same load)."""
        ratios = [
            own / vllm
            for own, vllm in zip(
                self.per_key[side, metric], self.per_key["vllm", metric], strict=True
            )
            if vllm > 0
        ]
        if len(ratios) < 2:
            return (ratios[0], ratios[0]) if ratios else (float("nan"), float("nan"))
        return percentile(ratios, 25), percentile(ratios, 75)


def timed_calls(
    call: Callable[[list[Any], Any], None], parts: list[list[Any]], ctx: Any
) -> tuple[float, tuple[float, float]]:
    """CPU seconds of this thread over ``call(part, ctx)`` for every part, and the worst
    call in wall-clock seconds: overall and among calls no garbage collection ran in."""
    clock = time.perf_counter
    worst = worst_no_gc = 0.0
    cpu_start = time.thread_time()
    for part in parts:
        collections = Collections.count
        start = clock()
        call(part, ctx)
        spent = clock() - start
        worst = max(worst, spent)
        if Collections.count == collections:
            worst_no_gc = max(worst_no_gc, spent)
    return time.thread_time() - cpu_start, (worst, worst_no_gc)


def look_up(side: Side, keys: list[Any], ctx: Any) -> None:
    """One lookup per key, each spelled as vLLM's connector spells it
    (``self.manager.lookup(key, req_context)``), so no driver frame lands in the timing."""
    for key in keys:
        side.manager.lookup(key, ctx)


def timed_round(run: Callable[[], None]) -> tuple[float, float]:
    """CPU seconds of this thread spent in ``run()``, and its wall-clock seconds."""
    cpu_start, start = time.thread_time(), time.perf_counter()
    run()
    return time.thread_time() - cpu_start, time.perf_counter() - start


def rotated(sides: list[Side], r: int) -> list[Side]:
    shift = r % len(sides)
    return sides[shift:] + sides[:shift]


def split(keys: list[int], batch: int) -> list[list[int]]:
    return [keys[i : i + batch] for i in range(0, len(keys), batch)]


def bench_policy(
    chunks: int, policy: str, rounds: int, seed: int, parts: Sequence[str] = PARTS
) -> dict[str, Any]:
    """The metrics of ``parts`` for ``policy`` at ``chunks`` chunks; see the module
    docstring."""
    rng = random.Random(seed)
    stored = hashes(chunks, rng)
    sides = [FACTORIES[name](chunks, policy) for name in SIDES]
    makers = {side.name: key_maker(side.name) for side in sides}
    keys = {side.name: [makers[side.name](h) for h in stored] for side in sides}
    for side in sides:
        fill(side, keys[side.name], "fill")
    results: dict[str, Any] = {"chunks": chunks, "policy": policy, "rows": []}
    try:
        # Lookups: per key, batch size plays no part.
        record = Recorder()
        for r in range(rounds if "lookup" in parts else 0):
            hits = rng.sample(range(chunks), ROUND_KEYS)
            misses = hashes(ROUND_KEYS, rng)
            for side in rotated(sides, r):
                hit_keys = [keys[side.name][i] for i in hits]
                miss_keys = [makers[side.name](h) for h in misses]
                ctx = side.begin(f"lookup-{r}")
                hit_s, hit_wall = timed_round(partial(look_up, side, hit_keys, ctx))
                miss_s, miss_wall = timed_round(partial(look_up, side, miss_keys, ctx))
                finish_s, finish_wall = timed_round(partial(side.finish, ctx))
                record.add(side.name, "lookup_hit", hit_s, ROUND_KEYS, (hit_wall, hit_wall))
                record.add(side.name, "lookup_miss", miss_s, ROUND_KEYS, (miss_wall, miss_wall))
                record.add(
                    side.name, "finish", finish_s, ROUND_KEYS, (finish_wall, finish_wall)
                )
        if "lookup" in parts:
            results["rows"] += rows(record, ("lookup_hit", "lookup_miss", "finish"), None)

        # Loads of resident chunks, then evicting stores of fresh ones: loads never evict,
        # so every side still holds every filled chunk when the loads run.
        for metric in [part for part in ("load", "store_evict") if part in parts]:
            for batch in BATCHES:
                record = Recorder()
                for r in range(rounds):
                    if metric == "load":
                        chosen = rng.sample(range(chunks), ROUND_KEYS)
                    else:
                        fresh = hashes(ROUND_KEYS, rng)
                    for side in rotated(sides, r):
                        if metric == "load":
                            own = [keys[side.name][i] for i in chosen]
                        else:
                            own = [makers[side.name](h) for h in fresh]
                        ctx = side.begin(f"{metric}-{batch}-{r}")
                        call = side.load if metric == "load" else side.store
                        total, worst = timed_calls(call, split(own, batch), ctx)
                        side.finish(ctx)
                        record.add(side.name, metric, total, ROUND_KEYS, worst)
                results["rows"] += rows(record, (metric,), batch)
    finally:
        for side in sides:
            side.shutdown()
    return results


def rows(record: Recorder, metrics: Sequence[str], batch: int | None) -> list[dict[str, Any]]:
    out = []
    for metric in metrics:
        row: dict[str, Any] = {"metric": metric, "batch": batch}
        for side in SIDES:
            row[f"{side}_us"] = record.median(side, metric)
            row[f"{side}_worst_ms"] = record.worst[side, metric] * 1e3
            row[f"{side}_worst_no_gc_ms"] = record.worst_no_gc[side, metric] * 1e3
        for side in SIDES[1:]:
            row[f"{side}_ratio"] = row[f"{side}_us"] / row["vllm_us"]
            row[f"{side}_ratio_p25"], row[f"{side}_ratio_p75"] = record.spread(side, metric)
        out.append(row)
    return out


# -- memory --------------------------------------------------------------------------
def key_maker(side_name: str) -> Callable[[bytes], Any]:
    """How ``side_name`` spells a key (vLLM's packing for vLLM-facing sides)."""
    if side_name == "direct":
        return lambda block_hash: make_offload_key(block_hash, 0)
    from vllm.v1.kv_offload import base as vbase

    return lambda block_hash: vbase.make_offload_key(block_hash, 0)


def bench_memory(chunks: int, policy: str, side_name: str, seed: int) -> dict[str, Any]:
    """Bytes per tracked chunk after a fill and after a full turnover (tracemalloc, from
    before the manager is built); the keys are made before tracing starts."""
    rng = random.Random(seed)
    make = key_maker(side_name)
    first = [make(h) for h in hashes(chunks, rng)]
    second = [make(h) for h in hashes(chunks, rng)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        side = FACTORIES[side_name](chunks, policy)
        fill(side, first, "fill")
        gc.collect()
        filled = tracemalloc.get_traced_memory()[0]
        fill(side, second, "turnover")
        gc.collect()
        turned = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    side.shutdown()
    return {
        "chunks": chunks,
        "policy": policy,
        "side": side_name,
        "filled_bytes_per_chunk": (filled - base) / chunks,
        "turnover_bytes_per_chunk": (turned - base) / chunks,
    }


# -- report --------------------------------------------------------------------------
LABELS = {
    "lookup_hit": "lookup HIT",
    "lookup_miss": "lookup MISS",
    "load": "load",
    "store_evict": "store+evict",
    "finish": "request finish",
}


def render(results: dict[str, Any]) -> str:
    """The results page for ``results``, the flat dict :data:`LAYOUT` maps onto the
    schema (a machine note converted from before the schema is read as it was)."""
    note = results["machine"].get("original", results["machine"])
    lines = [
        "# kvtiers' CPU tier vs vLLM's CPUOffloadingManager",
        "",
        f"Machine: {note['cpu']}, {note['cores']} cores, Python {note['python']}, torch "
        f"{note['torch']}, vLLM {note['vllm']}, {note['date']}; load average at the start "
        f"{note.get('load', note.get('load_start', '?'))}, at the end {note.get('load_end', '?')}.",
        f"Command: `{results.get('python', '.venv/bin/python')} benchmarks/bench_vs_vllm.py "
        f"{results['args']}`",
        *([f"Previous run: {results['previous']}"] if results.get("previous") else []),
        "",
        "Microseconds per key (CPU time of the benchmark's thread), median of "
        f"{results['rounds']} interleaved rounds of {ROUND_KEYS} keys (one request each); "
        "ratio = kvtiers / vLLM, of the medians (target <= 0.8 for route 1); `route1 "
        "p25-p75` = the quartiles of route 1's ratio round by round (its spread); worst = "
        "the slowest single call "
        "in wall-clock ms, in brackets the slowest that no "
        "full garbage collection ran in (lookups and finish: the slowest round of "
        f"{ROUND_KEYS}, GC not separated). `direct` is `CpuTierManager` with kvtiers keys; "
        "`route1` is the manager of `KVTiersOffloadingSpec` called as vLLM calls it.",
        "",
    ]
    for run in results["runs"]:
        lines += [
            f"## {run['policy']}, {run['chunks']:,} chunks",
            "",
            *markdown_table(
                ["metric", "batch", "vLLM", "direct", "direct ratio", "route1", "route1 ratio",
                 "route1 p25-p75", "worst vLLM", "worst direct", "worst route1"],
                ([LABELS[r["metric"]], r["batch"] or "-", f"{r['vllm_us']:.2f}",
                  f"{r['direct_us']:.2f}", f"{r['direct_ratio']:.2f}x", f"{r['route1_us']:.2f}",
                  f"{r['route1_ratio']:.2f}x",
                  f"{r['route1_ratio_p25']:.2f}-{r['route1_ratio_p75']:.2f}x",
                  *(f"{r[f'{side}_worst_ms']:.1f} ({r[f'{side}_worst_no_gc_ms']:.1f})"
                    for side in SIDES)]
                 for r in run["rows"])),
            "",
        ]
    lines += [
        "## Memory per tracked chunk (tracemalloc; target <= 200 B for route 1)",
        "",
        "Everything the manager allocates from before it is built, excluding the key objects "
        "(the caller's). `after turnover`: once as many evicting stores as the tier holds "
        "have replaced every chunk.",
        "",
        *markdown_table(
            ["policy", "chunks", "side", "after fill (B)", "after turnover (B)"],
            ([m["policy"], f"{m['chunks']:,}", m["side"], f"{m['filled_bytes_per_chunk']:.0f}",
              f"{m['turnover_bytes_per_chunk']:.0f}"] for m in results["memory"]),
            align="lrlrr"),
    ]
    lines += ["", "## Reading the numbers", "", *summary(results)]
    return "\n".join(lines) + "\n"


def summary(results: dict[str, Any]) -> list[str]:
    """Every route-1 ratio against its 0.8 target, and the worst calls side by side."""
    out = []
    for side in ("route1", "direct"):
        misses = []
        ratios = []
        for run in results["runs"]:
            for r in run["rows"]:
                ratios.append(r[f"{side}_ratio"])
                if r[f"{side}_ratio"] > 0.8:
                    batch = f" batch {r['batch']}" if r["batch"] else ""
                    misses.append(
                        f"{run['policy']} {run['chunks'] // 1000}k {LABELS[r['metric']]}"
                        f"{batch} {r[f'{side}_ratio']:.2f}x"
                    )
        out.append(
            f"- {side}: ratios {min(ratios):.2f}x-{max(ratios):.2f}x of vLLM's per-key cost; "
            f"{len(misses)}/{len(ratios)} above the 0.8x target"
            + (": " + "; ".join(misses) + "." if misses else ".")
        )
    for run in results["runs"]:
        store = [r for r in run["rows"] if r["metric"] == "store_evict"]
        if not store:
            continue
        worst = {
            side: (
                max(r[f"{side}_worst_ms"] for r in store),
                max(r[f"{side}_worst_no_gc_ms"] for r in store),
            )
            for side in SIDES
        }
        out.append(
            f"- Worst single store+evict call, {run['policy']} at {run['chunks']:,} chunks "
            "(in brackets: the worst no full garbage collection ran in): "
            + ", ".join(f"{side} {w:.1f} ms ({n:.1f})" for side, (w, n) in worst.items())
            + "."
        )
    out += [
        "- What the ratios show: `direct` against `route1` isolates the vLLM-facing adapter. "
        "Keys are not translated (vLLM's key objects are kvtiers' keys when every group is "
        "offloaded), a request's context is translated once, a one-tier `cpu` stack "
        "answers `lookup` in one call into the CPU tier, and the adapter makes its loads, "
        "stores and finishes itself on the CPU tier (the composite's door inlined: a type, "
        "a length and a group test per key). A key the tier holds gets a type "
        "test and is appended to the request's found list (moved into `ctx.keep` before a "
        "store reads it, so a request's store never evicts what its lookups found); a key "
        "it does not hold is a MISS unchecked: nothing is loaded or stored for a miss, and "
        "`prepare_store` / `prepare_load` check every key at the door. One Python call and "
        "a dict probe measure 0.75-0.8x of vLLM's MISS here, so MISS has no room for any "
        "per-key check in Python.",
        "- `request finish` after a lookup round drops the request's list of 1,024 found "
        "keys (vLLM keeps no such list); its cost is that of dropping the references, one "
        "memory touch of each key object, the colder the larger the tier. That list is how "
        "a request's own store never evicts what its lookups found (a guarantee vLLM's "
        "manager does not give); recording those keys without a reference (their slots in "
        "an integer array) would move the same memory read per key into the lookup HIT "
        "row rather than save it. In vLLM's own flow a request loads what it found in the "
        "step of the lookup, and the load drops the list.",
        "- Loads and stores of 1 key: route 1 adds the door's key tests, the request's "
        "context and vLLM's output objects on top of the CPU tier, about 0.5 us per call. "
        "With no KV events published the tier builds no event object (about 1 us each, "
        "two per evicting store): it forwards the keys it removes, which the adapter "
        "reports in the store's output, so route 1 stores cheaper than `direct`, which "
        "takes the tier's events. A load's slots stay a list until the worker reads them "
        "(converting a short list to an array cost more than the rest of a one-chunk "
        "load); ARC picks victims by walking its lists' links, with no generator per call. "
        "What is left is memory-bound: a random key's dict entry, the policy's list node, "
        "the victim's ghost entry.",
        "- Worst calls: the multi-second ones are full garbage collections over the "
        "benchmark's millions of live objects (all three sides' keys), landing in whichever "
        "side allocates when the threshold trips (an engine process that does not freeze "
        "its heap with `gc.freeze` sees them too). Without them, vLLM's LRU still "
        "has its lazy-heap rebuild inside one store.",
        "- vLLM 0.34 changed its CPU manager and policies where these calls do not reach: "
        "`touch` is gone (its connector never called it), a key counts once per request "
        "towards `store_threshold` (off by default, as here), stored events carry the "
        "request's context (events are off, vLLM's default), and a finished job's keys come "
        "as a tuple in prefix order (0.33: a set). Its lookup, load, store and finish paths "
        "do 0.33's work: the same calls on both releases on one machine differ within the "
        "spread of repeated runs.",
        "- The machine is shared with other work (2 cores): per-key costs are CPU time of "
        "the benchmark's thread, so preemption counts for no side, but caches are shared "
        "with other processes; ratios of repeated runs differ by up to about 0.15. Worst "
        "calls are wall-clock and include preemption, on every side alike.",
    ]
    route1 = [m for m in results["memory"] if m["side"] == "route1"]
    if route1:
        heaviest = max(
            max(m["filled_bytes_per_chunk"], m["turnover_bytes_per_chunk"]) for m in route1
        )
        out.append(
            f"- Memory: route 1 at most {heaviest:.0f} B per chunk (target 200), fill or "
            "turnover; vLLM and direct beside it in the table. The CPU tier keeps one hash "
            "table per chunk, its key → slot dict (52 B per entry after a fill, 105 B once "
            "churn has made CPython regrow it to twice the size), plus the slot's int "
            "(32 B), its key in a slot-indexed list (8 B) and the built-in policy's order "
            "in slot-indexed arrays (previous/next slot and the list it is on, 17 B; "
            "kvtiers/policies/slots.py). Before that change the policy's OrderedDict was a "
            "second hash table per chunk (105 B, then 179 B): 191 / 317 B. S3-FIFO (not "
            "run here; bench_cpu.py (c)) adds its ghost queue, up to one evicted key per "
            "slot."
        )
    return out


def interpreter() -> str:
    """The Python that runs this, as the report's command names it (relative to the
    repository root when it lives there, e.g. ``.venv-vllm34/bin/python``)."""
    path = Path(sys.executable)
    root = Path(__file__).resolve().parent.parent
    # A virtualenv's python is a link: the path as invoked names the environment.
    if path.is_relative_to(root):
        return str(path.relative_to(root))
    return str(path)


def previous_note(path: Path, vllm_version: str) -> str | None:
    """What to say of the report at ``path`` that a new one replaces: its route-1 ratios in
    one line when it measured another vLLM release, else the line it carried itself."""
    try:
        old = from_document(read_result(path))
        machine = old["machine"].get("original", old["machine"])
        old_version = machine["vllm"]
        if old_version == vllm_version:
            carried = old.get("previous")
            return str(carried) if carried else None
        ratios = [r["route1_ratio"] for run in old["runs"] for r in run["rows"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not ratios:
        return None
    above = sum(ratio > 0.8 for ratio in ratios)
    return (
        f"vLLM {old_version}, {machine.get('cpu', '?')}, "
        f"{machine.get('date', '?')}, `{old.get('args', '?')}` (load "
        f"{machine.get('load', machine.get('load_start', '?'))} to "
        f"{machine.get('load_end', '?')}): "
        f"route 1 at {min(ratios):.2f}-{max(ratios):.2f}x of vLLM, {len(ratios) - above} of "
        f"{len(ratios)} rows at or below 0.8x (git history holds its tables)."
    )


def main() -> None:
    parser = bench_parser(__doc__, quick="20,000 chunks, 10 rounds")
    parser.add_argument("--chunks", type=int, nargs="+", help="tier sizes (default 100000)")
    parser.add_argument("--rounds", type=int, help="rounds per metric (default 30; 10 quick)")
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="default both"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="default all"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    args = parser.parse_args()
    sizes = args.chunks or ([20_000] if args.quick else [100_000])
    rounds = args.rounds or (10 if args.quick else 30)
    import torch
    import vllm

    results: dict[str, Any] = {
        "machine": machine_note(torch=torch.__version__, vllm=vllm.__version__),
        "python": interpreter(),
        "args": " ".join(
            part
            for part in (
                "--quick" if args.quick else "",
                f"--chunks {' '.join(map(str, sizes))}",
                f"--rounds {rounds}",
                "" if args.policies == list(POLICIES) else "--policies " + " ".join(args.policies),
                "" if args.parts == list(PARTS) else "--parts " + " ".join(args.parts),
            )
            if part
        ),
        "rounds": rounds,
        "runs": [],
        "memory": [],
    }
    for chunks in sizes:
        for policy in args.policies:
            results["runs"].append(
                bench_policy(chunks, policy, rounds, seed=chunks, parts=args.parts)
            )
            print(f"{policy} {chunks}: done", flush=True)
    if not args.no_memory:
        for chunks in sizes:
            for policy in args.policies:
                for side in SIDES:
                    results["memory"].append(bench_memory(chunks, policy, side, seed=7))
    results["machine"] = finish_note(results["machine"])
    name = "vs_vllm"
    results["previous"] = previous_note(args.out / f"{name}.json", results["machine"]["vllm"])
    report = render(results)
    print(report)
    if not (args.quick or args.no_write):
        write_result(to_document("vs_vllm", results, **LAYOUT), args.out, name, report)


if __name__ == "__main__":
    main()
