"""Per-page overhead of kvtiers as SGLang HiCache's storage backend, beside SGLang's own
``HiCacheFile``, on the same calls in the same run.

Calls are SGLang's storage batches (128 pages, ``STORAGE_BATCH_SIZE``) over an MHA
``page_first`` host pool (the double of :mod:`kvtiers.testing.sglang`), both stores on
the same directory's filesystem, the page cache left warm (what is measured is the work
per page, not the disk):

* ``exists``: ``batch_exists`` of 128 stored pages;
* ``set``: storing 128 new pages; ``get``: loading 128 stored pages into other host pages.

Systems: ``HiCacheFile`` through the generic calls SGLang 0.5.23 makes for it
(``batch_set`` of flat pages, ``batch_get`` into flat staging pages); kvtiers through the
same generic calls; and kvtiers through the zero-copy calls SGLang makes with
``"interface_v1": 1`` (``batch_set_v1`` / ``batch_get_v1`` straight from and into the
host pool). kvtiers: one file tier, ``durability: process``, 8 I/O threads, every chunk
with its 4 KiB header and xxh3_128 checksum; a page-first page is two chunks (its K and
its V). Each figure is the median over the passes of microseconds per page.

Run: ``python benchmarks/bench_sglang.py [--quick] [--dir DIR] [--no-write]`` (needs
SGLang 0.5.23, which ``make test`` installs). The full run writes
``benchmarks/results/sglang.md`` and ``sglang.json`` unless ``--no-write``.
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    bench_parser,
    filesystem_of,
    finish_note,
    kept_section,
    machine_note,
    machine_sentence,
    markdown_table,
    size_label,
    to_document,
    write_result,
)

from kvtiers.testing.sglang import (
    MHATokenToKVPoolHost,
    StorageConfig,
    build_backend,
    page_indices,
    page_keys,
    storage_config,
)

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("command", "passes", "batch"),
    "tables": ("rows",),
    "summary": ("seconds",),
}
BATCH = 128
#: (tokens per page, layers, KV heads, head dim): bf16 pages of 32 KiB and 512 KiB.
GEOMETRIES = ((16, 4, 2, 64), (64, 8, 4, 64))
SYSTEMS = ("hicachefile", "kvtiers_generic", "kvtiers_v1")


class Store:
    """One system over one host pool: set / get / exists of a batch of pages."""

    def __init__(self, name: str, root: Path, pool: MHATokenToKVPoolHost) -> None:
        self.name = name
        self.pool = pool
        ps = pool.page_size
        if name == "hicachefile":
            from sglang.srt.mem_cache.hicache_storage import HiCacheFile

            self.store: Any = HiCacheFile(storage_config(StorageConfig(
                model_name="bench/model", extra_config={"file_storage_path": str(root)})))
            self.store.register_mem_pool_host(pool)
        else:
            self.store = build_backend(
                [{"kind": "file", "root": str(root), "threads": 8}], pool,
                model="bench/model", extra={"interface_v1": int(name == "kvtiers_v1")},
            )
        self.v1 = name == "kvtiers_v1"
        self.page_size = ps

    def set(self, keys: list[str], pages: list[int]) -> None:
        if self.v1:
            ok = all(self.store.batch_set_v1(keys, page_indices(pages, self.page_size)))
        else:
            ok = self.store.batch_set(keys, [
                self.pool.get_data_page(p * self.page_size, flat=True) for p in pages])
        assert ok, f"{self.name}: a set failed"

    def get(self, keys: list[str], pages: list[int]) -> None:
        if self.v1:
            ok = all(self.store.batch_get_v1(keys, page_indices(pages, self.page_size)))
        else:
            targets = [self.pool.get_dummy_flat_data_page() for _ in keys]
            got = self.store.batch_get(keys, targets)
            ok = all(t is not None for t in got)
            for page, target in zip(pages, targets, strict=True):
                self.pool.set_from_flat_data_page(page * self.page_size, target)
        assert ok, f"{self.name}: a get missed"

    def exists(self, keys: list[str]) -> None:
        assert self.store.batch_exists(keys) == len(keys), f"{self.name}: exists missed"

    def close(self) -> None:
        close = getattr(self.store, "close", None)
        if close is not None:
            close()


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_geometry(base: Path, geometry: tuple[int, int, int, int], passes: int
                   ) -> dict[str, Any]:
    tokens, layers, heads, dim = geometry
    pool = MHATokenToKVPoolHost(pages=2 * BATCH, page_size=tokens, layers=layers, heads=heads,
                                head_dim=dim)
    pool.fill_random(torch.Generator().manual_seed(0))
    page_bytes = len(pool.page_bytes(0))
    stores = {name: Store(name, base / f"{name}-{tokens}", pool) for name in SYSTEMS}
    samples: dict[str, dict[str, list[float]]] = {
        name: {"set": [], "get": [], "exists": []} for name in SYSTEMS}
    src, dst = list(range(BATCH)), list(range(BATCH, 2 * BATCH))
    try:
        for rep in range(passes):
            order = list(SYSTEMS[rep % 3:] + SYSTEMS[:rep % 3])
            for name in order:
                store = stores[name]
                keys = page_keys(BATCH, f"{name}-{tokens}-{rep}")
                samples[name]["set"].append(timed(functools.partial(store.set, keys, src)))
                samples[name]["exists"].append(timed(functools.partial(store.exists, keys)))
                samples[name]["get"].append(timed(functools.partial(store.get, keys, dst)))
                assert [pool.page_bytes(p * tokens) for p in dst] == [
                    pool.page_bytes(p * tokens) for p in src], f"{name}: wrong bytes"
    finally:
        for store in stores.values():
            store.close()
    row: dict[str, Any] = {"tokens_per_page": tokens, "page_bytes": page_bytes, "passes_us": {}}
    for name in SYSTEMS:
        for op, times in samples[name].items():
            per_page = [t / BATCH * 1e6 for t in times]
            row[f"{name}_{op}_us"] = statistics.median(per_page)
            row["passes_us"][f"{name}_{op}"] = per_page
    return row


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    cells = []
    for row in rows:
        for op in ("exists", "set", "get"):
            theirs, generic, v1 = (row[f"{s}_{op}_us"] for s in SYSTEMS)
            cells.append([size_label(row["page_bytes"]), op, f"{theirs:.1f}", f"{generic:.1f}",
                          f"{v1:.1f}", f"{v1 / theirs:.2f}x"])
    return markdown_table(["page", "op", "HiCacheFile µs/page", "kvtiers generic µs/page",
                           "kvtiers v1 µs/page", "v1 / HiCacheFile"], cells, align="rlrrrr")


def spread_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    cells = []
    for row in rows:
        for op in ("exists", "set", "get"):
            passes = [row["passes_us"][f"{name}_{op}"] for name in SYSTEMS]
            cells.append([size_label(row["page_bytes"]), op,
                          *(f"{min(p):.1f}-{max(p):.1f}" for p in passes)])
    return markdown_table(["page", "op", "HiCacheFile", "kvtiers generic", "kvtiers v1"],
                          cells, align="rlrrr")


NOTES = "## Reading the numbers"


def render(data: dict[str, Any]) -> str:
    """The results page (without the hand-written reading) for ``data``, the flat dict
    :data:`LAYOUT` maps onto the schema."""
    rows = data["rows"]
    text = [
        "# kvtiers as SGLang HiCache's storage backend: per-page overhead beside HiCacheFile",
        "",
        f"Machine: {machine_sentence(data['machine'])}.",
        "",
        f"Command: `{data['command']}` (batches of {data['batch']} pages, median of "
        f"{data['passes']} passes, {data['seconds']:.0f} s in all). Microseconds per page of "
        f"one call (call time / {data['batch']}); page cache warm. HiCacheFile and kvtiers "
        "generic: SGLang's generic "
        "`batch_set` / `batch_get` with flat pages (what SGLang 0.5.23 calls for "
        "HiCacheFile); kvtiers v1: `batch_set_v1` / `batch_get_v1` from and into the host "
        "pool (SGLang with `\"interface_v1\": 1`). kvtiers: one file tier, 8 I/O threads, "
        "`durability: process`, a 4 KiB header and xxh3_128 checksum per chunk, two chunks "
        "(K, V) per page.",
        "",
        *table(rows),
        "",
        "Fastest-slowest pass (µs/page; the table above gives medians):",
        "",
        *spread_table(rows),
        "",
    ]
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="3 passes")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default /tmp)")
    args = parser.parse_args(argv)
    passes = 3 if args.quick else 15
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtiers-sglang-") as tmp:
        note = machine_note(directory=tmp, filesystem=filesystem_of(Path(tmp)),
                            torch=torch.__version__)
        print(machine_sentence(note), flush=True)
        rows = [bench_geometry(Path(tmp), g, passes) for g in GEOMETRIES]
    elapsed = time.perf_counter() - started
    print("\n".join(table(rows)))
    print("\n".join(spread_table(rows)))
    print(f"took {elapsed:.0f} s")
    if args.quick or args.no_write:
        return 0
    data = {
        "machine": finish_note(note),
        "command": " ".join(["python benchmarks/bench_sglang.py", *sys.argv[1:]]),
        "passes": passes, "batch": BATCH, "seconds": elapsed, "rows": rows,
    }
    notes = kept_section(args.out / "sglang.md", NOTES)
    page = render(data) + ("\n" + notes if notes else "")
    write_result(to_document("sglang", data, **LAYOUT), args.out, "sglang", page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
