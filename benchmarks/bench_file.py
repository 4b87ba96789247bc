"""File tier benchmarks: mover throughput against the raw disk, a fresh namespace's cost,
and index rebuild time.

(a) Store and load throughput of the file tier's mover (posix backend, checksums on:
    every store hashes its payload into the header, every load verifies it) for 256 KiB,
    2 MiB and 16 MiB chunks with 1, 4 and 16 threads, in both durabilities, into a
    namespace whose fan-out directories exist (as in any namespace after its first
    fill: directories are made once and never removed). Each is a ratio to the raw
    medium measured in the same run with the same threads, the same bytes and the same
    files — the tier's own chunk paths, one new file per blob: ``open(O_CREAT) + pwrite +
    close`` for ``durability: process`` (target >= 0.9x), the same plus ``fsync`` for
    ``durability: power`` (target >= 0.85x), ``open + pread + close`` for loads (target
    >= 0.9x). Raw ``pwrite`` of the same blobs into one directory is printed beside them
    (the baseline before this benchmark wrote the tier's paths). The passes of each
    repeat run in rotating order; ``sync`` runs (untimed) before every write pass so that
    none inherits another's dirty pages, and before every read pass every file is fsynced
    and dropped from the page cache with ``posix_fadvise(DONTNEED)``.
(b) A fresh namespace: 256 KiB chunks, 4 threads, stored into a namespace with no fan-out
    directories yet (nearly every chunk creates its directory), then the same keys again
    once their files are removed (every directory exists and is cached), per durability;
    raw ``pwrite`` (``mkdir`` of each missing directory, then create + write + close) of
    the same paths into a fresh directory tree is the baseline of the fresh rows.
(c) Index rebuild: the time a manager takes to open a namespace holding 100,000 chunk
    files (empty files with chunk names; the scan stats, never opens). Target: <= 2 s.

Run: ``.venv/bin/python benchmarks/bench_file.py [--quick] [--dir DIR]``. The full run
writes ``benchmarks/results/file.md`` and ``file.json`` unless ``--no-write``.
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash
from harness import (
    bench_parser,
    drop_page_cache,
    filesystem_of,
    finish_note,
    kept_section,
    machine_note,
    machine_sentence,
    markdown_table,
    size_label,
    timed_threads,
    to_document,
    write_result,
)

from kvtiers.core.chunkformat import HEADER_BYTES, encode_header
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import ReqContext
from kvtiers.core.publish import Durability
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.filemapper import FileMapper, NamespaceIdentity
from kvtiers.tiers.file.io import PosixBackend, PublishSettings
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import FileMover

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("command", "volume_bytes", "repeats"),
    "tables": ("rows",),
    "summary": ("rebuild_s",),
}
#: The measured columns of a row, in the page's order.
ROW_KEYS = ("tier_process", "raw_pwrite", "process_ratio", "raw_onedir", "onedir_ratio",
            "tier_power", "raw_fsync", "power_ratio", "tier_read", "raw_read", "load_ratio")
KIB, MIB = 1024, 1024 * 1024
CTX = ReqContext(req_id="bench")
TARGET_PROCESS = 0.9
TARGET_POWER = 0.85
TARGET_LOAD = 0.9
TARGET_REBUILD_S = 2.0


class Region:
    """Page-aligned host slots over one anonymous mmap (as the CPU tier allocates)."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.map = mmap.mmap(-1, num_slots * slot_bytes)
        self._view = memoryview(self.map)
        seed = os.urandom(MIB)
        for start in range(0, len(self.map), MIB):
            end = min(start + MIB, len(self.map))
            self.map[start:end] = seed[: end - start]

    def view(self, slot_id: int) -> memoryview:
        start = slot_id * self.slot_bytes
        return self._view[start : start + self.slot_bytes]


def file_config(chunk_bytes: int) -> OffloadingConfig:
    """One group of 16-token blocks whose chunk is ``chunk_bytes`` (shared with the
    LMCache comparison, which measures the same files)."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers",), chunk_bytes),),
        model=OffloadingModelConfig(name=f"bench/file-{chunk_bytes}"),
        cache=OffloadingCacheConfig(tokens_per_hash=16),
    )


def bench_keys(n: int, tag: str) -> list[OffloadKey]:
    """``n`` distinct keys, the same for the same ``tag`` in every run."""
    return [make_offload_key(xxhash.xxh3_128_digest(f"{tag}:{i}".encode()), 0) for i in range(n)]


def raw_write(paths: Sequence[Path], region: Region, header: bytes, size: int,
              threads: int, fsync: bool, made: set[Path] | None = None) -> float:
    """Seconds to write blob ``i`` to ``paths[i]`` on ``threads`` threads. With ``made``
    (the directories this writer made or found), each parent not in it is made first
    (``mkdir -p``, as a raw writer of this layout would) and remembered."""
    def one(i: int) -> None:
        parent = paths[i].parent
        if made is not None and parent not in made:
            os.makedirs(parent, mode=0o700, exist_ok=True)
            made.add(parent)
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwritev(fd, [header, region.view(i)[:size]], 0)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    os.sync()
    return timed_threads(threads, one, len(paths))


def raw_read(paths: Sequence[Path], region: Region, header: bytearray, size: int,
             threads: int) -> float:
    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.preadv(fd, [bytearray(HEADER_BYTES), region.view(i)[:size]], 0)
        finally:
            os.close(fd)

    return timed_threads(threads, one, len(paths))


WRITES = ("raw_pwrite", "raw_onedir", "raw_fsync", "tier_process", "tier_power")
READS = ("raw_read", "tier_read")
TIER_DURABILITY: dict[str, Durability] = {"tier_process": "process", "tier_power": "power"}


class Case:
    """One chunk size and thread count: a tier (one mover per durability) and raw files
    over the same region. Every pass writes the same ``n`` keys' chunk paths (their
    directories made before timing), so tier and raw create the same files."""

    def __init__(self, base: Path, chunk_bytes: int, threads: int, volume: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        self.n = n = max(threads, volume // chunk_bytes)
        offloading = file_config(chunk_bytes)
        identity = NamespaceIdentity.from_config(offloading)
        geometry = ChunkGeometry.from_config(offloading)
        self.region = Region(n, geometry.slot_bytes)
        self.root = base / f"case-{chunk_bytes}-{threads}"
        raw_dir = self.root / "raw"
        raw_dir.mkdir(parents=True)
        self.onedir_paths = [raw_dir / f"{i}.blob" for i in range(n)]
        self.header = encode_header(
            identity.digest, bench_keys(1, "raw")[0], self.region.view(0)[:chunk_bytes]
        )
        mapper = FileMapper(self.root, identity)
        self.manager = FileTierManager(mapper, geometry)
        self.keys = bench_keys(n, f"{chunk_bytes}-{threads}")
        self.paths = [mapper.path(key) for key in self.keys]
        for path in self.paths:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.movers = {
            name: FileMover(self.region, geometry, identity.digest, PosixBackend(),
                            threads=threads, settings=PublishSettings(durability=durability))
            for name, durability in TIER_DURABILITY.items()
        }
        self.jobs = itertools.count()
        self.slots = CPULoadStoreSpec(range(n))
        self.samples: dict[str, list[float]] = {name: [] for name in WRITES + READS}

    def close(self) -> None:
        for mover in self.movers.values():
            mover.shutdown()
        self.manager.shutdown()
        shutil.rmtree(self.root)

    def _job(self, mover: FileMover, src: object, dst: object) -> float:
        start = time.perf_counter()
        mover.submit(next(self.jobs), src, dst)  # type: ignore[arg-type]
        mover.drain()
        elapsed = time.perf_counter() - start
        (result,) = mover.get_finished()
        assert result.success, result
        return elapsed

    def _store(self, mover: FileMover) -> float:
        """Store the case's keys through ``mover``; seconds of the job."""
        assert self.manager.prepare_store(self.keys, CTX) == self.keys
        spec = self.manager.get_spec(self.keys)
        assert [Path(p) for p in spec.paths] == self.paths
        os.sync()
        elapsed = self._job(mover, self.slots, spec)
        self.manager.complete_store(self.keys, CTX)
        return elapsed

    def _remove_chunks(self) -> None:
        self.manager.forget(self.keys, corrupt=False)
        self.clear(self.paths)

    def write(self, name: str) -> None:
        if name in ("raw_pwrite", "raw_fsync", "raw_onedir"):
            paths = self.onedir_paths if name == "raw_onedir" else self.paths
            self.samples[name].append(
                raw_write(paths, self.region, self.header, self.chunk_bytes,
                          self.threads, fsync=name == "raw_fsync")
            )
            self.clear(paths)
            return
        self.samples[name].append(self._store(self.movers[name]))
        self._remove_chunks()

    def read(self, name: str) -> None:
        if name == "raw_read":
            raw_write(self.paths, self.region, self.header, self.chunk_bytes,
                      self.threads, fsync=False)
            drop_page_cache(self.paths)
            self.samples[name].append(
                raw_read(self.paths, self.region, bytearray(), self.chunk_bytes,
                         self.threads)
            )
            self.clear(self.paths)
            return
        self._store(self.movers["tier_process"])
        self.manager.prepare_load(self.keys, CTX)
        spec = self.manager.get_spec(self.keys)
        drop_page_cache(self.paths)
        self.samples[name].append(self._job(self.movers["tier_process"], spec, self.slots))
        self.manager.complete_load(self.keys, CTX)
        self._remove_chunks()

    @staticmethod
    def clear(paths: Sequence[Path]) -> None:
        """Every pass creates fresh files, as stores of new chunks do."""
        for path in paths:
            path.unlink()


def bench_case(base: Path, chunk_bytes: int, threads: int, volume: int,
               repeats: int) -> dict[str, float]:
    case = Case(base, chunk_bytes, threads, volume)
    writes, reads = list(WRITES), list(READS)
    try:
        for rep in range(repeats):
            # Each variant takes each position in turn (the disk slows after a pass, as
            # it flushes and discards), so no variant always follows the others.
            turn = rep % len(writes)
            for name in writes[turn:] + writes[:turn]:
                case.write(name)
            for name in reads[rep % 2 :] + reads[: rep % 2]:
                case.read(name)
    finally:
        case.close()
    payload = case.n * chunk_bytes
    out = {name: payload / statistics.median(t) / 1e9 for name, t in case.samples.items()}
    out["process_ratio"] = out["tier_process"] / out["raw_pwrite"]
    out["onedir_ratio"] = out["tier_process"] / out["raw_onedir"]
    out["power_ratio"] = out["tier_power"] / out["raw_fsync"]
    out["load_ratio"] = out["tier_read"] / out["raw_read"]
    out["chunks"] = case.n
    return out


def bench_fresh(base: Path, volume: int, repeats: int) -> dict[str, float]:
    """(b): GB/s of 256 KiB stores, 4 threads, into a fresh namespace and again into
    the same (now existing) directories, per durability, and of raw ``pwrite`` of the
    same paths into a fresh directory tree (making each missing directory) and again;
    medians over ``repeats``."""
    chunk_bytes, threads = 256 * KIB, 4
    n = volume // chunk_bytes
    offloading = file_config(chunk_bytes)
    identity = NamespaceIdentity.from_config(offloading)
    geometry = ChunkGeometry.from_config(offloading)
    region = Region(n, geometry.slot_bytes)
    header = encode_header(identity.digest, bench_keys(1, "raw")[0], region.view(0)[:chunk_bytes])
    jobs = itertools.count()
    samples: dict[str, list[float]] = {}
    for rep in range(repeats):
        keys = bench_keys(n, f"fresh-{rep}")
        root = base / f"fresh-{rep}-raw"
        paths = [FileMapper(root, identity).path(key) for key in keys]
        made: set[Path] = set()
        for phase in ("fresh", "existing"):
            os.sync()
            elapsed = raw_write(paths, region, header, chunk_bytes, threads, fsync=False,
                                made=made)
            Case.clear(paths)
            samples.setdefault(f"raw_{phase}", []).append(n * chunk_bytes / elapsed / 1e9)
        shutil.rmtree(root)
        for name, durability in TIER_DURABILITY.items():
            root = base / f"fresh-{rep}-{name}"
            manager = FileTierManager(FileMapper(root, identity), geometry)
            mover = FileMover(region, geometry, identity.digest, PosixBackend(),
                              threads=threads, settings=PublishSettings(durability=durability))
            try:
                for phase in ("fresh", "existing"):
                    assert manager.prepare_store(keys, CTX) == keys
                    spec = manager.get_spec(keys)
                    os.sync()
                    start = time.perf_counter()
                    mover.submit(next(jobs), CPULoadStoreSpec(range(n)), spec)
                    mover.drain()
                    elapsed = time.perf_counter() - start
                    (result,) = mover.get_finished()
                    assert result.success, result
                    manager.complete_store(keys, CTX)
                    manager.forget(keys, corrupt=False)
                    Case.clear([Path(p) for p in spec.paths])
                    samples.setdefault(f"{name}_{phase}", []).append(
                        n * chunk_bytes / elapsed / 1e9
                    )
            finally:
                mover.shutdown()
                manager.shutdown()
                shutil.rmtree(root)
    out = {name: statistics.median(v) for name, v in samples.items()}
    out["fresh_ratio"] = out["tier_process_fresh"] / out["raw_fresh"]
    out["existing_ratio"] = out["tier_process_existing"] / out["raw_existing"]
    return out


def bench_rebuild(base: Path, num_files: int) -> tuple[float, int]:
    identity = NamespaceIdentity.from_config(file_config(4096))
    mapper = FileMapper(base / "rebuild", identity)
    FileTierManager(mapper, ChunkGeometry.from_config(file_config(4096))).shutdown()
    made: set[Path] = set()
    for key in bench_keys(num_files, "rebuild"):
        path = mapper.path(key)
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        manager = FileTierManager(mapper, ChunkGeometry.from_config(file_config(4096)))
        times.append(time.perf_counter() - start)
        chunks = int(manager.get_stats()["chunks"])
        manager.shutdown()
    shutil.rmtree(base / "rebuild")
    return statistics.median(times), chunks


NOTES = "## Reading the numbers"


def target_lines(rows: list[dict[str, float]]) -> list[str]:
    """One line per target: the rows that meet it and those that miss it, with ratios."""
    out = []
    for label, ratio, target in (
        ("process store >= {t}x raw `pwrite`", "process_ratio", TARGET_PROCESS),
        ("power store >= {t}x raw `pwrite+fsync`", "power_ratio", TARGET_POWER),
        ("load >= {t}x raw `pread`", "load_ratio", TARGET_LOAD),
    ):
        cells = [(f"{size_label(int(r['chunk_bytes']))} x{r['threads']} {r[ratio]:.2f}",
                  r[ratio] >= target) for r in rows]
        met = [cell for cell, ok in cells if ok]
        missed = [cell for cell, ok in cells if not ok]
        out.append(
            f"- {label.format(t=target)}: met in {len(met)} of {len(rows)} rows"
            + (f" ({', '.join(met)})" if met else "")
            + (f"; missed in {len(missed)} ({', '.join(missed)})" if missed else "")
            + "."
        )
    return out


def render(data: dict[str, Any]) -> str:
    """The results page (without the hand-written reading) for ``data``, the flat dict
    :data:`LAYOUT` maps onto the schema."""
    rows, fresh = data["rows"], data["fresh"]
    lines = [
        "# File tier benchmarks",
        "",
        f"Machine: {machine_sentence(data['machine'])}.",
        "",
        f"Command: `{data['command']}` ({data['volume_bytes'] // MIB} MiB per case, "
        f"median of {data['repeats']} passes; checksums on; `sync` before every write pass; "
        "page cache dropped with `posix_fadvise(DONTNEED)` after an fsync before every read "
        "pass). Throughput is payload GB/s; ratios are tier / raw with the same threads and "
        "bytes, measured in the same run; raw creates the same files as the tier (its chunk "
        "paths, fan-out directories made before timing); `one dir` is raw `pwrite` of the "
        "same blobs into one directory, with the process store's ratio to it. Targets: "
        f"process store >= {TARGET_PROCESS}x raw `pwrite`, power store >= {TARGET_POWER}x raw "
        f"`pwrite+fsync`, load >= {TARGET_LOAD}x raw `pread`.",
        "",
        *markdown_table(
            ["chunk", "threads", "process store", "raw pwrite", "ratio", "one dir", "ratio",
             "power store", "raw pwrite+fsync", "ratio", "load", "raw pread", "ratio"],
            ([size_label(int(r["chunk_bytes"])), r["threads"],
              *(f"{r[key]:.2f}" for key in ROW_KEYS)] for r in rows),
            align="r" * 13),
        "",
        *target_lines(rows),
        "",
        "Fresh namespace, 256 KiB chunks, 4 threads (GB/s; first store creates the fan-out "
        "directories, the second finds them; raw makes each missing directory of the same "
        "paths): "
        + ", ".join(f"{name.replace('_', ' ')} {value:.2f}" for name, value in fresh.items()
                    if "ratio" not in name)
        + f"; process store / raw: fresh {fresh['fresh_ratio']:.2f}x, existing "
        f"{fresh['existing_ratio']:.2f}x.",
        "",
        f"Index rebuild of {data['rebuild_chunks']} chunk files (warm dentry cache): "
        f"{data['rebuild_s']:.3f} s (target <= {TARGET_REBUILD_S} s).",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = bench_parser(__doc__, quick="64 MiB per case, one pass, 20,000 files to rebuild")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default /tmp)")
    parser.add_argument("--volume-mib", type=int, default=None, help="MiB per case")
    parser.add_argument("--repeats", type=int, default=None, help="passes per case")
    args = parser.parse_args()
    volume = (args.volume_mib or (64 if args.quick else 256)) * MIB
    repeats = args.repeats or (1 if args.quick else 6)
    files = 20_000 if args.quick else 100_000
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtiers-bench-") as tmp:
        base = Path(tmp)
        note = machine_note(directory=str(base), filesystem=filesystem_of(base))
        print(machine_sentence(note))
        for chunk_bytes in (256 * KIB, 2 * MIB, 16 * MIB):
            for threads in (1, 4, 16):
                r = bench_case(base, chunk_bytes, threads, volume, repeats)
                rows.append({"chunk_bytes": chunk_bytes, "threads": threads,
                             **{key: r[key] for key in ROW_KEYS}})
                print(
                    f"{size_label(chunk_bytes):>7} x{threads:>2}: process {r['tier_process']:.2f} "
                    f"GB/s vs pwrite {r['raw_pwrite']:.2f} ({r['process_ratio']:.2f}x; one "
                    f"dir {r['raw_onedir']:.2f}, {r['onedir_ratio']:.2f}x); power "
                    f"{r['tier_power']:.2f} vs pwrite+fsync {r['raw_fsync']:.2f} "
                    f"({r['power_ratio']:.2f}x); load {r['tier_read']:.2f} vs pread "
                    f"{r['raw_read']:.2f} ({r['load_ratio']:.2f}x)",
                    flush=True,
                )
        fresh = bench_fresh(base, volume, repeats)
        print("fresh namespace, 256 KiB x4 (GB/s): " + ", ".join(
            f"{name} {value:.2f}" for name, value in fresh.items() if "ratio" not in name
        ) + f"; process/raw fresh {fresh['fresh_ratio']:.2f}x, existing "
            f"{fresh['existing_ratio']:.2f}x")
        rebuild_s, chunks = bench_rebuild(base, files)
        print(f"index rebuild of {chunks} chunk files: {rebuild_s:.3f} s")
    if args.quick or args.no_write:
        return 0
    data = {
        "machine": finish_note(note),
        "command": " ".join([".venv/bin/python benchmarks/bench_file.py", *sys.argv[1:]]),
        "volume_bytes": volume, "repeats": repeats, "rows": rows, "fresh": fresh,
        "rebuild_chunks": chunks, "rebuild_s": rebuild_s,
    }
    # The hand-written reading of the numbers below the table survives a rerun.
    notes = kept_section(args.out / "file.md", NOTES)
    page = render(data) + ("\n" + notes if notes else "")
    for path in write_result(to_document("file", data, **LAYOUT), args.out, "file", page):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
