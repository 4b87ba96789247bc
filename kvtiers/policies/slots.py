"""Eviction orders over slot ids: the built-in policies as the CPU tier runs them.

A tier whose chunks live in numbered slots (the CPU tier) already keeps one hash table,
key → slot. A key-based policy (:class:`~kvtiers.policies.base.EvictionPolicy`) keeps a
second one, key → its node, which doubles the memory per chunk once churn has made CPython
regrow both. A :class:`SlotOrder` keeps its order in arrays indexed by slot instead: a
doubly linked list through ``prev``/``next`` lists of slot ids (one sentinel per list, past
the last slot), one byte per slot for the list a slot is on, and reads a slot's key from
the tier's slot → key list only where keys matter (protected keys, ghosts). It stores the
tier's own slot int objects, never new ones, so an entry costs two list pointers.

- :class:`SlotLists` holds the linked lists the built-in policies' slot twins run on. Each
  twin lives in its policy's own module beside it (``SlotLRU`` in :mod:`~kvtiers.policies.
  lru`, ``SlotARC`` in :mod:`~kvtiers.policies.arc`, ``SlotS3FIFO`` in
  :mod:`~kvtiers.policies.s3fifo`), so a rule is changed in both side by side, and the
  policy class names it (``slot_twin``). A twin picks the same victims in the same order
  as its policy (``tests/test_slot_orders.py`` replays random operation sequences through
  both); ghosts (keys of chunks already evicted) stay keyed by key.
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
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

from kvtiers.policies.base import EvictionPolicy

#: Where a slot is: ``UNTRACKED`` (not tracked), or on one of a policy's lists.
UNTRACKED = 0
FIRST = 1
SECOND = 2


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


class SlotLists(SlotOrder):
    """Doubly linked lists of slots through shared ``prev``/``next`` arrays, one sentinel
    id per list past the last slot (``num_slots``, ``num_slots + 1``, …), oldest first
    after the sentinel. ``_where[slot]`` names the list a slot is on (``UNTRACKED``: none).

    A twin is built as every slot order is (``num_slots``, ``keys``, ``slot_of``) and sets
    up its own state in :meth:`_start`, so the constructor is written once."""

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
        self._start()

    def _start(self) -> None:
        """Set up the twin's own state (list heads from ``_heads``, counts, ghosts); called
        once, last in the constructor."""

    def tracks(self, key: Any) -> bool:
        slot = self._slot_of(key)
        return slot is not None and slot >= 0 and self._where[slot] != UNTRACKED

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


class TwoSlotLists(SlotLists):
    """Two counted lists, ``FIRST`` and ``SECOND`` (``_len1`` and ``_len2`` slots): the
    bookkeeping ARC's ``T1``/``T2`` and S3-FIFO's small/main queues share."""

    _lists = 2

    def _start(self) -> None:
        self._h1, self._h2 = self._heads
        self._len1 = 0
        self._len2 = 0

    def __len__(self) -> int:
        return self._len1 + self._len2

    def remove(self, slot: int) -> None:
        where = self._where[slot]
        if where:
            self._unlink(slot)
            self._where[slot] = UNTRACKED
            if where == FIRST:
                self._len1 -= 1
            else:
                self._len2 -= 1


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


def slot_order(
    policy: EvictionPolicy | type[EvictionPolicy],
    num_slots: int,
    keys: Sequence[Any],
    slot_of: Callable[[Any], int | None],
) -> SlotOrder:
    """The order a slot tier runs for ``policy`` (a class, or a fresh instance tracking
    nothing yet): the slot twin its exact class names (``slot_twin``; a subclass may
    override any rule, so it does not inherit the twin), built without a key-based policy;
    else :class:`KeyOrder` over ``policy`` (an instance of the class, sized ``num_slots``,
    when given the class)."""
    cls = policy if isinstance(policy, type) else type(policy)
    twin = vars(cls).get("slot_twin")
    if twin is not None:
        built: SlotOrder = twin(num_slots, keys, slot_of)
        return built
    instance = policy(num_slots) if isinstance(policy, type) else policy
    return KeyOrder(instance, num_slots, keys, slot_of)
