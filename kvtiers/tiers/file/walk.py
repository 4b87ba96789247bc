"""The file tier's walk of its namespace, fan-out directories in parallel, off the
scheduler's thread (:mod:`kvtiers.tiers.build`).

One pass both indexes the chunk files (names and places parsed as
:func:`~kvtiers.filemapper.scan_namespace` does, sizes and mtimes from ``stat``, never
opening a file) and removes the temp files of interrupted publishes older than a cutoff.
A chunk's name in its own fan-out directory costs one match and one ``lstat`` by the
directory's descriptor, no entry object; anything else is taken as the scan's entries
are (:func:`_walk_part`; a test holds the two ways equal). The names-only pass
(``assume_size``) skips that ``lstat``: a chunk place's names are matched in one scan of
its listing and each chunk is taken at the assumed size and mtime 0 (name order);
the walking children measure them afterwards (:class:`ChildStats`), or
:func:`stat_chunks` does, off the scheduler's thread.
Each top-level directory is one part, walked by one of at most ``threads`` threads,
one until a part waited on the medium longer than it worked (:func:`map_parts`: ``stat``
and ``scandir`` release the GIL, so on a network filesystem or a cold disk their
latencies overlap; on a medium answering from memory more threads only contend for it);
``before_part(i)`` runs on the walking thread before part ``i`` (parts in name order),
and a build that is stopping skips the parts not yet begun.

:func:`walk_in_children` runs the same walk in child processes (``python -m
kvtiers.tiers.file.walk``), each over a contiguous block of the parts: the per-entry
objects (names, ``stat`` results, keys) live and die there, so the tier's process keeps
only the packed arrays they send back (its allocator never holds the walk's garbage), and
the walk's Python work runs beside the scheduler's, not under its GIL. A child writes one
byte a part (progress; a parent that died ends it with ``EPIPE``), then ``=``, a header and
its chunks' key lengths, sizes, mtimes and padded keys, unsorted; on an error ``!`` and
the message. After a names-only pass's answer, once the parent has every child's names
merged and says so, a child goes on with the stat pass of the chunks it named and sends
that too (:class:`ChildStats`), so the stat work runs beside the serving process, not
under its interpreter lock. The parent merges the blocks in part
order and sorts by mtime (stable), as the walk in this process does, so both give the
same :class:`Walked`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

import numpy as np

from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.filemapper import CHUNK_SUFFIX, QUARANTINE_DIR, key_from_chunk_name, remove_temp
from kvtiers.filemapper.mapper import CHUNK_NAME as _CHUNK_NAME
from kvtiers.filemapper.scan import ScannedEntry
from kvtiers.tiers.build import IndexBuild, anonymous_array
from kvtiers.tiers.compact import PackedChunks, sorted_rows, stable_order

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Threads walking fan-out directories at once, at most (in each walking process; one
#: until the medium keeps them waiting: :func:`map_parts`).
DEFAULT_WALK_THREADS = 4
#: Child processes walking blocks of fan-out directories at once (0: the tier's own
#: process). Two: the walk is bound by a stat and a name parse a chunk, which two cores
#: share (benchmarks/results/scale.md).
DEFAULT_WALK_PROCESSES = 2
# A child's result: chunk count, key width, temp files removed, entries not indexed.
_RESULT = struct.Struct("<QHQQ")
# A chunk's place below the namespace directory (its two fan-out levels).
_PLACE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/")
_GROUPS = 2 ** (8 * GROUP_INDEX_BYTES)
# The names-only pass: chunks' names (as _CHUNK_NAME) matched over a directory's listing
# joined by newlines, one line each, by one scan in C.
_CHUNK_LINES = re.compile(
    r"^((?:[0-9a-f]{2}){2,})_g(0|[1-9][0-9]{0,9})" + re.escape(CHUNK_SUFFIX) + "$", re.M
)
_GROUP_ZERO = bytes(GROUP_INDEX_BYTES)


@dataclass
class Walked:
    """What a walk found: the chunks packed oldest first, and what it met besides."""

    packed: PackedChunks
    removed_temps: int = 0
    #: Entries named like chunks that are not regular files (never indexed).
    unindexed: int = 0
    #: Names only (``assume_size``): chunks in name order at the assumed size, not yet
    #: ``stat``-ed (:func:`stat_chunks` does that afterwards).
    names_only: bool = False
    #: A names-only walk in child processes: their stat pass, under way there
    #: (:meth:`ChildStats.collect`; ``None``: stat in this process).
    stats: ChildStats | None = None


@dataclass
class _Part:
    keys: list[OffloadKey] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    mtimes: list[int] = field(default_factory=list)
    removed_temps: int = 0
    unindexed: int = 0
    #: With names kept (a walking child's names-only pass): each chunk place's
    #: directory, the index in ``keys`` of its first chunk taken by name, and those
    #: chunks' names in ``keys``' order (:func:`_stat_part` stats them).
    places: list[tuple[str, int, list[str]]] | None = None

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


def _list_parts(namespace_dir: Path, temp_cutoff: float) -> tuple[_Part, list[tuple[str, str]]]:
    """The namespace directory's own entries taken (temp files removed), and its
    fan-out directories as ``(path, name prefix)`` in name order."""
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
    return top, parts


def _walk_part(
    path: str, prefix: str, part: _Part, temp_cutoff: float, assume_size: int | None = None,
) -> None:
    """Take every entry below ``path`` into ``part`` as :func:`scan_namespace` yields them
    (``prefix``: the names' prefix, ``"ab/"``). In a chunk's place (``ab/cd/``) a chunk's
    name (nearly every entry) takes the short way: the name parsed by one match, one
    ``lstat`` relative to the directory's descriptor (no lookup of the whole path, no
    entry object). Any other entry goes the slow way, :meth:`_Part.take` as before: the
    directory is listed again for them (they are rare: temp files, strays, deeper
    directories). With ``assume_size`` a chunk's name is not ``lstat``-ed at all: it is
    taken at that size and mtime 0 (the names-only pass)."""
    stack = [(path, prefix)]
    while stack:
        path, prefix = stack.pop()
        others = (_take_chunks(path, prefix, part, assume_size)
                  if _PLACE.fullmatch(prefix) else None)
        if others is not None and not others:
            continue
        try:
            with os.scandir(path) as it:
                entries = [entry for entry in it if others is None or entry.name in others]
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            name = f"{prefix}{entry.name}"
            if entry.is_dir(follow_symlinks=False) and key_from_chunk_name(entry.name) is None:
                stack.append((entry.path, f"{name}/"))
            else:
                part.take(ScannedEntry(name, entry), temp_cutoff)


def _take_chunks(path: str, prefix: str, part: _Part, assume_size: int | None) -> set[str]:
    """The short way of :func:`_walk_part` through the chunk place ``path`` (``prefix``
    ``ab/cd/``); returns the names of the entries left for the slow way. With
    ``assume_size`` a chunk's name is taken as it is, no ``lstat``."""
    start = f"{prefix[0:2]}{prefix[3:5]}"
    others: set[str] = set()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return others
    if assume_size is not None:
        try:
            return _take_names(os.listdir(fd), start, part, assume_size, path)
        finally:
            os.close(fd)
    # Names bound once: this loop runs once a chunk.
    fullmatch, lstat, is_regular = _CHUNK_NAME.fullmatch, os.lstat, stat.S_ISREG
    keys, sizes, mtimes = part.keys.append, part.sizes.append, part.mtimes.append
    try:
        for name in os.listdir(fd):
            match = fullmatch(name) if name.startswith(start) else None
            if match is None:
                others.add(name)
                continue
            hex_hash, digits = match.groups()
            group = int(digits)
            if group >= _GROUPS:
                others.add(name)
                continue
            try:
                st = lstat(name, dir_fd=fd)
            except FileNotFoundError:
                continue  # gone since the listing
            if not is_regular(st.st_mode):
                # A FIFO, directory or symlink under a chunk's name (as _Part.take).
                part.unindexed += 1
                continue
            keys(OffloadKey(bytes.fromhex(hex_hash) + group.to_bytes(GROUP_INDEX_BYTES, "big")))
            sizes(st.st_size)
            mtimes(st.st_mtime_ns)
    finally:
        os.close(fd)
    return others


#: :func:`stat_chunks`'s size of a chunk whose file is gone, and of one that is not a
#: regular file.
STAT_MISSING = -1
STAT_NOT_REGULAR = -2
# Chunks stat-ed between two looks at whether the stat pass is stopping.
_STAT_SLICE = 4096


def stat_chunks(
    namespace_dir: Path, keys: Sequence[OffloadKey], stopping: Callable[[], bool],
) -> tuple[np.ndarray, np.ndarray] | None:
    """The stat pass after a names-only walk (off the scheduler's thread): each of
    ``keys``' chunk files ``lstat``-ed in its place, by its directory's descriptor, in
    slices of :data:`_STAT_SLICE` between which ``stopping()`` is asked (``None`` once it
    says so). Returns the sizes (or :data:`STAT_MISSING`, :data:`STAT_NOT_REGULAR`) and
    mtimes (ns) in ``keys``' order. ``keys`` come from the walk in directory order, so
    each directory is opened once in a row of its chunks."""
    count = len(keys)
    sizes = np.full(count, STAT_MISSING, dtype=np.int64)
    mtimes = np.zeros(count, dtype=np.int64)
    lstat, is_regular = os.lstat, stat.S_ISREG
    fd, fd_place = -1, ""
    try:
        for start in range(0, count, _STAT_SLICE):
            if stopping():
                return None
            for i in range(start, min(start + _STAT_SLICE, count)):
                key = keys[i]
                hex_hash = key[:-GROUP_INDEX_BYTES].hex()
                place = f"{hex_hash[0:2]}/{hex_hash[2:4]}"
                if place != fd_place:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd_place = place
                    try:
                        fd = os.open(namespace_dir / place,
                                     os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                    except OSError:
                        continue
                if fd < 0:
                    continue
                group = int.from_bytes(key[-GROUP_INDEX_BYTES:], "big")
                try:
                    st = lstat(f"{hex_hash}_g{group}{CHUNK_SUFFIX}", dir_fd=fd)
                except OSError:
                    continue
                if not is_regular(st.st_mode):
                    sizes[i] = STAT_NOT_REGULAR
                    continue
                sizes[i] = st.st_size
                mtimes[i] = st.st_mtime_ns
    finally:
        if fd >= 0:
            os.close(fd)
    return sizes, mtimes


def _stat_part(part: _Part) -> tuple[list[int], list[int]]:
    """A walking child's stat pass over one part of its names-only walk: the sizes
    (or :data:`STAT_MISSING`, :data:`STAT_NOT_REGULAR`) and mtimes of ``part.keys``, in
    their order. The chunks taken by name are ``lstat``-ed by their directory's
    descriptor; those the slow way took were ``stat``-ed then and keep those values."""
    sizes, mtimes = list(part.sizes), list(part.mtimes)
    lstat, is_regular = os.lstat, stat.S_ISREG
    for path, first, names in part.places or ():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            sizes[first:first + len(names)] = [STAT_MISSING] * len(names)
            continue
        try:
            for i, name in enumerate(names, first):
                try:
                    st = lstat(name, dir_fd=fd)
                except OSError:
                    sizes[i] = STAT_MISSING
                    continue
                if is_regular(st.st_mode):
                    sizes[i] = st.st_size
                    mtimes[i] = st.st_mtime_ns
                else:
                    sizes[i] = STAT_NOT_REGULAR
        finally:
            os.close(fd)
    return sizes, mtimes


def _take_names(
    names: list[str], start: str, part: _Part, assume_size: int, path: str,
) -> set[str]:
    """The names-only way of :func:`_take_chunks` through one chunk place's ``names``
    (their fan-out prefix ``start``, the place's directory ``path``): the chunks' names
    matched in one scan of the joined listing, each taken at ``assume_size`` (and kept in
    ``part.places`` when that is a list); returns the other names (the slow way's)."""
    text = "\n".join(names)
    if text.count("\n") != len(names) - 1:
        # A name holding a newline: matched one by one instead.
        found = [(n, *m.groups()) for n in names
                 for m in [_CHUNK_NAME.fullmatch(n)] if m is not None]
    else:
        found = [(m.group(0), m.group(1), m.group(2)) for m in _CHUNK_LINES.finditer(text)]
    keys, fromhex, zero = part.keys.append, bytes.fromhex, _GROUP_ZERO
    taken: set[str] | None = None if len(found) == len(names) else set()
    kept: list[str] | None = None
    if part.places is not None:
        kept = []
        part.places.append((path, len(part.keys), kept))
    for name, hex_hash, digits in found:
        if not hex_hash.startswith(start):
            continue
        if digits == "0":
            keys(OffloadKey(fromhex(hex_hash) + zero))
        else:
            group = int(digits)
            if group >= _GROUPS:
                continue
            keys(OffloadKey(fromhex(hex_hash) + group.to_bytes(GROUP_INDEX_BYTES, "big")))
        if taken is not None:
            taken.add(name)
        if kept is not None:
            kept.append(name)
    added = len(part.keys) - len(part.sizes)
    part.sizes.extend([assume_size] * added)
    part.mtimes.extend([0] * added)
    if taken is None and added == len(names):
        return set()
    if taken is None:
        # Some names were left (a foreign place or a group past range): find them.
        taken = {name for name, hex_hash, digits in found
                 if hex_hash.startswith(start) and int(digits) < _GROUPS}
    return set(names) - taken


#: A part whose thread spent longer blocked (waiting on the medium, not for a core) than
#: this many times its CPU time makes room for one more walking thread.
_BLOCKED_RATIO = 2.0


def map_parts(
    work: Callable[[int], _T], count: int, threads: int, *, name: str = "kvtiers-file-walk",
) -> list[_T]:
    """``work(i)`` for each part ``i`` of ``range(count)``, the results in part order, on
    at most ``threads`` threads: one at first, and one more each time a part's thread was
    blocked longer than :data:`_BLOCKED_RATIO` times its time on a core (a network
    filesystem, a cold disk: waits that more threads overlap). A medium answering from
    memory keeps one thread a process: every ``lstat`` and listing releases the
    interpreter lock, and threads that only contend for it cost about twice the CPU a
    chunk (benchmarks/results/scale.md). The first exception ``work`` raises is raised
    here once every thread has ended; parts not begun by then are skipped."""
    results: list[Any] = [None] * count
    pending = iter(range(count))
    lock = threading.Lock()
    workers: list[threading.Thread] = []
    errors: list[BaseException] = []

    def take() -> int | None:
        with lock:
            return None if errors else next(pending, None)

    def run() -> None:
        while (i := take()) is not None:
            before = _thread_times(start=True)
            try:
                results[i] = work(i)
            except BaseException as exc:  # raised by map_parts on its caller's thread
                with lock:
                    errors.append(exc)
                return
            if _blocked_longer(before, _thread_times(start=False)):
                add()

    def add() -> None:
        with lock:
            if len(workers) >= max(1, threads) or errors:
                return
            worker = threading.Thread(target=run, name=f"{name}-{len(workers)}", daemon=True)
            workers.append(worker)
        worker.start()

    add()
    joined = 0
    while True:
        with lock:
            if joined == len(workers):
                break
            worker = workers[joined]
        worker.join()
        joined += 1
    if errors:
        raise errors[0]
    return results


def _thread_times(*, start: bool) -> tuple[float, float, float]:
    """The wall clock, this thread's CPU time and its time spent waiting for a core
    (seconds; the scheduler's account of that wait where Linux gives it, else none
    known). The scheduler's own on-core figure is not used: it moves by whole ticks
    while the thread runs. ``start``: the first of a pair; the waits are read outside
    the wall clock's readings, so a preemption between two readings is never taken for
    time blocked."""
    if start:
        waiting = _waited()
        return time.perf_counter(), time.thread_time(), waiting
    on_core, wall = time.thread_time(), time.perf_counter()
    return wall, on_core, _waited()


def _waited() -> float:
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _blocked_longer(before: tuple[float, float, float], after: tuple[float, float, float]) -> bool:
    """Whether the thread was blocked (neither on a core nor waiting for one) longer than
    :data:`_BLOCKED_RATIO` times its time on a core between ``before`` and ``after``."""
    wall, on_core, waiting = (b - a for a, b in zip(before, after, strict=True))
    return wall - on_core - waiting > _BLOCKED_RATIO * on_core


def _walk_parts(
    parts: Sequence[tuple[str, str]], temp_cutoff: float, threads: int,
    before: Callable[[int], bool], assume_size: int | None = None, keep_names: bool = False,
) -> list[_Part]:
    """Walk ``parts``, ``threads`` at a time; ``before(i)`` runs first on the walking
    thread and returns False to skip part ``i``. ``keep_names``: the names-only pass
    keeps the chunks' names (:attr:`_Part.places`)."""

    def walk(i: int) -> _Part:
        part = _Part(places=[] if keep_names else None)
        if not before(i):
            return part
        path, prefix = parts[i]
        _walk_part(path, prefix, part, temp_cutoff, assume_size)
        return part

    return map_parts(walk, len(parts), threads)


def _pack(keys: list[OffloadKey], sizes: list[int], mtimes: np.ndarray) -> PackedChunks:
    """``keys`` with their ``sizes`` packed oldest first (stable by ``mtimes``)."""
    order = stable_order(mtimes).tolist()
    return PackedChunks.pack([keys[i] for i in order], [sizes[i] for i in order])


def walk_namespace(
    namespace_dir: Path,
    build: IndexBuild[Any],
    *,
    temp_cutoff: float,
    threads: int = DEFAULT_WALK_THREADS,
    before_part: Callable[[int], None] | None = None,
    assume_size: int | None = None,
) -> Walked:
    """Index ``namespace_dir``'s chunk files and remove its temp files modified before
    ``temp_cutoff`` (seconds since the epoch), in this process; see the module
    docstring. ``assume_size``: the names-only pass (:class:`Walked`'s ``names_only``)."""
    top, parts = _list_parts(namespace_dir, temp_cutoff)

    def before(i: int) -> bool:
        if build.stopping:
            return False
        if before_part is not None:
            before_part(i)
        return True

    def counted(i: int) -> bool:
        # Counted when the part is begun: its walk follows on this thread.
        if not before(i):
            return False
        build.part_done()
        return True

    done = [top, *_walk_parts(parts, temp_cutoff, threads, counted, assume_size)]
    keys = [key for part in done for key in part.keys]
    mtimes = np.fromiter((m for part in done for m in part.mtimes), dtype=np.int64,
                         count=len(keys))
    sizes = [size for part in done for size in part.sizes]
    return Walked(
        _pack(keys, sizes, mtimes),
        removed_temps=sum(part.removed_temps for part in done),
        unindexed=sum(part.unindexed for part in done),
        names_only=assume_size is not None,
    )


@dataclass
class _Block:
    """What one child found, unsorted: arrays as it sent them."""

    width: int
    lengths: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray
    keys: np.ndarray  # (count, width) uint8
    removed_temps: int
    unindexed: int


def walk_in_children(
    namespace_dir: Path,
    build: IndexBuild[Any],
    *,
    temp_cutoff: float,
    threads: int = DEFAULT_WALK_THREADS,
    processes: int = DEFAULT_WALK_PROCESSES,
    assume_size: int | None = None,
) -> Walked | None:
    """:func:`walk_namespace` with the fan-out directories walked by ``processes`` child
    processes (module docstring); ``None`` when a child could not be started or did not
    answer (logged) or the build was stopped: the caller walks in its own process or
    gives up. ``build.stop()`` kills the children. A names-only walk (``assume_size``)
    leaves the children running their stat pass: :attr:`Walked.stats`, whose owner
    collects or closes it (``build.stop()`` closes it too)."""
    top, parts = _list_parts(namespace_dir, temp_cutoff)
    count = max(1, min(processes, len(parts)))
    bounds = [len(parts) * i // count for i in range(count + 1)]
    blocks = [parts[bounds[i]:bounds[i + 1]] for i in range(count)]
    environ = dict(os.environ)
    environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    children: list[subprocess.Popen[bytes]] = []
    lock = threading.Lock()
    stats: ChildStats | None = None

    def kill_all() -> None:
        with lock:
            for child in children:
                if child.poll() is None:
                    child.kill()

    build.on_stop(kill_all)
    try:
        for block in blocks:
            if not block:
                continue
            args = [repr(temp_cutoff), str(threads),
                    "-" if assume_size is None else str(assume_size)]
            for path, _ in block:
                args.append(path)
            with lock:
                if build.stopping:
                    return None
                children.append(subprocess.Popen(
                    [sys.executable, "-m", __name__, *args],
                    stdin=subprocess.DEVNULL if assume_size is None else subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=environ,
                ))
    except OSError as exc:
        kill_all()
        logger.warning("file tier %s: could not start the walk's process (%s)",
                       namespace_dir, exc)
        return None
    try:
        with ThreadPoolExecutor(max(1, len(children)),
                                thread_name_prefix="kvtiers-file-walk-read") as pool:
            got = list(pool.map(lambda child: _read_child(child, build), children))
        found: list[_Block] = []
        for child, answer in zip(children, got, strict=True):
            if isinstance(answer, str):
                kill_all()
                child.wait()
                logger.warning("file tier %s: the walk's process failed (%s; exit status "
                               "%s)", namespace_dir, answer, child.returncode)
                return None
            found.append(answer)
        if build.stopping:
            return None
        names_only = assume_size is not None
        walked = _merge(top, found, names_only)
        walked.names_only = names_only
        if names_only:
            # The children go on with the stat pass; its owner collects or closes it.
            stats = walked.stats = ChildStats(
                top, [(child, len(block.lengths)) for child, block in zip(
                    children, found, strict=True)])
            build.on_stop(stats.close)
            stats.start()
        return walked
    finally:
        if stats is None:
            kill_all()
            for child in children:
                for stream in (child.stdin, child.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
                child.wait()


class ChildStats:
    """The stat pass of a names-only walk, running in its walking children: each child,
    once it sent its names and :meth:`start` told it to, ``lstat``-s its chunks and sends
    ``+``, their sizes (or :data:`STAT_MISSING`, :data:`STAT_NOT_REGULAR`) and mtimes
    (``<i8`` each) in the order of the keys it sent (``!`` and a message on an error).
    The chunks at the namespace's top were ``stat``-ed by the walk in this process.
    Thread-safe :meth:`close`."""

    def __init__(self, top: _Part, children: list[tuple[subprocess.Popen[bytes], int]]) -> None:
        self._top = (np.array(top.sizes, dtype=np.int64), np.array(top.mtimes, dtype=np.int64))
        self._children = children
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Tell the children to begin (``s`` on their stdin): only once every one has
        sent its names and they are merged, so a child that finished its names early
        takes no CPU from the others' before the index is usable. A child gone by then
        is found by :meth:`collect`."""
        for child, _ in self._children:
            if child.stdin is None:
                continue
            with contextlib.suppress(OSError):
                child.stdin.write(b"s")
                child.stdin.close()

    def collect(self) -> tuple[np.ndarray, np.ndarray] | str:
        """Wait for every child's stat pass: the sizes and mtimes of the walk's chunks in
        the order :func:`walk_in_children` packed them (its merge keeps the walk's order
        for a names-only walk), or why not (a child failed or was closed). Closes."""
        # Each child's answer is read straight into its slice: no copy of it is made.
        top_sizes, top_mtimes = self._top
        total = len(top_sizes) + sum(count for _, count in self._children)
        sizes, mtimes = anonymous_array(total, "<i8"), anonymous_array(total, "<i8")
        sizes[:len(top_sizes)], mtimes[:len(top_sizes)] = top_sizes, top_mtimes
        slices = []
        at = len(top_sizes)
        for child, count in self._children:
            slices.append((child, sizes[at:at + count], mtimes[at:at + count]))
            at += count
        try:
            with ThreadPoolExecutor(max(1, len(self._children)),
                                    thread_name_prefix="kvtiers-file-stat-read") as pool:
                failures = [f for f in pool.map(lambda job: _read_stats(*job), slices)
                            if f is not None]
        finally:
            self.close()
        return failures[0] if failures else (sizes, mtimes)

    def close(self) -> None:
        """Kill the children still running and reap them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for child, _ in self._children:
                if child.poll() is None:
                    child.kill()
        for child, _ in self._children:
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
            child.wait()


def _read_stats(
    child: subprocess.Popen[bytes], sizes: np.ndarray, mtimes: np.ndarray,
) -> str | None:
    """One child's stat pass (:class:`ChildStats`) read into ``sizes`` and ``mtimes``
    (``<i8``, its chunks' count each); why there is none, or ``None``."""
    stream = child.stdout
    assert stream is not None
    try:
        mark = stream.read(1)
        if mark == b"!":
            return stream.read().decode(errors="replace").strip() or "an error"
        if mark != b"+":
            return "it ended without its stat pass"
        _read_into(stream, sizes)
        _read_into(stream, mtimes)
    except (OSError, ValueError, EOFError) as exc:
        return f"its stat pass could not be read: {exc}"
    return None


def _read_into(stream: IO[bytes], out: np.ndarray) -> None:
    """Fill ``out`` (contiguous) from ``stream``; ``EOFError`` if it ends first."""
    view = out.data.cast("B")
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            raise EOFError(f"the answer ended after {got} of {len(view)} bytes")
        got += n


def _read_exact(stream: IO[bytes], nbytes: int) -> bytes:
    data = stream.read(nbytes)
    if len(data) != nbytes:
        raise EOFError(f"the answer ended after {len(data)} of {nbytes} bytes")
    return data


def _read_child(child: subprocess.Popen[bytes], build: IndexBuild[Any]) -> _Block | str:
    """One child's answer, or why there is none."""
    stream = child.stdout
    assert stream is not None
    try:
        while True:
            mark = stream.read(1)
            if mark == b".":
                build.part_done()
            elif mark == b"=":
                break
            elif mark == b"!":
                return stream.read().decode(errors="replace").strip() or "an error"
            else:
                return "it ended without an answer"
        count, width, removed, unindexed = _RESULT.unpack(_read_exact(stream, _RESULT.size))
        # Read on this thread, freed on the build's: in pages of their own.
        lengths, sizes, mtimes = (anonymous_array(count, "<u2"), anonymous_array(count, "<i8"),
                                  anonymous_array(count, "<i8"))
        keys = anonymous_array(width * count, "u1")
        for out in (lengths, sizes, mtimes, keys):
            _read_into(stream, out)
    except (OSError, EOFError, struct.error) as exc:
        return f"its answer could not be read: {exc}"
    return _Block(width, lengths, sizes, mtimes, keys.reshape(count, width), removed,
                  unindexed)


def _merge(top: _Part, blocks: list[_Block], names_only: bool = False) -> Walked:
    """The top part and the children's blocks, in part order, packed oldest first; a
    ``names_only`` walk's in the walk's order as they are (the children's stat pass sends
    its answers in that order: :class:`ChildStats`)."""
    width = max([block.width for block in blocks] + [len(key) for key in top.keys], default=0)
    total = len(top.keys) + sum(len(block.lengths) for block in blocks)
    matrix = np.zeros((total, width), dtype=np.uint8)
    lengths = np.empty(total, dtype=np.uint16)
    sizes = np.empty(total, dtype=np.int64)
    mtimes = np.empty(total, dtype=np.int64)
    at = 0
    for key, size, mtime in zip(top.keys, top.sizes, top.mtimes, strict=True):
        matrix[at, :len(key)] = np.frombuffer(key, dtype=np.uint8)
        lengths[at], sizes[at], mtimes[at] = len(key), size, mtime
        at += 1
    for block in blocks:
        n = len(block.lengths)
        matrix[at:at + n, :block.width] = block.keys
        lengths[at:at + n], sizes[at:at + n], mtimes[at:at + n] = (
            block.lengths, block.sizes, block.mtimes)
        at += n
    if names_only:
        mtimes[:] = 0  # the top's chunks were stat-ed; the walk's order is kept
    order = stable_order(mtimes)
    del mtimes
    key_bytes = sorted_rows(matrix, order)
    del matrix
    packed = PackedChunks.from_sorted(width, key_bytes, lengths[order], sizes[order])
    return Walked(
        packed,
        removed_temps=top.removed_temps + sum(block.removed_temps for block in blocks),
        unindexed=top.unindexed + sum(block.unindexed for block in blocks),
    )


def _child(argv: list[str]) -> int:
    """A walking child (module docstring): ``CUTOFF THREADS SIZE DIR...`` (``SIZE``: the
    names-only pass's assumed size, ``-`` to ``lstat`` every chunk). After a names-only
    pass's answer it waits for ``s`` on its stdin, then runs the stat pass and sends it
    (:class:`ChildStats`)."""
    out = sys.stdout.buffer
    lock = threading.Lock()
    try:
        temp_cutoff, threads = float(argv[0]), int(argv[1])
        assume_size = None if argv[2] == "-" else int(argv[2])
        parts = [(path, f"{os.path.basename(path)}/") for path in argv[3:]]

        def progress(i: int) -> bool:
            with lock:
                out.write(b".")
                out.flush()
            return True

        names_only = assume_size is not None
        done = _walk_parts(parts, temp_cutoff, threads, progress, assume_size,
                           keep_names=names_only)
        keys = [key for part in done for key in part.keys]
        width = max((len(key) for key in keys), default=0)
        padded = b"".join(keys) if all(len(k) == width for k in keys) else b"".join(
            key.ljust(width, b"\0") for key in keys)
        out.write(b"=" + _RESULT.pack(
            len(keys), width, sum(p.removed_temps for p in done), sum(p.unindexed for p in done)
        ))
        out.write(np.array([len(key) for key in keys], dtype="<u2").tobytes())
        out.write(np.array([size for part in done for size in part.sizes], dtype="<i8").tobytes())
        out.write(np.array([m for part in done for m in part.mtimes], dtype="<i8").tobytes())
        out.write(padded)
        out.flush()
        del keys, padded
        if names_only:
            # The stat pass waits for the parent's word (ChildStats.start): EOF means it
            # stopped the build or is gone.
            if sys.stdin.buffer.read(1) != b"s":
                return 1
            for part in done:
                part.keys = []  # sent: only the names are needed now
            stated = map_parts(lambda i: _stat_part(done[i]), len(done), threads,
                               name="kvtiers-file-stat")
            out.write(b"+")
            out.write(np.array([n for sizes, _ in stated for n in sizes],
                               dtype="<i8").tobytes())
            out.write(np.array([n for _, mtimes in stated for n in mtimes],
                               dtype="<i8").tobytes())
            out.flush()
    except BrokenPipeError:
        return 1  # the tier's process is gone or stopped the build
    except Exception as exc:  # reported to the parent, which walks in its own process
        out.write(f"!{type(exc).__name__}: {exc}".encode())
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
