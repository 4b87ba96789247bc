"""The probe book of a shared namespace: which index misses to check in the medium.

When other engines write into the same namespace, a key this tier's index lacks may
exist anyway. The manager asks the book on each such miss: a fresh negative answer makes
it a ``MISS``; otherwise the key is queued (``RETRY``) and the manager sends the queued
keys as one batch per scheduler step to its I/O pool, handing the answers back here.

Invariants: a key is queued at most once and never while its probe is in flight; a
negative answer is trusted for ``negative_ttl_s`` of the injected clock; the remembered
negative answers are pruned of expired ones whenever more than ``prune_at`` are held, so
their number stays bounded by ``prune_at`` plus the misses of one TTL. No threads, no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvtiers.core.keys import OffloadKey

#: How long a probe's "not there" answer is trusted, in seconds.
DEFAULT_NEGATIVE_TTL_S = 1.0
#: Remembered negative answers are pruned of expired ones beyond this many.
DEFAULT_PRUNE_AT = 4096


class ProbeBook:
    """Queued probes, probes in flight and remembered negative answers; see the module
    docstring. ``probes`` counts the keys sent."""

    def __init__(
        self,
        *,
        negative_ttl_s: float = DEFAULT_NEGATIVE_TTL_S,
        prune_at: int = DEFAULT_PRUNE_AT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if negative_ttl_s < 0:
            raise ValueError(f"probe book: negative_ttl_s must be >= 0, got {negative_ttl_s}")
        if prune_at < 0:
            raise ValueError(f"probe book: prune_at must be >= 0, got {prune_at}")
        self.negative_ttl_s = negative_ttl_s
        self.prune_at = prune_at
        self.probes = 0
        self._clock = clock
        self._queued: dict[OffloadKey, None] = {}
        self._in_flight: set[OffloadKey] = set()
        self._negative: dict[OffloadKey, float] = {}

    @property
    def pending(self) -> bool:
        """Whether a probe is queued or in flight."""
        return bool(self._queued or self._in_flight)

    @property
    def remembered(self) -> int:
        """How many negative answers are held (expired ones until the next pruning)."""
        return len(self._negative)

    def known_absent(self, key: OffloadKey) -> bool:
        """True while a negative answer for ``key`` is fresh (a ``MISS``). Otherwise the
        key is queued for the next batch unless already queued or in flight, and the
        answer is False (``RETRY``)."""
        expiry = self._negative.get(key)
        if expiry is not None:
            if self._clock() < expiry:
                return True
            del self._negative[key]
        if key not in self._in_flight:
            self._queued[key] = None
        return False

    def take_batch(self) -> list[OffloadKey]:
        """The queued keys, now in flight (empty when none are queued)."""
        if not self._queued:
            return []
        batch = list(self._queued)
        self._queued = {}
        self._in_flight.update(batch)
        self.probes += len(batch)
        return batch

    def answered(
        self, results: Iterable[tuple[OffloadKey, int | None]]
    ) -> list[tuple[OffloadKey, int]]:
        """Take probe answers ``(key, size or None when absent)``; returns the keys found
        with their sizes, in answer order. Absent ones are remembered for the TTL."""
        found = []
        expiry: float | None = None
        for key, size in results:
            self._in_flight.discard(key)
            if size is not None:
                found.append((key, size))
                continue
            if expiry is None:
                expiry = self._clock() + self.negative_ttl_s
            self._negative[key] = expiry
        if len(self._negative) > self.prune_at:
            now = self._clock()
            self._negative = {k: t for k, t in self._negative.items() if t > now}
        return found

    def stored(self, key: OffloadKey) -> None:
        """``key`` is being stored here: forget any negative answer for it."""
        self._negative.pop(key, None)

    def reset(self) -> None:
        """Drop queued probes and negative answers (probes in flight still answer)."""
        self._queued.clear()
        self._negative.clear()
