"""Which chunks each lower tier is written (docs/architecture.md, "Placement"): the
composite's write admission as one object, the predicate with its bookkeeping.

Owns: whether a lower tier is written at all (``admission: never`` makes it read-only),
when (its :class:`~kvtiers.core.tier.WriteRules`'s ``mode``) and which chunks: the
``after_hits`` count with the table of references per chunk (a load from the primary, or a
store of a chunk the primary lost and that was computed anew), and where each chunk in the
primary was promoted from (a tier never takes a chunk promoted from below it unless its
``write.promoted`` says so, and takes one promoted from itself only back at eviction).
The tables are bounded (:class:`~kvtiers.stack.placement.BoundedTable`), on the scheduler
thread; a stack that counts nothing pays nothing for them on its hot path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtiers.core.keys import OffloadKey
from kvtiers.core.primary import SlotState, SlottedPrimary
from kvtiers.stack.lower import Lower
from kvtiers.stack.placement import BoundedTable

#: How many chunks per primary slot the tables remember (load counts, where a promoted
#: chunk came from).
TABLE_CHUNKS_PER_SLOT = 4


class Admission:
    """The write rules of ``lowers`` (a stack's lower tiers, in order).

    ``table``: how many chunks the tables remember."""

    def __init__(self, lowers: Sequence[Lower], table: int) -> None:
        #: The tiers written at all, ...
        self.writing = [lo for lo in lowers if lo.tier.admission != "never"]
        #: ... those written when the primary stores a chunk, ...
        self.through = [lo for lo in self.writing if lo.write.mode == "through"]
        #: ... and those written when the tier above them evicts it.
        self.back = [lo for lo in self.writing if lo.write.mode == "back"]
        #: ``through`` tiers written at the reference that reaches their count.
        self.counted = [lo for lo in self.through if lo.write.after_hits > 0]
        #: Whether references are counted at all.
        self.counting = any(lo.write.after_hits > 0 for lo in self.writing)
        #: References per key: loads from the primary, stores of a key stored before.
        self._loads = BoundedTable(table)
        #: Key in the primary → position of the lower tier it was promoted from.
        self._promoted = BoundedTable(table)

    def keep_counts_in(self, primary: SlottedPrimary) -> None:
        """Never forget the count of a chunk ``primary`` holds: for a ``back`` tier written
        at the primary's evictions that admits by count (it reads the count when the
        primary evicts the chunk, however long it stayed). Before any count is taken."""
        assert not self._loads, "the counts' table is chosen before it counts"

        def keeps(key: OffloadKey) -> bool:
            return primary.slot_state(key) is not SlotState.FREE

        self._loads = BoundedTable(self._loads.limit, keeps)

    def writes(self, lower: Lower) -> bool:
        """Whether ``lower`` is written at all (not ``admission: never``)."""
        return lower.tier.admission != "never"

    def admits(self, lower: Lower, key: OffloadKey) -> bool:
        """Whether ``lower`` takes ``key`` (in the primary) now: referenced often enough,
        and not promoted from below ``lower`` unless it takes those."""
        after_hits = lower.write.after_hits
        if after_hits and self._loads.get(key) < after_hits:
            return False
        return self.takes_from_source(lower, key)

    def takes_from_source(self, lower: Lower, key: OffloadKey) -> bool:
        """Whether ``lower`` takes ``key`` as far as the tier it was promoted from goes."""
        write = lower.write
        source = self._promoted.get(key, 0)
        if source == lower.index:
            # Promoted from this very tier, which may have evicted it since: a demotion
            # writes it back (the tier skips a chunk it still holds); a cascade never.
            return write.mode == "back"
        return source == 0 or source < lower.index or (write.promoted and source > lower.index)

    def stored(self, keys: Iterable[OffloadKey]) -> list[int]:
        """The primary stored ``keys``: none is a promoted copy any more, and each stored
        again after the primary lost it counts one more reference. Their counts (0: not
        referenced before), in order; empty when nothing counts."""
        counts = []
        loads = self._loads
        for key in keys:
            self._promoted.pop(key)
            if self.counting:
                count = loads.get(key) + 1 if key in loads else 0
                loads.set(key, count)
                counts.append(count)
        return counts

    def loaded(self, keys: list[OffloadKey]) -> list[int]:
        """Count one reference for each of ``keys`` (distinct), loaded from the primary;
        their new counts, in order."""
        return self._loads.add(keys)

    @staticmethod
    def due(
        after_hits: int, keys: Sequence[OffloadKey], counts: Sequence[int], *, exact: bool
    ) -> list[OffloadKey]:
        """The ``keys`` whose ``counts`` reach ``after_hits`` (``exact``: at this very
        reference, for a ``through`` tier written once)."""
        return [key for key, count in zip(keys, counts, strict=True)
                if (count == after_hits if exact else count >= after_hits)]

    def promoted(self, keys: Iterable[OffloadKey], index: int) -> None:
        """``keys`` landed in the primary, promoted from the lower tier at ``index``."""
        for key in keys:
            self._promoted.set(key, index)

    def left(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` left the primary (evicted for a demotion): no longer promoted copies."""
        for key in keys:
            self._promoted.pop(key)

    def reset(self) -> None:
        """The primary dropped its chunks: none is a promoted copy any more."""
        self._promoted.clear()
