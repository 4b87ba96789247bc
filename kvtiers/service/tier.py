"""``kind: service``: an engine's primary tier held by ``kvtiers serve`` (docs/service.md).

:class:`ServiceTierManager` is an :class:`~kvtiers.core.manager.OffloadingManager`
answering as the CPU tier does, with the pool in another process:

- ``lookup`` and ``prepare_load`` read the pool's index mirror and the slot header (no
  round trip); ``prepare_store`` takes leased slots (a ``Lease`` round trip in a step
  whose stores outrun the lease; with ``lease_slots: 0``, a ``Reserve`` round trip);
- ``prepare_load`` queues an advisory ``Pin`` of each slot it found, ``complete_store``
  and ``complete_load`` queue ``Commit``/``Unpin``: all are sent in one write at
  ``on_schedule_end`` (or pipelined with a round trip) that waits for nothing, their
  replies taken in as they arrive;
- ``get_spec`` addresses a job by :class:`~kvtiers.service.worker.CheckedSlots`: each
  slot with the header generation seen for it, which the worker checks around its copy,
  so a chunk evicted between lookup and copy fails its job (vLLM recomputes) instead of
  serving another chunk's bytes;
- with tiers below the pool in the service, a lookup that misses the mirror answers
  ``RETRY`` and queues the key for a ``Probe`` sent with the step's end write: the service
  promotes a lower-tier hit into the pool, and the key is a ``HIT`` once the mirror shows
  it; a key held nowhere, or not in the pool within ``probe_steps`` steps and
  ``probe_wait_s`` seconds of its first lookup (a lower tier failing, a promotion still
  running), is a ``MISS`` (recomputed);
- with retention (a ``retention:`` section in the engine's stack: the composite reads each
  request's hint, :func:`~kvtiers.stack.composite.request_hint`), the hint of each
  request that stores or loads keys is queued and sent as a ``Retain`` with the step's
  end write, after its commits, to a service whose status says it reads them (asked once
  per session, a round trip);
- while the service is down every lookup is a ``MISS``, ``prepare_store`` returns
  ``None``, and the keys of ``prepare_load`` get an out-of-range slot in ``get_spec`` so
  the worker fails their job (vLLM recomputes).

The tier is shared by every engine of the node: ``reset_cache`` drops this engine's own
reservations and pins only, never chunks others use. Its generation stays 0.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.primary import SlotState
from kvtiers.errors import UnknownKeyError
from kvtiers.service import protocol as p
from kvtiers.service.client import REFUSED, ServiceClient, ServiceDown
from kvtiers.service.pool import tag_of
from kvtiers.service.server import NO_ROOM
from kvtiers.service.worker import CheckedSlots, ServiceWorker
from kvtiers.stack.composite import request_hint

if TYPE_CHECKING:
    from kvtiers.config.tiers import ServiceTierConfig
    from kvtiers.core.config import OffloadingConfig
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.mover import HostRegion
    from kvtiers.core.tier import BuiltTier
    from kvtiers.core.worker import KVCacheTensors
    from kvtiers.policies.retention import RetentionHint

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
#: Steps and seconds a key that missed the pool may answer ``RETRY`` while the service
#: looks for it below the pool (both must pass); then it is a ``MISS`` (and stays one
#: for ``PROBE_FORGET`` x as many steps).
PROBE_STEPS = 16
PROBE_WAIT_S = 10.0
PROBE_FORGET = 4
#: A probe's answer not read yet (the service's answers: ``protocol.PROBE_*``).
_ASKED = -1
#: How often (seconds) a lookup polls the socket for the service's death: a dead service
#: is noticed within this bound and a step of lookups costs one poll at most.
LIVENESS_S = 0.001
#: Slots an engine keeps leased by default, so that its stores need no round trip.
DEFAULT_LEASE = 64
#: A lease is topped up to this many steps' worth of the last step's stores, so that a
#: service a few steps behind in answering does not make a store wait for a round trip.
LEASE_STEPS = 4
#: Requests whose replies may stay owed (about eight steps' writes) before a step's end
#: waits for the oldest.
MAX_OWED = 32
#: Keys per Commit or Unpin message (a frame stays far below the service's bound).
COMMIT_BATCH = 4096


class ServiceTierManager(OffloadingManager):
    """The engine's side of a service-held pool; see the module docstring.

    ``liveness_s`` bounds how long a dead service goes unnoticed by lookups (0: every
    lookup polls the socket)."""

    medium = Medium.CPU
    locality = Locality.LOCAL
    capabilities = TierCapabilities(persistent=False, evicts=True, recency=True, events=False)

    def __init__(self, client: ServiceClient, *, liveness_s: float = LIVENESS_S,
                 lease_slots: int = DEFAULT_LEASE, probe_steps: int = PROBE_STEPS,
                 probe_wait_s: float = PROBE_WAIT_S) -> None:
        import time

        self._clock = time.monotonic
        self.client = client
        assert client.pool is not None
        self.region = client.pool
        self.num_slots = client.pool.num_slots
        self._digest = client.digest
        self._liveness_s = liveness_s
        self._checked_at = -1.0
        self._alive = True
        #: 0: every prepare_store is a Reserve round trip; else the least number of
        #: leased slots kept at hand (more when a step stores more).
        # The service grants one connection an eighth of the pool at most.
        self._lease_cap = max(1, self.num_slots // 8)
        self._lease_min = min(lease_slots, self._lease_cap)
        self._lease: list[int] = []
        self._stored_since_flush = 0
        self._refilled = False
        #: key → slot reserved or leased for it by this engine (session ``_session``).
        self._reserved: dict[OffloadKey, int] = {}
        #: key → [slot (-1: lost), loads planned and not completed, generation seen].
        self._pinned: dict[OffloadKey, list[int]] = {}
        #: Pins to send at the step's end (key, slot), and per key the slots pinned by
        #: Pins queued or sent and not unpinned yet (this session's).
        self._pins: list[tuple[bytes, int]] = []
        self._held: dict[OffloadKey, list[int]] = {}
        #: Stores finished and not yet committed: key → slot.
        self._commits: dict[bytes, int] = {}
        #: Commits sent whose replies are not read yet (not stored again meanwhile).
        self._committing: dict[bytes, int] = {}
        #: Requests sent whose replies are owed, and slots asked for by them.
        self._inflight: list[p.Request] = []
        self._leasing = 0
        self._failed: list[tuple[bytes, int]] = []
        self._unpins: list[int] = []
        self._session = client.session
        #: Probes of keys that missed the pool (see the module docstring): the steps
        #: counted by on_schedule_end, the keys to send, and key → [first step, answer,
        #: first time in ms on ``_clock``].
        self._probe_steps = probe_steps
        self._probe_wait_s = probe_wait_s
        self._step = 0
        self._probe_queue: list[bytes] = []
        self._probing: dict[OffloadKey, list[int]] = {}
        #: The (lookups, hits) last sent in a Report (None: none this session).
        self._reported: tuple[int, int] | None = None
        #: Hints to send at the step's end: hint → its keys (this session's).
        self._hints: dict[RetentionHint, dict[bytes, None]] = {}
        #: Whether the service reads hints (``None``: not asked in this session yet).
        self._service_retains: bool | None = None
        self.stats = {"lookups": 0, "hits": 0, "round_trips": 0, "lost_loads": 0,
                      "down_lookups": 0, "duplicate_stores": 0, "pins_missed": 0,
                      "owed_waits": 0, "probes": 0, "probes_given_up": 0,
                      "retention_hints_sent": 0, "retention_hints_unsent": 0}
        if lease_slots:
            self.flush(wait=True)

    # -- liveness -------------------------------------------------------------------
    def _live(self) -> bool:
        now = self._clock()
        if now - self._checked_at >= self._liveness_s:
            self._checked_at = now
            was_alive = self._alive
            self._alive = self.client.available()
            if self.client.session != self._session or (was_alive and not self._alive):
                # Down, or back as a new session: nothing held before is ours any more.
                self._new_session()
        return self._alive

    def _new_session(self) -> None:
        """The service restarted (or we reattached): what we held belongs to no one."""
        self._session = self.client.session
        self._reported = None
        self._reserved.clear()
        self._lease.clear()
        for entry in self._pinned.values():
            entry[0] = -1
        self._commits.clear()
        self._committing.clear()
        self._inflight.clear()
        self._leasing = 0
        self._failed.clear()
        self._pins.clear()
        self._held.clear()
        self._unpins.clear()
        self._probe_queue.clear()
        self._probing.clear()
        self._hints.clear()
        self._service_retains = None

    def _queued(self, lease: bool) -> list[p.Request]:
        """The queued commits, pins and unpins (each pin before any unpin of its slot),
        probes, the engine's lookup counts when they changed, and a lease top-up, as
        requests (taken from the queues)."""
        client = self.client
        size = client.chunk_bytes
        queued: list[p.Request] = []
        commits = list(self._commits.items())
        for at in range(0, len(commits), COMMIT_BATCH):
            batch = commits[at : at + COMMIT_BATCH]
            queued.append(p.Commit(client.next_seq(), client.ns, [k for k, _ in batch],
                                   [s for _, s in batch], [size] * len(batch)))
        self._committing.update(self._commits)
        self._commits.clear()
        for at in range(0, len(self._failed), COMMIT_BATCH):
            batch = self._failed[at : at + COMMIT_BATCH]
            queued.append(p.Commit(client.next_seq(), client.ns, [k for k, _ in batch],
                                   [s for _, s in batch], [size] * len(batch), False))
        self._failed = []
        for at in range(0, len(self._pins), COMMIT_BATCH):
            pins = self._pins[at : at + COMMIT_BATCH]
            queued.append(p.Pin(client.next_seq(), client.ns, [k for k, _ in pins],
                                [s for _, s in pins]))
        self._pins = []
        for at in range(0, len(self._unpins), COMMIT_BATCH):
            queued.append(p.Unpin(client.next_seq(), client.ns,
                                  self._unpins[at : at + COMMIT_BATCH]))
        self._unpins = []
        for hint, hinted in self._hints.items() if self._service_retains else ():
            # After the commits: a hint names keys the service holds by now.
            keys = list(hinted)
            for at in range(0, len(keys), COMMIT_BATCH):
                queued.append(p.Retain(client.next_seq(), client.ns,
                                       keys[at : at + COMMIT_BATCH], hint.priority,
                                       hint.pin_s, hint.ttl_s))
            self.stats["retention_hints_sent"] += 1
        if self._service_retains:
            self._hints.clear()
        for at in range(0, len(self._probe_queue), COMMIT_BATCH):
            queued.append(p.Probe(client.next_seq(), client.ns,
                                  self._probe_queue[at : at + COMMIT_BATCH]))
        self._probe_queue = []
        counts = (self.stats["lookups"], self.stats["hits"])
        if counts != self._reported:
            # The service's per-engine counts (it sees no lookup: they read the mirror).
            queued.append(p.Report(client.next_seq(), client.ns, *counts))
            self._reported = counts
        if self._lease_min and lease:
            target = min(self._lease_cap,
                         max(self._lease_min, LEASE_STEPS * self._stored_since_flush))
            want = target - len(self._lease) - self._leasing
            if want > 0:
                queued.append(p.Lease(client.next_seq(), client.ns, want))
                self._leasing += want
        self._stored_since_flush = 0
        return queued

    def _exchange(self, extra: list[p.Request], *, lease: bool = True, wait: bool = True,
                  queued: bool = True) -> list[p.Reply] | None:
        """Send the queued calls (:meth:`_queued`; none unless ``queued``) and ``extra``
        in one write. With ``wait`` the replies still owed from earlier writes and those
        to this one are read (a round trip) and those to ``extra`` returned; without,
        the owed replies that have arrived are taken in, nothing is waited for unless
        more than ``MAX_OWED`` would stay owed, and the rest stay owed. ``None`` when the
        service is down (what was queued is dropped with the session: the service frees
        the slots of a closed connection)."""
        if not self._live():
            return None
        sending = self._queued(lease) if queued else []
        client = self.client
        try:
            owed, self._inflight = self._inflight, []
            if owed:
                got = client.receive(owed) if wait else client.receive_ready(owed)
                # A service far behind: wait for the oldest replies, so that what it
                # has to work through before answering a round trip stays bounded.
                excess = len(owed) - len(got) - MAX_OWED
                if excess > 0:
                    self.stats["owed_waits"] += 1
                    got += client.receive(owed[len(got) : len(got) + excess])
                self._absorb(owed[: len(got)], got)
                owed = owed[len(got) :]
            if sending or extra:
                client.send([*sending, *extra])
            if not wait:
                self._inflight = owed + sending
                return []
            replies = client.receive([*sending, *extra]) if sending or extra else []
        except ServiceDown:
            self._alive = False
            self._new_session()
            return None
        if sending or extra:
            self.stats["round_trips"] += 1
        self._absorb(sending, replies[: len(sending)])
        return replies[len(sending) :]

    def _absorb(self, requests: list[p.Request], replies: list[p.Reply]) -> None:
        """Take in the replies to queued calls: slots of commits another engine beat
        (held once: the slot is leased to us again) and granted leases."""
        for request, reply in zip(requests, replies, strict=True):
            if isinstance(request, p.Commit) and request.ok:
                assert isinstance(reply, p.Slots)
                for key, slot, result in zip(request.keys, request.slots, reply.slots,
                                             strict=True):
                    self._committing.pop(key, None)
                    if result == 0:
                        self.stats["duplicate_stores"] += 1
                        self._lease.append(slot)
            elif isinstance(request, p.Lease):
                assert isinstance(reply, p.Slots)
                self._leasing -= request.count
                self._lease.extend(reply.slots)
            elif isinstance(request, p.Probe):
                assert isinstance(reply, p.Slots)
                for key, answer in zip(request.keys, reply.slots, strict=True):
                    entry = self._probing.get(OffloadKey(key))
                    if entry is not None:
                        entry[1] = answer
            elif isinstance(request, p.Pin):
                # Not pinned: the key had left that slot (the load's worker check decides).
                assert isinstance(reply, p.Slots)
                self.stats["pins_missed"] += reply.slots.count(-1)

    def _call(self, request: p.Request) -> p.Reply | None:
        # Alone: the step's commits wait for its end, so the service answers this first.
        replies = self._exchange([request], queued=False)
        return None if replies is None else replies[0]

    def flush(self, *, wait: bool = False) -> None:
        """Send queued commits, pins and unpins and top the lease up, in one write,
        waiting for nothing; their replies are taken in as they arrive, at later calls
        (``wait``: now, so that the service has taken them in when this returns)."""
        self._check_retains()
        self._exchange([], wait=wait)

    # -- the contract ---------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self.stats["lookups"] += 1
        if not self._live():
            self.stats["down_lookups"] += 1
            return _MISS
        assert self.client.pool is not None
        if self.client.pool.find(tag_of(self._digest, key)) >= 0:
            self.stats["hits"] += 1
            return _HIT
        return self._probe(key) if self.client.lower else _MISS

    def _probe(self, key: OffloadKey) -> LookupResult:
        """A key that missed the mirror, with tiers below the pool: ``RETRY`` while the
        service looks for it (re-asked each step until it answers for good), ``MISS`` once
        it is held nowhere, in the pool yet not in the mirror, or past both
        ``probe_steps`` steps and ``probe_wait_s`` seconds."""
        entry = self._probing.get(key)
        if entry is None:
            self._probing[key] = [self._step, _ASKED, int(self._clock() * 1000)]
            self._probe_queue.append(bytes(key))
            self.stats["probes"] += 1
            return _RETRY
        answer = entry[1]
        if answer in (p.PROBE_MISS, p.PROBE_HIT):
            return _MISS
        if (self._step - entry[0] >= self._probe_steps
                and self._clock() * 1000 - entry[2] >= self._probe_wait_s * 1000):
            entry[1] = p.PROBE_MISS
            self.stats["probes_given_up"] += 1
            return _MISS
        if answer != _ASKED:
            # Pending or "ask again": ask again with this step's end write (a promotion
            # that failed is then answered as held nowhere).
            entry[1] = _ASKED
            self._probe_queue.append(bytes(key))
        return _RETRY

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        if self._lease_min:
            return self._store_leased(keys)
        keys = [k for k in dict.fromkeys(keys) if k not in self._reserved]
        if not keys:
            return []
        reply = self._call(p.Reserve(self.client.next_seq(), self.client.ns, list(keys)))
        if not isinstance(reply, p.Slots):
            return None
        accepted = []
        for key, slot in zip(keys, reply.slots, strict=True):
            if slot >= 0:
                self._reserved[key] = slot
                accepted.append(key)
        if not accepted and NO_ROOM in reply.slots:
            return None
        return accepted

    def _store_leased(self, keys: Collection[OffloadKey]) -> list[OffloadKey] | None:
        """Leased slots for the keys not present (no round trip; one Lease round trip a
        step at most when the lease ran out)."""
        if not self._live():
            return None
        pool = self.client.pool
        assert pool is not None
        digest = self._digest
        accepted: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            if key in self._reserved or key in self._commits or key in self._committing:
                continue
            if pool.find(tag_of(digest, key)) >= 0:
                continue
            if not self._lease and self._leasing:
                # Top-ups asked for at earlier step ends: take in those answered already.
                self._exchange([], wait=False, queued=False)
            if not self._lease and not self._refilled:
                self._refilled = True
                self._exchange([])
            if not self._lease:
                # Leading keys only, as the CPU tier does when not all fit.
                return accepted or None
            self._reserved[key] = self._lease.pop()
            accepted.append(key)
        return accepted

    def complete_store(self, keys: Collection[OffloadKey], ctx: ReqContext,
                       success: bool = True, *, generation: int | None = None) -> None:
        for key in keys:
            slot = self._reserved.pop(key, None)
            if slot is None:
                continue
            if success:
                self._commits[key] = slot
                self._stored_since_flush += 1
                self._hint(key, ctx)
            elif self._lease_min:
                self._lease.append(slot)  # still leased to this connection
            else:
                self._failed.append((key, slot))

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        """No round trip: each key's slot and generation from the mirror and header (the
        worker checks them around its copy) and a ``Pin`` queued for the step's end."""
        alive = self._live()
        locate = self.region.locate
        digest = self._digest
        for key in keys:
            entry = self._pinned.get(key)
            if entry is None:
                slot, generation = locate(tag_of(digest, key)) if alive else (-1, 0)
                entry = self._pinned[key] = [slot, 0, generation]
            entry[1] += 1
            slot = entry[0]
            if slot < 0:
                self.stats["lost_loads"] += 1
                continue
            self._hint(key, ctx)
            self._pins.append((bytes(key), slot))
            held = self._held.get(key)
            if held is None:
                self._held[key] = [slot]
            else:
                held.append(slot)

    def _hint(self, key: OffloadKey, ctx: ReqContext) -> None:
        """Queue ``ctx``'s retention hint, if it has one, for ``key``."""
        hint = request_hint(ctx)
        if hint is not None:
            self._hints.setdefault(hint, {})[bytes(key)] = None

    def _check_retains(self) -> None:
        """Ask the service once per session whether it reads hints (a service without a
        ``retention:`` section, or of an earlier release, does not: hints are dropped)."""
        if self._service_retains is None and self._hints:
            reply = self._call(p.Status(self.client.next_seq()))
            if isinstance(reply, p.StatusReply):
                self._service_retains = reply.state.get("retention") is not None
        if self._service_retains is False and self._hints:
            self.stats["retention_hints_unsent"] += len(self._hints)
            self._hints.clear()

    def get_spec(self, keys: Collection[OffloadKey]) -> CheckedSlots:
        ids = []
        generations = []
        region = self.region
        for key in keys:
            slot = self._reserved.get(key)
            if slot is not None:
                generation = region.generation(slot)  # WRITING since it was handed out
            else:
                entry = self._pinned.get(key)
                if entry is None:
                    raise UnknownKeyError(
                        "get_spec: a key neither reserved by prepare_store nor pinned by "
                        "prepare_load in the service tier"
                    )
                # A lost key's slot is out of range: the worker fails the job.
                slot = entry[0] if entry[0] >= 0 else self.num_slots
                generation = entry[2]
            ids.append(slot)
            generations.append(generation)
        return CheckedSlots(ids, generations)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext, *,
                      generation: int | None = None) -> None:
        for key in keys:
            entry = self._pinned.get(key)
            if entry is None:
                raise UnknownKeyError("complete_load: a key this tier has not pinned")
            entry[1] -= 1
            held = self._held.get(key)
            if held:
                self._unpins.append(held.pop())
                if not held:
                    del self._held[key]
            if entry[1] <= 0:
                del self._pinned[key]

    # -- core's slotted primary (a sharded engine's shard check addresses slots) ------
    @property
    def free_slots(self) -> int:
        """Slots leased to this engine and not handed to a store yet."""
        return len(self._lease)

    def slot_of(self, key: OffloadKey) -> int | None:
        """The slot this engine is writing ``key`` into, else the pool's slot holding it
        (from the mirror), else ``None``."""
        slot = self._reserved.get(key)
        if slot is not None:
            return slot
        found = self.region.find(tag_of(self._digest, key))
        return found if found >= 0 else None

    def slot_state(self, key: OffloadKey) -> SlotState:
        if key in self._reserved:
            return SlotState.WRITING
        return SlotState.READY if self.region.find(tag_of(self._digest, key)) >= 0 else (
            SlotState.FREE
        )

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self._step += 1
        if self._probing:
            # First steps are in insertion order: the oldest entries are at the front.
            horizon = self._step - PROBE_FORGET * self._probe_steps
            while self._probing:
                oldest = next(iter(self._probing))
                if self._probing[oldest][0] > horizon:
                    break
                del self._probing[oldest]
        self.flush()
        self._refilled = False

    def reset_cache(self) -> None:
        """The pool is shared: nothing of other engines is dropped (see the module)."""

    def get_stats(self) -> Mapping[str, float]:
        stats: dict[str, float] = dict(self.stats)
        stats["capacity_bytes"] = self.num_slots * self.region.slot_bytes
        stats["service_up"] = float(self.client.up)
        stats["service_downs"] = self.client.downs
        stats["service_reattaches"] = self.client.reattaches
        return stats

    def shutdown(self) -> None:
        """Commit what is finished (no new lease) and detach: the service frees the
        slots still leased."""
        self._exchange([], lease=False)
        self.client.close()


def build_tier(config: ServiceTierConfig, offloading: OffloadingConfig, *,
               primary_region: HostRegion | None, name: str,
               staging: bool = False) -> BuiltTier:
    """The ``kind: service`` tier ``name``: attaches to the service (fail-closed: no
    service, no stack) with this engine's namespace identity. The pool never stages
    (``staging`` is accepted and has no effect): the slots belong to the service, so a
    store larger than what this engine may take is refused, not evicted for."""
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.tier import BuiltTier
    from kvtiers.core.worker import OffloadingWorker
    from kvtiers.errors import ConfigError
    from kvtiers.filemapper import NamespaceIdentity

    if primary_region is not None:
        raise ConfigError(f"tier {name!r}: a service tier can only be the first tier",
                          path="kind")
    identity = NamespaceIdentity.from_config(offloading)
    geometry = ChunkGeometry.from_config(offloading)
    try:
        client = ServiceClient(config.socket, identity.canonical_json(),
                               geometry.max_chunk_bytes, engine=identity.namespace,
                               timeout_s=config.timeout_s, retry_s=config.retry_s)
    except ServiceDown as exc:
        raise ConfigError(f"tier {name!r}: {exc}{_start_hint(exc)}", path="socket") from None
    manager = ServiceTierManager(client, lease_slots=config.lease_slots,
                                 probe_wait_s=config.probe_wait_s)
    region = manager.region

    def make_worker(kv: KVCacheTensors) -> OffloadingWorker:
        return ServiceWorker(kv, region, geometry)

    return BuiltTier(name=name, manager=manager, region=region, make_worker=make_worker)


def attach_rank(config: ServiceTierConfig, offloading: OffloadingConfig, kv: KVCacheTensors,
                rank_geometry: ChunkGeometry, *, shard: tuple[int, int], writes: bool = True
                ) -> tuple[ServiceWorker, ServiceClient]:
    """A tensor-parallel rank's worker over the service's pool, in the rank's process: it
    attaches with the engine's namespace identity (``offloading``, which counts every
    rank's bytes) and maps the pool, and copies its ``shard`` of each slot (see
    :mod:`kvtiers.integrations.vllm.spec`). It takes no lease: the scheduler's tier owns
    the engine's slots. The caller closes the client after the worker."""
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.errors import ConfigError
    from kvtiers.filemapper import NamespaceIdentity

    identity = NamespaceIdentity.from_config(offloading)
    chunk_bytes = ChunkGeometry.from_config(offloading).max_chunk_bytes
    try:
        client = ServiceClient(config.socket, identity.canonical_json(), chunk_bytes,
                               engine=identity.namespace, timeout_s=config.timeout_s,
                               retry_s=config.retry_s)
    except ServiceDown as exc:
        raise ConfigError(f"{exc}{_start_hint(exc)}", path="tiers[0].socket") from None
    assert client.pool is not None
    try:
        return ServiceWorker(kv, client.pool, rank_geometry, shard=shard,
                             writes=writes), client
    except BaseException:
        client.close()
        raise


def _start_hint(exc: ServiceDown) -> str:
    # A service that answered and refused is running: its reason says what to change.
    return "" if REFUSED in str(exc) else "; start it with kvtiers serve"
