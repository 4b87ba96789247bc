"""What the composite needs to decide where chunks are written (docs/architecture.md,
"Placement"): how often each chunk was referenced (loaded, or stored again), which tier
a chunk in the primary was promoted from, and how much free room the primary keeps for
demotions. What demotion asks of the tiers themselves (a primary that holds an evicted
chunk's slot, a lower tier that hands its evictions over) is core's contract
(:mod:`kvtiers.core.primary`).

The tables are small and bounded, on the scheduler thread: no I/O, no threads. They
forget their oldest entries beyond a limit, so memory stays bounded however many
distinct chunks pass through; the reference counts never forget a chunk the primary
holds while a ``write: back`` tier below it admits by count, so a forgotten count only
delays a chunk's admission. Below a handing tier the decision is kept with the chunk in
that tier instead (:meth:`~kvtiers.core.primary.HandingTier.want_evictions`), however
long it holds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from kvtiers.core.keys import OffloadKey

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
    written back; never less than :attr:`floor` (the slots a primary shared with writers
    outside the stack hands out between its steps, which the stack does not see)."""

    def __init__(self, steps: int = HEADROOM_STEPS) -> None:
        self._demand: deque[int] = deque(maxlen=steps)
        self._step = 0
        #: The fewest free slots to keep, whatever the recent steps reserved.
        self.floor = 0

    def reserved(self, count: int) -> None:
        """The primary reserved ``count`` slots in this step."""
        self._step += count

    def end_step(self) -> int:
        """Close this step; the number of free slots to keep from now on."""
        self._demand.append(self._step)
        self._step = 0
        return max(max(self._demand), self.floor)
