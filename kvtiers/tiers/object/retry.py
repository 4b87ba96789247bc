"""Bounded retries with exponential backoff and full jitter, under one overall deadline,
for object-store requests.

Attempt ``n`` (counting from 0) that fails transiently sleeps a uniformly random time in
``[0, min(max_s, base_s * 2**n))`` before the next one ("full jitter": many clients
throttled together spread out instead of retrying in lockstep). After ``max_attempts``
attempts in all the last error is raised. Non-transient errors are raised at once.

Every call also has a deadline, ``deadline_s`` after it starts: no attempt starts and no
back-off sleeps past it (the call raises :class:`OperationDeadlineError` instead), and
while an attempt runs :func:`remaining_s` tells the store on the calling thread how long
it may still take, so a store caps its own socket timeouts by it. A store that honours
:func:`remaining_s` therefore makes a whole call, attempts and back-off together, end
within ``deadline_s`` (plus the scheduling slack of one socket wake-up).

The sleep, the random source and the clock are injectable so tests are exact and fast.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


#: The overall deadline of one operation when none is configured (``op_deadline_s``).
DEFAULT_OP_DEADLINE_S = 30.0

_local = threading.local()


class OperationDeadlineError(TimeoutError):
    """An operation's attempts and back-off used up its deadline; the message says how
    many attempts ran and what the last one failed with."""


def remaining_s() -> float | None:
    """Seconds left to the deadline of the :meth:`Retrier.call` running on this thread
    (0.0 once passed), or ``None`` outside one. Stores cap their socket timeouts by it."""
    current = getattr(_local, "deadline", None)
    if current is None:
        return None
    clock, deadline = current
    return max(0.0, deadline - clock())


class Retrier:
    """Runs a request until it succeeds, fails for good, runs out of attempts or reaches
    its deadline."""

    def __init__(
        self,
        is_transient: Callable[[BaseException], bool],
        *,
        max_attempts: int = 5,
        base_s: float = 0.05,
        max_s: float = 2.0,
        deadline_s: float = DEFAULT_OP_DEADLINE_S,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        self.is_transient = is_transient
        self.max_attempts = max_attempts
        self.base_s = base_s
        self.max_s = max_s
        self.deadline_s = deadline_s
        self._sleep = sleep
        self._rng = rng
        self._clock = clock
        self._lock = threading.Lock()
        self._retries = 0

    @property
    def retries(self) -> int:
        """Retries made so far (attempts after the first), over all calls."""
        return self._retries

    def delay_s(self, attempt: int) -> float:
        """The backoff before retry number ``attempt + 1``."""
        return self._rng() * min(self.max_s, self.base_s * (2.0**attempt))

    def call(self, request: Callable[[], _T], *, bounded: bool = True) -> _T:
        """``request()``, retried on transient errors within :attr:`deadline_s`.

        Raises the request's own error when it is permanent or attempts run out, and
        :class:`OperationDeadlineError` (chained to the last error) when the next
        back-off would end past the deadline or an attempt ended there. ``bounded=False``
        is for requests made of many round trips whose total is not one operation (the
        start-up listing of a namespace): no overall deadline, each round trip bounded by
        the store's own timeouts."""
        outer = getattr(_local, "deadline", None)
        if bounded:
            deadline = self._clock() + self.deadline_s
            # A nested call never outlives the call around it.
            if outer is not None and outer[0] is self._clock:
                deadline = min(deadline, outer[1])
            _local.deadline = (self._clock, deadline)
        else:
            deadline = math.inf
            _local.deadline = None
        try:
            return self._attempts(request, deadline)
        finally:
            _local.deadline = outer

    def _attempts(self, request: Callable[[], _T], deadline: float) -> _T:
        attempt = 0
        while True:
            try:
                return request()
            except Exception as exc:
                attempt += 1
                if attempt >= self.max_attempts or not self.is_transient(exc):
                    raise
                delay = self.delay_s(attempt - 1)
                if self._clock() + delay >= deadline:
                    raise OperationDeadlineError(
                        f"gave up after {attempt} attempt(s) within the {self.deadline_s:g} s "
                        f"operation deadline (op_deadline_s); last error: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
            with self._lock:
                self._retries += 1
            self._sleep(delay)
