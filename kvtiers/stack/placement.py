"""What the composite needs to decide where chunks are written (docs/architecture.md,
"Placement"): how often each chunk was referenced (loaded, or stored again), which tier
a chunk in the primary was promoted from, how much free room the primary keeps for
demotions, and the two capabilities demotion asks of tiers — a primary that holds an
evicted chunk's slot (:class:`HoldingPrimary`, the first hop) and a lower tier that hands
the chunks it evicts over instead of deleting them (:class:`HandingTier`, the second hop).

The tables are small and bounded, on the scheduler thread: no I/O, no threads. They
forget their oldest entries beyond a limit, so memory stays bounded however many
distinct chunks pass through; the reference counts never forget a chunk the primary
holds while a ``write: back`` tier below it admits by count, so a forgotten count only
delays a chunk's admission. Below a handing tier the decision is kept with the chunk in
that tier instead (:meth:`HandingTier.want_evictions`), however long it holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from typing import Protocol, runtime_checkable

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import OffloadingManager
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.tiers.cpu.manager import SlotState

#: Steps over which the primary's demand for slots is remembered (see :class:`Headroom`).
HEADROOM_STEPS = 8


class BoundedTable:
    """key → int, forgetting the entries set longest ago beyond ``limit`` entries.

    ``keeps``: an entry it is true for is not forgotten but renewed (set again, as the
    newest); it must be true for fewer than ``limit`` keys at a time (else the oldest
    goes anyway). Each renewed entry is passed over for ``limit`` further entries, so a
    ``set`` costs O(1) amortized."""

    def __init__(self, limit: int, keeps: Callable[[OffloadKey], bool] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"a bounded table needs a limit of at least 1, got {limit}")
        self.limit = limit
        self._keeps = keeps
        self._values: dict[OffloadKey, int] = {}

    def get(self, key: OffloadKey, default: int = 0) -> int:
        return self._values.get(key, default)

    def set(self, key: OffloadKey, value: int) -> None:
        """Set ``key`` (now the newest entry), forgetting the oldest beyond the limit."""
        values = self._values
        values.pop(key, None)
        values[key] = value
        if len(values) <= self.limit:
            return
        keeps = self._keeps
        if keeps is not None:
            for _ in range(len(values) - 1):
                oldest = next(iter(values))
                if not keeps(oldest):
                    break
                values[oldest] = values.pop(oldest)
        del values[next(iter(values))]

    def add(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Count one more for each key (each once however often named); the new counts,
        in the order the keys first appear."""
        return [self._bump(key) for key in dict.fromkeys(keys)]

    def _bump(self, key: OffloadKey) -> int:
        value = self._values.get(key, 0) + 1
        self.set(key, value)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def pop(self, key: OffloadKey) -> None:
        self._values.pop(key, None)

    def clear(self) -> None:
        self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


class Headroom:
    """How many primary slots to keep free for demotions: the most the primary reserved
    in one step (stores and promotions) over the last :data:`HEADROOM_STEPS` steps, so a
    step like the recent ones finds free slots and does not have to drop chunks not yet
    written back."""

    def __init__(self, steps: int = HEADROOM_STEPS) -> None:
        self._demand: deque[int] = deque(maxlen=steps)
        self._step = 0

    def reserved(self, count: int) -> None:
        """The primary reserved ``count`` slots in this step."""
        self._step += count

    def end_step(self) -> int:
        """Close this step; the number of free slots to keep from now on."""
        self._demand.append(self._step)
        self._step = 0
        return max(self._demand)


@runtime_checkable
class HoldingPrimary(Protocol):
    """A primary that can evict chunks while holding their slots for a demotion, and give
    up a promotion's reservation while holding its slot until the copy ends (the CPU
    tier: ``CpuTierManager``)."""

    @property
    def free_slots(self) -> int: ...

    @property
    def evictions(self) -> int: ...

    def evict_held(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> dict[OffloadKey, int]: ...

    def hold_free(self, count: int) -> list[int]: ...

    def slot_state(self, key: OffloadKey) -> SlotState: ...

    def release_held(self, slots: Iterable[int]) -> None: ...

    def detach_writing(self, keys: Collection[OffloadKey]) -> dict[OffloadKey, int]: ...


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
    """A lower tier whose bookkeeping is a chunk index (:mod:`kvtiers.tiers.index`; the
    file, object and in-memory tiers): what it holds can be asked without a lookup."""

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
