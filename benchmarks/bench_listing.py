"""What announcing a shared namespace costs: background listings and the namespace summary.

A tier with ``shared: true`` and ``list_interval_s`` lists its namespace on a thread of
its own and compares what it finds with its index on the scheduler thread, a bounded
number of keys per step (:mod:`kvtiers.tiers.listing`). Here the namespace holds N chunks
that "another server" published (this tier's index holds none of them, the most it has
to announce), and a second listing finds nothing new (the steady state). Measured per
case:

* ``listing s`` — the listing thread's time for one listing (names only, no chunk read);
* ``compare`` — the scheduler thread's CPU time in ``on_schedule_end`` over the steps
  that compared the listing with the index, in all, and its slowest step (wall times in
  the JSON); ``steps``;
* ``summary`` — building and publishing the namespace summary after the listing (on the
  listing thread; it is part of ``listing s``), and its size;
* memory — bytes per chunk of a listing's key set and of the announced set
  (``tracemalloc``, measured apart from the timed runs).

Times per 100,000 chunks are the measured ones scaled by ``100,000 / N``. Tiers: ``file``
(chunk files, empty, under the real fan-out directories, on a local disk whose directory
entries the kernel has cached: a warm listing) and ``s3`` (a moto server in its own
process, 1,000 keys per page; fewer chunks, as filling moto is slow). Run from the
repository root: ``.venv/bin/python benchmarks/bench_listing.py [--quick] [--no-write]``;
writes ``benchmarks/results/listing.md`` and ``listing.json``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash
from harness import (
    bench_parser,
    finish_note,
    machine_note,
    machine_sentence,
    markdown_table,
    to_document,
    write_result,
)

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import ScheduleEndContext
from kvtiers.filemapper import FileMapper, NamespaceIdentity
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import AWS_TEST_ENV, MotoProcess
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.listing import KEYS_PER_STEP, ListingSettings
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.manager import ObjectTierManager

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("quick", "command"),
    "tables": ("rows",),
    "summary": ("seconds",),
}
END = ScheduleEndContext()
CONFIG = offloading_config()
IDENTITY = NamespaceIdentity.from_config(CONFIG)
GEOMETRY = ChunkGeometry.from_config(CONFIG)
INTERVAL_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(n: int) -> list[OffloadKey]:
    return [make_offload_key(xxhash.xxh3_128_digest(b"bench-listing:%d" % i), 0)
            for i in range(n)]


def one_listing(manager: Any, clock: Clock) -> dict[str, float]:
    """Start a listing one interval on, wait for its thread, then step until compared."""
    clock.now += INTERVAL_S
    manager.on_schedule_end(END)
    listing = manager.listing
    listing.wait()
    steps: list[float] = []
    cpu: list[float] = []
    while listing.busy:
        start, start_cpu = time.perf_counter(), time.thread_time()
        manager.on_schedule_end(END)
        cpu.append(time.thread_time() - start_cpu)
        steps.append(time.perf_counter() - start)
    announced = sum(len(e.keys) for e in manager.take_events() if e.listed and not e.removed)
    stats = manager.get_stats()
    return {"listing_s": stats["listing_s"], "compare_s": sum(steps),
            "compare_cpu_s": sum(cpu), "slowest_step_s": max(steps, default=0.0),
            "slowest_step_cpu_s": max(cpu, default=0.0), "steps": len(steps),
            "announced": announced, "listed": stats["listed_chunks"]}


def file_case(n: int, root: Path) -> dict[str, Any]:
    clock = Clock()
    manager = FileTierManager(FileMapper(root, IDENTITY), GEOMETRY, shared=True, clock=clock,
                              listing=ListingSettings(INTERVAL_S, summary_interval_s=1.0))
    try:
        start = time.perf_counter()
        for key in keys(n):  # "another server" publishes n chunks
            path = manager.mapper.path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        fill_s = time.perf_counter() - start
        first = one_listing(manager, clock)
        summary_bytes = (manager.namespace_dir / "summary.kvsum").stat().st_size
        second = one_listing(manager, clock)
    finally:
        manager.shutdown()
    return {"tier": "file", "chunks": n, "fill_s": fill_s, "first": first, "steady": second,
            "summary_bytes": summary_bytes}


def s3_case(n: int) -> dict[str, Any]:
    from kvtiers.tiers.s3.store import S3Store

    os.environ.update(AWS_TEST_ENV)
    with MotoProcess() as moto:
        store = S3Store("kvtiers-bench", endpoint_url=moto.endpoint_url, max_connections=16)
        store.create_bucket()
        clock = Clock()
        manager = ObjectTierManager(
            ObjectBackend(S3Store("kvtiers-bench", endpoint_url=moto.endpoint_url), IDENTITY,
                          prefix="bench", threads=2),
            max_chunk_bytes=GEOMETRY.max_chunk_bytes, shared=True, clock=clock,
            listing=ListingSettings(INTERVAL_S, summary_interval_s=1.0))
        writer = ObjectBackend(store, IDENTITY, prefix="bench", threads=16)
        start = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:  # "another server" publishes n chunks
            list(pool.map(lambda key: store.put_if_absent(writer.object_key(key), [b"x"]),
                          keys(n)))
        fill_s = time.perf_counter() - start
        try:
            first = one_listing(manager, clock)
            summary_bytes = store.head(f"bench/{IDENTITY.namespace}/summary.kvsum")
            second = one_listing(manager, clock)
        finally:
            manager.shutdown()
            writer.close()
    return {"tier": "s3", "chunks": n, "fill_s": fill_s, "first": first, "steady": second,
            "summary_bytes": summary_bytes}


def memory_per_chunk(n: int) -> dict[str, float]:
    """Bytes per chunk: a listing's frozenset of keys, the announced set, and the keys
    themselves (held once, by whichever set keeps them)."""
    def measure(build: Callable[[], object]) -> float:
        tracemalloc.start()
        held = build()
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del held
        return size / n

    listed = keys(n)
    return {
        "keys": measure(lambda: keys(n)) - measure(lambda: list(listed)),
        "listing_set": measure(lambda: frozenset(listed)),
        "order_tuple": measure(lambda: tuple(listed)),
        "announced_set": measure(lambda: set(listed)),
    }


def per_100k(row: dict[str, Any], name: str) -> float:
    return row[name] * 100_000 / row["listed"] if row["listed"] else 0.0


def render(data: dict[str, Any]) -> str:
    """The results page for ``data``, the flat dict :data:`LAYOUT` maps onto the schema."""
    rows, memory = data["rows"], data["memory_per_chunk"]
    peak = (memory["keys"] + 2 * memory["listing_set"] + memory["announced_set"]
            + memory["order_tuple"])
    lines = [
        "# Announcing a shared namespace: listing and summary cost",
        "",
        f"Machine: {machine_sentence(data['machine'])}; `{data['command']}` "
        f"({data['seconds']:.0f} s). The machine was shared with other work (the load "
        "averages above), so times are upper bounds (rerun on a quiet machine to tighten "
        "them).",
        "",
        "Every chunk was published by another server (the listing tier's index held none): "
        "the first listing announces all of them, the second finds nothing new. `listing` "
        "is the listing thread's wall time (the summary built and published included); "
        "`compare` the scheduler thread's CPU time in `on_schedule_end` comparing the "
        f"listing with the index, {KEYS_PER_STEP} keys per step (CPU time, so that other "
        "work on the machine does not count; its wall time is in the JSON); per 100k = "
        "scaled from the measured count.",
        "",
        *markdown_table(
            ["tier", "chunks", "listing", "listing s", "per 100k s", "compare CPU ms",
             "per 100k ms", "slowest step ms", "steps", "announced", "summary"],
            ([row["tier"], f"{row['chunks']:,}", name, f"{run['listing_s']:.2f}",
              f"{per_100k(run, 'listing_s'):.2f}", f"{1000 * run['compare_cpu_s']:.1f}",
              f"{1000 * per_100k(run, 'compare_cpu_s'):.1f}",
              f"{1000 * run['slowest_step_cpu_s']:.2f}", run["steps"],
              f"{run['announced']:,}", f"{row['summary_bytes'] / 1024:.1f} KiB"]
             for row in rows
             for name, run in (("first (all new)", row["first"]),
                               ("steady (none new)", row["steady"]))),
            align="lrlrrrrrrrr"),
    ]
    lines += [
        "",
        f"Memory per listed chunk, every chunk announced: the key itself {memory['keys']:.0f} B "
        f"(one object, shared by the sets), the last complete listing's key set "
        f"{memory['listing_set']:.0f} B (kept to find what later listings no longer see) "
        f"and the announced set {memory['announced_set']:.0f} B: "
        f"{memory['keys'] + memory['listing_set'] + memory['announced_set']:.0f} B between "
        f"listings; while the next one is compared, its key set and its keys in order "
        f"({memory['order_tuple']:.0f} B) too: "
        f"{peak:.0f} B at most. The summary is 1.25 B per chunk.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__, quick="small counts")
    args = parser.parse_args()
    note = machine_note()
    file_counts = (2_000,) if args.quick else (10_000, 100_000)
    s3_counts = (1_000,) if args.quick else (20_000,)
    started = time.perf_counter()
    rows = []
    for n in file_counts:
        with tempfile.TemporaryDirectory(prefix="kvtiers-bench-listing-") as root:
            rows.append(file_case(n, Path(root)))
    for n in s3_counts:
        rows.append(s3_case(n))
    memory = memory_per_chunk(100_000 if not args.quick else 2_000)
    data = {
        "machine": finish_note(note), "quick": args.quick,
        "command": " ".join(["benchmarks/bench_listing.py", *sys.argv[1:]]),
        "seconds": time.perf_counter() - started, "rows": rows, "memory_per_chunk": memory,
    }
    text = render(data)
    print(text)
    if not (args.quick or args.no_write):
        write_result(to_document("listing", data, **LAYOUT), args.out, "listing", text)


if __name__ == "__main__":
    main()
