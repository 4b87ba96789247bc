"""Eviction orders over slot ids: the built-in policies as the CPU tier runs them.

A tier whose chunks live in numbered slots (the CPU tier) already keeps one hash table,
key → slot. A key-based policy (:class:`~kvtiers.policies.base.EvictionPolicy`) keeps a
second one, key → its node, which doubles the memory per chunk once churn has made CPython
regrow both. A :class:`SlotOrder` keeps its order in arrays indexed by slot instead: a
doubly linked list through ``prev``/``next`` lists of slot ids (one sentinel per list, past
the last slot), one byte per slot for the list a slot is on, and reads a slot's key from
the tier's slot → key list only where keys matter (protected keys, ghosts). It stores the
tier's own slot int objects, never new ones, so an entry costs two list pointers.

- :class:`SlotLRU`, :class:`SlotARC` and :class:`SlotS3FIFO` are the exact twins of
  ``LRUPolicy``, ``ARCPolicy`` and ``S3FIFOPolicy``: the same operations pick the same
  victims in the same order (``tests/test_slot_orders.py`` replays random operation
  sequences through both). Their ghosts (keys of chunks already evicted) stay keyed by key.
- :class:`KeyOrder` runs any other policy (a ``package.module:Class`` policy, or a
  subclass of a built-in, which may override its rules) through its key-based API.
- :func:`slot_order` picks between them.

Invariants are :class:`~kvtiers.policies.base.EvictionPolicy`'s, with slots for keys: a
slot is tracked once between :meth:`SlotOrder.insert` and its removal; ``evict`` is atomic
(exactly ``n`` unprotected slots, or ``None`` and no change); ``evictable`` is the largest
``n`` for which it succeeds. The tier keeps ``keys[slot]`` set while the slot is tracked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from kvtiers.policies.arc import ARCPolicy
from kvtiers.policies.base import EvictionPolicy
from kvtiers.policies.lru import LRUPolicy
from kvtiers.policies.s3fifo import _MAX_FREQ, _SMALL_FRACTION, S3FIFOPolicy

#: Where a tracked slot is: ``_NONE`` is not tracked; the others name one of a policy's lists.
_NONE = 0
_FIRST = 1
_SECOND = 2


class SlotOrder(ABC):
    """Orders a tier's evictable slots. ``num_slots`` bounds the slot ids; ``keys`` is the
    tier's slot → key list and ``slot_of`` its key → slot lookup (``None``: no slot), both
    read, never written.

    ``recency`` and ``shields_request_head`` are the policy's (see
    :class:`~kvtiers.policies.base.EvictionPolicy`). ``protected`` and ``shielded`` are
    collections of *keys*, as the tier gets them from its callers."""

    recency: bool = False
    shields_request_head: bool = False

    def __init__(
        self,
        num_slots: int,
        keys: Sequence[Any],
        slot_of: Callable[[Any], int | None],
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"a slot order needs a positive number of slots, got {num_slots}")
        self.capacity = num_slots
        self._keys = keys
        self._slot_of = slot_of

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked slots."""

    @abstractmethod
    def tracks(self, key: Any) -> bool:
        """Whether ``key``'s slot is tracked."""

    @abstractmethod
    def insert(self, slot: int) -> None:
        """Start tracking ``slot`` (not tracked yet; ``keys[slot]`` is its key)."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """``slot`` was used. An untracked slot is ignored."""

    @abstractmethod
    def refresh(self, slot: int) -> None:
        """Most recent among the slots it ranks with, without a use. Untracked: ignored."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """Stop tracking ``slot`` without an eviction. Untracked: ignored."""

    def evict(
        self, n: int, protected: Collection[Any] = (), shielded: Collection[Any] = ()
    ) -> list[int] | None:
        """Exactly ``n`` victim slots, none holding a key in ``protected``, or ``None`` (no
        change); ``shielded`` as in :meth:`EvictionPolicy.evict`."""
        if n <= 0:
            return []
        if len(self) - len(protected) < n and self._free_count(protected) < n:
            return None
        victims = self._evict(n, protected)
        assert len(victims) == n, f"{type(self).__name__} returned {len(victims)} of {n}"
        return victims

    def evictable(self, protected: Collection[Any] = (), shielded: Collection[Any] = ()) -> int:
        """The most victims one :meth:`evict` call with these arguments could take."""
        return self._free_count(protected)

    def _free_count(self, protected: Collection[Any]) -> int:
        """Tracked slots whose keys are not in ``protected``."""
        tracks = self.tracks
        return len(self) - sum(1 for key in set(protected) if tracks(key))

    @abstractmethod
    def _evict(self, n: int, protected: Collection[Any]) -> list[int]:
        """Pick and stop tracking ``n`` unprotected slots; at least ``n`` exist."""


class _Lists(SlotOrder):
    """Doubly linked lists of slots through shared ``prev``/``next`` arrays, one sentinel
    id per list past the last slot (``num_slots``, ``num_slots + 1``, …), oldest first
    after the sentinel. ``_where[slot]`` names the list a slot is on (``_NONE``: none)."""

    _lists = 1

    def __init__(
        self,
        num_slots: int,
        keys: Sequence[Any],
        slot_of: Callable[[Any], int | None],
    ) -> None:
        super().__init__(num_slots, keys, slot_of)
        # The sentinels are the only ids made here: list entries are always these objects
        # or the tier's own slot ints, so an id costs a pointer, and `is` compares them.
        self._heads = tuple(range(num_slots, num_slots + self._lists))
        size = num_slots + self._lists
        self._prev: list[int] = [0] * size
        self._next: list[int] = [0] * size
        for head in self._heads:
            self._prev[head] = self._next[head] = head
        self._where = bytearray(size)

    def tracks(self, key: Any) -> bool:
        slot = self._slot_of(key)
        return slot is not None and slot >= 0 and self._where[slot] != _NONE

    def _append(self, slot: int, head: int) -> None:
        """Link ``slot`` as the newest of ``head``'s list."""
        prev = self._prev
        last = prev[head]
        self._next[last] = slot
        prev[slot] = last
        self._next[slot] = head
        prev[head] = slot

    def _unlink(self, slot: int) -> None:
        prev = self._prev
        nxt = self._next
        before = prev[slot]
        after = nxt[slot]
        nxt[before] = after
        prev[after] = before


class SlotLRU(_Lists):
    """:class:`~kvtiers.policies.lru.LRUPolicy` over slots: one list, oldest first."""

    recency = True
    shields_request_head = True

    def __init__(
        self,
        num_slots: int,
        keys: Sequence[Any],
        slot_of: Callable[[Any], int | None],
    ) -> None:
        super().__init__(num_slots, keys, slot_of)
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
        self._where[slot] = _FIRST
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
            self._where[slot] = _NONE
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
                where[slot] = _NONE
                victims.append(slot)
            slot = after
        self._len -= n
        return victims


class SlotARC(_Lists):
    """:class:`~kvtiers.policies.arc.ARCPolicy` over slots: ``T1`` and ``T2`` are lists of
    slots; the ghost lists ``B1``/``B2`` keep keys (their slots hold other chunks now)."""

    shields_request_head = True
    _lists = 2

    def __init__(
        self,
        num_slots: int,
        keys: Sequence[Any],
        slot_of: Callable[[Any], int | None],
    ) -> None:
        super().__init__(num_slots, keys, slot_of)
        self._h1, self._h2 = self._heads
        self._len1 = 0
        self._len2 = 0
        self._b1: OrderedDict[Any, None] = OrderedDict()
        self._b2: OrderedDict[Any, None] = OrderedDict()
        self._p = 0
        # Whether p has grown / shrunk in this eviction round.
        self._grown = False
        self._shrunk = False

    def __len__(self) -> int:
        return self._len1 + self._len2

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
        self._where[slot] = _FIRST
        self._len1 += 1
        if b1 or b2:
            self._trim_ghosts()

    def touch(self, slot: int) -> None:
        where = self._where[slot]
        if not where:
            return
        if where == _FIRST:
            self._where[slot] = _SECOND
            self._len1 -= 1
            self._len2 += 1
        self._move(slot, self._h2)

    def refresh(self, slot: int) -> None:
        where = self._where[slot]
        if where:
            self._move(slot, self._h1 if where == _FIRST else self._h2)

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

    def remove(self, slot: int) -> None:
        where = self._where[slot]
        if where:
            self._unlink(slot)
            self._where[slot] = _NONE
            if where == _FIRST:
                self._len1 -= 1
            else:
                self._len2 -= 1

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
            if slot is not None and slot >= 0 and where[slot] == _FIRST:
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
            if where[slot] == _FIRST:
                self._len1 -= 1
                self._b1[keys[slot]] = None
            else:
                self._len2 -= 1
                self._b2[keys[slot]] = None
            where[slot] = _NONE
        self._trim_ghosts()
        return picks

    def _trim_ghosts(self) -> None:
        b1 = self._b1
        b2 = self._b2
        while b1 and self._len1 + len(b1) > self.capacity:
            b1.popitem(last=False)
        while b2 and len(self) + len(b1) + len(b2) > 2 * self.capacity:
            b2.popitem(last=False)


class SlotS3FIFO(_Lists):
    """:class:`~kvtiers.policies.s3fifo.S3FIFOPolicy` over slots: the small and main
    queues are lists of slots with a 2-bit frequency per slot; the ghost queue keeps keys."""

    _lists = 2

    def __init__(
        self,
        num_slots: int,
        keys: Sequence[Any],
        slot_of: Callable[[Any], int | None],
    ) -> None:
        super().__init__(num_slots, keys, slot_of)
        self._small, self._main = self._heads
        self._small_len = 0
        self._main_len = 0
        self._freq = bytearray(num_slots)
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._small_target = max(1, int(num_slots * _SMALL_FRACTION))

    def __len__(self) -> int:
        return self._small_len + self._main_len

    def insert(self, slot: int) -> None:
        key = self._keys[slot]
        self._freq[slot] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._to_main(slot)
        else:
            self._append(slot, self._small)
            self._where[slot] = _FIRST
            self._small_len += 1

    def touch(self, slot: int) -> None:
        if self._where[slot]:
            self._freq[slot] = min(self._freq[slot] + 1, _MAX_FREQ)

    def refresh(self, slot: int) -> None:
        """A FIFO has no recency to move."""

    def remove(self, slot: int) -> None:
        where = self._where[slot]
        if where:
            self._unlink(slot)
            self._where[slot] = _NONE
            if where == _FIRST:
                self._small_len -= 1
            else:
                self._main_len -= 1

    def _to_main(self, slot: int) -> None:
        self._append(slot, self._main)
        self._where[slot] = _SECOND
        self._main_len += 1

    def _pop(self, head: int) -> int:
        """Unlink and return the oldest slot of ``head``'s list (not empty)."""
        slot = self._next[head]
        self._unlink(slot)
        self._where[slot] = _NONE
        if head is self._small:
            self._small_len -= 1
        else:
            self._main_len -= 1
        return slot

    def _evict(self, n: int, protected: Collection[Any]) -> list[int]:
        keys = self._keys
        freq = self._freq
        victims: list[int] = []
        # Consecutive protected keys met at the head of main: once a whole lap of main is
        # protected, only the small queue can yield a victim.
        main_skips = 0
        while len(victims) < n:
            use_small = self._small_len and (
                self._small_len >= self._small_target
                or not self._main_len
                or main_skips >= self._main_len
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


class KeyOrder(SlotOrder):
    """Any :class:`~kvtiers.policies.base.EvictionPolicy` behind the slot API, through its
    key-based methods: the path of policies defined outside kvtiers (and of subclasses of
    the built-ins, which may change their rules). It costs what the policy costs, plus one
    slot → key read per call and a key → slot lookup per victim."""

    def __init__(
        self,
        policy: EvictionPolicy,
        num_slots: int,
        keys: Sequence[Any],
        slot_of: Callable[[Any], int | None],
    ) -> None:
        super().__init__(num_slots, keys, slot_of)
        self.policy = policy
        self.recency = policy.recency
        self.shields_request_head = policy.shields_request_head

    def __len__(self) -> int:
        return len(self.policy)

    def tracks(self, key: Any) -> bool:
        return key in self.policy

    def insert(self, slot: int) -> None:
        self.policy.insert(self._keys[slot])

    def touch(self, slot: int) -> None:
        self.policy.touch(self._keys[slot])

    def refresh(self, slot: int) -> None:
        self.policy.refresh(self._keys[slot])

    def remove(self, slot: int) -> None:
        self.policy.remove(self._keys[slot])

    def evict(
        self, n: int, protected: Collection[Any] = (), shielded: Collection[Any] = ()
    ) -> list[int] | None:
        victims = self.policy.evict(n, protected, shielded)
        return None if victims is None else self._slots(victims)

    def evictable(self, protected: Collection[Any] = (), shielded: Collection[Any] = ()) -> int:
        return self.policy.evictable(protected, shielded)

    def _evict(self, n: int, protected: Collection[Any]) -> list[int]:
        raise AssertionError("KeyOrder.evict delegates to the policy")  # pragma: no cover

    def _slots(self, victims: list[Hashable]) -> list[int]:
        slot_of = self._slot_of
        slots = []
        for key in victims:
            slot = slot_of(key)
            assert slot is not None and slot >= 0, f"the policy evicted an untracked key {key!r}"
            slots.append(slot)
        return slots


#: The built-in policies' slot twins, by exact class: a subclass may override any rule, so
#: it runs through :class:`KeyOrder`.
_TWINS: dict[type[EvictionPolicy], type[_Lists]] = {
    LRUPolicy: SlotLRU,
    ARCPolicy: SlotARC,
    S3FIFOPolicy: SlotS3FIFO,
}


def slot_order(
    policy: EvictionPolicy,
    num_slots: int,
    keys: Sequence[Any],
    slot_of: Callable[[Any], int | None],
) -> SlotOrder:
    """The order a slot tier runs for ``policy`` (a fresh instance, tracking nothing yet):
    its slot twin for an ``lru``, ``arc`` or ``s3fifo`` instance, else :class:`KeyOrder`
    over ``policy`` itself."""
    twin = _TWINS.get(type(policy))
    if twin is not None:
        return twin(num_slots, keys, slot_of)
    return KeyOrder(policy, num_slots, keys, slot_of)
