"""``KVTiersServiceTier``: the node's pool held by ``kvtiers serve`` as a secondary tier of
vLLM's ``TieringOffloadingSpec`` (route 2 through the service; docs/service.md).

vLLM keeps its CPU tier; this tier sits below it, as :class:`KVTiersFileTier` does, and
shares everything with the other route-2 classes (:mod:`kvtiers.integrations.vllm.tiers`):
the chunk is vLLM's CPU chunk (every rank's bytes side by side), the namespace identity is
route 2's (``kv_layout: <layout>+vllm-cpu-chunk``), so the pool keeps these chunks apart
from route 1's and two route-2 engines of one model share them. The node then holds a
chunk twice in DRAM (vLLM's CPU tier and the pool), in exchange for sharing it between
engines and keeping it across engine restarts.

Scheduler side: the service tier's own manager (:class:`~kvtiers.service.tier.
ServiceTierManager`, no round trip for lookups, leased slots for stores, commits sent
with the step's end write), whose job addressing additionally names each slot's key
(:class:`PoolSlots`) so the mover reports key by key. What a dead service does is that
manager's: every lookup is a ``MISS`` within ``LIVENESS_S`` of the socket closing, a
store is refused at once (vLLM's job fails; nothing waits), a load planned before gets an
out-of-range slot and fails, and the tier reattaches at a later call when the service is
back (``retry_s``).

Copies (:class:`PoolMover`): host to host between vLLM's row and the pool slot, one task
per chunk, loads on a pool at the engine's priority and stores on a background one. Each
copy reads the slot's header first: a store's slot must still be the ``WRITING`` slot of
the generation it was leased with; a load's the ``READY`` chunk of the generation its
lookup found, and, after the copy, the same generation again (the seqlock's second read:
the service bumps it before a slot changes hands). Any other outcome fails that key
(:class:`~kvtiers.service.worker.StaleSlot`): vLLM recomputes it, and never receives bytes
of a chunk evicted mid-copy.

Not offered here: ``promotion_deadline_s`` (a promotion is one memory copy per chunk, no
I/O to wait for), a ``tenants:`` section (route 2 has none) and events (the pool's changes
are every engine's, so the tier reports none; vLLM's own CPU tier reports its stores).
A store the engine's lease cannot hold whole stores its leading keys and succeeds, as the
CPU tier does when a store does not fit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload import base as vbase

from kvtiers.config.tiers import ServiceTierConfig
from kvtiers.core.keys import OffloadKey
from kvtiers.core.specs import CPULoadStoreSpec, LoadStoreSpec
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.tiers import MemoryviewRegion, _KVTiersSecondaryTier
from kvtiers.service.pool import SlotState
from kvtiers.service.tier import ServiceTierManager
from kvtiers.service.worker import CheckedSlots, StaleSlot
from kvtiers.tiers.fanout import ChunkCopy, FanOutJob, FanOutMover, plan_chunks
from kvtiers.tiers.iopool import IOPool

if TYPE_CHECKING:
    from kvtiers.config.tiers import TierConfig
    from kvtiers.core.config import OffloadingConfig
    from kvtiers.core.tier import BuiltTier
    from kvtiers.service.pool import PoolView

logger = logging.getLogger(__name__)


class PoolSlots(CheckedSlots):
    """:class:`~kvtiers.service.worker.CheckedSlots` with, position by position, the key
    each slot holds (a load) or is written for (a store)."""

    def __init__(self, slot_ids: Iterable[int], generations: Sequence[int],
                 keys: Sequence[OffloadKey]) -> None:
        super().__init__(slot_ids, generations)
        self.keys = list(keys)


class RowsServiceManager(ServiceTierManager):
    """The service tier's manager addressing jobs by :class:`PoolSlots` (what
    :class:`PoolMover` copies between vLLM's rows and the pool)."""

    def get_spec(self, keys: Collection[OffloadKey]) -> PoolSlots:
        keys = list(keys)
        checked = super().get_spec(keys)
        return PoolSlots(checked.slot_ids, checked.generations, keys)


@dataclass
class _PoolJob(FanOutJob):
    """A job in flight with, per chunk, its pool slot and that slot's expected generation."""

    pool_slots: tuple[tuple[int, int], ...] = field(default=())


class PoolMover(FanOutMover[_PoolJob]):
    """Copies chunks between vLLM's rows (``rows``) and the mapped ``pool``, each checked
    against the slot's header around its copy (see the module docstring). ``chunk_bytes``
    is the chunk's length, the same in every row and slot."""

    def __init__(self, rows: MemoryviewRegion, pool: PoolView, chunk_bytes: int, *,
                 threads: int = 1) -> None:
        super().__init__("service tier")
        self.rows = rows
        self.pool = pool
        self.chunk_bytes = chunk_bytes
        #: Keys failed because their slot changed hands (a race the design expects: the
        #: chunk was evicted, or the service restarted, between lookup and copy).
        self.stale = 0
        self._loads = IOPool(threads, "kvtiers-pool-load")
        self._stores = IOPool(threads, "kvtiers-pool-store", background=True)

    def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> _PoolJob:
        # PoolSlots is a CPULoadStoreSpec too: test for it first.
        if isinstance(dst, PoolSlots) and not isinstance(src, PoolSlots) and isinstance(
            src, CPULoadStoreSpec
        ):
            store, rows, pool = True, src, dst
        elif isinstance(src, PoolSlots) and not isinstance(dst, PoolSlots) and isinstance(
            dst, CPULoadStoreSpec
        ):
            store, rows, pool = False, dst, src
        else:
            raise TypeError(f"a pool mover copies between vLLM's rows and pool slots, got "
                            f"{type(src).__name__} -> {type(dst).__name__}")
        slots = [int(s) for s in pool.slot_ids]
        chunks = plan_chunks(rows.slot_ids, pool.keys, (f"pool slot {s}" for s in slots))
        return _PoolJob(job_id, store, chunks,
                        pool_slots=tuple(zip(slots, pool.generations, strict=True)))

    def _start_task(self, task: Callable[[], None]) -> None:
        self._loads.submit(task)

    def _start_store_task(self, task: Callable[[], None]) -> None:
        self._stores.submit(task)

    def _copy(self, job: _PoolJob, chunk: ChunkCopy) -> int:
        slot, generation = job.pool_slots[chunk.index]
        self._check(slot, generation, SlotState.WRITING if job.store else SlotState.READY)
        size = self.chunk_bytes
        row = self.rows.view(chunk.slot)[:size]
        held = self.pool.view(slot)[:size]
        if job.store:
            self._move(held, row)
        else:
            self._move(row, held)
            # The seqlock's second read: a slot handed to another chunk during the copy
            # has a new generation, and the bytes read may be partly that chunk's.
            self._check(slot, generation, None)
        return size

    @staticmethod
    def _move(dst: memoryview, src: memoryview) -> None:
        """Copy ``src`` into ``dst`` (as long) through numpy, which lets go of the GIL for
        the copy, so the scheduler's thread runs beside a large chunk's copy."""
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))

    def _check(self, slot: int, generation: int, state: SlotState | None) -> None:
        """Raise :class:`StaleSlot` unless ``slot`` is in range, has ``generation`` and
        (unless ``state`` is ``None``) is in ``state``."""
        pool = self.pool
        if not 0 <= slot < pool.num_slots:
            raise StaleSlot(f"slot {slot}: the chunk was gone when the job was planned")
        found, found_state = pool.stamp(slot)
        if found != generation or (state is not None and found_state != state):
            raise StaleSlot(f"slot {slot} changed (generation {found}, state {found_state}; "
                            f"expected {generation})")

    def _chunk_failed(self, job: _PoolJob, chunk: ChunkCopy, error: Exception) -> None:
        """A stale slot is an expected race, counted and logged at debug level; any other
        failure warns as every mover's does."""
        if isinstance(error, StaleSlot):
            self.stale += 1
            logger.debug("%s: %s", self.name, error)
            return
        super()._chunk_failed(job, chunk, error)

    def _release(self, idle: bool) -> None:
        self._loads.shutdown(None if idle else 0.0, cancel_queued=not idle)
        self._stores.shutdown(None if idle else 0.0, cancel_queued=not idle)


class KVTiersServiceTier(_KVTiersSecondaryTier):
    """The node's pool held by ``kvtiers serve`` below vLLM's CPU tier (``kind: service``
    options: ``socket``, ``timeout_s``, ``retry_s``, ``lease_slots``); see the module
    docstring."""

    medium: ClassVar[Any] = vbase.Medium.CPU
    config_type = ServiceTierConfig

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **options: Any) -> None:
        where = f"secondary_tiers[type={tier_type}]"
        if options.get("promotion_deadline_s") is not None:
            raise ConfigError(
                "not offered by the service tier: a promotion from the pool is one memory "
                "copy per chunk, with no I/O to wait for",
                path=f"{where}.promotion_deadline_s",
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector,
                         **options)

    def _build_tier(self, tier_config: TierConfig, offloading: OffloadingConfig,
                    region: MemoryviewRegion, where: str) -> BuiltTier[Any]:
        """Attach to the service with route 2's identity (fail-closed: no service, no
        tier), and a :class:`PoolMover` between vLLM's rows and the pool."""
        from kvtiers.core.geometry import ChunkGeometry
        from kvtiers.core.tier import BuiltTier
        from kvtiers.filemapper import NamespaceIdentity
        from kvtiers.service.client import ServiceClient, ServiceDown

        assert isinstance(tier_config, ServiceTierConfig)
        identity = NamespaceIdentity.from_config(offloading)
        chunk_bytes = ChunkGeometry.from_config(offloading).max_chunk_bytes
        try:
            client = ServiceClient(tier_config.socket, identity.canonical_json(), chunk_bytes,
                                   engine=identity.namespace, timeout_s=tier_config.timeout_s,
                                   retry_s=tier_config.retry_s)
        except ServiceDown as exc:
            raise ConfigError(f"{exc}; start it with kvtiers serve",
                              path=f"{where}.socket") from None
        assert client.pool is not None  # attached: mapped (a slot too small refuses it)
        try:
            manager = RowsServiceManager(client, lease_slots=tier_config.lease_slots)
        except BaseException:
            client.close()
            raise
        mover = PoolMover(region, client.pool, chunk_bytes)
        return BuiltTier(name=tier_config.name, manager=manager, mover=mover)
