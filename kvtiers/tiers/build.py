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
work to end early (it checks :attr:`stopping` between parts) and waits for the thread a
bounded time (a walk stuck in a filesystem call is left behind, a daemon thread).

:class:`TakesBuiltIndex` is the managers' side of it, written once: it takes a finished
build in on the scheduler's thread, with the keys its index removed meanwhile, and says
whether the index is complete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from kvtiers.core.keys import OffloadKey
    from kvtiers.tiers.compact import CompactChunkIndex

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

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the work to end and wait for it, at most ``timeout_s``."""
        self._stop.set()
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
            self.done.set()


class TakesBuiltIndex(Generic[_T]):
    """A manager whose :class:`~kvtiers.tiers.compact.CompactChunkIndex` ``index`` is
    built in the background by ``_build``: :meth:`_poll_build` (scheduler's thread; O(1)
    until the build is done) hands a successful build's result to :meth:`_merge_build`
    with the keys the index removed while it ran, and the index is complete after;
    a failed build is logged and index misses stay probed."""

    index: CompactChunkIndex
    _build: IndexBuild[_T] | None
    _complete: bool
    #: Seconds the build took (``None`` until it is merged).
    index_build_s: float | None

    @property
    def index_complete(self) -> bool:
        """Whether every chunk found at start is indexed (the build was merged)."""
        return self._complete

    def wait_index(self) -> None:
        """Block until the index is built, then merge it. For tests and tools: the
        scheduler never blocks (its calls merge the build once it is done)."""
        if self._build is not None:
            self._build.done.wait()
            self._poll_build()

    def _poll_build(self) -> None:
        """Merge the build once it is done (see the class docstring)."""
        build = self._build
        if build is None or not build.done.is_set():
            return
        self._build = None
        index = self.index
        gone = index.removed or set()
        index.removed = None
        if build.error is not None or build.result is None:
            logger.error("%s: the index could not be built (%s); index misses stay probed",
                         index.tier, build.error)
            return
        self.index_build_s = build.elapsed_s
        self._merge_build(build.result, gone)
        self._complete = True

    def _merge_build(self, result: _T, gone: set[OffloadKey]) -> None:
        """Take ``result`` in as the least recently used entries (merge_oldest), leaving
        out ``gone``; :attr:`index_build_s` is set."""
        raise NotImplementedError
