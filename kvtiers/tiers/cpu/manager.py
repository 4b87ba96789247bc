"""The CPU tier's manager: slot bookkeeping for the host region, with a pluggable policy.

State per slot is explicit: :class:`SlotState` ``FREE`` / ``WRITING`` (reserved by
``prepare_store``, bytes in flight) / ``READY`` (stored), and, separately, a pin count per
pinned key (``prepare_load`` … ``complete_load``). ``reset_cache`` *fences* the slots of
keys being written or pinned and moves the tier to its next ``generation``: the keys are
gone (``MISS``), their slots stay out of use until the job that holds each ends (its
completion, carrying the job's generation) or ``on_reset_flushed``.
:meth:`CpuTierManager.evict_held` evicts chunks but *holds* their slots for the caller (the
composite copies them to a write-back tier: a demotion) until :meth:`release_held`.
Invariants:

- every key maps to exactly one slot; every non-free slot belongs to exactly one key, is
  fenced (held for a job from before a reset) or is held for a demotion;
- only ``READY`` keys are tracked by the policy, and pinned keys, the batch's present keys
  and the request's ``ctx.keep`` keys are passed to it as protected, so eviction never
  picks a writing or pinned chunk, nor a chunk of the prefix the storing request holds;
- ``prepare_store`` reserves every key it returns and changes nothing else but the
  evictions that make room for them; when not all fit it evicts nothing and reserves the
  leading keys the free slots hold (a ``staging`` tier evicts for them too, as far as the
  policy allows: ``EvictionPolicy.evictable``), and when none fits it returns ``None``
  and changes nothing (the policy's ``evict`` is atomic);
- ``complete_store`` / ``complete_load`` of a key this tier never reserved or pinned raise
  :class:`~kvtiers.errors.UnknownKeyError` before changing anything;
- a completion of an older generation (a job from before a reset) releases only that job's
  fenced slot, never the key's newer reservation or pin;
- the number of non-free slots never exceeds ``num_slots``.

Recency follows prefix order: a request's prompt head is shared by the most requests, so
within one batch of keys (given head to tail) the tail is made less recent than the head
— on ``touch``, and on ``prepare_load`` of a request not announced by ``on_new_request``
— and when an announced request finishes, every key it stored or loaded is made recent
again, tail first, the loaded ones as a use (``touch``) and the stored-only ones without
one (``refresh``). Under a policy that shields a request's head (``lru``, ``arc``: see
``EvictionPolicy.shields_request_head``), while an announced request runs its stores never
evict its own earlier keys (nearer its head). The keys a request saw are kept in its
context's state, never in the manager.

Memory per tracked chunk is kept small: one hash table entry per chunk (key → slot id),
one byte of state per slot, the slot's key in a slot-indexed list, and the policy's order
in slot-indexed arrays (the built-in policies' slot twins, see :mod:`kvtiers.policies.slots`; a
policy defined elsewhere runs through its key-based API and keeps its own tables); pin
counts exist only for pinned keys. A key being
written maps to the marker :data:`_BEING_WRITTEN` instead of its slot (the slot waits in a
small table of keys in flight), so a lookup tells ``HIT`` from ``HIT_PENDING`` by identity
and never reads the slot's int object: a random lookup over a large tier is bound by
memory reads, and that one is a cache miss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import filterfalse
from typing import TYPE_CHECKING, Any, TypeVar

from kvtiers.core.keys import KeyFormat, OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    TierCapabilities,
)
from kvtiers.core.primary import SlotState
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.errors import ClosedError, UnknownKeyError
from kvtiers.policies.base import EvictionPolicy
from kvtiers.policies.slots import SlotOrder, slot_order

if TYPE_CHECKING:
    from kvtiers.tiers.cpu.region import SlotRegion


def _shown(key: object) -> str:
    """A key for an error message."""
    return key.hex() if isinstance(key, bytes) else repr(key)


_WRITING = int(SlotState.WRITING)
_READY = int(SlotState.READY)
_FREE = int(SlotState.FREE)
_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_R = TypeVar("_R")
#: ``_slots``' value for a key being written. -1 is never a slot, and CPython keeps one
#: object for it, so comparing by identity is exact and reads nothing.
_BEING_WRITTEN = -1


def _protected(*parts: Collection[OffloadKey]) -> Collection[OffloadKey]:
    """The union of ``parts``, skipping the empty ones: the one part itself when only one
    is left (eviction then tests each candidate with one C-level ``in``)."""
    kept = tuple(filter(None, parts))
    if len(kept) == 1:
        return kept[0]
    return _Protected(*kept) if kept else ()


class _Protected(Collection[OffloadKey]):
    """The union of key collections, without building it (membership is what eviction
    asks; iteration, rarely needed, yields each key once)."""

    __slots__ = ("_parts",)

    def __init__(self, *parts: Collection[OffloadKey]) -> None:
        self._parts = parts

    def __contains__(self, key: object) -> bool:
        # A loop, not any() over a generator: eviction asks once per candidate.
        for part in self._parts:  # noqa: SIM110 (see above)
            if key in part:
                return True
        return False

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(set().union(*self._parts))

    def __len__(self) -> int:
        """An upper bound: keys named by more than one part count once per part."""
        return sum(map(len, self._parts))


@dataclass(slots=True)
class _RequestAccess:
    """The keys one request stored or reused in one manager (and cache generation), in the
    order first seen; ``reused`` are those it found ready."""

    owner: object
    generation: int
    seen: dict[OffloadKey, None] = field(default_factory=dict)
    reused: set[OffloadKey] = field(default_factory=set)


class CpuTierManager(OffloadingManager):
    """Bookkeeping of ``num_slots`` host slots of ``slot_bytes`` each.

    ``policy`` is an :class:`~kvtiers.policies.base.EvictionPolicy` class (or a fresh
    instance sized for ``num_slots``): for a class that names a slot twin (``lru``, ``arc``
    and ``s3fifo``, exactly those classes) the tier tracks its chunks in the twin and builds
    no key-based policy (a given instance stays empty); any other policy, a subclass of a
    built-in included, tracks them itself (an instance of the class when given a class).
    ``region``, when given, is closed by :meth:`shutdown`. ``staging``: see the attribute.
    It is the :class:`~kvtiers.core.primary.HoldingPrimary` and
    :class:`~kvtiers.core.primary.DirectPrimary` of core's primary-tier contract, its slot
    states core's :class:`~kvtiers.core.primary.SlotState`. Keys passed to ``complete_store``
    that are stored already are ignored, and a key named twice counts once; a key neither
    reserved, stored nor fenced raises.

    The rules are those of the chunk index (:mod:`kvtiers.tiers.index`), which the other
    tiers use (this tier keeps its own arrays for its pluggable policies; see
    docs/architecture.md): releasing more pins than held raises, changing nothing;
    ``touch`` of a key being written is ignored (the policy tracks ready keys only);
    ``prepare_store`` either reserves every key it returns or changes nothing.
    """

    medium = Medium.CPU
    locality = Locality.LOCAL

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        policy: EvictionPolicy | type[EvictionPolicy],
        *,
        region: SlotRegion | None = None,
        staging: bool = False,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"a CPU tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.policy = policy
        self._shields = policy.shields_request_head
        #: Whether this tier stages chunks for lower tiers that are written through (every
        #: chunk it stores is copied below: the stack builder decides, see
        #: :mod:`kvtiers.core.primary`): a store that does not fit whole then evicts for
        #: its leading keys too, not only the free slots.
        self.staging = staging
        # The region this manager's slots index; closed by shutdown().
        self.region = region
        # An instance-level declaration: LRU order holds only for policies that keep it.
        self.capabilities = TierCapabilities(
            persistent=False, evicts=True, recency=policy.recency, events=True
        )
        # Key → slot for ready keys, → _BEING_WRITTEN for keys being written, whose slots
        # are in _writing.
        self._slots: dict[OffloadKey, int] = {}
        self._writing: dict[OffloadKey, int] = {}
        # Slot → key of its ready chunk (None otherwise): how victim slots name their keys.
        self._keys: list[OffloadKey | None] = [None] * num_slots
        # The policy's order over ready slots: the built-ins' slot twins, any other policy
        # through its key-based API (kvtiers/policies/slots.py, slot_order).
        self._order: SlotOrder = slot_order(policy, num_slots, self._keys, self._slots.get)
        self._state = bytearray(num_slots)
        # Popped from the end, so slots are handed out in ascending order at first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pins: dict[OffloadKey, int] = {}
        # The reset fence: key → its fenced slots, oldest first; slot → completions it
        # still waits for (1 for a store, the pin count for a load), and the generation of
        # the jobs that hold it.
        self._fenced: dict[OffloadKey, list[int]] = {}
        self._fence_holds: dict[int, int] = {}
        self._fence_generation: dict[int, int] = {}
        # Slots of evicted chunks held for the caller of evict_held until release_held.
        self._held: set[int] = set()
        self._events: list[OffloadingEvent] = []
        # Where removed keys go instead of events once forward_removals was called.
        self._removed: list[OffloadKey] | None = None
        # Bumped by reset_cache: a request's access state, and a job, from before a reset
        # are stale.
        self._generation = 0
        self._hits = 0
        self._misses = 0
        self._stores = 0
        self._store_failures = 0
        self._evictions = 0
        self._loads = 0
        self._closed = False
        # Called by shutdown(): each closes one function lookup_as made, or is a caller's
        # (on_shutdown).
        self._closers: list[Callable[[], None]] = []
        # The hits and misses of each function lookup_as made.
        self._lookup_counts: list[Callable[[], tuple[int, int]]] = []

    # -- queries --------------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        slot = self._slots.get(key)
        if slot is None:
            self._misses += 1
            return _MISS
        if slot is _BEING_WRITTEN:
            return _PENDING
        self._hits += 1
        return _HIT

    def lookup_as(
        self,
        hit: _R,
        miss: _R,
        pending: _R,
        *,
        keys: KeyFormat | None = None,
        found: Mapping[Any, list[OffloadKey]] | None = None,
    ) -> Callable[[Any, Any], _R]:
        """:meth:`lookup` as one plain function answering ``hit`` / ``miss`` / ``pending``
        (an engine's own result values), counted the same: for an adapter whose keys are
        this tier's keys and whose stack is this tier alone, so a lookup costs one call.
        The function keeps reading the manager's live tables (it never rebinds them).

        With ``keys`` it keeps a composite's door where a key can lead anywhere: a key
        found present (which a load may follow) that is not ``bytes`` raises
        :class:`~kvtiers.errors.InvalidKeyError`, as does an unhashable key, and any lookup
        after :meth:`shutdown` raises :class:`~kvtiers.errors.ClosedError`, before anything
        is counted. Any other key the tier does not hold answers ``miss`` unchecked:
        nothing is loaded or stored for a miss, and ``prepare_store`` / ``prepare_load``
        check every key at the door. With ``found`` (each announced request's list, by
        ``req_id``) a key found present is appended to its request's list: the caller
        moves those keys into ``ctx.keep`` before a call that reads it (a list costs less
        to fill and to drop than a set)."""
        slot_of: Callable[[Any], int | None] = self._slots.get
        # Counted in the function's own cells (cheaper than the manager's attributes),
        # which get_stats adds up.
        hits = misses = 0

        def counts() -> tuple[int, int]:
            return hits, misses

        self._lookup_counts.append(counts)
        if keys is None:

            def lookup(key: Any, ctx: Any) -> _R:
                nonlocal hits, misses
                slot = slot_of(key)
                if slot is None:
                    misses += 1
                    return miss
                if slot is _BEING_WRITTEN:
                    return pending
                hits += 1
                return hit

            return lookup

        fmt = keys
        found_of = (found if found is not None else {}).get

        def refuse(key: Any) -> None:
            """Raise for a key the door refuses."""
            fmt.check(key, "lookup")

        def closed(key: Any) -> int | None:
            raise ClosedError("lookup: this CPU tier was shut down; build a new one")

        def close() -> None:
            # No closed flag read per lookup: from now on the probe itself raises.
            nonlocal slot_of
            slot_of = closed

        self._closers.append(close)

        def checked_lookup(key: Any, ctx: Any) -> _R:
            nonlocal hits, misses
            try:
                slot = slot_of(key)
            except TypeError:  # unhashable: not a key
                refuse(key)
                raise
            if slot is None:
                misses += 1
                return miss
            # Only keys the door let in were ever stored: a present key needs its type
            # checked alone (an equal bytes subclass is still refused).
            if type(key) is not bytes:
                refuse(key)
            keys_found = found_of(ctx.req_id)
            if keys_found is not None:
                keys_found.append(key)
            if slot is _BEING_WRITTEN:
                return pending
            hits += 1
            return hit

        return checked_lookup

    def get_spec(self, keys: Collection[OffloadKey]) -> CPULoadStoreSpec:
        slots = self._slots
        writing = self._writing
        pins = self._pins
        ids = []
        for key in keys:
            slot = slots.get(key)
            if slot is _BEING_WRITTEN:
                slot = writing[key]
            elif slot is None or key not in pins:
                raise UnknownKeyError(
                    f"get_spec: key {_shown(key)} is neither reserved by prepare_store nor "
                    "pinned by prepare_load in the CPU tier"
                )
            ids.append(slot)
        return CPULoadStoreSpec(ids)

    # -- store ----------------------------------------------------------------------
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        slots = self._slots
        free = self._free
        # C-level filters, not comprehensions: no frame per call (a batch is often 1 key).
        accepted = list(filterfalse(slots.__contains__, keys))
        if len(accepted) > 1:
            accepted = list(dict.fromkeys(accepted))  # a key named twice is reserved once
        # _access(ctx), inlined: once per store on the scheduler's path.
        access = ctx.get_state(_RequestAccess)
        if access is not None and (
            access.owner is not self or access.generation != self._generation
        ):
            access = None
        shortfall = len(accepted) - len(free)
        if shortfall > 0:
            # Every key is absent, or some are present (or named twice): only then look.
            present = [] if len(accepted) == len(keys) else list(filter(slots.__contains__, keys))
            # An announced request's earlier keys (nearer its head) outlive its later ones
            # where the policy asks (as in vLLM's LRU, where a running request's keys rank
            # tail first); a policy's own rule keeps it scan-resistant (ARC: a long prompt
            # does not take T2's keys, it stores what T1 has room for).
            shielded: Collection[OffloadKey] = (
                access.seen if access is not None and self._shields else ()
            )
            # Keys the caller counts as stored must survive the store that names them,
            # and the request's own prefix must survive its own stores and promotions.
            protected = _protected(self._pins, present, ctx.keep, shielded)
            order = self._order
            victims = order.evict(shortfall, protected, shielded)
            if victims is None:
                # Not all fit: reserve the leading keys the free slots hold. Evicting for
                # them would give up chunks the next requests reuse for the head of one
                # prompt that does not fit (benchmarks/results/hit_rate.md), except where
                # this tier stages for lower tiers: there what it evicts lives on below,
                # and the head it keeps reaches them.
                fit = len(free)
                if self.staging:
                    fit += order.evictable(protected, shielded)
                if fit <= 0:
                    return None
                del accepted[fit:]
                victims = order.evict(fit - len(free), protected, shielded) if self.staging else []
                assert victims is not None
            if victims:
                self._drop(victims)
        state = self._state
        writing = self._writing
        for key in accepted:
            slot = free.pop()
            slots[key] = _BEING_WRITTEN
            writing[key] = slot
            state[slot] = _WRITING
        if access is not None:
            access.seen.update(dict.fromkeys(keys))
            if len(accepted) < len(keys):
                access.reused.update(
                    key for key in keys
                    if key in slots and slots[key] is not _BEING_WRITTEN
                )
        return accepted

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        """See :meth:`OffloadingManager.complete_store`: a completion of an older
        ``generation`` releases the slot fenced for its job; with the current one, only
        the key's live reservation is completed; without one, the live reservation, else a
        fenced slot."""
        if generation is not None and generation != self._generation:
            self._complete_fenced(keys, _WRITING, generation, "complete_store")
            return
        slots = self._slots
        state = self._state
        # A completion that names the current generation never reaches a fenced slot.
        fenced = self._fenced if generation is None else {}
        # One C-level pass for the usual completion, where every key is reserved.
        if not all(map(slots.__contains__, keys)):
            for key in keys:
                if key not in slots and key not in fenced:
                    raise UnknownKeyError(
                        f"complete_store: key {_shown(key)} was never reserved by "
                        "prepare_store in the CPU tier (complete only the keys prepare_store "
                        "returned"
                        + ("" if generation is None else f", in generation {generation}")
                        + ")"
                    )
        # One pass that changes each slot's state as it goes, so a key named twice is
        # no longer WRITING (or no longer present) the second time: it counts once.
        done = []
        writing = self._writing
        if success:
            insert = self._order.insert
            slot_keys = self._keys
            for key in keys:
                if slots.get(key) is _BEING_WRITTEN:
                    slot = writing.pop(key)
                    slots[key] = slot
                    state[slot] = _READY
                    slot_keys[slot] = key
                    insert(slot)
                    done.append(key)
                elif fenced:
                    self._release_fenced(key, _WRITING, None)
            self._stores += len(done)
            if done and self._removed is None:
                self._events.append(self._event(done, removed=False))
        else:
            free = self._free
            for key in keys:
                if slots.get(key) is _BEING_WRITTEN:
                    del slots[key]
                    slot = writing.pop(key)
                    state[slot] = _FREE
                    free.append(slot)
                    done.append(key)
                elif fenced:
                    self._release_fenced(key, _WRITING, None)
            self._store_failures += len(done)
            if done and self._removed is None:
                self._events.append(dataclasses.replace(
                    self._event(done, removed=True), metadata_only=True
                ))

    # -- demotion -------------------------------------------------------------------
    def evict_held(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> dict[OffloadKey, int]:
        """Evict up to ``count`` ready chunks now, the policy's choice among those neither
        pinned nor in ``protected``, and hold their slots: the keys are gone (``MISS``,
        removal events), the slots keep their bytes and are not reused until
        :meth:`release_held` names them. Returns key → held slot (empty: nothing
        evictable)."""
        guard = _Protected(self._pins, protected)
        order = self._order
        count = min(count, order.evictable(guard))
        if count <= 0:
            return {}
        victims = order.evict(count, guard)
        assert victims is not None, "the policy refused victims it counted as evictable"
        slots = self._slots
        slot_keys = self._keys
        held: dict[OffloadKey, int] = {}
        for slot in victims:
            key = slot_keys[slot]
            assert key is not None
            slot_keys[slot] = None
            del slots[key]
            held[key] = slot
        self._held.update(victims)
        self._evictions += len(victims)
        self._removal(list(held))
        return held

    def held_keys(self) -> list[OffloadKey]:
        """Every key holding a slot (stored, or being written), in no order: what a caller
        accounting the tier's bytes by owner counts, ``slot_bytes`` each."""
        return list(self._slots)

    def hold_free(self, count: int) -> list[int]:
        """Take up to ``count`` free slots out of use for the caller (a demotion staging a
        chunk of a lower tier through them), as :meth:`evict_held` holds an evicted
        chunk's slot, until :meth:`release_held` names them. Returns the slots (empty:
        none free)."""
        taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
        for slot in taken:
            self._state[slot] = _WRITING
        self._held.update(taken)
        return taken

    def detach_writing(self, keys: Collection[OffloadKey]) -> dict[OffloadKey, int]:
        """Give up the reservations of ``keys`` whose bytes are still being written (a
        promotion abandoned in flight): each key is gone at once (``MISS``, a new store of
        it is accepted into another slot; a ``metadata_only`` removal, since it was never
        announced as stored) while its slot stays held, never reused, until
        :meth:`release_held` names it (when the write ends). Returns key → held slot; a key
        not being written is skipped."""
        slots = self._slots
        writing = self._writing
        held: dict[OffloadKey, int] = {}
        for key in keys:
            if slots.get(key) is _BEING_WRITTEN and key not in held:
                del slots[key]
                held[key] = writing.pop(key)
        if held:
            self._held.update(held.values())
            if self._removed is None:
                self._events.append(dataclasses.replace(
                    self._event(list(held), removed=True), metadata_only=True
                ))
        return held

    def release_held(self, slots: Iterable[int]) -> None:
        """Free slots :meth:`evict_held` or :meth:`hold_free` held. Raises, changing
        nothing, for a slot not held."""
        slots = list(dict.fromkeys(slots))
        unknown = [slot for slot in slots if slot not in self._held]
        if unknown:
            raise UnknownKeyError(
                f"release_held: slots {unknown} are not held by evict_held in the CPU tier "
                "(release each held slot once)"
            )
        for slot in slots:
            self._held.remove(slot)
            self._state[slot] = _FREE
            self._free.append(slot)

    @property
    def evictions(self) -> int:
        """Chunks evicted so far (by stores that needed room and by :meth:`evict_held`)."""
        return self._evictions

    @property
    def free_slots(self) -> int:
        """Slots free now (neither holding a chunk, fenced nor held)."""
        return len(self._free)

    # -- load -----------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._pin(keys, ctx)

    def prepare_load_spec(self, keys: Collection[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        """:meth:`prepare_load`, then the spec of its keys (what :meth:`get_spec` gives
        now), in one pass over them: for a caller that asks for both at once."""
        return CPULoadStoreSpec(self._pin(keys, ctx))

    def _pin(self, keys: Collection[OffloadKey], ctx: ReqContext) -> list[int]:
        """:meth:`prepare_load`; returns the keys' slots."""
        slots = self._slots
        ids = []
        for key in keys:
            slot = slots.get(key)
            if slot is None or slot is _BEING_WRITTEN:
                raise UnknownKeyError(
                    f"prepare_load: key {_shown(key)} is not stored in the CPU tier "
                    "(look it up first; only HIT keys can be loaded)"
                )
            ids.append(slot)
        self._loads += len(keys)
        pins = self._pins
        # _access(ctx), inlined: once per load on the scheduler's path.
        access = ctx.get_state(_RequestAccess)
        if access is not None and access.owner is self and access.generation == self._generation:
            # Counted as a use when the request finishes, in prefix order (one loop with the
            # pins: a load is often of one key).
            seen = access.seen
            for key in keys:
                pins[key] = pins.get(key, 0) + 1
                seen[key] = None
            access.reused.update(keys)
            return ids
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        # Earliest keys last (see touch); every key is ready (checked above).
        touch = self._order.touch
        for slot in reversed(ids):
            touch(slot)
        return ids

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        """Drop one pin per occurrence of each key. Raises, changing nothing, when a key
        would drop more pins than it holds. A completion of an older ``generation`` drops
        only the pins fenced for its job; with the current one, only live pins; without
        one, live pins first, then fenced ones."""
        if generation is not None and generation != self._generation:
            self._complete_fenced(keys, _READY, generation, "complete_load")
            return
        pins = self._pins
        if len(keys) == 1:
            # One key with a live pin (the usual batch of one): nothing to count.
            (key,) = keys
            held = pins.get(key, 0)
            if held > 1:
                pins[key] = held - 1
                return
            if held:
                del pins[key]
                return
        drops: dict[OffloadKey, int] = {}
        for key in keys:
            drops[key] = drops.get(key, 0) + 1
        fenced = self._fenced if generation is None else {}
        for key, count in drops.items():
            held = pins.get(key, 0)
            if held < count and fenced:
                held += self._fenced_pins(key)
            if held < count:
                raise UnknownKeyError(
                    f"complete_load: key {_shown(key)} is pinned {held} times in the CPU "
                    f"tier but released {count} times (complete each prepare_load once)"
                )
        for key, count in drops.items():
            held = pins.get(key, 0)
            if held > count:
                pins[key] = held - count
            elif held == count:
                del pins[key]
            else:
                # Pins beyond the live ones are those of loads from before a reset.
                pins.pop(key, None)
                for _ in range(count - held):
                    self._release_fenced(key, _READY, None)

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        # Earliest keys last, so a prompt's first chunks (shared by the most requests)
        # are the most recent.
        slots = self._slots
        touch = self._order.touch
        for key in reversed(list(keys)):
            slot = slots.get(key)
            if slot is not None and slot is not _BEING_WRITTEN:
                touch(slot)

    # -- lifecycle ------------------------------------------------------------------
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        ctx.set_state(_RequestAccess(self, self._generation))
        return RequestOffloadingContext()

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Make the request's keys recent again, tail first (see the module docstring)."""
        access = self._access(ctx)
        if access is None:
            return
        access.owner = None
        if not access.seen:
            return
        slots = self._slots
        touch = self._order.touch
        refresh = self._order.refresh
        reused = access.reused
        for key in reversed(access.seen):
            slot = slots.get(key)
            if slot is None or slot is _BEING_WRITTEN:
                continue  # evicted or not written yet: not tracked
            if key in reused:
                touch(slot)
            else:
                refresh(slot)

    def _access(self, ctx: ReqContext) -> _RequestAccess | None:
        """The live access state of a request announced to this manager, else ``None``."""
        access = ctx.get_state(_RequestAccess)
        if access is None or access.owner is not self or access.generation != self._generation:
            return None
        return access

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def forward_removals(self) -> list[OffloadKey]:
        """Build no events from now on: every key this tier removes (an evicted chunk's,
        one :meth:`reset_cache` forgot; never a freed reservation, which was not stored) is
        appended, in order, to the list returned instead, which the caller empties, and
        :meth:`take_events` returns no more. For an adapter that publishes no events and
        reports evictions itself: an event object per call is what a small batch costs
        most. Removals of events not yet taken move onto the list."""
        if self._removed is None:
            removed: list[OffloadKey] = []
            for event in self._events:
                if event.removed and not event.metadata_only:
                    removed += event.keys
            self._events.clear()
            self._removed = removed
        return self._removed

    @property
    def generation(self) -> int:
        """Resets so far: the generation a job planned now belongs to."""
        return self._generation

    def reset_cache(self) -> None:
        """Drop every chunk: ready, unpinned slots are free at once; the slots of keys
        being written or pinned are fenced (see the module docstring)."""
        state = self._state
        pins = self._pins
        remove = self._order.remove
        slot_keys = self._keys
        removed = []
        writing = self._writing
        for key, slot in self._slots.items():
            if slot is not _BEING_WRITTEN:
                remove(slot)
                slot_keys[slot] = None
                removed.append(key)
                held = pins.get(key, 0)
                if not held:
                    state[slot] = _FREE
                    self._free.append(slot)
                    continue
            else:
                slot = writing[key]
                held = 1
            self._fenced.setdefault(key, []).append(slot)
            self._fence_holds[slot] = held
            self._fence_generation[slot] = self._generation
        self._slots.clear()
        writing.clear()
        pins.clear()
        self._generation += 1
        if removed:
            self._removal(removed)

    def on_reset_flushed(self) -> None:
        """Free every fenced slot: no job from before the last reset touches them."""
        for slot in self._fence_holds:
            self._state[slot] = _FREE
            self._free.append(slot)
        self._fence_holds.clear()
        self._fence_generation.clear()
        self._fenced.clear()

    def get_stats(self) -> Mapping[str, float]:
        chunks = len(self._slots)
        return {
            "hits": self._hits + sum(count()[0] for count in self._lookup_counts),
            "misses": self._misses + sum(count()[1] for count in self._lookup_counts),
            "stores": self._stores,
            "store_failures": self._store_failures,
            "evictions": self._evictions,
            "loads": self._loads,
            "chunks": chunks,
            "pinned_chunks": len(self._pins),
            "fenced_slots": len(self._fence_holds),
            "held_slots": len(self._held),
            "usage_bytes": chunks * self.slot_bytes,
            "capacity_bytes": self.num_slots * self.slot_bytes,
        }

    def on_shutdown(self, callback: Callable[[], None]) -> None:
        """Have :meth:`shutdown` call ``callback`` (once, on this thread): for a caller
        that calls this tier directly and must stop doing so then."""
        self._closers.append(callback)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for close in self._closers:
            close()
        if self.region is not None:
            self.region.close()

    # -- internals ------------------------------------------------------------------
    def _drop(self, victims: list[int]) -> None:
        """Free the victim slots the order gave up and report their keys evicted."""
        slots = self._slots
        slot_keys = self._keys
        state = self._state
        free = self._free
        keys: list[OffloadKey] = []
        for slot in victims:
            key = slot_keys[slot]
            assert key is not None
            slot_keys[slot] = None
            del slots[key]
            state[slot] = _FREE
            free.append(slot)
            keys.append(key)
        self._evictions += len(keys)
        removed = self._removed
        if removed is None:
            self._events.append(self._event(keys, removed=True))
        else:
            removed += keys

    def _fenced_pins(self, key: OffloadKey) -> int:
        """Pins the fenced slots of ``key`` still wait for."""
        return sum(
            self._fence_holds[slot] for slot in self._fenced.get(key, ())
            if self._state[slot] == _READY
        )

    def _complete_fenced(
        self, keys: Collection[OffloadKey], kind: int, generation: int, method: str
    ) -> None:
        """A completion of a job of an older ``generation``: one release of its fenced
        slot per key named (see :meth:`_release_fenced`); nothing else changes."""
        if not 0 <= generation < self._generation:
            raise ValueError(
                f"{method}: generation {generation} is not one this CPU tier has had (it is "
                f"at {self._generation}); pass the generation read when the job's keys were "
                "reserved or pinned"
            )
        if self._fenced:
            for key in keys:
                self._release_fenced(key, kind, generation)

    def _release_fenced(self, key: OffloadKey, kind: int, generation: int | None) -> None:
        """One completion of a job from before a reset that holds a fenced slot of
        ``key`` (a store's for ``kind`` WRITING, a load's for READY) of ``generation`` (any,
        oldest first, for ``None``); the slot is free when its last completion came. No such
        slot (``on_reset_flushed`` freed it): nothing happens."""
        slots = self._fenced.get(key)
        if not slots:
            return
        state = self._state
        born = self._fence_generation
        index = next(
            (i for i, slot in enumerate(slots)
             if state[slot] == kind and (generation is None or born[slot] == generation)),
            None,
        )
        if index is None:
            return
        slot = slots[index]
        holds = self._fence_holds[slot] - 1
        if holds:
            self._fence_holds[slot] = holds
            return
        del self._fence_holds[slot]
        del born[slot]
        del slots[index]
        if not slots:
            del self._fenced[key]
        self._state[slot] = _FREE
        self._free.append(slot)

    def _removal(self, keys: list[OffloadKey]) -> None:
        """Report ``keys`` removed: an event, or onto the list :meth:`forward_removals`
        handed out."""
        if self._removed is None:
            self._events.append(self._event(keys, removed=True))
        else:
            self._removed += keys

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=Medium.CPU, removed=removed, locality=Locality.LOCAL
        )

    def slot_state(self, key: OffloadKey) -> SlotState:
        """State of ``key``'s slot (``FREE`` when the key is not present)."""
        slot = self.slot_of(key)
        return SlotState.FREE if slot is None else SlotState(self._state[slot])

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot holding ``key``, or ``None``."""
        slot = self._slots.get(key)
        return self._writing[key] if slot is _BEING_WRITTEN else slot

    def pin_count(self, key: OffloadKey) -> int:
        return self._pins.get(key, 0)
