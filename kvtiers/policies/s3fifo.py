"""S3-FIFO (Yang et al., SOSP 2023): a small probationary FIFO, a main FIFO and a ghost FIFO.

New keys enter the small queue (about 10% of capacity). Each use bumps a 2-bit frequency.
Evicting from the small queue promotes keys used more than once to the main queue and
drops the rest (remembered in the ghost queue, so a quick re-insert goes straight to
main). Evicting from the main queue gives keys with a non-zero frequency another lap
(frequency minus one) and drops the rest. Protected keys are never dropped: they are
moved to the tail of the main queue with their frequency intact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Any

from kvtiers.policies.base import EvictionPolicy

_MAX_FREQ = 3
_SMALL_FRACTION = 0.1


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with pin-aware eviction."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[Any, int] = OrderedDict()
        self._main: OrderedDict[Any, int] = OrderedDict()
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._small_target = max(1, int(capacity * _SMALL_FRACTION))

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, key: object) -> bool:
        return key in self._small or key in self._main

    def insert(self, key: Hashable) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = 0
        else:
            self._small[key] = 0

    def touch(self, key: Hashable) -> None:
        if key in self._small:
            self._small[key] = min(self._small[key] + 1, _MAX_FREQ)
        elif key in self._main:
            self._main[key] = min(self._main[key] + 1, _MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        self._small.pop(key, None)
        self._main.pop(key, None)

    def _evict(self, n: int, protected: Collection[Any]) -> list[Any]:
        victims: list[Any] = []
        # Consecutive protected keys met at the head of main: once a whole lap of main is
        # protected, only the small queue can yield a victim.
        main_skips = 0
        while len(victims) < n:
            use_small = self._small and (
                len(self._small) >= self._small_target
                or not self._main
                or main_skips >= len(self._main)
            )
            if use_small:
                key, freq = self._small.popitem(last=False)
                if freq > 1 or key in protected:
                    self._main[key] = freq
                else:
                    self._remember(key)
                    victims.append(key)
                continue
            key, freq = self._main.popitem(last=False)
            if key in protected:
                self._main[key] = freq
                main_skips += 1
            elif freq > 0:
                self._main[key] = freq - 1
                main_skips = 0
            else:
                victims.append(key)
                main_skips = 0
        return victims

    def _remember(self, key: Any) -> None:
        self._ghost[key] = None
        while len(self._ghost) > self.capacity:
            self._ghost.popitem(last=False)
