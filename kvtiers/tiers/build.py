"""A persistent tier's index built in the background: :class:`IndexBuild`.

A file or object tier serves from its first call; the chunks already in its medium are
found on a thread of their own (a walk of the fan-out directories, listings by key
prefix, or a snapshot) and packed there into a
:class:`~kvtiers.tiers.compact.PackedChunks`, oldest first. The manager takes the result
in on its scheduler's thread with
:meth:`~kvtiers.tiers.compact.CompactChunkIndex.merge_oldest` once :attr:`IndexBuild.done`
is set; until then an index miss is answered by a batched existence probe, as a shared
namespace answers one (docs/architecture.md, "Start-up").

Invariants: ``work`` runs once, on the build's thread, and its result or its exception is
kept (never raised on that thread); :attr:`done` is set after either; ``stop`` asks the
work to end early (it checks :attr:`stopping` between parts, and the actions it gave
:meth:`IndexBuild.on_stop` run, such as killing a child process it waits on) and waits
for the thread a bounded time (a walk stuck in a filesystem call is left behind, a daemon
thread).
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar, cast

import numpy as np

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long :meth:`IndexBuild.stop` waits for the work's current part.
STOP_TIMEOUT_S = 5.0


class IndexBuild(Generic[_T]):
    """``work(self)`` on a daemon thread named ``name``; see the module docstring."""

    def __init__(self, work: Callable[[IndexBuild[_T]], _T], *, name: str) -> None:
        self.done = threading.Event()
        self.result: _T | None = None
        self.error: BaseException | None = None
        #: Parts of the medium covered so far (fan-out directories, prefixes).
        self.parts_done = 0
        self.started = time.perf_counter()
        #: Seconds from start to :attr:`done` (``None`` until then).
        self.elapsed_s: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._on_stop: list[Callable[[], None]] = []
        self._work = work
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def part_done(self) -> None:
        """Count one part covered (any thread)."""
        with self._lock:
            self.parts_done += 1

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called (the work ends at its next part)."""
        return self._stop.is_set()

    def on_stop(self, action: Callable[[], None]) -> None:
        """Run ``action`` when :meth:`stop` is called, or now if it was: for work that
        waits outside Python (a child process), which ``stopping`` cannot reach."""
        with self._lock:
            if not self._stop.is_set():
                self._on_stop.append(action)
                return
        action()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the work to end and wait for it, at most ``timeout_s``."""
        with self._lock:
            self._stop.set()
            actions, self._on_stop = self._on_stop, []
        for action in actions:
            action()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("%s: still running %g s after it was asked to stop; left behind",
                           self._thread.name, timeout_s)

    def _run(self) -> None:
        try:
            self.result = self._work(self)
        except BaseException as exc:  # kept for the scheduler's thread, which decides
            self.error = exc
        finally:
            self.elapsed_s = time.perf_counter() - self.started
            release_free_memory()
            self.done.set()


def release_free_memory() -> None:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim``;
    nothing elsewhere). A build frees arrays of tens of megabytes that glibc keeps in its
    heaps once its mmap threshold has grown; without this the tier's process keeps about
    100 bytes a chunk it no longer uses (benchmarks/results/scale.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def anonymous_array(count: int, dtype: str) -> np.ndarray:
    """A zero-filled array of ``count`` items in pages of its own (an anonymous
    mapping), handed back to the system when the array is freed. For a build's large
    buffers filled on threads other than the scheduler's: glibc serves those from the
    thread's own heap, and a freed block at the top of such a heap stays resident
    (``malloc_trim`` does not reach it): about 36 B a chunk at 1M chunks, the walking
    children's answers read on two threads (benchmarks/results/scale.md)."""
    kind = np.dtype(dtype)
    if count == 0:
        return np.zeros(0, dtype=kind)
    return np.frombuffer(mmap.mmap(-1, count * kind.itemsize), dtype=kind)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return cast("Callable[[int], int]", ctypes.CDLL(None).malloc_trim)
    except (OSError, AttributeError):  # not glibc
        return None
