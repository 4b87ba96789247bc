"""The CPU tier's manager: slot bookkeeping for the host region, with a pluggable policy.

State per slot is explicit: :class:`SlotState` ``FREE`` / ``WRITING`` (reserved by
``prepare_store``, bytes in flight) / ``READY`` (stored), and, separately, a pin count per
pinned key (``prepare_load`` … ``complete_load``). Invariants:

- every key maps to exactly one slot and every non-free slot to exactly one key;
- only ``READY`` keys are tracked by the policy, and pinned keys are passed to it as
  protected, so eviction never picks a writing or pinned chunk;
- ``prepare_store`` either reserves every key it returns or returns ``None`` and changes
  nothing (the policy's ``evict`` is atomic, and it is the only step that can fail);
- the number of non-free slots never exceeds ``num_slots``.

Recency follows prefix order: a request's prompt head is shared by the most requests, so
within one batch of keys (given head to tail) the tail is made less recent than the head
— on ``touch``, and on ``prepare_load`` of a request not announced by ``on_new_request``
— and when an announced request finishes, every key it stored or loaded is made recent
again, tail first, the loaded ones as a use (``touch``) and the stored-only ones without
one (``refresh``). Under a recency policy (``lru``), while an announced request runs its
stores never evict its own earlier keys (nearer its head). The keys a request saw are
kept in its context's state, never in the manager.

Memory per tracked chunk is kept small: one dict entry key → slot id, one byte of state
per slot, the policy's own entry; pin counts exist only for pinned keys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvtiers.core.keys import OffloadKey
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
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.errors import UnknownKeyError
from kvtiers.policies.base import EvictionPolicy

if TYPE_CHECKING:
    from kvtiers.tiers.cpu.region import SlotRegion


class SlotState(IntEnum):
    """State of one slot of the host region."""

    FREE = 0
    WRITING = 1
    READY = 2


_WRITING = int(SlotState.WRITING)
_READY = int(SlotState.READY)
_FREE = int(SlotState.FREE)
_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_PENDING = LookupResult.HIT_PENDING
_R = TypeVar("_R")


class _Protected(Collection[OffloadKey]):
    """The union of three key collections, without building it (membership is what
    eviction asks; iteration, rarely needed, yields each key once)."""

    __slots__ = ("_a", "_b", "_c")

    def __init__(
        self, a: Collection[OffloadKey], b: Collection[OffloadKey], c: Collection[OffloadKey]
    ) -> None:
        self._a, self._b, self._c = a, b, c

    def __contains__(self, key: object) -> bool:
        return key in self._a or key in self._b or key in self._c

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(set(self._a).union(self._b, self._c))

    def __len__(self) -> int:
        """An upper bound: keys named by more than one part count once per part."""
        return len(self._a) + len(self._b) + len(self._c)


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

    ``policy`` is a fresh :class:`~kvtiers.policies.base.EvictionPolicy` sized for
    ``num_slots``. ``region``, when given, is closed by :meth:`shutdown`. Keys passed to
    ``complete_store`` that are not being written are ignored, and a key named twice
    counts once.

    The rules are those of :class:`~kvtiers.tiers.index.ChunkIndex`, which the other
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
        policy: EvictionPolicy,
        *,
        region: SlotRegion | None = None,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"a CPU tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.policy = policy
        # The region this manager's slots index; closed by shutdown().
        self.region = region
        # An instance-level declaration: LRU order holds only for policies that keep it.
        self.capabilities = TierCapabilities(
            persistent=False, evicts=True, recency=policy.recency, events=True
        )
        self._slots: dict[OffloadKey, int] = {}
        self._state = bytearray(num_slots)
        # Popped from the end, so slots are handed out in ascending order at first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._pins: dict[OffloadKey, int] = {}
        self._events: list[OffloadingEvent] = []
        # Bumped by reset_cache: a request's access state from before a reset is stale.
        self._generation = 0
        self._hits = 0
        self._misses = 0
        self._stores = 0
        self._store_failures = 0
        self._evictions = 0
        self._loads = 0

    # -- queries --------------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        slot = self._slots.get(key)
        if slot is None:
            self._misses += 1
            return _MISS
        if self._state[slot] == _READY:
            self._hits += 1
            return _HIT
        return _PENDING

    def lookup_as(self, hit: _R, miss: _R, pending: _R) -> Callable[[Any, Any], _R]:
        """:meth:`lookup` as one plain function answering ``hit`` / ``miss`` / ``pending``
        (an engine's own result values), counted the same: for an adapter whose keys are
        this tier's keys, so a lookup costs one call. (The manager never rebinds the
        tables it reads.)"""
        manager = self
        slot_of = self._slots.get
        state = self._state

        def lookup(key: Any, ctx: Any) -> _R:
            slot = slot_of(key)
            if slot is None:
                manager._misses += 1
                return miss
            if state[slot] == _READY:
                manager._hits += 1
                return hit
            return pending

        return lookup

    def get_spec(self, keys: Collection[OffloadKey]) -> CPULoadStoreSpec:
        slots = self._slots
        state = self._state
        pins = self._pins
        ids = [slots.get(key, -1) for key in keys]
        for key, slot in zip(keys, ids, strict=True):
            if slot < 0 or (state[slot] != _WRITING and key not in pins):
                raise UnknownKeyError(
                    f"get_spec: key {key.hex()} is neither reserved by prepare_store nor "
                    "pinned by prepare_load in the CPU tier"
                )
        return CPULoadStoreSpec(np.array(ids, dtype=np.int64))

    # -- store ----------------------------------------------------------------------
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        slots = self._slots
        accepted = list(dict.fromkeys(key for key in keys if key not in slots))
        shortfall = len(accepted) - len(self._free)
        if shortfall > 0:
            protected: Collection[OffloadKey] = self._pins
            present = [key for key in keys if key in slots]
            # Under a recency policy an announced request's earlier keys (nearer its head)
            # outlive its later ones, as in vLLM, where a running request's keys rank tail
            # first; frequency policies keep their scan resistance (a long prompt evicts
            # its own once-used keys first).
            access = self._access(ctx) if self.policy.recency else None
            if present or access is not None:
                # Keys the caller counts as stored must survive the store that names them.
                protected = _Protected(self._pins, present, () if access is None else access.seen)
            victims = self.policy.evict(shortfall, protected)
            if victims is None:
                return None
            self._drop(victims)
        free = self._free
        state = self._state
        for key in accepted:
            slot = free.pop()
            slots[key] = slot
            state[slot] = _WRITING
        access = self._access(ctx)
        if access is not None:
            access.seen.update(dict.fromkeys(keys))
            if len(accepted) < len(keys):
                access.reused.update(
                    key for key in keys if key in slots and state[slots[key]] == _READY
                )
        return accepted

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        slots = self._slots
        state = self._state
        # One pass that changes each slot's state as it goes, so a key named twice is
        # no longer WRITING (or no longer present) the second time: it counts once.
        done = []
        if success:
            insert = self.policy.insert
            for key in keys:
                slot = slots.get(key)
                if slot is not None and state[slot] == _WRITING:
                    state[slot] = _READY
                    insert(key)
                    done.append(key)
            self._stores += len(done)
            if done:
                self._events.append(self._event(done, removed=False))
        else:
            free = self._free
            for key in keys:
                slot = slots.get(key)
                if slot is not None and state[slot] == _WRITING:
                    del slots[key]
                    state[slot] = _FREE
                    free.append(slot)
                    done.append(key)
            self._store_failures += len(done)
            if done:
                event = self._event(done, removed=True)
                event.metadata_only = True
                self._events.append(event)

    # -- load -----------------------------------------------------------------------
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        slots = self._slots
        state = self._state
        for key in keys:
            slot = slots.get(key)
            if slot is None or state[slot] != _READY:
                raise UnknownKeyError(
                    f"prepare_load: key {key.hex()} is not stored in the CPU tier "
                    "(look it up first; only HIT keys can be loaded)"
                )
        pins = self._pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        self._loads += len(keys)
        access = self._access(ctx)
        if access is not None:
            # Counted as a use when the request finishes, in prefix order.
            access.seen.update(dict.fromkeys(keys))
            access.reused.update(keys)
            return
        # Earliest keys last (see touch).
        touch = self.policy.touch
        for key in reversed(list(keys)):
            touch(key)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Drop one pin per occurrence of each key. Raises, changing nothing, when a key
        would drop more pins than it holds."""
        pins = self._pins
        drops: dict[OffloadKey, int] = {}
        for key in keys:
            drops[key] = drops.get(key, 0) + 1
        for key, count in drops.items():
            if pins.get(key, 0) < count:
                raise UnknownKeyError(
                    f"complete_load: key {key.hex()} is pinned {pins.get(key, 0)} times in "
                    f"the CPU tier but released {count} times (complete each prepare_load once)"
                )
        for key, count in drops.items():
            left = pins[key] - count
            if left:
                pins[key] = left
            else:
                del pins[key]

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        # Earliest keys last, so a prompt's first chunks (shared by the most requests)
        # are the most recent.
        touch = self.policy.touch
        for key in reversed(list(keys)):
            touch(key)

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
        policy = self.policy
        reused = access.reused
        for key in reversed(list(access.seen)):
            if key in reused:
                policy.touch(key)
            else:
                policy.refresh(key)

    def _access(self, ctx: ReqContext) -> _RequestAccess | None:
        """The live access state of a request announced to this manager, else ``None``."""
        access = ctx.get_state(_RequestAccess)
        if access is None or access.owner is not self or access.generation != self._generation:
            return None
        return access

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Drop every ready, unpinned chunk; writing and pinned chunks stay."""
        victims = [
            key for key, slot in self._slots.items()
            if self._state[slot] == _READY and key not in self._pins
        ]
        for key in victims:
            self.policy.remove(key)
        self._free_slots(victims)
        self._generation += 1
        if victims:
            self._events.append(self._event(victims, removed=True))

    def get_stats(self) -> Mapping[str, float]:
        chunks = len(self._slots)
        return {
            "hits": self._hits,
            "misses": self._misses,
            "stores": self._stores,
            "store_failures": self._store_failures,
            "evictions": self._evictions,
            "loads": self._loads,
            "chunks": chunks,
            "pinned_chunks": len(self._pins),
            "usage_bytes": chunks * self.slot_bytes,
            "capacity_bytes": self.num_slots * self.slot_bytes,
        }

    def shutdown(self) -> None:
        if self.region is not None:
            self.region.close()

    # -- internals ------------------------------------------------------------------
    def _drop(self, victims: list[OffloadKey]) -> None:
        self._free_slots(victims)
        self._evictions += len(victims)
        self._events.append(self._event(victims, removed=True))

    def _free_slots(self, keys: list[OffloadKey]) -> None:
        slots = self._slots
        state = self._state
        free = self._free
        for key in keys:
            slot = slots.pop(key)
            state[slot] = _FREE
            free.append(slot)

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=Medium.CPU, removed=removed, locality=Locality.LOCAL
        )

    def slot_state(self, key: OffloadKey) -> SlotState:
        """State of ``key``'s slot (``FREE`` when the key is not present)."""
        slot = self._slots.get(key)
        return SlotState.FREE if slot is None else SlotState(self._state[slot])

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot holding ``key``, or ``None``."""
        return self._slots.get(key)

    def pin_count(self, key: OffloadKey) -> int:
        return self._pins.get(key, 0)
