"""CPU tier benchmarks: worker throughput, scheduler cost per key, manager memory per chunk.

(a) GPU ⇄ CPU worker store and load throughput for 16, 64 and 256 KiB pages, 1 and 4
    groups, blocks_per_chunk 1 and 4, as a ratio to a plain contiguous ``copy_`` of the same
    number of bytes measured in the same run (target >= 0.8x).
(b) Scheduler path cost per key for batches of 1, 16 and 1024 keys: ``lookup``;
    ``prepare_store + get_spec + complete_store`` on a full tier (every store evicts);
    ``prepare_load + get_spec + complete_load`` (targets <= 1 us and <= 5 us at 1024).
(c) Manager memory per tracked chunk, measured with tracemalloc (target <= 200 bytes).

(b) and (c) also measure ``chunkindex``: the same operations on a slot map over a
:class:`~kvtiers.tiers.index.ChunkIndex` (the reference tier, LRU), the bookkeeping the
file and object tiers use, so the CPU tier's tuned arrays are compared with it in the
same run (docs/architecture.md says why the CPU tier keeps them).

Run: ``.venv/bin/python benchmarks/bench_cpu.py [--quick] [--scheduler-only]``. Writes
``benchmarks/results/cpu.md`` and ``cpu.json`` unless ``--no-write`` or
``--scheduler-only`` (which prints the (b) table only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from machine import cores, cpu_model

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import OffloadingManager, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer
from kvtiers.core.worker import KVCacheTensors, KVTensorRef
from kvtiers.policies import BUILTIN_POLICIES, load_policy
from kvtiers.testing.reference import InMemoryTier
from kvtiers.tiers.cpu.manager import CpuTierManager
from kvtiers.tiers.cpu.region import SlotRegion
from kvtiers.tiers.cpu.worker import CpuWorker

RESULTS = Path(__file__).parent / "results"
#: The CPU tier with each builtin policy, then the ChunkIndex bookkeeping it is compared with.
SCHEDULER_KINDS = (*BUILTIN_POLICIES, "chunkindex")
KIB = 1024
LAYERS_PER_GROUP = 2
CTX = ReqContext(req_id="bench")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- (a) worker throughput -----------------------------------------------------------
def bench_worker(
    page_bytes: int, num_groups: int, per_chunk: int, total_bytes: int, repeats: int, layout: str
) -> dict[str, float | str]:
    """``layout``: ``scattered`` draws GPU blocks and slots at random (two-pass copies);
    ``fresh`` gives consecutive slots, as a tier that has not churned yet hands out."""
    rng = np.random.default_rng(0)
    blocks_per_group = max(per_chunk, total_bytes // (num_groups * LAYERS_PER_GROUP * page_bytes))
    blocks_per_group -= blocks_per_group % per_chunk
    num_blocks = 2 * blocks_per_group  # room to load into blocks other than the stored ones
    tensors, groups = [], []
    for _ in range(num_groups):
        refs = []
        for _ in range(LAYERS_PER_GROUP):
            refs.append(KVTensorRef(len(tensors), page_bytes))
            tensors.append(torch.randint(0, 256, (num_blocks, page_bytes), dtype=torch.uint8))
        groups.append(refs)
    kv = KVCacheTensors(tensors, groups)
    geometry = ChunkGeometry(per_chunk, (LAYERS_PER_GROUP * page_bytes,) * num_groups)
    chunks_per_group = blocks_per_group // per_chunk
    region = SlotRegion(num_groups * chunks_per_group, geometry.slot_bytes)
    region.tensor().fill_(1)  # fault the pages in before timing
    slot_order = (
        rng.permutation(region.num_slots) if layout == "scattered" else np.arange(region.num_slots)
    )
    transfers_store, transfers_load = [], []
    for g in range(num_groups):
        slots = slot_order[g * chunks_per_group : (g + 1) * chunks_per_group]
        order = rng.permutation(num_blocks)
        spec = CPULoadStoreSpec(slots)
        transfers_store.append(GroupTransfer(GPULoadStoreSpec(order[:blocks_per_group]), spec))
        transfers_load.append(GroupTransfer(GPULoadStoreSpec(order[blocks_per_group:]), spec))
    moved = blocks_per_group * num_groups * LAYERS_PER_GROUP * page_bytes
    worker = CpuWorker(kv, region, geometry)
    job = iter(range(1 << 30))

    def run(store: bool) -> None:
        job_id = next(job)
        submit = worker.submit_store if store else worker.submit_load
        submit(job_id, transfers_store if store else transfers_load)
        worker.wait([job_id])
        assert all(r.success for r in worker.get_finished())

    src = torch.randint(0, 256, (moved,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    # Interleaved, best of each: the baseline and the worker see the same machine load.
    copy_s = store_s = load_s = float("inf")
    dst.copy_(src)
    run(True)
    run(False)
    for _ in range(repeats):
        copy_s = min(copy_s, timed(lambda: dst.copy_(src)))
        store_s = min(store_s, timed(lambda: run(True)))
        load_s = min(load_s, timed(lambda: run(False)))
    worker.shutdown()
    del kv, tensors
    region.close()
    return {
        "layout": layout,
        "page_kib": page_bytes // KIB,
        "groups": num_groups,
        "blocks_per_chunk": per_chunk,
        "bytes": moved,
        "copy_gbs": moved / copy_s / 1e9,
        "store_gbs": moved / store_s / 1e9,
        "load_gbs": moved / load_s / 1e9,
        "store_ratio": copy_s / store_s,
        "load_ratio": copy_s / load_s,
    }


# -- (b) scheduler path --------------------------------------------------------------
def random_keys(count: int, seed: int) -> list[OffloadKey]:
    rng = random.Random(seed)
    return [make_offload_key(rng.randbytes(16), 0) for _ in range(count)]


def make_manager(kind: str, capacity: int) -> OffloadingManager:
    """The CPU tier with policy ``kind``, or for ``chunkindex`` the reference tier (a slot
    map over a ChunkIndex, LRU)."""
    if kind == "chunkindex":
        return InMemoryTier(capacity)
    return CpuTierManager(capacity, 4096, load_policy(kind)(capacity))


def bench_scheduler(policy: str, batch: int, keys_per_run: int) -> dict[str, float]:
    capacity = max(4096, 4 * batch)
    manager = make_manager(policy, capacity)
    stored = random_keys(capacity, seed=1)
    for begin in range(0, capacity, 1024):
        part = stored[begin : begin + 1024]
        manager.prepare_store(part, CTX)
        manager.complete_store(part, CTX)
    rounds = max(1, keys_per_run // batch)
    fresh = random_keys(rounds * batch, seed=2)
    probes = [stored[i % capacity] if i % 2 else fresh[i] for i in range(rounds * batch)]

    start = time.perf_counter()
    lookup = manager.lookup
    for key in probes:
        lookup(key, CTX)
    lookup_s = time.perf_counter() - start

    loads = [stored[(r * batch) % (capacity - batch) :][:batch] for r in range(rounds)]
    start = time.perf_counter()
    for keys in loads:
        manager.prepare_load(keys, CTX)
        manager.get_spec(keys)
        manager.complete_load(keys, CTX)
    load_s = time.perf_counter() - start

    batches = [fresh[r * batch : (r + 1) * batch] for r in range(rounds)]
    start = time.perf_counter()
    for keys in batches:
        accepted = manager.prepare_store(keys, CTX)
        assert accepted is not None
        manager.get_spec(accepted)
        manager.complete_store(accepted, CTX)
    store_s = time.perf_counter() - start
    assert manager.get_stats()["evictions"] > 0
    n = rounds * batch
    return {
        "policy": policy,
        "batch": batch,
        "lookup_us": lookup_s / n * 1e6,
        "store_us": store_s / n * 1e6,
        "load_us": load_s / n * 1e6,
    }


# -- (c) memory per tracked chunk ----------------------------------------------------
def bench_memory(policy: str, chunks: int) -> dict[str, float]:
    keys = random_keys(chunks, seed=3)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    manager = make_manager(policy, chunks)
    for begin in range(0, chunks, 1024):
        part = keys[begin : begin + 1024]
        manager.prepare_store(part, CTX)
        manager.complete_store(part, CTX)
        manager.take_events()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert manager.get_stats()["chunks"] == chunks
    return {
        "policy": policy,
        "chunks": chunks,
        "bytes_per_chunk": used / chunks,
        "key_object_bytes": sys.getsizeof(keys[0]),
    }


# -- report --------------------------------------------------------------------------
def machine_note() -> dict[str, str]:
    return {
        "cpu": cpu_model(),
        "cores": cores(),
        "torch": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def render(results: dict[str, object]) -> str:
    note = results["machine"]
    assert isinstance(note, dict)
    lines = [
        "# CPU tier benchmarks",
        "",
        f"Machine: {note['cpu']}, {note['cores']} cores, torch {note['torch']} "
        f"({note['torch_threads']} threads), Python {note['python']}, {note['date']}.",
        "Command: `.venv/bin/python benchmarks/bench_cpu.py"
        + (" --quick`" if results["quick"] else "`"),
        "",
        "## (a) Worker throughput vs a plain contiguous copy (target >= 0.8x)",
        "",
        f"{LAYERS_PER_GROUP} layer tensors per group, random non-contiguous GPU blocks; slots "
        "`scattered` (random: gather to a staging buffer, then scatter) or `fresh` "
        "(consecutive, as a tier that has not churned yet hands out: one pass).",
        "",
        "| slots | page | groups | blocks/chunk | MiB | copy GB/s | store GB/s | store ratio "
        "| load GB/s | load ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["worker"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['layout']} | {r['page_kib']} KiB | {r['groups']} | {r['blocks_per_chunk']} | "
            f"{r['bytes'] / 2**20:.0f} | {r['copy_gbs']:.1f} | {r['store_gbs']:.1f} | "
            f"{r['store_ratio']:.2f}x | {r['load_gbs']:.1f} | {r['load_ratio']:.2f}x |"
        )
    lines += [
        "",
        render_scheduler(results["scheduler"]),  # type: ignore[arg-type]
        "",
        "",
        "## (c) Manager memory per tracked chunk (target <= 200 bytes)",
        "",
        "Everything the manager and its policy allocate (tracemalloc), excluding the key "
        "objects themselves, which the caller creates.",
        "",
        "| policy | chunks | bytes per chunk | + key object |",
        "|---|---:|---:|---:|",
    ]
    for r in results["memory"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['policy']} | {r['chunks']} | {r['bytes_per_chunk']:.0f} | "
            f"{r['bytes_per_chunk'] + r['key_object_bytes']:.0f} |"
        )
    lines += ["", "## Reading the numbers", "", *summary(results)]
    return "\n".join(lines) + "\n"


def render_scheduler(rows: list[dict[str, float]]) -> str:
    """The (b) section: one row per policy (or ``chunkindex``) and batch size."""
    lines = [
        "## (b) Scheduler path, microseconds per key (targets: lookup <= 1, "
        "store and load paths <= 5 at 1024)",
        "",
        "| policy | batch | lookup | prepare_store+get_spec+complete_store "
        "| prepare_load+get_spec+complete_load |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['batch']} | {r['lookup_us']:.2f} | {r['store_us']:.2f} "
            f"| {r['load_us']:.2f} |"
        )
    return "\n".join(lines)


def summary(results: dict[str, object]) -> list[str]:
    """The closing note: each target, the measured range, and what limits it."""
    worker = results["worker"]
    scheduler = results["scheduler"]
    memory = results["memory"]
    assert isinstance(worker, list) and isinstance(scheduler, list) and isinstance(memory, list)
    index_rows = {r["batch"]: r for r in scheduler if r["policy"] == "chunkindex"}
    lru_rows = {r["batch"]: r for r in scheduler if r["policy"] == "lru"}
    index_memory = [r for r in memory if r["policy"] == "chunkindex"]
    # The targets are the CPU tier's; the chunkindex rows are its comparison.
    scheduler = [r for r in scheduler if r["policy"] != "chunkindex"]
    memory = [r for r in memory if r["policy"] != "chunkindex"]
    comparison = ", ".join(
        f"batch {batch}: store {index_rows[batch]['store_us'] / lru['store_us']:.2f}x, "
        f"load {index_rows[batch]['load_us'] / lru['load_us']:.2f}x"
        for batch, lru in lru_rows.items() if batch in index_rows
    )

    def ratio_range(layout: str) -> str:
        ratios = [
            r[k] for r in worker if r["layout"] == layout for k in ("store_ratio", "load_ratio")
        ]
        return f"{min(ratios):.2f}x-{max(ratios):.2f}x (median {float(np.median(ratios)):.2f}x)"

    at_1024 = [r for r in scheduler if r["batch"] == 1024]
    worst_lookup = max(r["lookup_us"] for r in scheduler)
    worst_path = max(max(r["store_us"], r["load_us"]) for r in at_1024)
    worst_memory = max(r["bytes_per_chunk"] for r in memory)
    return [
        f"- (a) `fresh` slots: {ratio_range('fresh')} of a plain copy. Either side being "
        "evenly spaced lets one `index_select(out=strided view)` or `index_copy_(strided "
        "source)` move each page once. The low end is blocks_per_chunk 4 with several "
        "layers, where each sub-block class of each layer is its own, smaller call.",
        f"- (a) `scattered` slots: {ratio_range('scattered')}, below the 0.8x target. Both "
        "sides are random, and torch has no indexed-to-indexed copy, so the bytes go through "
        "a cache-sized staging buffer: gather, then scatter, each at about copy speed, so "
        "about 0.5x is the ceiling of this path. Tried: 16-byte element views (uint8 "
        "scatter is ~5x slower), staging sizes 256 KiB-16 MiB (1 MiB best), a per-page "
        "loop (0.1-0.35x: call overhead), torch's intra-op threads in the worker thread "
        "(which doubled it). What would close it: a fused gather-scatter kernel (a small C++ "
        "op or numba loop that memcpy's page i from block b[i] to slot s[i] with the GIL "
        "released), or, on GPUs, device-side gathers and DMA, where the host touches each "
        "byte once.",
        f"- (b) lookup <= {worst_lookup:.2f} us per key (target 1 us); store and load paths "
        f"<= {worst_path:.2f} us per key at 1024 keys (target 5 us), every store evicting.",
        f"- (c) <= {worst_memory:.0f} bytes per tracked chunk (target 200), excluding the "
        f"key objects the caller creates ({memory[0]['key_object_bytes']} bytes each here); "
        "ARC and S3-FIFO ghost entries (keys only, at most one capacity's worth) come on top "
        "once evictions start.",
        f"- ChunkIndex (the reference tier) against the CPU tier with lru, time ratio: "
        f"{comparison}; memory {index_memory[0]['bytes_per_chunk']:.0f} bytes per chunk "
        "(above 1.0x: the CPU tier's arrays are faster, so it keeps them).",
        "- The copy baseline swings between about 7 and 24 GB/s on this shared 2-core "
        "machine (other jobs run alongside); each ratio pairs interleaved best-of runs.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--scheduler-only", action="store_true", help="run and print (b) only; writes nothing"
    )
    args = parser.parse_args()
    keys_per_run = 20_000 if args.quick else 100_000
    if args.scheduler_only:
        print(render_scheduler(
            [bench_scheduler(kind, batch, keys_per_run) for kind in SCHEDULER_KINDS
             for batch in (1, 16, 1024)]
        ))
        return
    total = (16 if args.quick else 64) << 20
    repeats = 3 if args.quick else 7
    results: dict[str, object] = {"machine": machine_note(), "quick": args.quick}
    results["worker"] = [
        bench_worker(page * KIB, groups, per_chunk, total, repeats, layout)
        for layout in ("scattered", "fresh")
        for page in (16, 64, 256)
        for groups in (1, 4)
        for per_chunk in (1, 4)
    ]
    results["scheduler"] = [
        bench_scheduler(kind, batch, keys_per_run)
        for kind in SCHEDULER_KINDS
        for batch in (1, 16, 1024)
    ]
    chunks = 20_000 if args.quick else 100_000
    results["memory"] = [bench_memory(kind, chunks) for kind in SCHEDULER_KINDS]
    report = render(results)
    print(report)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        name = "cpu-quick" if args.quick else "cpu"
        (RESULTS / f"{name}.md").write_text(report)
        (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
