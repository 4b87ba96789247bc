"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over a tier's evictable keys.

Two resident lists: ``T1`` (not used since insertion) and ``T2`` (used again: touched), each
oldest first, plus ghost lists ``B1`` / ``B2`` remembering keys recently evicted from each.
A key re-inserted while in a ghost list moves the target size ``p`` of ``T1``: a ``B1`` hit
grows it (recency pays), a ``B2`` hit shrinks it (frequency pays). Ghosts hold keys only;
together the four lists never exceed twice the capacity.

Where a tier's chunks differ from the paper's pages (each choice measured against the
paper's in ``benchmarks/results/hit_rate.md``):

- a re-inserted ghost enters ``T1`` like any stored key: a store is not a use; only
  ``touch`` (a load) moves a key to ``T2``;
- ``p`` moves at most one step each way per eviction round (from one :meth:`evict` call to
  the next): a prompt re-storing a run of remembered chunks is one miss, not one per chunk;
- the storing request's own keys (``shielded``, see ``shields_request_head``) stay, and
  while ``T1`` is over its target and holds them, no ``T2`` key is taken instead: a long
  once-seen prompt stores what ``T1`` has room for and keeps its head, and never flushes
  the keys that are used again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable
from typing import Any

from kvtiers.policies.base import EvictionPolicy
from kvtiers.policies.slots import FIRST, SECOND, UNTRACKED, TwoSlotLists


class SlotARC(TwoSlotLists):
    """:class:`~kvtiers.policies.arc.ARCPolicy` over slots: ``T1`` and ``T2`` are lists of
    slots; the ghost lists ``B1``/``B2`` keep keys (their slots hold other chunks now)."""

    shields_request_head = True

    def _start(self) -> None:
        super()._start()
        self._b1: OrderedDict[Any, None] = OrderedDict()
        self._b2: OrderedDict[Any, None] = OrderedDict()
        self._p = 0
        # Whether p has grown / shrunk in this eviction round.
        self._grown = False
        self._shrunk = False

    def insert(self, slot: int) -> None:
        b1 = self._b1
        b2 = self._b2
        if b1 or b2:
            key = self._keys[slot]
            if key in b1:
                if not self._grown:
                    self._grown = True
                    self._p = min(self.capacity, self._p + max(len(b2) // len(b1), 1))
                del b1[key]
            elif key in b2:
                if not self._shrunk:
                    self._shrunk = True
                    self._p = max(0, self._p - max(len(b1) // len(b2), 1))
                del b2[key]
        # _append, inlined: once per stored chunk.
        prev = self._prev
        nxt = self._next
        head = self._h1
        last = prev[head]
        nxt[last] = slot
        prev[slot] = last
        nxt[slot] = head
        prev[head] = slot
        self._where[slot] = FIRST
        self._len1 += 1
        if b1 or b2:
            self._trim_ghosts()

    def touch(self, slot: int) -> None:
        where = self._where[slot]
        if not where:
            return
        if where == FIRST:
            self._where[slot] = SECOND
            self._len1 -= 1
            self._len2 += 1
        self._move(slot, self._h2)

    def refresh(self, slot: int) -> None:
        where = self._where[slot]
        if where:
            self._move(slot, self._h1 if where == FIRST else self._h2)

    def _move(self, slot: int, head: int) -> None:
        """Unlink ``slot`` and link it as the newest of ``head``'s list (inlined: once per
        loaded chunk)."""
        prev = self._prev
        nxt = self._next
        before = prev[slot]
        after = nxt[slot]
        nxt[before] = after
        prev[after] = before
        last = prev[head]
        nxt[last] = slot
        prev[slot] = last
        nxt[slot] = head
        prev[head] = slot

    def evict(
        self, n: int, protected: Collection[Any] = (), shielded: Collection[Any] = ()
    ) -> list[int] | None:
        self._grown = self._shrunk = False
        if not shielded:
            return super().evict(n, protected)
        if n <= 0:
            return []
        picks = self._pick(n, protected, shielded)
        return self._take(picks) if len(picks) == n else None

    def evictable(self, protected: Collection[Any] = (), shielded: Collection[Any] = ()) -> int:
        if not shielded:
            return super().evictable(protected)
        return len(self._pick(len(self), protected, shielded))

    def _evict(self, n: int, protected: Collection[Any]) -> list[int]:
        return self._take(self._pick(n, protected, ()))

    def _pick(self, n: int, protected: Collection[Any], shielded: Collection[Any]) -> list[int]:
        """``ARCPolicy._pick`` over slots: up to ``n`` victims in eviction order (still
        tracked: ``_where`` tells which list each is on). Each list is walked through its
        links, past protected keys, without a generator: a batch of one is the usual."""
        nxt = self._next
        keys = self._keys
        h1 = self._h1
        h2 = self._h2
        p = self._p
        t1 = nxt[h1]
        while t1 is not h1 and keys[t1] in protected:
            t1 = nxt[t1]
        t2 = nxt[h2]
        while t2 is not h2 and keys[t2] in protected:
            t2 = nxt[t2]
        t1_size = self._len1
        holds_shielded: bool | None = None
        picks: list[int] = []
        while len(picks) < n:
            if t1 is not h1 and (t1_size > p or t2 is h2):
                picks.append(t1)
                t1_size -= 1
                t1 = nxt[t1]
                while t1 is not h1 and keys[t1] in protected:
                    t1 = nxt[t1]
                continue
            if t2 is h2:
                break
            if t1_size > p:
                if holds_shielded is None:
                    holds_shielded = self._t1_holds(shielded)
                if holds_shielded:
                    break
            picks.append(t2)
            t2 = nxt[t2]
            while t2 is not h2 and keys[t2] in protected:
                t2 = nxt[t2]
        return picks

    def _t1_holds(self, keys: Collection[Any]) -> bool:
        slot_of = self._slot_of
        where = self._where
        for key in keys:
            slot = slot_of(key)
            if slot is not None and slot >= 0 and where[slot] == FIRST:
                return True
        return False

    def _take(self, picks: list[int]) -> list[int]:
        """Stop tracking the picked slots, remembering each key in its list's ghost list."""
        keys = self._keys
        where = self._where
        prev = self._prev
        nxt = self._next
        for slot in picks:
            # _unlink, inlined: once per victim.
            before = prev[slot]
            after = nxt[slot]
            nxt[before] = after
            prev[after] = before
            if where[slot] == FIRST:
                self._len1 -= 1
                self._b1[keys[slot]] = None
            else:
                self._len2 -= 1
                self._b2[keys[slot]] = None
            where[slot] = UNTRACKED
        self._trim_ghosts()
        return picks

    def _trim_ghosts(self) -> None:
        b1 = self._b1
        b2 = self._b2
        while b1 and self._len1 + len(b1) > self.capacity:
            b1.popitem(last=False)
        while b2 and len(self) + len(b1) + len(b2) > 2 * self.capacity:
            b2.popitem(last=False)


class ARCPolicy(EvictionPolicy):
    """ARC with pin-aware eviction: protected keys are skipped, never demoted."""

    #: Its slot-indexed twin, which the CPU tier runs for this exact class.
    slot_twin = SlotARC

    shields_request_head = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[Any, None] = OrderedDict()
        self._t2: OrderedDict[Any, None] = OrderedDict()
        self._b1: OrderedDict[Any, None] = OrderedDict()
        self._b2: OrderedDict[Any, None] = OrderedDict()
        self._p = 0
        # Whether p has grown / shrunk in this eviction round.
        self._grown = False
        self._shrunk = False

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def insert(self, key: Hashable) -> None:
        if key in self._b1:
            if not self._grown:
                self._grown = True
                self._p = min(self.capacity, self._p + max(len(self._b2) // len(self._b1), 1))
            del self._b1[key]
        elif key in self._b2:
            if not self._shrunk:
                self._shrunk = True
                self._p = max(0, self._p - max(len(self._b1) // len(self._b2), 1))
            del self._b2[key]
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

    def evict(
        self, n: int, protected: Collection[Any] = (), shielded: Collection[Any] = ()
    ) -> list[Any] | None:
        self._grown = self._shrunk = False
        if not shielded:
            return super().evict(n, protected)
        if n <= 0:
            return []
        picks = self._pick(n, protected, shielded)
        return self._take(picks) if len(picks) == n else None

    def evictable(self, protected: Collection[Any] = (), shielded: Collection[Any] = ()) -> int:
        if not shielded:
            return super().evictable(protected)
        return len(self._pick(len(self), protected, shielded))

    def _evict(self, n: int, protected: Collection[Any]) -> list[Any]:
        return self._take(self._pick(n, protected, ()))

    def _pick(
        self, n: int, protected: Collection[Any], shielded: Collection[Any]
    ) -> list[tuple[Any, bool]]:
        """Up to ``n`` victims in eviction order, each with whether it comes from ``T1``;
        fewer where ``T1`` is over its target and every key left in it is protected, one of
        them ``shielded``. One pass over each list, oldest first: a batch costs what its
        victims and the protected keys skipped cost, not a scan per victim."""
        t1_free = (key for key in self._t1 if key not in protected)
        t2_free = (key for key in self._t2 if key not in protected)
        next_t1, next_t2 = next(t1_free, None), next(t2_free, None)
        t1_size = len(self._t1)
        # Whether T1 holds a shielded key: asked once, when T1 first runs out of victims.
        holds_shielded: bool | None = None
        picks: list[tuple[Any, bool]] = []
        while len(picks) < n:
            if next_t1 is not None and (t1_size > self._p or next_t2 is None):
                picks.append((next_t1, True))
                t1_size -= 1
                next_t1 = next(t1_free, None)
                continue
            if next_t2 is None:
                break
            if t1_size > self._p:
                if holds_shielded is None:
                    holds_shielded = any(key in self._t1 for key in shielded)
                if holds_shielded:
                    break
            picks.append((next_t2, False))
            next_t2 = next(t2_free, None)
        return picks

    def _take(self, picks: list[tuple[Any, bool]]) -> list[Any]:
        """Stop tracking the picked keys, remembering each in its list's ghost list."""
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
