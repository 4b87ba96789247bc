"""The manager contract every tier and the composite implement, with its supporting types.

A manager is the control plane of a tier: bookkeeping only, called by the engine
scheduler every step, so every method must be cheap and non-blocking; all I/O happens in
workers and movers. Managers never see KV-cache groups: a key is opaque bytes to them.

Lifecycle of a key in a tier::

    MISS --prepare_store--> reserved (HIT_PENDING) --complete_store(True)--> HIT
                                    \\--complete_store(False)--> MISS
    HIT --prepare_load--> pinned (still HIT, never evicted) --complete_load--> HIT

``get_spec(keys)`` addresses keys that are reserved or pinned, and nothing else.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, ClassVar, NamedTuple, TypeVar

from kvtiers.core.keys import OffloadKey
from kvtiers.core.specs import LoadStoreSpec

_T = TypeVar("_T")


class Medium(Enum):
    """Storage medium of a tier."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(Enum):
    """Where a tier's storage is relative to the engine that publishes into it."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class TierMatcher(NamedTuple):
    """Matches tiers by medium and locality; ``None`` on either side matches anything."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        medium_ok = self.medium is None or medium is None or self.medium == medium
        locality_ok = self.locality is None or locality is None or self.locality == locality
        return medium_ok and locality_ok


@dataclass(frozen=True)
class TierFilter:
    """Per-request choice of the tiers a lookup may load from."""

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        return any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter(matchers=(TierMatcher(),))


@dataclass
class ReqContext:
    """Per-request context handed to every manager call."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    #: The request's ``kv_hints`` envelope as the engine hands it (vLLM's
    #: ``KvHintsEnvelope``), or ``None``: read by :mod:`kvtiers.policies.retention`.
    kv_hints: Any = None
    load_tier_filter: TierFilter = TierFilter.ALL
    #: The end token of a key's chunk in this request's tokens, as the engine records it
    #: (vLLM does for every key it asks about), or ``None`` when it records none: the cost
    #: model places a request's chunks by it, since an engine may look a prefix up in any
    #: order (vLLM scans a sliding-window group from its end). Without it a group's chunks
    #: are taken to be asked for in prefix order.
    key_position: Callable[[OffloadKey], int | None] | None = field(default=None, repr=False)
    #: The request's ``cache_salt`` as the engine received it (``None``: none, or an
    #: engine that does not say): a ``tenants:`` section may name the tenant by it.
    cache_salt: str | None = None
    #: Keys no store or promotion for this request may evict: the chunks of its prefix
    #: that its lookups found in the primary or promoted into it, kept until it loads them
    #: (``prepare_load``) or finishes. A prefix larger than the primary then stops at what
    #: fits instead of evicting its own head (see docs/architecture.md, "Liveness").
    keep: set[OffloadKey] = field(default_factory=set, repr=False, init=False)
    # Per-request scratch space keyed by value type: a tier parses kv_transfer_params once
    # (in on_new_request) and reads the result back on later calls for the same request.
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        value = self._state.get(cls)
        return value if isinstance(value, cls) else None


class LookupResult(Enum):
    """Result of :meth:`OffloadingManager.lookup`."""

    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()
    RETRY = auto()


class OffloadScope(Enum):
    """Which of a request's blocks get offloaded. (vLLM calls this the request's offload
    "policy"; in kvtiers a policy is an eviction policy only, see :mod:`kvtiers.policies`.)
    """

    # Only newly computed blocks; blocks that were prefix hits are skipped.
    BLOCK_LEVEL = "block_level"
    # Every block of the request, prefix hits included.
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """What a manager asks of a new request (returned by ``on_new_request``)."""

    scope: OffloadScope = OffloadScope.BLOCK_LEVEL


class ScheduleEndContext(NamedTuple):
    """Per-step scheduling information passed to ``on_schedule_end``."""

    new_req_ids: Collection[str] = ()
    preempted_req_ids: Collection[str] = ()


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys that were stored into, or removed from, storage a manager owns (a value:
    whoever adds to it makes a copy with :func:`dataclasses.replace`)."""

    keys: list[OffloadKey]
    medium: Medium
    removed: bool
    locality: Locality | None = None
    # Name of the tier that owns the storage, None for the primary of a bare tier.
    ownership: str | None = None
    # A removal of bookkeeping only (a reservation freed after a failed store or
    # promotion): the keys were never announced as stored, so nothing was evicted.
    metadata_only: bool = False
    # Announced by a background listing of a shared namespace: chunks another server
    # published (stored) or that vanished from it (removed), not this tier's own.
    listed: bool = False


@dataclass(frozen=True)
class TierCapabilities:
    """What a tier can do; the conformance suite skips a test only through one of these.

    ``persistent``: stored chunks survive closing and reopening the tier.
    ``evicts``: a full tier evicts unpinned chunks to make room (else it refuses stores).
    ``recency``: eviction prefers the least recently used/touched chunk (LRU order).
    ``events``: stored/removed events are emitted.
    """

    persistent: bool = False
    evicts: bool = True
    recency: bool = True
    events: bool = True


class OffloadingManager(ABC):
    """Bookkeeping of one tier (or a composite of tiers). See the module docstring.

    Note to implementers: ``lookup``, ``prepare_store``, ``prepare_load``, ``get_spec`` and
    ``on_new_request`` are required; the rest have do-nothing defaults a tier overrides
    when it has state to keep.
    """

    #: What this tier can do; a read-only declaration, never discovered by exceptions.
    capabilities: TierCapabilities = TierCapabilities()
    #: Medium and locality, used by tier filters and events.
    medium: Medium = Medium.CPU
    locality: Locality = Locality.LOCAL

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """``HIT`` ready; ``HIT_PENDING`` present but still being written or promoted;
        ``MISS``; ``RETRY`` when an asynchronous probe is under way (ask again next step)."""

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        """Reserve space for the keys that need storing and return them, in input order.

        Keys already present (stored, or reserved by an earlier store) are not returned.
        May evict unpinned ready chunks to make room, never a key named in the batch nor one
        in ``ctx.keep``. When not all keys fit, a tier may reserve the leading ones that do
        and return just those (the CPU tier does: a prompt longer than the tier still
        stores its head). Returns ``None`` when the keys cannot be stored now, and then
        changes nothing at all.
        """

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Pin ``keys`` (each must currently be a ``HIT``) against eviction until
        :meth:`complete_load`. Pins count: a key pinned twice needs two completions."""

    @abstractmethod
    def get_spec(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        """Medium addressing of ``keys``, in order. Every key must be reserved (after
        ``prepare_store``) or pinned (after ``prepare_load``); any other key raises
        :class:`~kvtiers.errors.UnknownKeyError`. Called once per group by the scheduler."""

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """Mark ``keys`` recently used (no pin). Unknown keys are ignored."""

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        ctx: ReqContext,
        success: bool = True,
        *,
        generation: int | None = None,
    ) -> None:
        """Finish a store: on success the keys become ``HIT``; on failure their
        reservations are freed and they are ``MISS``.

        ``generation`` is the job's: :attr:`generation` as read when ``prepare_store``
        reserved the keys. A completion of an older generation is that of a job from before
        a :meth:`reset_cache`: it frees the memory fenced for that job and nothing else (the
        key's newer reservation, if any, waits for its own job), and stores nothing. A
        generation newer than the tier's raises ``ValueError``. ``None`` (the default)
        names no generation: the key's current reservation is completed when it has one,
        else memory fenced for it — right for an engine that never delivers a completion of
        a job from before a reset (vLLM drops them); an engine that does deliver them must
        pass each job's generation. A tier that keeps every reservation and pin across a
        reset ignores it."""

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        """Drop one pin of each key. ``generation`` is the job's, read when
        ``prepare_load`` pinned the keys, as for :meth:`complete_store`: a completion of an
        older generation drops only what the reset fenced for that job, never a newer pin."""

    @abstractmethod
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """A request is seen for the first time."""

    def on_request_finished(self, ctx: ReqContext) -> None:
        """No more submit-side calls will come for this request (completions may)."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored/removed events since the last call, for storage this manager owns."""
        return ()

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        """End of a scheduler step: flush batched probes, poll movers."""

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping (asynchronous work is in flight)."""
        return False

    @property
    def generation(self) -> int:
        """The tier's reset generation: 0 at first, one more at each :meth:`reset_cache`
        (see there). An engine reads it when it plans a job and
        passes it with the job's completion (``complete_store`` / ``complete_load``). A
        tier that keeps every reservation and pin across a reset stays at 0."""
        return 0

    def reset_cache(self) -> None:
        """Drop every chunk this manager can drop (persistent tiers keep their data).

        Keys being stored or pinned by a load are dropped too: they answer ``MISS`` at once
        and a new store of them is accepted, and :attr:`generation` moves on. The memory
        their jobs still touch is *fenced*: not reused until the job's completion, carrying
        its generation, names the key, or :meth:`on_reset_flushed` says no such job runs any
        more. An engine either drops the completions of jobs from before a reset (vLLM
        does) or delivers them with their generation (as
        :class:`~kvtiers.engine.scheduler.OffloadScheduler` does); either way it calls
        :meth:`on_reset_flushed` once its workers finished those jobs."""

    def on_reset_flushed(self) -> None:
        """No job from before the last :meth:`reset_cache` touches this tier's memory any
        more: fenced memory is free again."""

    def get_stats(self) -> Mapping[str, float]:
        """Counters and gauges; names are documented in the README."""
        return {}

    def wait_index(self) -> None:
        """Block until the chunks the medium held at start are indexed (a persistent tier
        builds that index in the background and answers ``RETRY`` for a key it has not
        found yet; docs/architecture.md, "Start-up"). For tests and tools that need a
        warm restart's answers at once; the scheduler never calls it. Returns at once
        for a tier without such an index."""

    def shutdown(self) -> None:
        """Release resources. Idempotent."""
