"""Least-recently-used eviction: victims in the order their keys were last inserted or
touched, oldest first, skipping protected keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Any

from kvtiers.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Classic LRU over an ordered dict (oldest first)."""

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
