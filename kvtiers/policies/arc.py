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


def _oldest_unprotected(order: OrderedDict[Any, None], protected: Collection[Any]) -> Any:
    return next((key for key in order if key not in protected), None)


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
        victims: list[Any] = []
        while len(victims) < n:
            from_t1 = _oldest_unprotected(self._t1, protected)
            from_t2 = _oldest_unprotected(self._t2, protected)
            if from_t1 is not None and (len(self._t1) > self._p or from_t2 is None):
                del self._t1[from_t1]
                self._b1[from_t1] = None
                victims.append(from_t1)
            else:
                del self._t2[from_t2]
                self._b2[from_t2] = None
                victims.append(from_t2)
        self._trim_ghosts()
        return victims

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * self.capacity:
            self._b2.popitem(last=False)
