"""What the composite needs to decide where chunks are written (docs/architecture.md,
"Placement"): how often each chunk was referenced (loaded, or stored again), which tier
a chunk in the primary was promoted from, and how much free room the primary keeps for
demotions.

All three are small bounded tables on the scheduler thread: no I/O, no threads. The
tables forget their oldest entries beyond a limit, so memory stays bounded however many
distinct chunks pass through; a forgotten count only delays a chunk's admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable
from typing import Protocol, runtime_checkable

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import OffloadingManager

#: Steps over which the primary's demand for slots is remembered (see :class:`Headroom`).
HEADROOM_STEPS = 8


class BoundedTable:
    """key → int, forgetting the entries set longest ago beyond ``limit`` entries."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a bounded table needs a limit of at least 1, got {limit}")
        self.limit = limit
        self._values: dict[OffloadKey, int] = {}

    def get(self, key: OffloadKey, default: int = 0) -> int:
        return self._values.get(key, default)

    def set(self, key: OffloadKey, value: int) -> None:
        """Set ``key`` (now the newest entry), forgetting the oldest beyond the limit."""
        values = self._values
        values.pop(key, None)
        values[key] = value
        if len(values) > self.limit:
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
    """A primary that can evict chunks while holding their slots for a demotion (the CPU
    tier: ``CpuTierManager``)."""

    @property
    def free_slots(self) -> int: ...

    def evict_held(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> dict[OffloadKey, int]: ...

    def release_held(self, slots: Iterable[int]) -> None: ...


def holding(manager: OffloadingManager) -> HoldingPrimary | None:
    """``manager`` as a :class:`HoldingPrimary`, or ``None`` when it cannot hold slots."""
    return manager if isinstance(manager, HoldingPrimary) else None
