"""``kind: service``: an engine's primary tier held by ``kvtiers serve`` (docs/service.md).

:class:`ServiceTierManager` is an :class:`~kvtiers.core.manager.OffloadingManager`
answering as the CPU tier does, with the pool in another process:

- ``lookup`` reads the pool's index mirror and the slot header (no round trip);
- ``prepare_store`` and ``prepare_load`` are one round trip each (``Reserve``, ``Pin``);
- ``complete_store`` and ``complete_load`` queue ``Commit``/``Unpin``, sent pipelined with
  the next round trip or at ``on_schedule_end`` (at most one round trip a step);
- while the service is down every lookup is a ``MISS``, ``prepare_store`` returns
  ``None``, and the keys of ``prepare_load`` get an out-of-range slot in ``get_spec`` so
  the worker fails their job (vLLM recomputes) — never a slot the service may reuse.

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
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.errors import UnknownKeyError
from kvtiers.service import protocol as p
from kvtiers.service.client import ServiceClient, ServiceDown
from kvtiers.service.pool import tag_of
from kvtiers.service.server import NO_ROOM

if TYPE_CHECKING:
    from kvtiers.config.tiers import ServiceTierConfig
    from kvtiers.core.config import OffloadingConfig
    from kvtiers.core.mover import HostRegion
    from kvtiers.core.tier import BuiltTier

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
#: How often (seconds) a lookup polls the socket for the service's death: a dead service
#: is noticed within this bound and a step of lookups costs one poll at most.
LIVENESS_S = 0.001


class ServiceTierManager(OffloadingManager):
    """The engine's side of a service-held pool; see the module docstring.

    ``liveness_s`` bounds how long a dead service goes unnoticed by lookups (0: every
    lookup polls the socket)."""

    medium = Medium.CPU
    locality = Locality.LOCAL
    capabilities = TierCapabilities(persistent=False, evicts=True, recency=True, events=False)

    def __init__(self, client: ServiceClient, *, liveness_s: float = LIVENESS_S) -> None:
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
        #: key → slot reserved by this engine (session ``_session``).
        self._reserved: dict[OffloadKey, int] = {}
        #: key → [slot (-1: lost), pin count].
        self._pinned: dict[OffloadKey, list[int]] = {}
        self._commits: list[tuple[bytes, int]] = []
        self._failed: list[tuple[bytes, int]] = []
        self._unpins: list[bytes] = []
        self._session = client.session
        self.stats = {"lookups": 0, "hits": 0, "round_trips": 0, "lost_loads": 0,
                      "down_lookups": 0}

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
        self._reserved.clear()
        for entry in self._pinned.values():
            entry[0] = -1
        self._commits.clear()
        self._failed.clear()
        self._unpins.clear()

    def _call(self, request: p.Request) -> p.Reply | None:
        """``request`` after any queued commits and unpins, in one round trip; ``None``
        when the service is down (the queued calls are dropped with the session)."""
        if not self._live():
            return None
        requests = self._queued()
        requests.append(request)
        try:
            replies = self.client.call(requests)
        except ServiceDown:
            self._alive = False
            self._new_session()
            return None
        self.stats["round_trips"] += 1
        return replies[-1]

    def _queued(self) -> list[p.Request]:
        client = self.client
        requests: list[p.Request] = []
        size = self.client.chunk_bytes
        for batch, ok in ((self._commits, True), (self._failed, False)):
            if batch:
                keys = [k for k, _ in batch]
                slots = [s for _, s in batch]
                requests.append(p.Commit(client.next_seq(), client.ns, keys, slots,
                                         [size] * len(keys), ok))
                batch.clear()
        if self._unpins:
            requests.append(p.Unpin(client.next_seq(), client.ns, self._unpins))
            self._unpins = []
        return requests

    def flush(self) -> None:
        """Send queued commits and unpins now (one round trip, none if nothing is queued)."""
        if not (self._commits or self._failed or self._unpins) or not self._live():
            return
        try:
            self.client.call(self._queued())
        except ServiceDown:
            self._alive = False
            self._new_session()
            return
        self.stats["round_trips"] += 1

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
        return _MISS

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
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

    def complete_store(self, keys: Collection[OffloadKey], ctx: ReqContext,
                       success: bool = True, *, generation: int | None = None) -> None:
        target = self._commits if success else self._failed
        for key in keys:
            slot = self._reserved.pop(key, None)
            if slot is not None:
                target.append((key, slot))

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        wanted = list(dict.fromkeys(keys))
        reply = self._call(p.Pin(self.client.next_seq(), self.client.ns, list(map(bytes, wanted))))
        slots = reply.slots if isinstance(reply, p.Slots) else [-1] * len(wanted)
        found = dict(zip(wanted, slots, strict=True))
        for key in keys:
            slot = found[key]
            entry = self._pinned.get(key)
            if entry is None:
                self._pinned[key] = [slot, 1]
            else:
                # A second pin of a key: the service counted it too (or it is lost).
                entry[1] += 1
                if slot < 0 and entry[0] >= 0:
                    entry[0] = -1
            if slot < 0:
                self.stats["lost_loads"] += 1

    def get_spec(self, keys: Collection[OffloadKey]) -> CPULoadStoreSpec:
        ids = []
        for key in keys:
            slot = self._reserved.get(key)
            if slot is None:
                entry = self._pinned.get(key)
                if entry is None:
                    raise UnknownKeyError(
                        "get_spec: a key neither reserved by prepare_store nor pinned by "
                        "prepare_load in the service tier"
                    )
                # A lost key's slot is out of range: the worker fails the job.
                slot = entry[0] if entry[0] >= 0 else self.num_slots
            ids.append(slot)
        return CPULoadStoreSpec(ids)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext, *,
                      generation: int | None = None) -> None:
        for key in keys:
            entry = self._pinned.get(key)
            if entry is None:
                raise UnknownKeyError("complete_load: a key this tier has not pinned")
            entry[1] -= 1
            if entry[0] >= 0:
                self._unpins.append(key)
            if entry[1] <= 0:
                del self._pinned[key]

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.flush()

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
        self.flush()
        self.client.close()


def build_tier(config: ServiceTierConfig, offloading: OffloadingConfig, *,
               primary_region: HostRegion | None, name: str) -> BuiltTier:
    """The ``kind: service`` tier ``name``: attaches to the service (fail-closed: no
    service, no stack) with this engine's namespace identity."""
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.tier import BuiltTier
    from kvtiers.core.worker import KVCacheTensors, OffloadingWorker
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
        raise ConfigError(f"tier {name!r}: {exc}; start it with kvtiers serve",
                          path="socket") from None
    manager = ServiceTierManager(client)
    region = manager.region

    def make_worker(kv: KVCacheTensors) -> OffloadingWorker:
        from kvtiers.tiers.cpu.worker import CpuWorker

        return CpuWorker(kv, region, geometry)  # type: ignore[arg-type]

    return BuiltTier(name=name, manager=manager, region=region, make_worker=make_worker)
