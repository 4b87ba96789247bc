"""A bounded pool of daemon I/O threads whose shutdown can give up on a stuck thread.

Movers run blocking I/O (file reads on a hung NFS server, requests to an object store)
on pool threads. ``concurrent.futures.ThreadPoolExecutor`` joins every worker thread at
interpreter exit, so one thread stuck in I/O keeps the process from ever exiting even
after its owner gave up on it. :class:`IOPool` offers the same ``submit`` with daemon
threads and a :meth:`IOPool.shutdown` that waits at most a given time: threads still
busy then are abandoned (they end on their own if their call ever returns, and never hold
up exit), and the caller is told so.

Two classes of work (docs/architecture.md, "Two classes of work"): a *foreground* pool
runs what a waiting request needs (loads, promotions, existence probes) at the engine's
priority; a *background* pool (``background=True``) runs write-behind (stores, cascades,
demotions, listings, deletions) with each of its threads' nice value raised by
:data:`BACKGROUND_NICE` above the engine's, so on a contended core the kernel gives it a
small share (about a tenth of an engine thread's) and on an idle one full speed. Keeping
the two apart also means a load never queues behind a store. On Linux a thread sets its
own nice value (``setpriority`` on its thread id; raising it needs no privilege);
elsewhere priorities are left alone (``setpriority`` there would change the whole
process).

Invariants: tasks start in submission order, at most ``threads`` at once; after
:meth:`IOPool.shutdown` no task can be submitted, and none starts once its wait is over
(queued ones are then cancelled); a task's exception is kept in its future, never lost
in the thread.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]

logger = logging.getLogger(__name__)

#: How far above the engine's nice value background threads run. At nice +10 the kernel
#: gives a busy background thread about a tenth of the share of an engine thread on the
#: same core, yet it still runs on idle CPU at full speed.
BACKGROUND_NICE = 10

#: Whether threads can have priorities of their own here (Linux: per-thread nice values).
THREAD_PRIORITIES = sys.platform == "linux"
#: The highest nice value (the lowest priority) there is.
MAX_NICE = 19


def background_nice(engine: int) -> int:
    """The nice value of write-behind threads beside an engine thread at ``engine``."""
    return min(MAX_NICE, engine + BACKGROUND_NICE)


def thread_nice() -> int:
    """The calling thread's nice value (the process's where threads have none of their
    own; 0 where there are none)."""
    if THREAD_PRIORITIES:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if not hasattr(os, "getpriority"):  # Windows: no nice values
        return 0
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_thread_nice(nice: int) -> bool:
    """Set the calling thread's nice value; True when it now has it. Raising it always
    works; lowering it needs a privilege the engine may lack (then False, unchanged)."""
    if not THREAD_PRIORITIES:
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


def background_initializer(nice: int | None = None) -> Callable[[], None]:
    """A thread initializer (e.g. ``ThreadPoolExecutor(initializer=...)``) that puts its
    thread in the background class: ``nice`` (default: the caller's nice value plus
    :data:`BACKGROUND_NICE`, taken now, on the caller's thread)."""
    target = background_nice(thread_nice()) if nice is None else nice

    def initializer() -> None:
        set_thread_nice(target)

    return initializer


class IOPool:
    """``threads`` daemon threads named ``<name>-<n>``, started as work arrives.

    The pool's priority is taken from the thread that makes it (the engine's): a
    foreground pool's threads run at that nice value (one started by a background thread
    asks for it back, which works where the engine may lower nice values); a background
    pool's threads at :data:`BACKGROUND_NICE` above it. :attr:`nice` is the value its
    threads ask for.
    """

    def __init__(self, threads: int, name: str, *, background: bool = False) -> None:
        if threads < 1:
            raise ValueError(f"an I/O pool needs at least one thread, got {threads}")
        self._max = threads
        self._name = name
        self.background = background
        engine = thread_nice()
        self.nice = background_nice(engine) if background else engine
        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Run ``fn(*args)`` on a pool thread. Raises ``RuntimeError`` once shut down."""
        future: Future[_T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot submit after shutdown")
            self._queue.put((future, fn, args))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._max:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _run(self) -> None:
        if thread_nice() != self.nice and not set_thread_nice(self.nice):
            logger.debug("%s: thread runs at nice %d, not %d", self._name, thread_nice(),
                         self.nice)
        while True:
            task = self._queue.get()
            if task is None:
                return
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            with self._lock:
                self._idle += 1

    def shutdown(self, timeout_s: float | None = None, *, cancel_queued: bool = False) -> bool:
        """Stop taking work and wait for the threads at most ``timeout_s`` seconds
        (``None``: for ever). Queued tasks still run within that time unless
        ``cancel_queued``; whatever has not started when the time is up is cancelled.
        True when every thread has ended; False when some are still busy and have been
        abandoned. Idempotent."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_queued:
            self._cancel_queued()
        for _ in threads:
            self._queue.put(None)
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        alive = sum(thread.is_alive() for thread in threads)
        if alive:
            self._cancel_queued()
            # The stop signals just drained, again for each thread still running a task.
            for _ in range(alive):
                self._queue.put(None)
        return not alive

    def _cancel_queued(self) -> None:
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                return
            if task is not None:
                task[0].cancel()
