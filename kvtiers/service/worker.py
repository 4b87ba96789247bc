"""The engine's worker over a service-held pool: the CPU tier's copies, each checked
against the slot's header (docs/service.md, "Loads without a round trip").

The scheduler addresses a job with :class:`CheckedSlots`: each slot id and the header
generation the scheduler saw for it (a load: the ``READY`` chunk its lookup found; a
store: the ``WRITING`` slot it was leased or reserved). :class:`ServiceWorker` reads each
header before the copy (state and generation as expected) and, for a load, the
generation again after it. The service bumps a slot's generation at every change of its
header, before it hands the slot to anyone else, so a load whose slot kept its
generation across the copy read the chunk the scheduler found; any other outcome fails
that job (vLLM recomputes it). Pins are advisory: they make eviction skip a slot, they
are not what makes a load correct.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvtiers.core.specs import CPULoadStoreSpec, GroupTransfer
from kvtiers.service.pool import SlotState
from kvtiers.tiers.cpu.worker import CpuWorker

if TYPE_CHECKING:
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.worker import KVCacheTensors
    from kvtiers.service.pool import PoolView
    from kvtiers.tiers.queued_worker import QueuedJob


class StaleSlot(RuntimeError):
    """A slot's header is not what the scheduler saw: the job fails, nothing is served."""


class CheckedSlots(CPULoadStoreSpec):
    """CPU slot ids with, position by position, the header generation the scheduler saw
    (a slot id out of range marks a key the scheduler already knows is gone)."""

    def __init__(self, slot_ids: Iterable[int], generations: Sequence[int]) -> None:
        super().__init__(slot_ids)
        self.generations = list(generations)

    def __repr__(self) -> str:
        return f"CheckedSlots({self.slot_ids.tolist()!r}, {self.generations!r})"


class ServiceWorker(CpuWorker):
    """A :class:`~kvtiers.tiers.cpu.worker.CpuWorker` over the mapped ``pool`` whose
    jobs must be addressed by :class:`CheckedSlots`; see the module docstring."""

    thread_name = "kvtiers-service-worker"

    def __init__(self, kv: KVCacheTensors, pool: PoolView, geometry: ChunkGeometry, *,
                 shard: tuple[int, int] = (0, 1), writes: bool = True) -> None:
        # ``shard`` and ``writes``: a tensor-parallel rank's part of each slot, as the
        # CPU worker's (every rank checks the whole slot's header around its copy).
        super().__init__(kv, pool, geometry, shard=shard,  # type: ignore[arg-type]
                         writes=writes)
        self._pool = pool

    def _execute(self, job: QueuedJob) -> int:
        expected = self._expected(job.groups)
        self._check_slots(expected, SlotState.WRITING if job.store else SlotState.READY)
        moved = super()._execute(job)
        if not job.store:
            # The seqlock's second read: a slot handed to another store during the copy
            # has a new generation, and the bytes read may be partly the new chunk's.
            self._check_slots(expected, None)
        return moved

    def _expected(self, groups: Sequence[GroupTransfer]) -> list[tuple[int, int]]:
        """``(slot, generation)`` of every slot the job touches."""
        expected: list[tuple[int, int]] = []
        for transfer in groups:
            spec = transfer.offload_spec
            if not isinstance(spec, CheckedSlots):
                raise TypeError(f"a service pool's job needs CheckedSlots, got {spec!r}")
            if len(transfer.gpu_spec) == 0:
                continue
            expected.extend(zip(spec.slot_ids.tolist(), spec.generations, strict=True))
        return expected

    def _check_slots(self, expected: list[tuple[int, int]], state: SlotState | None) -> None:
        """Raise :class:`StaleSlot` unless every slot is in range, has its expected
        generation and (unless ``state`` is ``None``) is in ``state``."""
        pool = self._pool
        num_slots = pool.num_slots
        for slot, generation in expected:
            if not 0 <= slot < num_slots:
                raise StaleSlot(f"slot {slot}: the chunk was gone when the load was planned")
            found, found_state = pool.stamp(slot)
            if found != generation or (state is not None and found_state != state):
                raise StaleSlot(
                    f"slot {slot} changed (generation {found}, state {found_state}; "
                    f"expected {generation}"
                    + (f", state {int(state)})" if state is not None else ")")
                )
