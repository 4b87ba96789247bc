"""What a stack asks of its tiers beyond :class:`~kvtiers.core.manager.OffloadingManager`:
the primary-tier contract, and the lower tiers' part in demotion.

A tier says what it can do in two ways, both here in core: its declared
:class:`~kvtiers.core.manager.TierCapabilities` (persistent, evicts, recency, events), and
the runtime-checkable protocols below, which the composite (:mod:`kvtiers.stack`) and the
adapters (:mod:`kvtiers.integrations`) test with ``isinstance`` once, when they are built.
Nothing above :mod:`kvtiers.tiers` names a concrete tier (``tests/test_layers.py``); a
primary held by another process satisfies these protocols as the cpu tier does.

**Slots.** A :class:`SlottedPrimary` keeps each chunk in one numbered slot of a host region
(what its workers and the lower tiers' movers address), and tells a key's slot and its
:class:`SlotState` without counting a lookup: ``FREE`` (the key is not there), ``WRITING``
(reserved by ``prepare_store`` or a promotion, bytes in flight), ``READY`` (stored).

**Holding** (:class:`HoldingPrimary`, the first hop of a demotion). ``evict_held(count,
protected)`` evicts up to ``count`` ready chunks, the primary's own choice among those
neither pinned nor in ``protected``: each key is gone at once (``MISS``, a removal event)
while its slot keeps its bytes and is never reused until ``release_held`` names it, so a
``write: back`` tier's mover can copy it out. ``hold_free(count)`` holds free slots the
same way (a second hop stages a lower tier's chunk through them). ``detach_writing(keys)``
gives up the reservations of keys still being written (a promotion abandoned in flight):
the keys are gone at once, a ``metadata_only`` removal, their slots held until the write
ends. ``release_held`` frees held slots, each once (a slot not held raises, changing
nothing). ``free_slots`` is the free room now (neither holding a chunk, fenced nor held);
``evictions`` counts chunks evicted so far, by stores and by ``evict_held``, so a caller
sees whether a store evicted by itself. A holding primary never evicts a held slot, nor
hands it out, until it is released.

**Handing** (:class:`HandingTier`, the second hop). A lower tier that can hand the chunks it
evicts up to the composite instead of deleting them, so the ``write: back`` tier below it
receives them (from the primary's slot when the primary holds the chunk, else read from
the handing tier into a held primary slot).

**Staging.** Whether the primary evicts for the head of a store that does not fit whole
(every chunk it stores is copied below, so what it evicts lives on there) is decided when
the stack is built: the builder passes ``staging`` to the primary's factory
(:class:`~kvtiers.core.tier.TierFactory`). The composite never changes it.

**Calling the primary directly** (:class:`DirectPrimary`). An adapter whose keys are the
primary's keys and whose stack is that primary alone may call it for every per-key call
(the vLLM adapter's one-call mode): one plain function per lookup, removals forwarded as a
list instead of events, a load's pin and spec in one pass, and a callback at shutdown.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Mapping, Sequence
from enum import IntEnum
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvtiers.core.keys import KeyFormat, OffloadKey
from kvtiers.core.manager import OffloadingManager, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec

_R = TypeVar("_R")


class SlotState(IntEnum):
    """State of a key's slot in a slotted primary (``FREE``: the key holds none)."""

    FREE = 0
    WRITING = 1
    READY = 2


@runtime_checkable
class SlottedPrimary(Protocol):
    """A primary whose chunks live in numbered slots of a host region (see the module
    docstring)."""

    @property
    def free_slots(self) -> int:
        """Slots free now (neither holding a chunk, fenced nor held)."""
        ...

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot holding ``key`` (ready or being written), or ``None``."""
        ...

    def slot_state(self, key: OffloadKey) -> SlotState:
        """The state of ``key``'s slot (``FREE`` when the key is not present); counts
        nothing."""
        ...


@runtime_checkable
class HoldingPrimary(SlottedPrimary, Protocol):
    """A primary that evicts chunks while holding their slots for a demotion, and gives up
    a promotion's reservation while holding its slot until the copy ends (see the module
    docstring, "Holding")."""

    @property
    def evictions(self) -> int:
        """Chunks evicted so far (by stores that needed room and by :meth:`evict_held`)."""
        ...

    def evict_held(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> dict[OffloadKey, int]:
        """Evict up to ``count`` ready chunks, neither pinned nor in ``protected``, holding
        their slots; key → held slot (empty: nothing evictable)."""
        ...

    def hold_free(self, count: int) -> list[int]:
        """Hold up to ``count`` free slots for the caller; the slots (empty: none free)."""
        ...

    def detach_writing(self, keys: Collection[OffloadKey]) -> dict[OffloadKey, int]:
        """Drop the reservations of ``keys`` still being written, holding their slots;
        key → held slot (a key not being written is skipped)."""
        ...

    def release_held(self, slots: Iterable[int]) -> None:
        """Free held slots; raises, changing nothing, for a slot not held."""
        ...


@runtime_checkable
class DirectPrimary(Protocol):
    """A primary an adapter may call itself for every call of a one-tier stack (see the
    module docstring, "Calling the primary directly")."""

    def lookup_as(
        self,
        hit: _R,
        miss: _R,
        pending: _R,
        *,
        keys: KeyFormat | None = None,
        found: Mapping[Any, list[OffloadKey]] | None = None,
    ) -> Callable[[Any, Any], _R]:
        """``lookup`` as one plain function answering the caller's own result values,
        counted as ``lookup`` is; with ``keys`` a key found present that the format
        refuses raises, and every lookup after shutdown raises
        :class:`~kvtiers.errors.ClosedError`; with ``found`` (lists by ``req_id``) each key
        found present is appended to its request's list."""
        ...

    def prepare_load_spec(self, keys: Collection[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        """``prepare_load``, then the spec ``get_spec`` would give for ``keys``."""
        ...

    def forward_removals(self) -> list[OffloadKey]:
        """Build no events from now on: every removed key (never a freed reservation) is
        appended to the returned list instead, which the caller empties."""
        ...

    def on_shutdown(self, callback: Callable[[], None]) -> None:
        """Have ``shutdown`` call ``callback`` once."""
        ...


@runtime_checkable
class HandingTier(Protocol):
    """A lower tier that can hand the chunks it evicts to the composite (the file tier),
    so that the ``back`` tier below it receives them: a second-hop demotion.

    After :meth:`hand_over_evictions` every chunk the tier evicts leaves its index at once
    (a lookup answers ``MISS``, a removal event goes out) but its bytes stay in the medium
    until :meth:`release_evicted` names it: :meth:`take_evicted` lists the new ones each
    step, :meth:`evicted_spec` addresses them for the tier's mover to read. A key stored
    into the tier again meanwhile is the tier's own again: releasing it deletes nothing.
    Keys the tier no longer holds for the caller are ignored by :meth:`release_evicted`;
    ``shutdown`` deletes what was never released.

    With ``wanted_only`` only the chunks named to :meth:`want_evictions` since the tier
    took them (stored, or being stored) are handed over; the others are deleted at
    eviction as before. The mark lives with the chunk: it goes when the chunk leaves the
    tier, and a key stored anew is unmarked."""

    def hand_over_evictions(self, wanted_only: bool = False) -> None: ...

    def want_evictions(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Mark the chunks of ``keys`` the tier holds (stored or being stored) to be
        handed over at eviction; returns the others, which it does not hold."""
        ...

    def take_evicted(self) -> list[OffloadKey]: ...

    def evicted_spec(self, keys: Sequence[OffloadKey]) -> LoadStoreSpec: ...

    def release_evicted(self, keys: Iterable[OffloadKey]) -> None: ...


@runtime_checkable
class IndexedTier(Protocol):
    """A lower tier whose bookkeeping answers membership (the file, object and reference
    tiers' chunk index): what it holds, stored or being stored, is asked without a lookup
    (nothing counted, nothing probed)."""

    @property
    def index(self) -> Container[OffloadKey]: ...


def holds(manager: OffloadingManager, key: OffloadKey) -> bool:
    """Whether ``manager`` holds ``key``, stored or being stored, as far as its own
    bookkeeping knows (nothing is counted, nothing probed); ``False`` for a tier that
    cannot say."""
    return isinstance(manager, IndexedTier) and key in manager.index


def handing(manager: OffloadingManager) -> HandingTier | None:
    """``manager`` as a :class:`HandingTier`, or ``None`` when it cannot hand evictions."""
    return manager if isinstance(manager, HandingTier) else None


def holding(manager: OffloadingManager) -> HoldingPrimary | None:
    """``manager`` as a :class:`HoldingPrimary`, or ``None`` when it cannot hold slots."""
    return manager if isinstance(manager, HoldingPrimary) else None
