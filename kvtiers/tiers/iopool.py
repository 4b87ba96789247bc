"""A bounded pool of daemon I/O threads whose shutdown can give up on a stuck thread.

Movers run blocking I/O (file reads on a hung NFS server, requests to an object store)
on pool threads. ``concurrent.futures.ThreadPoolExecutor`` joins every worker thread at
interpreter exit, so one thread stuck in I/O keeps the process from ever exiting even
after its owner gave up on it. :class:`IOPool` offers the same ``submit`` with daemon
threads and a :meth:`IOPool.shutdown` that waits at most a given time: threads still
busy then are abandoned (they end on their own if their call ever returns, and never hold
up exit), and the caller is told so.

Invariants: tasks start in submission order, at most ``threads`` at once; after
:meth:`IOPool.shutdown` no task can be submitted, and none starts once its wait is over
(queued ones are then cancelled); a task's exception is kept in its future, never lost
in the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class IOPool:
    """``threads`` daemon threads named ``<name>-<n>``, started as work arrives."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"an I/O pool needs at least one thread, got {threads}")
        self._max = threads
        self._name = name
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
