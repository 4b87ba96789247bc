"""Least-recently-used eviction: victims in the order their keys were last inserted or
touched, oldest first, skipping protected keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Any

from kvtiers.policies.base import EvictionPolicy
from kvtiers.policies.slots import FIRST, UNTRACKED, SlotLists


class SlotLRU(SlotLists):
    """:class:`~kvtiers.policies.lru.LRUPolicy` over slots: one list, oldest first."""

    recency = True
    shields_request_head = True

    def _start(self) -> None:
        (self._head,) = self._heads
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def insert(self, slot: int) -> None:
        # _append, inlined: once per stored chunk.
        prev = self._prev
        nxt = self._next
        head = self._head
        last = prev[head]
        nxt[last] = slot
        prev[slot] = last
        nxt[slot] = head
        prev[head] = slot
        self._where[slot] = FIRST
        self._len += 1

    def touch(self, slot: int) -> None:
        if not self._where[slot]:
            return
        # _unlink then _append, inlined: once per loaded chunk.
        prev = self._prev
        nxt = self._next
        head = self._head
        before = prev[slot]
        after = nxt[slot]
        nxt[before] = after
        prev[after] = before
        last = prev[head]
        nxt[last] = slot
        prev[slot] = last
        nxt[slot] = head
        prev[head] = slot

    # LRU ranks every slot alike: a refresh is a touch (bound as one, no second call).
    refresh = touch

    def remove(self, slot: int) -> None:
        if self._where[slot]:
            self._unlink(slot)
            self._where[slot] = UNTRACKED
            self._len -= 1

    def _evict(self, n: int, protected: Collection[Any]) -> list[int]:
        nxt = self._next
        prev = self._prev
        keys = self._keys
        where = self._where
        head = self._head
        victims: list[int] = []
        slot = nxt[head]
        while len(victims) < n:
            after = nxt[slot]
            if keys[slot] not in protected:
                before = prev[slot]
                nxt[before] = after
                prev[after] = before
                where[slot] = UNTRACKED
                victims.append(slot)
            slot = after
        self._len -= n
        return victims


class LRUPolicy(EvictionPolicy):
    """Classic LRU over an ordered dict (oldest first)."""

    #: Its slot-indexed twin, which the CPU tier runs for this exact class.
    slot_twin = SlotLRU

    recency = True
    shields_request_head = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Any, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def insert(self, key: Hashable) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def refresh(self, key: Hashable) -> None:
        self.touch(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def _evict(self, n: int, protected: Collection[Any]) -> list[Any]:
        victims: list[Any] = []
        for key in self._order:
            if key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        for key in victims:
            del self._order[key]
        return victims
