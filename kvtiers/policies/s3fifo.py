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
from kvtiers.policies.slots import FIRST, SECOND, UNTRACKED, TwoSlotLists

_MAX_FREQ = 3
_SMALL_FRACTION = 0.1


class SlotS3FIFO(TwoSlotLists):
    """:class:`~kvtiers.policies.s3fifo.S3FIFOPolicy` over slots: the small and main
    queues are lists of slots with a 2-bit frequency per slot (the small queue is
    ``FIRST``, counted in ``_len1``; the main queue ``SECOND``, in ``_len2``); the ghost
    queue keeps keys."""

    def _start(self) -> None:
        super()._start()
        self._small, self._main = self._h1, self._h2
        self._freq = bytearray(self.capacity)
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._small_target = max(1, int(self.capacity * _SMALL_FRACTION))

    def insert(self, slot: int) -> None:
        key = self._keys[slot]
        self._freq[slot] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._to_main(slot)
        else:
            self._append(slot, self._small)
            self._where[slot] = FIRST
            self._len1 += 1

    def touch(self, slot: int) -> None:
        if self._where[slot]:
            self._freq[slot] = min(self._freq[slot] + 1, _MAX_FREQ)

    def refresh(self, slot: int) -> None:
        """A FIFO has no recency to move."""

    def _to_main(self, slot: int) -> None:
        self._append(slot, self._main)
        self._where[slot] = SECOND
        self._len2 += 1

    def _pop(self, head: int) -> int:
        """Unlink and return the oldest slot of ``head``'s list (not empty)."""
        slot = self._next[head]
        self._unlink(slot)
        self._where[slot] = UNTRACKED
        if head is self._small:
            self._len1 -= 1
        else:
            self._len2 -= 1
        return slot

    def _evict(self, n: int, protected: Collection[Any]) -> list[int]:
        keys = self._keys
        freq = self._freq
        victims: list[int] = []
        # Consecutive protected keys met at the head of main: once a whole lap of main is
        # protected, only the small queue can yield a victim.
        main_skips = 0
        while len(victims) < n:
            use_small = self._len1 and (
                self._len1 >= self._small_target
                or not self._len2
                or main_skips >= self._len2
            )
            if use_small:
                slot = self._pop(self._small)
                if freq[slot] > 1 or keys[slot] in protected:
                    self._to_main(slot)
                else:
                    self._remember(keys[slot])
                    victims.append(slot)
                continue
            slot = self._pop(self._main)
            if keys[slot] in protected:
                self._to_main(slot)
                main_skips += 1
            elif freq[slot] > 0:
                freq[slot] -= 1
                self._to_main(slot)
                main_skips = 0
            else:
                victims.append(slot)
                main_skips = 0
        return victims

    def _remember(self, key: Any) -> None:
        ghost = self._ghost
        ghost[key] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO with pin-aware eviction."""

    #: Its slot-indexed twin, which the CPU tier runs for this exact class.
    slot_twin = SlotS3FIFO

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
