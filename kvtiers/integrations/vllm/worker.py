"""Route 1's worker side: vLLM's ``OffloadingWorker`` over the primary tier's kvtiers
worker, and the shared memory both of an engine's processes map.

* A job's transfer arrives as vLLM addresses the engine's KV blocks: vLLM 0.32 and 0.33
  hand a packed ``GPULoadStoreSpec(block_ids, group_sizes, block_indices)``; vLLM 0.34
  hands ``DevicePointers`` its connector resolved from the same canonical KV tensors the
  worker was built over (flat ``ptrs`` / ``sizes`` per group, per data ref, per block).
  Either becomes one :class:`~kvtiers.core.specs.GroupTransfer` per group, the group's
  offloaded spec carrying ``block_indices[g]`` as its ``gpu_block_offset``: a pointer is
  turned back into its block id against the tensor of its data ref (base address and row
  stride), and every data ref of a group must name the same blocks with its own page size.
  A transfer that does not address the engine's KV tensors that way is refused as a
  failed job (``success=False`` from ``get_finished``), never an exception: vLLM 0.34
  asserts that a submission was accepted and recomputes a failed load.
* :class:`KVTiersLoadStoreSpec` is the manager's addressing of a job in the primary tier,
  one kvtiers spec per offloaded group.
* Scheduler and worker may run in different processes; both must see the same primary
  memory, so a ``cpu`` primary without ``shared_memory_name`` is given a ``/dev/shm``
  file both map, named after the user and the engine id (:func:`shared_memory_name`).
  Tensor and pipeline parallel ranks on one node share it too (see
  :mod:`kvtiers.integrations.vllm.spec`); ranks on other nodes cannot
  (:func:`check_one_node`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload import base as vbase

from kvtiers.config import CPUTierConfig, StackConfig
from kvtiers.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, GroupTransfer, LoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, OffloadingWorker, TransferResult
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm import compat
from kvtiers.tiers.cpu.region import SlotRegion, remove_left_overs
from kvtiers.tiers.cpu.shards import ShardLedger, ledger_name

logger = logging.getLogger(__name__)


class KVTiersLoadStoreSpec(vbase.LoadStoreSpec):
    """The primary tier's addressing of one job: one kvtiers spec per offloaded group,
    by position, each addressing that group's keys in the order vLLM gave them.
    ``stamp``: a sharded engine's store job's stamp in the shard ledger (0 otherwise)."""

    def __init__(self, groups: Sequence[LoadStoreSpec], stamp: int = 0) -> None:
        self.groups: tuple[LoadStoreSpec, ...] = tuple(groups)
        self.stamp = stamp

    def __len__(self) -> int:
        return sum(len(spec) for spec in self.groups)

    def __repr__(self) -> str:
        return f"KVTiersLoadStoreSpec({list(self.groups)!r})"



def _byte_rows(tensor: Any, index: int) -> Any:
    """``tensor`` as a ``(num_blocks, row_bytes)`` uint8 view (never a copy)."""
    import torch

    try:
        rows = tensor if tensor.dim() == 2 else tensor.view(tensor.shape[0], -1)
        return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)
    except RuntimeError as exc:
        raise ConfigError(
            f"KV tensor {index} of shape {tuple(tensor.shape)} cannot be viewed as "
            f"(num_blocks, bytes) without a copy: {exc}",
            path="kv_caches",
        ) from None


def kv_cache_tensors(kv_caches: Any) -> KVCacheTensors:
    """kvtiers' description of vLLM's ``CanonicalKVCaches`` (byte views, no copies)."""
    return KVCacheTensors(
        tensors=[_byte_rows(t.tensor, i) for i, t in enumerate(kv_caches.tensors)],
        groups=[
            [KVTensorRef(tensor_idx=ref.tensor_idx, page_bytes=ref.page_size_bytes) for ref in refs]
            for refs in kv_caches.group_data_refs
        ],
    )




class KVTiersWorker(vbase.OffloadingWorker):
    """vLLM's worker API over a kvtiers worker (see the module docstring).

    ``kv`` is the engine's KV tensors the worker copies to and from (vLLM 0.34 addresses
    them by pointer). Jobs run in submission order; an ``expedited`` load is not
    reordered.
    """

    def __init__(
        self,
        worker: OffloadingWorker,
        kv: KVCacheTensors,
        on_shutdown: Callable[[], None] | None = None,
        *,
        shard: tuple[int, ShardLedger] | None = None,
    ) -> None:
        self.worker = worker
        self._groups = kv.groups
        self._num_groups = len(kv.groups)
        # Each tensor's (base address, row stride in bytes, rows), to read a pointer back.
        self._rows = [
            (int(tensor.data_ptr()), int(tensor.stride(0)), int(tensor.shape[0]))
            for tensor in kv.tensors
        ]
        self._on_shutdown = on_shutdown
        self._closed = False
        # Jobs refused at submission, reported by the next get_finished.
        self._refused: list[vbase.TransferResult] = []
        # A sharded engine's rank and ledger, and each store job's (stamp, slots) in flight.
        self._shard = shard
        self._stores: dict[int, tuple[int, npt.NDArray[np.int64]]] = {}

    def split(self, device: Any, offloaded: Any) -> list[GroupTransfer]:
        """One transfer per group from the engine's side of a job (a packed GPU spec, or
        vLLM 0.34's ``DevicePointers``) and the manager's spec. Raises ``ValueError`` or
        ``TypeError`` when they do not describe one job over this worker's KV tensors."""
        if not isinstance(offloaded, KVTiersLoadStoreSpec):
            raise TypeError(f"expected a KVTiersLoadStoreSpec, got {offloaded!r}")
        indices = list(device.block_indices)
        if compat.POINTERS is not None and isinstance(device, compat.POINTERS):
            blocks = self._pointed_blocks(device)
        else:
            blocks = self._listed_blocks(device)
        if not len(blocks) == len(indices) == len(offloaded.groups) == self._num_groups:
            raise ValueError(
                f"{len(blocks)} device groups and {len(offloaded.groups)} offloaded groups "
                f"for {self._num_groups} KV-cache groups"
            )
        return [
            GroupTransfer(GPULoadStoreSpec(ids), copy.copy(spec).set_gpu_block_offset(index))
            for ids, index, spec in zip(blocks, indices, offloaded.groups, strict=True)
        ]

    @staticmethod
    def _listed_blocks(gpu: Any) -> list[npt.NDArray[np.int64]]:
        """Each group's block ids from a packed ``GPULoadStoreSpec``."""
        block_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        groups = []
        start = 0
        for size in gpu.group_sizes:
            groups.append(block_ids[start : start + size])
            start += size
        if start != block_ids.size:
            raise ValueError(f"group sizes {list(gpu.group_sizes)} for {block_ids.size} blocks")
        return groups

    def _pointed_blocks(self, pointers: Any) -> list[npt.NDArray[np.int64]]:
        """Each group's block ids from ``DevicePointers``: per group, per data ref, per
        block, each pointer ``base + block * stride`` of its data ref's tensor and each
        size that ref's page; every ref of a group naming the same blocks."""
        ptrs = np.asarray(pointers.ptrs, dtype=np.uint64)
        sizes = np.asarray(pointers.sizes, dtype=np.uint64)
        counts = tuple(pointers.group_block_counts)
        refs = tuple(pointers.group_data_ref_counts)
        if len(counts) != self._num_groups or len(refs) != self._num_groups:
            raise ValueError(
                f"pointers for {len(counts)} groups ({len(refs)} data-ref counts), the "
                f"engine has {self._num_groups} KV-cache groups"
            )
        if ptrs.shape != sizes.shape or ptrs.ndim != 1:
            raise ValueError(f"{ptrs.shape} pointers with {sizes.shape} sizes")
        groups: list[npt.NDArray[np.int64]] = []
        at = 0
        for g, (count, num_refs) in enumerate(zip(counts, refs, strict=True)):
            if count == 0:  # vLLM's resolution emits no pointer for an empty group
                groups.append(np.empty(0, dtype=np.int64))
                continue
            data_refs = self._groups[g]
            if num_refs != len(data_refs):
                raise ValueError(
                    f"group {g}: pointers for {num_refs} data refs, the engine's KV tensors "
                    f"have {len(data_refs)}"
                )
            blocks: npt.NDArray[np.int64] | None = None
            for ref in data_refs:
                end = at + count
                if end > ptrs.size:
                    raise ValueError(f"{ptrs.size} pointers, fewer than the groups count")
                blocks = self._blocks_of(g, ref, ptrs[at:end], sizes[at:end], blocks)
                at = end
            assert blocks is not None
            groups.append(blocks)
        if at != ptrs.size:
            raise ValueError(f"{ptrs.size} pointers, the groups count {at}")
        return groups

    def _blocks_of(
        self,
        group: int,
        ref: KVTensorRef,
        ptrs: npt.NDArray[np.uint64],
        sizes: npt.NDArray[np.uint64],
        expected: npt.NDArray[np.int64] | None,
    ) -> npt.NDArray[np.int64]:
        """The block ids ``ptrs`` address in ``ref``'s tensor (equal to ``expected``, the
        group's first ref's, when given)."""
        base, stride, rows = self._rows[ref.tensor_idx]
        # Unsigned: a pointer below the base wraps to a huge offset, out of range below.
        offsets = ptrs - np.uint64(base)
        blocks = offsets // np.uint64(stride)
        if (
            (offsets % np.uint64(stride)).any()
            or (blocks >= np.uint64(rows)).any()
            or (sizes != np.uint64(ref.page_bytes)).any()
        ):
            raise ValueError(
                f"group {group}: pointers or sizes outside KV tensor {ref.tensor_idx}'s "
                f"blocks of {ref.page_bytes} bytes"
            )
        ids = blocks.astype(np.int64)
        if expected is not None and not np.array_equal(ids, expected):
            raise ValueError(f"group {group}: its data refs address different blocks")
        return ids

    def _refuse(self, job_id: int, error: Exception) -> bool:
        """Report ``job_id`` failed at the next ``get_finished``; the submission itself is
        accepted (vLLM 0.34 asserts it was)."""
        logger.warning("kvtiers: transfer job %d refused: %s", job_id, error)
        self._refused.append(
            vbase.TransferResult(job_id=job_id, success=False, transfer_size=0, transfer_time=0.0)
        )
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """``src_spec``: the engine's blocks (``GPULoadStoreSpec``, or ``DevicePointers``
        on vLLM 0.34); ``dst_spec``: the manager's :class:`KVTiersLoadStoreSpec`."""
        try:
            transfers = self.split(src_spec, dst_spec)
            stamped = (dst_spec.stamp, _store_slots(dst_spec)) if self._shard else None
        except (TypeError, ValueError) as exc:
            return self._refuse(job_id, exc)
        if stamped is not None:
            self._stores[job_id] = stamped
        return self._submitted(job_id, self.worker.submit_store, transfers)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """``src_spec``: the manager's :class:`KVTiersLoadStoreSpec`; ``dst_spec``: the
        engine's blocks (``GPULoadStoreSpec``, or ``DevicePointers`` on vLLM 0.34)."""
        try:
            transfers = self.split(dst_spec, src_spec)
        except (TypeError, ValueError) as exc:
            return self._refuse(job_id, exc)
        return self._submitted(job_id, self.worker.submit_load, transfers)

    def _submitted(
        self,
        job_id: int,
        submit: Callable[[int, Sequence[GroupTransfer]], bool],
        transfers: list[GroupTransfer],
    ) -> bool:
        """Hand ``transfers`` to the kvtiers worker; one whose checks refuse them (ids
        out of range, chunks the blocks do not fill) fails the job instead of raising."""
        try:
            accepted = submit(job_id, transfers)
        except (TypeError, ValueError, IndexError) as exc:
            self._stores.pop(job_id, None)
            return self._refuse(job_id, exc)
        if not accepted:  # the kvtiers worker was shut down
            self._stores.pop(job_id, None)
            return self._refuse(job_id, RuntimeError("the worker is shut down"))
        return True

    def get_finished(self) -> list[Any]:
        refused, self._refused = self._refused, []
        results = self.worker.get_finished()
        if self._shard is not None:
            results = [self._stamped(r) for r in results]
        return refused + [
            vbase.TransferResult(
                job_id=r.job_id,
                success=r.success,
                transfer_size=r.transfer_bytes,
                transfer_time=r.transfer_s,
            )
            for r in results
        ]

    def _stamped(self, result: TransferResult) -> TransferResult:
        """A sharded rank's result: a store that completed stamps its slots in the
        ledger; one that failed stamps nothing and is reported finished, so the scheduler
        (which checks every rank's stamps) frees its chunks for every rank instead of vLLM
        stopping the engine."""
        store = self._stores.pop(result.job_id, None)
        if store is None:
            return result
        assert self._shard is not None
        rank, ledger = self._shard
        if result.success:
            stamp, slots = store
            ledger.stamp(rank, slots, stamp)
            return result
        logger.warning(
            "kvtiers: rank %d failed store job %d; its chunks will not be published",
            rank,
            result.job_id,
        )
        return dataclasses.replace(result, success=True, transfer_bytes=0)

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.worker.shutdown()
        if self._on_shutdown is not None:
            self._on_shutdown()


def _store_slots(spec: Any) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Every primary slot a sharded store job writes (its stamp must be set)."""
    if not isinstance(spec, KVTiersLoadStoreSpec) or spec.stamp <= 0:
        raise ValueError(
            f"a sharded engine's store needs a stamped KVTiersLoadStoreSpec, got {spec!r}"
        )
    slots = []
    for group in spec.groups:
        if not isinstance(group, CPULoadStoreSpec):
            raise TypeError(f"a sharded engine's primary is a cpu tier, got {group!r}")
        slots.append(np.asarray(group.slot_ids, dtype=np.int64))
    return np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)


def _shared_memory_prefix() -> str:
    return f"kvtiers-{os.geteuid()}-"


def shared_memory_name(engine_id: str) -> str:
    """The ``/dev/shm`` name both of an engine's processes derive for its cpu primary:
    ``kvtiers-<uid>-<sha256 of the engine id, 16 hex digits>``. Scoped to the user and the
    engine (vLLM's default engine id is a random UUID, so the name is not guessable), and
    short whatever the id; the region itself refuses a file it did not make."""
    digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{_shared_memory_prefix()}{digest[:16]}"


def check_one_node(engine: Any, ranks: int) -> None:
    """Refuse an engine whose ranks span nodes: they cannot map one primary region."""
    if engine is None:
        return
    nodes = int(getattr(engine.vllm.parallel_config, "nnodes_within_dp", 1) or 1)
    if nodes > 1:
        raise ConfigError(
            f"kvtiers' vLLM spec shares its cpu tier between the ranks of one node, and this "
            f"engine's {ranks} ranks span {nodes} nodes; use route 2 (vLLM's "
            "TieringOffloadingSpec with KVTiersFileTier / KVTiersS3Tier) instead",
            path="parallel",
        )


def slot_region(tier: BuiltTier) -> SlotRegion:
    """The memory of a sharded engine's primary ``tier``, which must be a cpu tier."""
    if not isinstance(tier.region, SlotRegion):
        raise ConfigError(
            f"tier {tier.name!r}: a sharded engine's primary must be a cpu tier",
            path="tiers[0].kind",
        )
    return tier.region


def engine_ledger_name(engine_id: str) -> str:
    """The ``/dev/shm`` name of the shard ledger of a sharded engine whose primary is a
    service's pool: the engine's own, beside the pool (the pool is the service's), named
    as a cpu primary's ledger would be. Left-overs of ended engines are removed first, as
    :func:`share_primary` does."""
    remove_left_overs(_shared_memory_prefix())
    return ledger_name(shared_memory_name(engine_id))


def share_primary(stack: StackConfig, engine_id: str) -> StackConfig:
    """``stack`` with a cpu primary placed in ``/dev/shm`` under a per-engine name."""
    primary = stack.tiers[0]
    if not isinstance(primary, CPUTierConfig) or primary.shared_memory_name is not None:
        return stack
    # A killed engine leaves its region (and ledger) behind under a name no later engine
    # derives: remove this user's that no process maps before adding another.
    remove_left_overs(_shared_memory_prefix())
    name = shared_memory_name(engine_id)
    shared = dataclasses.replace(primary, shared_memory_name=name)
    return dataclasses.replace(stack, tiers=(shared, *stack.tiers[1:]))

