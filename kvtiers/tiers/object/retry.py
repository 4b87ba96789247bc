"""Bounded retries with exponential backoff and full jitter, for object-store requests.

Attempt ``n`` (counting from 0) that fails transiently sleeps a uniformly random time in
``[0, min(max_s, base_s * 2**n))`` before the next one ("full jitter": many clients
throttled together spread out instead of retrying in lockstep). After ``max_attempts``
attempts in all the last error is raised. Non-transient errors are raised at once.
The sleep and the random source are injectable so tests are exact and fast.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")


class Retrier:
    """Runs a request until it succeeds, fails for good, or runs out of attempts."""

    def __init__(
        self,
        is_transient: Callable[[BaseException], bool],
        *,
        max_attempts: int = 5,
        base_s: float = 0.05,
        max_s: float = 2.0,
        sleep: Callable[[float], None] = time.sleep,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.is_transient = is_transient
        self.max_attempts = max_attempts
        self.base_s = base_s
        self.max_s = max_s
        self._sleep = sleep
        self._rng = rng
        self._lock = threading.Lock()
        self._retries = 0

    @property
    def retries(self) -> int:
        """Retries made so far (attempts after the first), over all calls."""
        return self._retries

    def delay_s(self, attempt: int) -> float:
        """The backoff before retry number ``attempt + 1``."""
        return self._rng() * min(self.max_s, self.base_s * (2.0**attempt))

    def call(self, request: Callable[[], _T]) -> _T:
        """``request()``, retried on transient errors."""
        attempt = 0
        while True:
            try:
                return request()
            except Exception as exc:
                attempt += 1
                if attempt >= self.max_attempts or not self.is_transient(exc):
                    raise
            with self._lock:
                self._retries += 1
            self._sleep(self.delay_s(attempt - 1))
