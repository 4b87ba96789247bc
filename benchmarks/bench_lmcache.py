"""The file tier beside LMCache 0.5.6's local-disk backend: store and load throughput of
the same bytes with the same threads in the same run, and what each does with a damaged
chunk file and after a restart. Optional: without LMCache it prints one skip line and
exits 0.

(a) Throughput, 256 KiB, 2 MiB and 16 MiB chunks, 4 I/O threads on each side, the same
    random payload bytes (one region of page-aligned slots, as in ``bench_file.py``):
    kvtiers' file tier (``FileTierManager`` + ``FileMover``, posix backend,
    ``durability: process``, checksums on: 4096-byte header + payload per file, hashed on
    store, verified on load) against LMCache's ``LocalDiskBackend`` driven directly with
    CPU memory objects (``TensorMemoryAllocator`` over a CPU tensor; ``local_cpu: false``;
    its own pools sized by ``extra_config.disk_io_threads: 4``: the put executor's four
    workers and the read pool of ``batched_get_blocking``). A store pass is
    ``batched_submit_put_task`` until every key's completion callback ran (LMCache does
    not fsync; neither does ``durability: process``); a load pass is one
    ``batched_get_blocking`` of every key into memory objects it allocates. Raw
    ``open + pwrite + close`` / ``open + pread + close`` of the same payloads into one
    directory, 4 threads, is the medium reference. Passes of each repeat run in rotating
    order; ``sync`` runs (untimed) before every write pass, and before every read pass
    every file is fsynced and dropped from the page cache (``posix_fadvise(DONTNEED)``).
(b) Integrity: 8 chunks of 256 KiB stored in each; one byte of one chunk's file is
    flipped, another chunk's file truncated to half; each is then loaded through each
    system and judged: refused (a miss), a hit with wrong bytes, or a hit with the right
    bytes. (c) Restart: a new manager / backend over the same directory; how many of the 6
    intact chunks it finds.

LMCache's ``LocalDiskBackend.remove()`` does not lower ``current_cache_size`` (only its own
eviction loop does), so a benchmark that removes its chunks between passes would soon
hit the size limit and evict; ``max_local_disk_size`` is set far above what the run
writes, and the run reports the counter's drift.

LMCache in a virtualenv of its own (its wheel declares CUDA packages; ``--no-deps`` and the
pure-Python packages its local-disk backend imports, with the CPU torch wheel)::

    python3 -m venv /tmp/lmcache-venv
    /tmp/lmcache-venv/bin/pip install "torch==2.13.0"   # pinned: the local CPU wheel
    /tmp/lmcache-venv/bin/pip install --no-deps lmcache==0.5.6
    /tmp/lmcache-venv/bin/pip install numpy numba pyyaml requests cachetools \\
        sortedcontainers prometheus_client psutil py-cpuinfo aiohttp aiofile msgspec \\
        pyzmq transformers cryptography
    /tmp/lmcache-venv/bin/pip install -e .

(checked from an empty virtualenv. pip then reports the rest of LMCache's declared
dependencies, CUDA packages among them, and its pins ``numpy<=2.2.6`` and
``prometheus_client<=0.24.1`` as unmet; the local-disk backend needs none of the rest and
runs with the numpy 2.4 and prometheus_client 0.26 it gets.)

Run: ``/tmp/lmcache-venv/bin/python benchmarks/bench_lmcache.py [--quick] [--dir DIR]
[--volume-mib N] [--repeats N] [--no-write]``. The full run writes
``benchmarks/results/lmcache.md`` and ``lmcache.json`` unless ``--no-write``.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_file import Region, bench_keys, file_config, raw_write
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

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.filemapper import FileMapper, NamespaceIdentity
from kvtiers.tiers.file.io import PosixBackend, PublishSettings
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import BadChunkHandler, FileMover

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("command", "lmcache_version", "volume_bytes", "repeats", "threads"),
    "tables": ("rows",),
    "summary": ("seconds",),
}
KIB, MIB = 1024, 1024 * 1024
CTX = ReqContext(req_id="bench-lmcache")
LMCACHE_VERSION = "0.5.6"
THREADS = 4
CHUNK_SIZES = (256 * KIB, 2 * MIB, 16 * MIB)
INTEGRITY_CHUNKS = 8
INTEGRITY_CHUNK_BYTES = 256 * KIB
#: LMCache's disk size limit (GB): far above what a run writes, so its eviction never runs
#: although ``remove()`` leaves ``current_cache_size`` where it was.
LMCACHE_DISK_GB = 4096.0
INSTALL = (
    'python3 -m venv /tmp/lmcache-venv && /tmp/lmcache-venv/bin/pip install "torch==2.13.0"'
    f" && /tmp/lmcache-venv/bin/pip install --no-deps lmcache=={LMCACHE_VERSION}"
    " && the packages in this script's docstring, then pip install -e ."
)
LMCACHE_MODULES = (
    "lmcache.v1.config",
    "lmcache.v1.storage_backend.local_disk_backend",
    "lmcache.v1.storage_backend.local_cpu_backend",
    "lmcache.v1.memory_allocators.tensor_memory_allocator",
)

WRITES = ("raw_pwrite", "kvtiers_store", "lmcache_store")
READS = ("raw_pread", "kvtiers_load", "lmcache_load")

REFUSED = "refused (miss)"
WRONG = "hit, wrong bytes"
RIGHT = "hit, right bytes"


# -- pure helpers ------------------------------------------------------------------------
def lmcache_missing(import_module: Callable[[str], Any] = importlib.import_module) -> str | None:
    """Why LMCache's local-disk backend cannot be used here, or ``None`` when it can."""
    for name in LMCACHE_MODULES:
        try:
            import_module(name)
        except ImportError as exc:
            return str(exc) or type(exc).__name__
    return None


def skip_line(reason: str) -> str:
    return f"lmcache not installed: {reason}; install with: {INSTALL}"


def gbps(nbytes: int, seconds: Sequence[float]) -> float:
    """Payload GB/s of the median of ``seconds``."""
    return nbytes / statistics.median(seconds) / 1e9


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else math.nan


def judge(expected: bytes, served: bytes | None) -> str:
    """What a load of a damaged chunk gave: nothing, other bytes, or the stored bytes."""
    if served is None:
        return REFUSED
    return RIGHT if served == expected else WRONG


def describe(expected: bytes, served: bytes | None) -> str:
    """:func:`judge`'s verdict, with how many bytes of a wrong hit differ."""
    verdict = judge(expected, served)
    if verdict != WRONG:
        return verdict
    assert served is not None
    if len(served) != len(expected):
        return f"{verdict} ({len(served)} bytes served, {len(expected)} stored)"
    differ = sum(a != b for a, b in zip(served, expected, strict=True))
    return f"{verdict} ({differ} of {len(expected)} bytes differ)"


def file_fate(path: Path, quarantine: Path | None) -> str:
    """Where a damaged chunk's file is after the load."""
    if path.exists():
        return "file left in place"
    if quarantine is not None and any(quarantine.glob(f"{path.name}.*")):
        return "file quarantined"
    return "file removed"


def throughput_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    return markdown_table(
        ["chunk", "kvtiers store", "LMCache store", "store ratio", "raw pwrite",
         "kvtiers load", "LMCache load", "load ratio", "raw pread"],
        ([size_label(int(r["chunk_bytes"])), f"{r['kvtiers_store']:.2f}",
          f"{r['lmcache_store']:.2f}", f"{r['store_ratio']:.2f}x", f"{r['raw_pwrite']:.2f}",
          f"{r['kvtiers_load']:.2f}", f"{r['lmcache_load']:.2f}", f"{r['load_ratio']:.2f}x",
          f"{r['raw_pread']:.2f}"] for r in rows),
        align="r" * 9)


def spread_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Slowest and fastest pass of each variant (GB/s): how far apart the passes were."""
    names = WRITES + READS
    return markdown_table(
        ["chunk", *(n.replace("_", " ") for n in names)],
        ([size_label(int(r["chunk_bytes"])),
          *(f"{min(r['passes_gbps'][n]):.2f}-{max(r['passes_gbps'][n]):.2f}" for n in names)]
         for r in rows),
        align="r" * (1 + len(names)))


def integrity_table(kvtiers: dict[str, Any], lmcache: dict[str, Any]) -> list[str]:
    def restart(result: dict[str, Any]) -> str:
        return f"{result['restart_found']} of {result['intact']}"

    def cell(result: dict[str, Any], case: str) -> str:
        return f"{result[case]}; {result[case + '_file']}"

    return [
        f"| {INTEGRITY_CHUNKS} chunks of {size_label(INTEGRITY_CHUNK_BYTES)} | kvtiers | "
        f"LMCache {LMCACHE_VERSION} |",
        "|---|---|---|",
        f"| one byte flipped in a chunk's file | {cell(kvtiers, 'flipped')} | "
        f"{cell(lmcache, 'flipped')} |",
        f"| a chunk's file truncated to half | {cell(kvtiers, 'truncated')} | "
        f"{cell(lmcache, 'truncated')} |",
        f"| restart over the same directory: intact chunks found | {restart(kvtiers)} | "
        f"{restart(lmcache)} |",
    ]


def payloads(n: int, nbytes: int, seed: int = 7) -> list[bytes]:
    """``n`` distinct pseudo-random payloads (repeatable)."""
    import random

    rng = random.Random(seed)
    return [rng.randbytes(nbytes) for _ in range(n)]


def flip_byte(path: Path, offset_from_end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        (byte,) = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def truncate_half(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


# -- kvtiers' file tier -----------------------------------------------------------------
class KvtiersFiles:
    """The file tier over ``root``: a manager, one mover (``durability: process``,
    checksums on, corrupt chunks quarantined) and ``n`` page-aligned slots."""

    def __init__(self, root: Path, chunk_bytes: int, n: int, threads: int = THREADS,
                 region: Region | None = None) -> None:
        offloading = file_config(chunk_bytes)
        self.identity = NamespaceIdentity.from_config(offloading)
        self.geometry = ChunkGeometry.from_config(offloading)
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        self.root = root
        self.region = region or Region(n + 1, self.geometry.slot_bytes)
        self.mapper = FileMapper(root, self.identity)
        self.jobs = itertools.count()
        self._open()

    def _open(self) -> None:
        self.manager = FileTierManager(self.mapper, self.geometry)
        self.mover = FileMover(
            self.region, self.geometry, self.identity.digest, PosixBackend(),
            threads=self.threads, settings=PublishSettings(durability="process"),
            bad_chunks=BadChunkHandler(self.manager, self.manager.quarantine_dir),
        )

    def close(self) -> None:
        self.mover.shutdown()
        self.manager.shutdown()

    def restart(self) -> None:
        """A new manager and mover over the same directory (the index is rebuilt)."""
        self.close()
        self._open()

    def paths(self, keys: Sequence[OffloadKey]) -> list[Path]:
        return [self.mapper.path(key) for key in keys]

    def _job(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> tuple[float, Any]:
        start = time.perf_counter()
        self.mover.submit(next(self.jobs), src, dst)
        self.mover.drain()
        elapsed = time.perf_counter() - start
        (result,) = self.mover.get_finished()
        return elapsed, result

    def store(self, keys: Sequence[OffloadKey], slots: Sequence[int],
              before: Callable[[], None] = lambda: None) -> float:
        """Store slot ``slots[i]`` as ``keys[i]``; seconds of the mover's job."""
        assert self.manager.prepare_store(list(keys), CTX) == list(keys)
        spec = self.manager.get_spec(keys)
        before()
        elapsed, result = self._job(CPULoadStoreSpec(slots), spec)
        assert result.success, result
        self.manager.complete_store(list(keys), CTX)
        return elapsed

    def load(self, keys: Sequence[OffloadKey], slots: Sequence[int],
             before: Callable[[], None] = lambda: None) -> tuple[float, Any]:
        self.manager.prepare_load(keys, CTX)
        spec = self.manager.get_spec(keys)
        before()
        elapsed, result = self._job(spec, CPULoadStoreSpec(slots))
        self.manager.complete_load(keys, CTX)
        return elapsed, result

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        self.manager.forget(keys, corrupt=False)
        for path in self.paths(keys):
            path.unlink()

    def found(self, keys: Sequence[OffloadKey]) -> int:
        return sum(self.manager.lookup(key, CTX) is LookupResult.HIT for key in keys)


class KvtiersIntegrity:
    """The integrity harness's kvtiers side: store payloads, load one chunk, restart."""

    def __init__(self, root: Path, chunk_payloads: Sequence[bytes]) -> None:
        self.payloads = list(chunk_payloads)
        n = len(self.payloads)
        self.tier = KvtiersFiles(root, len(self.payloads[0]), n)
        self.keys = bench_keys(n, "integrity")
        self.spare = n  # the slot loads land in

    def store(self) -> None:
        for i, data in enumerate(self.payloads):
            self.tier.region.view(i)[: len(data)] = data
        self.tier.store(self.keys, range(len(self.keys)))

    def path(self, i: int) -> Path:
        return self.tier.paths([self.keys[i]])[0]

    def load(self, i: int) -> bytes | None:
        key = self.keys[i]
        if self.tier.manager.lookup(key, CTX) is not LookupResult.HIT:
            return None
        view = self.tier.region.view(self.spare)
        view[:] = bytes(len(view))
        _, result = self.tier.load([key], [self.spare])
        if not result.success:
            return None
        return bytes(view[: len(self.payloads[i])])

    def quarantine(self) -> Path | None:
        return self.tier.manager.quarantine_dir

    def restart(self) -> None:
        self.tier.restart()

    def found(self, indexes: Sequence[int]) -> int:
        return self.tier.found([self.keys[i] for i in indexes])

    def close(self) -> None:
        self.tier.close()


def run_integrity(side: Any, chunk_payloads: Sequence[bytes]) -> dict[str, Any]:
    """Store, damage chunk 0 (a flipped payload byte) and chunk 1 (truncated to half),
    load both, then restart and count the intact chunks found."""
    side.store()
    flip_byte(side.path(0), len(chunk_payloads[0]) // 2)
    truncate_half(side.path(1))
    out: dict[str, Any] = {}
    for i, case in enumerate(("flipped", "truncated")):
        out[case] = describe(chunk_payloads[i], side.load(i))
        out[f"{case}_file"] = file_fate(side.path(i), side.quarantine())
    out["damaged_found_after_load"] = side.found([0, 1])
    side.restart()
    intact = list(range(2, len(chunk_payloads)))
    out["intact"] = len(intact)
    out["restart_found"] = side.found(intact)
    out["damaged_found_after_restart"] = side.found([0, 1])
    side.close()
    return out


# -- LMCache's local-disk backend --------------------------------------------------------
class LMCacheDisk:
    """LMCache's ``LocalDiskBackend`` over ``directory`` with CPU memory objects from a
    ``TensorMemoryAllocator`` of ``pool_bytes``; its event loop runs on a thread."""

    def __init__(self, directory: Path, pool_bytes: int, threads: int = THREADS) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.tensor_memory_allocator import (
            TensorMemoryAllocator,
        )
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self._torch = torch
        self._key_type = CacheEngineKey
        self._fmt = MemoryFormat.KV_2LTD
        self.directory = directory
        self.threads = threads
        self.config = LMCacheEngineConfig.from_defaults(
            local_cpu=False, local_disk=str(directory), max_local_disk_size=LMCACHE_DISK_GB,
            extra_config={"disk_io_threads": threads},
        )
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._loop_thread.start()
        allocator = TensorMemoryAllocator(torch.zeros(pool_bytes, dtype=torch.uint8))
        self.cpu = LocalCPUBackend(self.config, memory_allocator=allocator)
        self._open()

    def _open(self) -> None:
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self.backend = LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu")

    def keys(self, n: int, tag: str) -> list[Any]:
        base = zlib.crc32(tag.encode())
        return [self._key_type("bench", 1, 0, (base << 20) + i, self._torch.uint8)
                for i in range(n)]

    def allocate(self, data: memoryview | bytes) -> Any:
        obj = self.cpu.allocate(self._torch.Size([len(data)]), self._torch.uint8, self._fmt)
        assert obj is not None, "LMCache's CPU pool is full"
        # Its byte_array is a '<B' memoryview, which slice assignment refuses.
        obj.tensor.view(-1).copy_(self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8))
        return obj

    def path(self, key: Any) -> Path:
        return Path(self.backend._key_to_path(key))

    def store(self, keys: Sequence[Any], objs: Sequence[Any]) -> float:
        """Seconds from submitting every put until every completion callback ran."""
        done = threading.Semaphore(0)
        start = time.perf_counter()
        self.backend.batched_submit_put_task(
            list(keys), list(objs), on_complete_callback=lambda _key: done.release()
        )
        for _ in keys:
            if not done.acquire(timeout=600):
                raise TimeoutError("LMCache's disk puts did not finish")
        return time.perf_counter() - start

    def load(self, keys: Sequence[Any]) -> tuple[float, list[Any]]:
        start = time.perf_counter()
        objs = self.backend.batched_get_blocking(list(keys))
        return time.perf_counter() - start, objs

    def free(self, objs: Sequence[Any]) -> None:
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()

    def remove(self, keys: Sequence[Any]) -> None:
        for key in keys:
            assert self.backend.remove(key)

    def found(self, keys: Sequence[Any]) -> int:
        return sum(bool(self.backend.contains(key)) for key in keys)

    def close_backend(self) -> None:
        self.backend.close()

    def restart(self) -> None:
        """A new backend over the same directory (the CPU pool and loop are kept)."""
        self.close_backend()
        self._open()

    def close(self) -> None:
        self.close_backend()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)


class LMCacheIntegrity:
    """The integrity harness's LMCache side (same interface as :class:`KvtiersIntegrity`)."""

    def __init__(self, directory: Path, chunk_payloads: Sequence[bytes]) -> None:
        self.payloads = list(chunk_payloads)
        size = sum(len(p) for p in self.payloads)
        self.disk = LMCacheDisk(directory, pool_bytes=3 * size + 16 * MIB)
        self.keys = self.disk.keys(len(self.payloads), "integrity")
        self.sources: list[Any] = []

    def store(self) -> None:
        self.sources = [self.disk.allocate(p) for p in self.payloads]
        self.disk.store(self.keys, self.sources)

    def path(self, i: int) -> Path:
        return self.disk.path(self.keys[i])

    def load(self, i: int) -> bytes | None:
        obj = self.disk.backend.get_blocking(self.keys[i])
        if obj is None:
            return None
        data = bytes(obj.byte_array)
        self.disk.free([obj])
        return data

    def quarantine(self) -> Path | None:
        return None

    def restart(self) -> None:
        self.disk.restart()

    def found(self, indexes: Sequence[int]) -> int:
        return self.disk.found([self.keys[i] for i in indexes])

    def close(self) -> None:
        self.disk.close()


def lmcache_remove_drift(directory: Path, chunks: int = 4) -> dict[str, float]:
    """Store ``chunks`` chunks of 256 KiB, remove them: ``current_cache_size`` before and
    after, and the bytes the backend's own ``usage`` counter holds after."""
    data = payloads(chunks, 256 * KIB, seed=11)
    disk = LMCacheDisk(directory, pool_bytes=2 * chunks * 256 * KIB + 16 * MIB)
    try:
        keys = disk.keys(chunks, "drift")
        objs = [disk.allocate(p) for p in data]
        disk.store(keys, objs)
        before = float(disk.backend.current_cache_size)
        disk.remove(keys)
        return {
            "stored_bytes": float(chunks * 256 * KIB),
            "current_cache_size_after_store": before,
            "current_cache_size_after_remove": float(disk.backend.current_cache_size),
            "usage_after_remove": float(disk.backend.usage),
            "files_left": float(len(list(Path(disk.backend.path).glob("*.pt")))),
        }
    finally:
        disk.close()


# -- throughput ----------------------------------------------------------------------------
def raw_pread(paths: Sequence[Path], region: Region, size: int, threads: int) -> float:
    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.preadv(fd, [region.view(i)[:size]], 0)
        finally:
            os.close(fd)

    return timed_threads(threads, one, len(paths))


class Case:
    """One chunk size: a region of ``n`` slots, the file tier, LMCache's disk backend
    (memory objects holding the same bytes) and raw files of the same payloads."""

    def __init__(self, base: Path, chunk_bytes: int, volume: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.n = n = max(THREADS, volume // chunk_bytes)
        self.root = base / f"case-{chunk_bytes}"
        self.tier = KvtiersFiles(self.root / "kvtiers", chunk_bytes, n)
        self.region = self.tier.region
        self.keys = bench_keys(n, f"lmcache-{chunk_bytes}")
        for path in self.tier.paths(self.keys):
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.root / "raw").mkdir(parents=True)
        self.raw_paths = [self.root / "raw" / f"{i}.blob" for i in range(n)]
        (self.root / "lmcache").mkdir()
        # Sources for stores plus the objects loads allocate, with alignment to spare.
        self.lmc = LMCacheDisk(self.root / "lmcache", pool_bytes=2 * n * chunk_bytes + 64 * MIB)
        self.lmc_keys = self.lmc.keys(n, f"case-{chunk_bytes}")
        self.lmc_sources = [self.lmc.allocate(self.region.view(i)[:chunk_bytes])
                            for i in range(n)]
        self.samples: dict[str, list[float]] = {name: [] for name in WRITES + READS}
        self.verified = False

    def close(self) -> None:
        self.lmc.close()
        self.tier.close()
        shutil.rmtree(self.root)

    def _lmc_paths(self) -> list[Path]:
        return [self.lmc.path(key) for key in self.lmc_keys]

    def write(self, name: str) -> None:
        slots = range(self.n)
        if name == "raw_pwrite":
            elapsed = raw_write(self.raw_paths, self.region, b"", self.chunk_bytes,
                                THREADS, fsync=False)
            for path in self.raw_paths:
                path.unlink()
        elif name == "kvtiers_store":
            elapsed = self.tier.store(self.keys, slots, before=os.sync)
            self.tier.remove(self.keys)
        else:
            os.sync()
            elapsed = self.lmc.store(self.lmc_keys, self.lmc_sources)
            self.lmc.remove(self.lmc_keys)
        self.samples[name].append(elapsed)

    def read(self, name: str) -> None:
        slots = range(self.n)
        if name == "raw_pread":
            raw_write(self.raw_paths, self.region, b"", self.chunk_bytes, THREADS, fsync=False)
            drop_page_cache(self.raw_paths)
            elapsed = raw_pread(self.raw_paths, self.region, self.chunk_bytes, THREADS)
            for path in self.raw_paths:
                path.unlink()
        elif name == "kvtiers_load":
            self.tier.store(self.keys, slots)
            paths = self.tier.paths(self.keys)
            elapsed, result = self.tier.load(
                self.keys, slots, before=lambda: drop_page_cache(paths)
            )
            assert result.success, result
            self.tier.remove(self.keys)
        else:
            self.lmc.store(self.lmc_keys, self.lmc_sources)
            drop_page_cache(self._lmc_paths())
            elapsed, objs = self.lmc.load(self.lmc_keys)
            assert all(obj is not None for obj in objs), "LMCache missed a stored chunk"
            if not self.verified:
                for i, obj in enumerate(objs):
                    assert bytes(obj.byte_array) == self.region.view(i)[: self.chunk_bytes]
                self.verified = True
            self.lmc.free(objs)
            self.lmc.remove(self.lmc_keys)
        self.samples[name].append(elapsed)


def bench_case(base: Path, chunk_bytes: int, volume: int, repeats: int) -> dict[str, Any]:
    case = Case(base, chunk_bytes, volume)
    writes, reads = list(WRITES), list(READS)
    try:
        for rep in range(repeats):
            turn = rep % len(writes)
            for name in writes[turn:] + writes[:turn]:
                case.write(name)
            for name in reads[turn:] + reads[:turn]:
                case.read(name)
        drift = float(case.lmc.backend.current_cache_size)
    finally:
        case.close()
    payload = case.n * chunk_bytes
    out: dict[str, Any] = {"chunk_bytes": chunk_bytes, "chunks": case.n}
    out.update({name: gbps(payload, t) for name, t in case.samples.items()})
    out["passes_gbps"] = {name: [payload / s / 1e9 for s in t]
                          for name, t in case.samples.items()}
    out["store_ratio"] = ratio(out["kvtiers_store"], out["lmcache_store"])
    out["load_ratio"] = ratio(out["kvtiers_load"], out["lmcache_load"])
    out["lmcache_current_cache_size_end"] = drift
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="32 MiB per case, one pass")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default /tmp)")
    parser.add_argument("--volume-mib", type=int, default=None, help="MiB per case")
    parser.add_argument("--repeats", type=int, default=None, help="passes per case")
    args = parser.parse_args(argv)
    missing = lmcache_missing()
    if missing is not None:
        print(skip_line(missing))
        return 0
    import lmcache

    version = getattr(lmcache, "__version__", "unknown")
    volume = (args.volume_mib or (32 if args.quick else 256)) * MIB
    repeats = args.repeats or (1 if args.quick else 9)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtiers-lmcache-") as tmp:
        base = Path(tmp)
        note = machine_note(directory=str(base), filesystem=filesystem_of(base),
                            lmcache=version)
        print(machine_sentence(note), flush=True)
        if version != LMCACHE_VERSION:
            print(f"note: this benchmark was written against LMCache {LMCACHE_VERSION}")
        for chunk_bytes in CHUNK_SIZES:
            r = bench_case(base, chunk_bytes, volume, repeats)
            rows.append(r)
            print(
                f"{size_label(chunk_bytes):>7} x{THREADS}: store kvtiers {r['kvtiers_store']:.2f} "
                f"GB/s vs LMCache {r['lmcache_store']:.2f} ({r['store_ratio']:.2f}x; raw "
                f"pwrite {r['raw_pwrite']:.2f}); load kvtiers {r['kvtiers_load']:.2f} vs "
                f"LMCache {r['lmcache_load']:.2f} ({r['load_ratio']:.2f}x; raw pread "
                f"{r['raw_pread']:.2f})",
                flush=True,
            )
        data = payloads(INTEGRITY_CHUNKS, INTEGRITY_CHUNK_BYTES)
        kvt = run_integrity(KvtiersIntegrity(base / "integrity-kvtiers", data), data)
        lmc = run_integrity(LMCacheIntegrity(base / "integrity-lmcache", data), data)
        drift = lmcache_remove_drift(base / "drift")
    elapsed = time.perf_counter() - started
    print("\n".join(throughput_table(rows)))
    print()
    print("\n".join(spread_table(rows)))
    print()
    print("\n".join(integrity_table(kvt, lmc)))
    print(
        f"LMCache remove(): current_cache_size {drift['current_cache_size_after_store']:.0f} "
        f"B after storing {drift['stored_bytes']:.0f} B, "
        f"{drift['current_cache_size_after_remove']:.0f} B after removing all (its usage "
        f"counter: {drift['usage_after_remove']:.0f} B, files left: "
        f"{drift['files_left']:.0f})"
    )
    print(f"took {elapsed:.0f} s")
    if args.quick or args.no_write:
        return 0
    report = {
        "machine": finish_note(note),
        "command": " ".join(["/tmp/lmcache-venv/bin/python benchmarks/bench_lmcache.py",
                             *sys.argv[1:]]),
        "lmcache_version": version, "volume_bytes": volume, "repeats": repeats,
        "threads": THREADS, "seconds": elapsed, "rows": rows,
        "integrity": {"kvtiers": kvt, "lmcache": lmc}, "lmcache_remove_drift": drift,
    }
    notes = kept_section(args.out / "lmcache.md", NOTES)
    page = render(report) + ("\n" + notes if notes else "")
    for path in write_result(to_document("lmcache", report, **LAYOUT), args.out, "lmcache", page):
        print(f"wrote {path}")
    return 0


NOTES = "## Reading the numbers"


def render(data: dict[str, Any]) -> str:
    """The results page (without the hand-written reading) for ``data``, the flat dict
    :data:`LAYOUT` maps onto the schema."""
    rows, drift = data["rows"], data["lmcache_remove_drift"]
    kvt, lmc = data["integrity"]["kvtiers"], data["integrity"]["lmcache"]
    lines = [
        f"# kvtiers' file tier vs LMCache {data['lmcache_version']}'s local-disk backend",
        "",
        f"Machine: {machine_sentence(data['machine'])}.",
        "",
        f"Command: `{data['command']}` ({data['volume_bytes'] // MIB} MiB per case, median "
        f"of {data['repeats']} passes, {data['threads']} I/O threads on each side, "
        f"{data['seconds']:.0f} s in all). Throughput is payload "
        "GB/s; ratios are kvtiers / LMCache, same bytes, same run. kvtiers: file tier "
        "mover, `durability: process`, checksums on (a 4096-byte header per file). "
        f"LMCache: `LocalDiskBackend` with `extra_config.disk_io_threads: {data['threads']}` "
        "(its put executor and its read pool; no thread pool of the benchmark's), CPU memory "
        "objects, `local_cpu: false`, no fsync. `sync` before every write pass; page cache "
        "dropped with `posix_fadvise(DONTNEED)` after an fsync before every read pass. Raw "
        "`pwrite` / `pread` of the same payloads into one directory, "
        f"{data['threads']} threads, is the medium reference.",
        "",
        *throughput_table(rows),
        "",
        "Slowest-fastest pass of each (GB/s; the table above gives medians):",
        "",
        *spread_table(rows),
        "",
        "Integrity (one byte flipped in the middle of one chunk's payload, another chunk's "
        "file truncated to half, each then loaded once; then a new manager / backend over "
        "the same directory):",
        "",
        *integrity_table(kvt, lmc),
        "",
        f"LMCache's `remove()` and its size counter: after storing "
        f"{drift['stored_bytes'] / KIB:.0f} KiB, `current_cache_size` was "
        f"{drift['current_cache_size_after_store'] / KIB:.0f} KiB; after `remove()` of "
        f"every chunk it was {drift['current_cache_size_after_remove'] / KIB:.0f} KiB "
        f"(its `usage` counter: {drift['usage_after_remove'] / KIB:.0f} KiB; files left: "
        f"{drift['files_left']:.0f}). The benchmark sets `max_local_disk_size: "
        f"{LMCACHE_DISK_GB:.0f}` GB so that eviction never runs.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
