"""Demotion: ``write: back`` tiers written when the tier above them evicts a chunk
(docs/architecture.md, "Placement").

Owns: which ``back`` tiers take the primary's evictions (the *first hop*) and which take
a handing tier's (the *second hop*, :class:`~kvtiers.stack.lower.Hop`); the primary's
headroom (:class:`~kvtiers.stack.placement.Headroom`: as many slots kept free as the
primary reserved in its busiest recent step); the primary slots held for demotion copies
and how many copies read each; staging a handing tier's evicted chunk through a held
primary slot; and the ``demotions_dropped`` / ``demotions_refused`` counts.

* **First hop.** At the end of a step :meth:`Demotion.end_step` evicts through the
  primary's ``evict_held`` (:class:`~kvtiers.core.primary.HoldingPrimary`): the victims'
  slots stay held, and readable, while the ``back`` tiers' movers copy them out; a slot is
  released once every copy of it ended, succeeded or failed. A chunk the primary evicts
  by itself (a step that needed more than the free room) is not written back
  (:meth:`Demotion.count_dropped`).
* **Second hop.** Below a tier that can hand its evictions over
  (:class:`~kvtiers.core.primary.HandingTier`, the file tier) the ``back`` tier receives
  what that tier evicts: from the chunk's primary slot while the primary holds it ready,
  else read from the evicted file into a held primary slot and stored from there; the
  file is released once nothing reads it. No slot to stage through: dropped. A ``back``
  tier that admits by count is decided for when the count is reached
  (:meth:`Demotion.want`): the tier above keeps the mark with the chunk.

Chunks a live request's lookups hold in ``ctx.keep`` are never demoted. All on the
scheduler thread.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import OffloadingEvent, OffloadingManager, ReqContext
from kvtiers.core.primary import HoldingPrimary, SlotState, handing, holds
from kvtiers.errors import ConfigError
from kvtiers.stack.admission import Admission
from kvtiers.stack.lower import INTERNAL, DemotionTag, Hop, JobTag, Lower
from kvtiers.stack.placement import Headroom
from kvtiers.tiers.jobs import FinishedJob


def plan_hops(admission: Admission, lowers: Sequence[Lower]) -> tuple[list[Lower], list[Hop]]:
    """The ``back`` tiers written at the primary's evictions (their nearest writing tier
    above is the primary, or a tier that cannot hand evictions over), and the hops of
    those written at a handing tier's."""
    first: list[Lower] = []
    hops: list[Hop] = []
    for lower in admission.back:
        above = next((a for a in reversed(lowers[: lower.index - 1]) if admission.writes(a)),
                     None)
        source = None if above is None else handing(above.manager)
        if above is None or source is None:
            first.append(lower)
        else:
            hops.append(Hop(above, lower, source))
    return first, hops


def demotion_for(
    admission: Admission,
    lowers: Sequence[Lower],
    holder: HoldingPrimary | None,
    primary_name: str,
    *,
    stats: dict[str, float],
    job_ids: Iterator[int],
    keepers: Mapping[str, ReqContext],
) -> Demotion | None:
    """The demotions of a stack whose lower tiers are ``lowers`` (``None``: no ``back``
    tier). ``back`` tiers need a primary that holds slots (``holder``; else
    :class:`~kvtiers.errors.ConfigError`); a first-hop one that admits by count has
    ``admission`` keep the counts of the chunks the primary holds."""
    if not admission.back:
        return None
    if holder is None:
        back = admission.back[0]
        raise ConfigError(
            f"tier {back.tier.name!r} has write: back, which needs a primary that can hold "
            "an evicted chunk's slot while it is copied (a cpu tier); "
            f"{primary_name!r} cannot: use write: through",
            path=f"tiers[{back.index}].write",
        )
    first, hops = plan_hops(admission, lowers)
    if any(lo.write.after_hits > 0 for lo in first):
        # A first-hop back tier that admits by count reads a chunk's count when the
        # primary evicts it, however long it stayed: the primary's chunks keep theirs.
        admission.keep_counts_in(holder)
    return Demotion(holder, first, hops, admission, stats=stats, job_ids=job_ids,
                    keepers=keepers)


class Demotion:
    """The demotions of one stack (see the module docstring). ``stats``, ``job_ids`` and
    ``keepers`` (requests by id whose ``ctx.keep`` names keys) are the composite's own."""

    def __init__(
        self,
        holder: HoldingPrimary,
        first: list[Lower],
        hops: list[Hop],
        admission: Admission,
        *,
        stats: dict[str, float],
        job_ids: Iterator[int],
        keepers: Mapping[str, ReqContext],
    ) -> None:
        self._holder = holder
        #: ``back`` tiers written at the primary's evictions.
        self.first = first
        self.hops = hops
        #: Hops whose ``back`` tier admits by count: the tier above keeps the decision
        #: with the chunk (``want_evictions``) and hands over only the chunks it names.
        self.wanting = [hop for hop in hops if hop.target.write.after_hits > 0]
        for hop in hops:
            hop.source.hand_over_evictions(wanted_only=hop in self.wanting)
        self._admission = admission
        self._stats = stats
        self._job_ids = job_ids
        self._keepers = keepers
        self.headroom = Headroom()
        #: Held slot → demotion copies of it not yet ended.
        self._held: dict[int, int] = {}

    def _protected(self) -> Collection[OffloadKey]:
        return _Union([ctx.keep for ctx in self._keepers.values()])

    # -- the first hop --------------------------------------------------------------
    def end_step(self) -> None:
        """Keep the primary's free room: evict with held slots and copy each victim to
        the first-hop ``back`` tiers that admit it."""
        holder = self._holder
        target = self.headroom.end_step()
        if not self.first:
            return
        want = target - holder.free_slots - len(self._held)
        if want <= 0:
            return
        victims = holder.evict_held(want, self._protected())
        if not victims:
            return
        held = self._held
        admission = self._admission
        # This pass holds every victim's slot itself until it is done, and counts a tier's
        # copy before submitting it: a job the mover refuses ends (and gives its count
        # back) inside the submit, and must not free a slot another tier's copy reads.
        for slot in victims.values():
            held[slot] = held.get(slot, 0) + 1
        try:
            for lower in self.first:
                admitted = [key for key in victims if admission.admits(lower, key)
                            and not holds(lower.manager, key)]
                if not admitted:
                    continue
                slots = {key: victims[key] for key in admitted}
                for slot in slots.values():
                    held[slot] += 1
                self._store_held(lower, admitted, slots, None)
        finally:
            admission.left(victims)
            self.unhold(list(victims.values()))

    def prepare_store(
        self, primary: OffloadingManager, keys: Collection[OffloadKey], ctx: ReqContext,
        events: list[OffloadingEvent],
    ) -> list[OffloadKey] | None:
        """``primary.prepare_store`` (``primary`` is the holder), counting what it evicts by
        itself: those chunks a first-hop ``back`` tier never receives. Its events name them;
        the events it had, and those of this call, are appended to ``events``."""
        before = self._holder.evictions
        events.extend(primary.take_events())
        accepted = primary.prepare_store(keys, ctx)
        if self._holder.evictions != before:
            new = list(primary.take_events())
            events.extend(new)
            self.count_dropped(
                [k for e in new if e.removed and not e.metadata_only for k in e.keys])
        return accepted

    def count_dropped(self, victims: list[OffloadKey]) -> None:
        """The primary evicted ``victims`` by itself: count those a first-hop ``back``
        tier would have been written and does not hold (``demotions_dropped``)."""
        admission = self._admission
        self._stats["demotions_dropped"] += sum(
            1 for key in victims
            if any(admission.admits(lower, key) and not holds(lower.manager, key)
                   for lower in self.first)
        )

    def unhold(self, slots: Sequence[int]) -> None:
        """Give back one count of each of ``slots`` (a slot named twice, two); release
        the slots no copy reads any more."""
        released = []
        for slot in slots:
            left = self._held[slot] - 1
            if left:
                self._held[slot] = left
            else:
                del self._held[slot]
                released.append(slot)
        if released:
            self._holder.release_held(released)

    def _store_held(
        self, lower: Lower, keys: list[OffloadKey], slots: Mapping[OffloadKey, int],
        hop: Hop | None,
    ) -> None:
        """Store ``keys`` into ``lower`` from their held ``slots`` (one count each taken);
        the count of a key the tier refuses is given back at once."""
        accepted: list[OffloadKey] | None = None
        try:
            accepted = lower.jobs.store(next(self._job_ids), keys, INTERNAL,
                                        DemotionTag(slots, hop), slots=slots)
        finally:
            if accepted is None:
                self._stats["demotions_refused"] += len(keys)
            taken = set(accepted or ())
            self.unhold([slots[key] for key in keys if key not in taken])

    # -- the second hop -------------------------------------------------------------
    def want(self, keys: list[OffloadKey], counts: list[int]) -> None:
        """``keys`` (in the primary, ready) were referenced ``counts`` times: those that
        reach a counting hop's threshold are wanted below. The tier above keeps that with
        the chunk and hands it over when it evicts it; a chunk it no longer holds (it
        evicted it before it was wanted, or never took it) is written down now, from the
        primary, its last copy."""
        admission = self._admission
        for hop in self.wanting:
            due = admission.due(hop.target.write.after_hits, keys, counts, exact=False)
            if not due:
                continue
            target = hop.target
            down = [key for key in hop.source.want_evictions(due)
                    if admission.takes_from_source(target, key)
                    and not holds(target.manager, key)]
            if down:
                self._store_down(hop, down)

    def second_hop(self) -> bool:
        """Copy the chunks each handing tier evicted since the last call to the ``back``
        tier below it; whether there were any."""
        took = False
        for hop in self.hops:
            evicted = hop.source.take_evicted()
            if evicted:
                took = True
                self._hand_down(hop, evicted)
        return took

    def _store_down(self, hop: Hop, keys: list[OffloadKey]) -> None:
        """Demote ``keys`` to ``hop``'s ``back`` tier from their own primary slots (pinned
        while the copy reads them); a refusal is counted."""
        accepted: list[OffloadKey] | None = None
        try:
            accepted = hop.target.jobs.store(next(self._job_ids), keys, INTERNAL,
                                             DemotionTag(None, hop))
        finally:
            if accepted is None:
                self._stats["demotions_refused"] += len(keys)

    def _hand_down(self, hop: Hop, evicted: list[OffloadKey]) -> None:
        """One hop's evicted chunks: those the tier below admits are copied from their
        primary slot when the primary holds them ready, else read from the tier above into
        a held primary slot (staged) and stored from there; with no slot to stage through,
        dropped. Every file is released once nothing reads it any more."""
        holder = self._holder
        target = hop.target
        # A counting tier's admission was decided when the count was reached: the tier
        # above hands over only the chunks wanted then (see want).
        admitted = [key for key in evicted if self._admission.takes_from_source(target, key)
                    and not holds(target.manager, key)]
        ready = [key for key in admitted if holder.slot_state(key) is SlotState.READY]
        in_primary = set(ready)
        staged = [key for key in admitted if key not in in_primary]
        reading: list[OffloadKey] = []
        try:
            if ready:
                self._store_down(hop, ready)
            if staged:
                slots = self._stage_slots(len(staged))
                self._stats["demotions_dropped"] += len(staged) - len(slots)
                staged = staged[: len(slots)]
                if slots:
                    rows = dict(zip(staged, slots, strict=True))
                    for slot in slots:
                        self._held[slot] = 1
                    try:
                        spec = hop.source.evicted_spec(staged)
                    except BaseException:
                        self.unhold(slots)
                        raise
                    # From here the read job owns these keys' files and slots: it releases
                    # them when it ends, even when it ends at once, failed.
                    reading = staged
                    hop.above.jobs.load_evicted(next(self._job_ids), staged, spec, slots,
                                                DemotionTag(rows, hop))
        finally:
            being_read = set(reading)
            hop.source.release_evicted([key for key in evicted if key not in being_read])

    def _stage_slots(self, count: int) -> list[int]:
        """Up to ``count`` primary slots held for staging: free ones, and, when no tier
        takes the primary's own evictions, those of its next victims (evicted a little
        early: they would go at its next store that needs room)."""
        holder = self._holder
        slots = holder.hold_free(count)
        short = count - len(slots)
        if short and not self.first:
            victims = holder.evict_held(short, self._protected())
            self._admission.left(victims)
            slots.extend(victims.values())
        return slots

    def staged(self, job: FinishedJob[JobTag]) -> None:
        """A staging read ended: its files are released, the chunks that arrived intact
        are stored from their slots into the tier below, the others' slots released."""
        tag = job.tag
        assert tag is not None and tag.hop is not None and tag.slots is not None
        hop, slots = tag.hop, tag.slots
        hop.source.release_evicted(job.keys)
        self._stats["demotion_failures"] += len(job.failed)
        self.unhold([slots[key] for key in job.failed])
        arrived = list(job.succeeded)
        if arrived:
            self._store_held(hop.target, arrived, {key: slots[key] for key in arrived}, hop)


class _Union(Collection[OffloadKey]):
    """Several key collections seen as one, without building it (eviction asks
    membership; iteration yields each key once)."""

    __slots__ = ("_parts",)

    def __init__(self, parts: Sequence[Collection[OffloadKey]]) -> None:
        self._parts = parts

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self._parts)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(set().union(*self._parts))

    def __len__(self) -> int:
        """An upper bound: a key in several parts counts once per part."""
        return sum(map(len, self._parts))
