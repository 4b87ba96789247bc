"""The file tier's walk of its namespace, fan-out directories in parallel, off the
scheduler's thread (:mod:`kvtiers.tiers.build`).

One pass both indexes the chunk files (names and places parsed as
:func:`~kvtiers.filemapper.scan_namespace` does, sizes and mtimes from ``stat``, never
opening a file) and removes the temp files of interrupted publishes older than a cutoff.
Each top-level directory is one part, walked by one of ``threads`` threads (``stat`` and
``scandir`` release the GIL: on a network filesystem their latencies overlap);
``before_part(i)`` runs on the walking thread before part ``i`` (parts in name order),
and a build that is stopping skips the parts not yet begun.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvtiers.core.keys import OffloadKey
from kvtiers.filemapper import QUARANTINE_DIR, key_from_chunk_name, remove_temp, scan_namespace
from kvtiers.filemapper.scan import ScannedEntry
from kvtiers.tiers.build import IndexBuild
from kvtiers.tiers.compact import PackedChunks

#: Threads walking fan-out directories at once.
DEFAULT_WALK_THREADS = 4


@dataclass
class Walked:
    """What a walk found: the chunks packed oldest first, and what it met besides."""

    packed: PackedChunks
    removed_temps: int = 0
    #: Entries named like chunks that are not regular files (never indexed).
    unindexed: int = 0


@dataclass
class _Part:
    keys: list[OffloadKey] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    mtimes: list[int] = field(default_factory=list)
    removed_temps: int = 0
    unindexed: int = 0

    def take(self, item: ScannedEntry, temp_cutoff: float) -> None:
        if item.is_temp:
            self.removed_temps += remove_temp(item, temp_cutoff)
            return
        key = item.chunk_key()
        if key is None:
            return
        try:
            st = item.entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            # A FIFO, directory or symlink under a chunk's name is never a chunk: indexed,
            # every load of it would fail. `kvtiers verify` lists them.
            self.unindexed += 1
            return
        self.keys.append(key)
        self.sizes.append(st.st_size)
        self.mtimes.append(st.st_mtime_ns)


def walk_namespace(
    namespace_dir: Path,
    build: IndexBuild[Any],
    *,
    temp_cutoff: float,
    threads: int = DEFAULT_WALK_THREADS,
    before_part: Callable[[int], None] | None = None,
) -> Walked:
    """Index ``namespace_dir``'s chunk files and remove its temp files modified before
    ``temp_cutoff`` (seconds since the epoch); see the module docstring."""
    top = _Part()
    parts: list[tuple[str, str]] = []
    try:
        with os.scandir(namespace_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if entry.is_dir(follow_symlinks=False) and key_from_chunk_name(entry.name) is None:
            if entry.name != QUARANTINE_DIR:
                parts.append((entry.path, f"{entry.name}/"))
            continue
        top.take(ScannedEntry(entry.name, entry), temp_cutoff)

    def walk(i: int) -> _Part:
        part = _Part()
        if build.stopping:
            return part
        if before_part is not None:
            before_part(i)
        path, prefix = parts[i]
        for item in scan_namespace(Path(path), prefix=prefix):
            part.take(item, temp_cutoff)
        build.part_done()
        return part

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvtiers-file-walk") as pool:
        done = [top, *pool.map(walk, range(len(parts)))]
    keys = [key for part in done for key in part.keys]
    mtimes = np.fromiter((m for part in done for m in part.mtimes), dtype=np.int64,
                         count=len(keys))
    sizes = [size for part in done for size in part.sizes]
    order = np.argsort(mtimes, kind="stable")
    keys = [keys[i] for i in order.tolist()]
    sizes = [sizes[i] for i in order.tolist()]
    return Walked(
        PackedChunks.pack(keys, sizes),
        removed_temps=sum(part.removed_temps for part in done),
        unindexed=sum(part.unindexed for part in done),
    )
