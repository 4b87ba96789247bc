"""The GPU ⇄ CPU worker: copies the engine's KV blocks to and from CPU-tier slots.

Layout (see :mod:`kvtiers.core.geometry`): in a slot holding a chunk of group ``g``, the
group's layer tensors follow each other in order, each as ``blocks_per_chunk`` pages of
``page_bytes`` back to back. For a transfer of ``n`` GPU blocks, the ``k``-th block is the
sub-block ``p = skip + k`` of the chunk list, with ``skip = gpu_block_offset %
blocks_per_chunk``: chunk ``p // F``, sub-block ``p % F``. The last chunk may be partial.

Sharded engines (tensor / pipeline parallel ranks on one node, ``shard=(rank, ranks)``):
every rank's worker writes the same slots, and a chunk holds every rank's pages with the
rank innermost: for each layer tensor, for each sub-block, the ``ranks`` pages of that
tensor and block in rank order. Rank ``r``'s page of tensor ``t``, sub-block ``f`` sits at
``ranks x (offset of t) + (f x ranks + r) x page_bytes``. A chunk is then, block by block,
the concatenation of the ranks' pages, which is what vLLM calls a parallelism-agnostic
layout when the pages are head shards; the geometry a sharded worker is given is its own
(one rank's bytes per block).

CPU copies go through the fused page-copy kernel of :mod:`kvtiers.tiers.cpu.pagecopy` when
it builds: every (source, destination) page address of the job is computed at once with
numpy, bounds-checked, and one call moves each page once, in any layout, with the GIL
released, over up to ``copy_threads`` threads (one per ``MIN_BYTES_PER_THREAD``), and with
non-temporal stores for jobs of ``STREAMING_BYTES`` or more.

Without the kernel (no C compiler, ``kernel=False``, or KV tensors on a GPU), copies are
vectorised in torch: bytes move with ``index_select`` (gather) and ``index_copy_`` (scatter)
on the widest view the alignment allows (16-, 8-, 4-, 2- or 1-byte elements):
``index_copy_`` on ``uint8`` runs at a fraction of memory speed. When either side is evenly
spaced (consecutive GPU blocks, or slot pages at a constant stride) one indexed copy moves
the bytes in a single pass; otherwise a gather into a cache-sized staging buffer and a
scatter out of it take two (torch has no indexed-to-indexed copy). Slot pages are
addressed through one strided view of the region whose rows start every ``gcd(slot,
page)`` elements, so pages of partial chunks need no special case.

Jobs run on one worker thread, in submission order, through a bounded staging buffer.
When the KV tensors live on a GPU, the GPU side of each batch runs on a dedicated CUDA
stream (gather or scatter on the device, one DMA to or from a pinned staging buffer) and
the thread waits on a CUDA event before touching the staging buffer on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import CPULoadStoreSpec, GroupTransfer
from kvtiers.core.worker import KVCacheTensors
from kvtiers.errors import ConfigError
from kvtiers.tiers.queued_worker import (
    QueuedJob,
    QueuedWorker,
    check_ids,
    check_kv_geometry,
    dtype_for,
    widest_element,
)

if TYPE_CHECKING:
    import torch

    from kvtiers.tiers.cpu.pagecopy import PageCopier
    from kvtiers.tiers.cpu.region import SlotRegion


#: Bytes gathered or scattered per step: large enough to amortise call overhead, small
#: enough that the staging buffer stays in cache between the two halves of a copy.
DEFAULT_BATCH_BYTES = 1 << 20
#: Bytes a job must move per extra kernel thread: starting a thread costs about as much
#: as copying a few hundred KiB.
MIN_BYTES_PER_THREAD = 1 << 20
#: Threads past this add no bandwidth to a host memory copy.
MAX_COPY_THREADS = 8
#: Jobs moving at least this many bytes write with non-temporal stores: far larger than a
#: core's share of the last-level cache, their destination would only evict useful lines.
STREAMING_BYTES = 4 << 20


@dataclass(frozen=True)
class _TensorPlan:
    """How one layer tensor of a group maps onto slots.

    ``pages`` is the tensor as ``(num_blocks, page_elems)`` rows; ``slot_rows`` is the
    region as overlapping rows of ``page_elems`` starting every ``row_step`` elements from
    the tensor's (and rank's) offset inside a slot. The kernel path addresses the same
    pages by bytes: block ``b`` starts at ``pages_addr + b * block_stride``, and its page in
    slot ``s``, sub-block ``f`` at ``region address + s * slot_bytes + slot_offset + f *
    sub_stride`` (``sub_stride`` is ``page_bytes`` times the number of ranks sharing the
    slot; ``sub_elems`` the same in elements).
    """

    pages: torch.Tensor
    slot_rows: torch.Tensor
    page_bytes: int
    page_elems: int
    slot_elems: int
    row_step: int
    pages_addr: int
    block_stride: int
    num_blocks: int
    slot_offset: int
    sub_stride: int
    sub_elems: int


class CpuWorker(QueuedWorker):
    """Asynchronous copies between ``kv``'s tensors and ``region``'s slots.

    ``geometry`` must describe ``kv``: same number of groups, and group ``g``'s bytes per
    block equal to the sum of its tensors' page bytes. ``kernel``: ``None`` uses the fused
    page-copy kernel for host tensors when it builds, ``True`` requires it
    (:class:`~kvtiers.errors.ConfigError` if it cannot be built, or the tensors are on a
    GPU), ``False`` keeps the torch path. ``copy_threads`` caps the kernel's threads
    (default: torch's intra-op thread count, at most ``MAX_COPY_THREADS``).
    ``shard=(rank, ranks)``: this worker is rank ``rank`` of ``ranks`` whose pages share
    each slot (see the module docstring); ``geometry`` is then one rank's. ``writes=False``:
    a store job copies nothing and succeeds (KV every rank holds the same of, stored once
    by the rank that writes; loads still copy).
    """

    thread_name = "kvtiers-cpu-worker"

    def __init__(
        self,
        kv: KVCacheTensors,
        region: SlotRegion,
        geometry: ChunkGeometry,
        *,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        kernel: bool | None = None,
        copy_threads: int | None = None,
        shard: tuple[int, int] = (0, 1),
        writes: bool = True,
    ) -> None:
        import torch

        rank, ranks = shard
        if not 0 <= rank < ranks:
            raise ConfigError(
                f"shard rank {rank} is outside [0, {ranks}); give (rank, number of ranks)",
                path="shard",
            )
        self._rank, self._ranks = rank, ranks
        self._writes = writes
        self._check(kv, region, geometry, ranks)
        self.geometry = geometry
        self._blocks_per_chunk = geometry.blocks_per_chunk
        self._batch_bytes = batch_bytes
        self._device = kv.tensors[0].device
        self._cuda = self._device.type == "cuda"
        flat = region.tensor()
        self._plans = [self._plan_group(kv, flat, region.slot_bytes, refs) for refs in kv.groups]
        largest_page = max(plan.page_bytes for plans in self._plans for plan in plans)
        # A multiple of the widest element, so every view of it is legal.
        staging_bytes = -(-max(batch_bytes, largest_page) // 16) * 16
        self._staging = torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        self._stream: Any = torch.cuda.Stream(self._device) if self._cuda else None
        self._device_staging = (
            torch.empty(staging_bytes, dtype=torch.uint8, device=self._device)
            if self._cuda
            else None
        )
        self._intra_op_threads = torch.get_num_threads()
        if copy_threads is not None and copy_threads < 1:
            raise ConfigError(
                f"copy_threads must be at least 1, got {copy_threads}", path="copy_threads"
            )
        self._copy_threads = copy_threads or min(self._intra_op_threads, MAX_COPY_THREADS)
        self._region_addr = flat.data_ptr()
        self._num_slots = region.num_slots
        self._slot_bytes = region.slot_bytes
        self._copier = self._load_kernel(kernel)
        super().__init__()

    def _load_kernel(self, wanted: bool | None) -> PageCopier | None:
        if wanted is False:
            return None
        if self._cuda:
            if wanted:
                raise ConfigError(
                    "the page-copy kernel copies host memory only; these KV tensors are on "
                    f"{self._device}",
                    path="kernel",
                )
            return None
        from kvtiers.tiers.cpu.pagecopy import load_page_copier

        copier = load_page_copier()
        if copier is None and wanted:
            raise ConfigError(
                "the CPU page-copy kernel could not be built (see the warning above); "
                "install a C compiler or set CC",
                path="kernel",
            )
        return copier

    @property
    def uses_kernel(self) -> bool:
        """Whether copies go through the fused page-copy kernel."""
        return self._copier is not None

    # -- construction ---------------------------------------------------------------
    @staticmethod
    def _check(
        kv: KVCacheTensors, region: SlotRegion, geometry: ChunkGeometry, ranks: int
    ) -> None:
        check_kv_geometry(kv, geometry)
        if region.slot_bytes < geometry.max_chunk_bytes * ranks:
            raise ConfigError(
                f"CPU slots of {region.slot_bytes} bytes cannot hold a chunk of "
                f"{geometry.max_chunk_bytes} bytes from each of {ranks} rank(s)",
                path="slot_bytes",
            )

    def _plan_group(
        self, kv: KVCacheTensors, flat: torch.Tensor, slot_bytes: int, refs: Sequence[Any]
    ) -> list[_TensorPlan]:
        import torch

        plans = []
        ranks = self._ranks
        offset = 0
        for ref in refs:
            tensor = kv.tensors[ref.tensor_idx]
            # This rank's first page of the tensor; its sub-blocks follow every `ranks` pages.
            start_bytes = offset + self._rank * ref.page_bytes
            size = widest_element(
                ref.page_bytes,
                tensor.stride(0),
                tensor.storage_offset(),
                tensor.data_ptr(),
                start_bytes,
                slot_bytes,
            )
            dtype = dtype_for(size)
            page_elems = ref.page_bytes // size
            pages = tensor.view(dtype)[:, :page_elems]
            wide = flat.view(dtype)
            slot_elems = slot_bytes // size
            row_step = math.gcd(slot_elems, page_elems)
            start = start_bytes // size
            num_rows = (wide.numel() - start - page_elems) // row_step + 1
            slot_rows = torch.as_strided(wide, (num_rows, page_elems), (row_step, 1), start)
            plans.append(
                _TensorPlan(
                    pages,
                    slot_rows,
                    ref.page_bytes,
                    page_elems,
                    slot_elems,
                    row_step,
                    pages_addr=tensor.data_ptr(),
                    block_stride=tensor.stride(0) * tensor.element_size(),
                    num_blocks=tensor.shape[0],
                    slot_offset=start_bytes,
                    sub_stride=ref.page_bytes * ranks,
                    sub_elems=page_elems * ranks,
                )
            )
            offset += ref.page_bytes * self._blocks_per_chunk * ranks
        return plans

    # -- submission -----------------------------------------------------------------
    def _validate(self, groups: Sequence[GroupTransfer], store: bool) -> None:
        if len(groups) > len(self._plans):
            raise ValueError(f"{len(groups)} group transfers for {len(self._plans)} groups")
        for g, transfer in enumerate(groups):
            self._check_transfer(g, transfer)

    def _ready_marker(self) -> Any:
        """CUDA: an event on the submitting stream, so copies start after the kernels
        that produced (store) or last read (load) the blocks."""
        if not self._cuda:
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record()
        return ready

    def _check_transfer(self, group: int, transfer: GroupTransfer) -> None:
        spec = transfer.offload_spec
        if not isinstance(spec, CPULoadStoreSpec):
            raise TypeError(f"group {group}: expected a CPULoadStoreSpec, got {spec!r}")
        per_chunk = self._blocks_per_chunk
        blocks = len(transfer.gpu_spec) + spec.gpu_block_offset % per_chunk
        chunks = len(spec)
        if transfer.gpu_spec.block_ids.size and not (
            (chunks - 1) * per_chunk < blocks <= chunks * per_chunk
        ):
            raise ValueError(
                f"group {group}: {len(transfer.gpu_spec)} GPU blocks at offset "
                f"{spec.gpu_block_offset} do not fill {chunks} chunks of {per_chunk} blocks"
            )

    # -- the worker thread ----------------------------------------------------------
    def _on_thread_start(self) -> None:
        import torch

        # torch's OpenMP pool runs a new thread's ops on one core until the thread sets
        # its own count; give the copies the caller's intra-op parallelism.
        torch.set_num_threads(self._intra_op_threads)

    def _execute(self, job: QueuedJob) -> int:
        if job.store and not self._writes:
            return 0
        if self._copier is not None:
            return self._execute_fused(job, self._copier)
        if job.ready is not None:
            self._stream.wait_event(job.ready)
        moved = 0
        for g, transfer in enumerate(job.groups):
            self._transfer_group(g, transfer, job.store)
            moved += len(transfer.gpu_spec) * self.geometry.group_bytes_per_block[g]
        return moved

    def _execute_fused(self, job: QueuedJob, copier: PageCopier) -> int:
        """Every page of the job in one kernel call, after checking every id is in range
        (the kernel copies whatever addresses it is given)."""
        per_chunk = self._blocks_per_chunk
        gpu: list[npt.NDArray[np.int64]] = []
        host: list[npt.NDArray[np.int64]] = []
        sizes: list[npt.NDArray[np.int64]] = []
        moved = 0
        for g, transfer in enumerate(job.groups):
            block_ids = transfer.gpu_spec.block_ids
            if block_ids.size == 0:
                continue
            spec = transfer.offload_spec
            assert isinstance(spec, CPULoadStoreSpec)
            skip = spec.gpu_block_offset % per_chunk
            positions = np.arange(block_ids.size, dtype=np.int64) + skip
            slots = spec.slot_ids[positions // per_chunk]
            subs = positions % per_chunk
            plans = self._plans[g]
            check_ids(g, block_ids, min(plan.num_blocks for plan in plans), "GPU block")
            check_ids(g, slots, self._num_slots, "slot")
            slot_addrs = self._region_addr + slots * self._slot_bytes
            for plan in plans:
                gpu.append(plan.pages_addr + block_ids * plan.block_stride)
                host.append(slot_addrs + (plan.slot_offset + subs * plan.sub_stride))
                sizes.append(np.full(block_ids.size, plan.page_bytes, dtype=np.int64))
            moved += block_ids.size * self.geometry.group_bytes_per_block[g]
        if gpu:
            src, dst = np.concatenate(gpu), np.concatenate(host)
            if not job.store:
                src, dst = dst, src
            threads = max(1, min(self._copy_threads, moved // MIN_BYTES_PER_THREAD))
            streaming = moved >= STREAMING_BYTES
            copier.copy(dst, src, np.concatenate(sizes), threads, streaming=streaming)
        return moved

    def _transfer_group(self, group: int, transfer: GroupTransfer, store: bool) -> None:
        import torch

        block_ids = transfer.gpu_spec.block_ids
        if block_ids.size == 0:
            return
        per_chunk = self._blocks_per_chunk
        spec = transfer.offload_spec
        assert isinstance(spec, CPULoadStoreSpec)
        positions = np.arange(block_ids.size, dtype=np.int64) + spec.gpu_block_offset % per_chunk
        slots = spec.slot_ids[positions // per_chunk]
        subs = positions % per_chunk
        blocks = torch.from_numpy(block_ids)
        if self._cuda:
            plans = self._plans[group]
            check_ids(group, block_ids, min(plan.num_blocks for plan in plans), "GPU block")
            check_ids(group, slots, self._num_slots, "slot")
            blocks = blocks.to(self._device)
        for plan in self._plans[group]:
            rows = (slots * plan.slot_elems + subs * plan.sub_elems) // plan.row_step
            if self._cuda:
                self._copy_batched(plan, blocks, torch.from_numpy(rows), store)
            elif self._copy_run(plan, block_ids, rows, store):
                continue
            elif per_chunk == 1:
                self._copy_batched(plan, blocks, torch.from_numpy(rows), store)
            else:
                # Sub-block f of consecutive slots sits at a constant stride even when
                # the chunk's pages do not, so each class can still go in one pass.
                for sub in range(per_chunk):
                    chosen = subs == sub
                    self._copy_run_or_batched(plan, block_ids[chosen], rows[chosen], store)

    def _copy_run_or_batched(
        self,
        plan: _TensorPlan,
        block_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        store: bool,
    ) -> None:
        import torch

        if rows.size and not self._copy_run(plan, block_ids, rows, store):
            self._copy_batched(plan, torch.from_numpy(block_ids), torch.from_numpy(rows), store)

    def _copy_run(
        self,
        plan: _TensorPlan,
        block_ids: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        store: bool,
    ) -> bool:
        """One-pass copy when either side is evenly spaced (GPU blocks at a constant step,
        or slot pages at a constant stride, as a fresh tier hands out). False: neither is."""
        import torch

        steps = np.diff(rows)
        if rows.size == 1 or (steps[0] > 0 and (steps == steps[0]).all()):
            stride = int(steps[0]) * plan.row_step if rows.size > 1 else plan.page_elems
            run = torch.as_strided(
                plan.slot_rows,
                (rows.size, plan.page_elems),
                (stride, 1),
                plan.slot_rows.storage_offset() + int(rows[0]) * plan.row_step,
            )
            index = torch.from_numpy(block_ids)
            if store:
                torch.index_select(plan.pages, 0, index, out=run)
            else:
                plan.pages.index_copy_(0, index, run)
            return True
        gaps = np.diff(block_ids)
        if gaps[0] > 0 and (gaps == gaps[0]).all():
            start, gap = int(block_ids[0]), int(gaps[0])
            run = plan.pages[start : start + gap * (block_ids.size - 1) + 1 : gap]
            index = torch.from_numpy(rows)
            if store:
                plan.slot_rows.index_copy_(0, index, run)
            else:
                torch.index_select(plan.slot_rows, 0, index, out=run)
            return True
        return False

    def _copy_batched(
        self, plan: _TensorPlan, blocks: torch.Tensor, rows: torch.Tensor, store: bool
    ) -> None:
        """Gather into the staging buffer, then scatter from it, a batch at a time."""
        import torch

        dtype = plan.pages.dtype
        per_batch = max(1, self._batch_bytes // plan.page_bytes)
        staging = self._staging.view(dtype)
        for begin in range(0, rows.numel(), per_batch):
            b, r = blocks[begin : begin + per_batch], rows[begin : begin + per_batch]
            host = staging[: r.numel() * plan.page_elems].view(r.numel(), plan.page_elems)
            if self._cuda:
                self._copy_cuda(plan, b, r, host, store)
            elif store:
                torch.index_select(plan.pages, 0, b, out=host)
                plan.slot_rows.index_copy_(0, r, host)
            else:
                torch.index_select(plan.slot_rows, 0, r, out=host)
                plan.pages.index_copy_(0, b, host)

    def _copy_cuda(
        self,
        plan: _TensorPlan,
        blocks: torch.Tensor,
        rows: torch.Tensor,
        host: torch.Tensor,
        store: bool,
    ) -> None:
        import torch

        assert self._device_staging is not None
        device = self._device_staging.view(plan.pages.dtype)[: host.numel()].view(host.shape)
        done = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            if store:
                torch.index_select(plan.pages, 0, blocks, out=device)
                host.copy_(device, non_blocking=True)
                done.record()
            else:
                torch.index_select(plan.slot_rows, 0, rows, out=host)
                device.copy_(host, non_blocking=True)
                plan.pages.index_copy_(0, blocks, device)
                done.record()
        done.synchronize()
        if store:
            plan.slot_rows.index_copy_(0, rows, host)
