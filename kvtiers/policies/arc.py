"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over a tier's evictable keys.

Two resident lists: ``T1`` (seen once since insertion) and ``T2`` (used again), each oldest
first, plus ghost lists ``B1`` / ``B2`` remembering keys recently evicted from each. A key
re-inserted while in a ghost list goes straight to ``T2`` and moves the target size ``p``
of ``T1``: a ``B1`` hit grows it (recency pays), a ``B2`` hit shrinks it (frequency pays).
Ghosts hold keys only; together the four lists never exceed twice the capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Any

from kvtiers.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    """ARC with pin-aware eviction: protected keys are skipped, never demoted."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Any, None] = OrderedDict()
        self._t2: OrderedDict[Any, None] = OrderedDict()
        self._b1: OrderedDict[Any, None] = OrderedDict()
        self._b2: OrderedDict[Any, None] = OrderedDict()
        self._p = 0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def insert(self, key: Hashable) -> None:
        if key in self._b1:
            self._p = min(self.capacity, self._p + max(len(self._b2) // len(self._b1), 1))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0, self._p - max(len(self._b1) // len(self._b2), 1))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        """Most recent within its own list: a store is not a second use."""
        if key in self._t1:
            self._t1.move_to_end(key)
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def _evict(self, n: int, protected: Collection[Any]) -> list[Any]:
        # Pick first (one pass over each list, oldest first), then move: a batch costs
        # what its victims and the protected keys skipped cost, not a scan per victim.
        t1_free = (key for key in self._t1 if key not in protected)
        t2_free = (key for key in self._t2 if key not in protected)
        next_t1, next_t2 = next(t1_free, None), next(t2_free, None)
        t1_size = len(self._t1)
        picks: list[tuple[Any, bool]] = []
        while len(picks) < n:
            if next_t1 is not None and (t1_size > self._p or next_t2 is None):
                picks.append((next_t1, True))
                t1_size -= 1
                next_t1 = next(t1_free, None)
            else:
                picks.append((next_t2, False))
                next_t2 = next(t2_free, None)
        victims: list[Any] = []
        for key, from_t1 in picks:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
            victims.append(key)
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            self._b2.popitem(last=False)
