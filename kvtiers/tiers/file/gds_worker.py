"""The file tier as primary (``gds: true``): GPU KV blocks straight to and from chunk files.

Implements :class:`~kvtiers.core.worker.OffloadingWorker` with
:class:`~kvtiers.core.specs.FileLoadStoreSpec` on the offloaded side. Chunk layout is the
shared tensor-major one (:mod:`kvtiers.core.geometry`), so a chunk written here reads back
through any tier. For a transfer of ``n`` GPU blocks the ``k``-th block is sub-block
``p = skip + k`` of the chunk list, ``skip = gpu_block_offset % blocks_per_chunk``.

Paths, per chunk:

- kvikio backend and CUDA tensors: pages are gathered on the device into a device
  staging buffer that kvikio writes (or reads) directly; the payload checksum needs the
  bytes on the host, so one device → host copy per chunk feeds it;
- otherwise the pages are gathered into a page-aligned host staging buffer and published
  with the POSIX backend (loads read into it and scatter out). Gathers and scatters run on
  the widest integer view the alignment allows (``index_copy_`` on ``uint8`` is slow).

Stores must cover whole chunks (the scheduler only stores whole chunks); a store that
does not fails its job, and a store that fails removes the chunks it already published
(the manager drops the whole job's keys). Loads may start mid-chunk (``skip``) and end
mid-chunk. A chunk that fails verification fails its job, is quarantined and reported
through the same handler the mover uses. Jobs run one at a time on one thread, in submission order.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtiers.core.chunkformat import HEADER_BYTES, decode_header, encode_header, verify_payload
from kvtiers.core.geometry import ChunkGeometry, round_up
from kvtiers.core.keys import OffloadKey
from kvtiers.core.specs import FileLoadStoreSpec, GroupTransfer
from kvtiers.core.worker import KVCacheTensors, KVTensorRef
from kvtiers.errors import CorruptChunkError
from kvtiers.tiers.file.io import IOBackend, PublishSettings
from kvtiers.tiers.file.mover import BadChunkHandler
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



@dataclass(frozen=True)
class _Plan:
    """One layer tensor of a group: its pages as wide rows and its place in a chunk."""

    pages: torch.Tensor
    dtype: torch.dtype
    page_elems: int
    chunk_offset_elems: int


class FileWorker(QueuedWorker):
    """Copies between ``kv``'s tensors and chunk files; see the module docstring."""

    thread_name = "kvtiers-file-worker"

    def __init__(
        self,
        kv: KVCacheTensors,
        geometry: ChunkGeometry,
        digest: bytes,
        backend: IOBackend,
        *,
        settings: PublishSettings | None = None,
        bad_chunks: BadChunkHandler | None = None,
    ) -> None:
        import torch

        check_kv_geometry(kv, geometry)
        self.geometry = geometry
        self.digest = digest
        self.backend = backend
        self.settings = settings or PublishSettings()
        self.bad_chunks = bad_chunks or BadChunkHandler(None, None)
        self._per_chunk = geometry.blocks_per_chunk
        self._device = kv.tensors[0].device
        self._cuda = self._device.type == "cuda"
        self._plans = [self._plan_group(kv, refs) for refs in kv.groups]
        staging_bytes = round_up(geometry.max_chunk_bytes)
        self._host_map = mmap.mmap(-1, staging_bytes)
        self._host_view = memoryview(self._host_map)
        self._host = torch.frombuffer(self._host_map, dtype=torch.uint8)
        self._device_stage = (
            torch.empty(staging_bytes, dtype=torch.uint8, device=self._device)
            if self._cuda
            else None
        )
        self._direct = self._cuda and backend.device_memory
        self._header = memoryview(mmap.mmap(-1, HEADER_BYTES))
        super().__init__()

    def _plan_group(self, kv: KVCacheTensors, refs: Sequence[KVTensorRef]) -> list[_Plan]:
        plans = []
        offset = 0
        for ref in refs:
            tensor = kv.tensors[ref.tensor_idx]
            # Integer views only (at most 8 bytes): the staging copies index into them.
            size = widest_element(
                ref.page_bytes, tensor.stride(0), int(tensor.storage_offset()), tensor.data_ptr(),
                offset, largest=8,
            )
            dtype = dtype_for(size)
            page_elems = ref.page_bytes // size
            pages = tensor.view(dtype)[:, :page_elems]
            plans.append(_Plan(pages, dtype, page_elems, offset // size))
            offset += ref.page_bytes * self._per_chunk
        return plans

    # -- submission -----------------------------------------------------------------
    def _validate(self, groups: Sequence[GroupTransfer], store: bool) -> None:
        if len(groups) > len(self._plans):
            raise ValueError(f"{len(groups)} group transfers for {len(self._plans)} groups")
        for g, transfer in enumerate(groups):
            if not isinstance(transfer.offload_spec, FileLoadStoreSpec):
                raise TypeError(
                    f"group {g}: expected a FileLoadStoreSpec, got {transfer.offload_spec!r}"
                )

    def _ready_marker(self) -> Any:
        """CUDA: an event on the submitting thread's current stream, so the job starts
        after the kernels that produced (store) or last read (load) the blocks."""
        if not self._cuda:
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self._device))
        return ready

    # -- the worker thread ----------------------------------------------------------
    def _execute(self, job: QueuedJob) -> int:
        if job.ready is not None:
            # File I/O is driven from the host, so the host waits (a stream wait would not
            # hold back kvikio or the staging copies' host side).
            job.ready.synchronize()
        published: list[Path] = []
        try:
            return sum(
                self._transfer_group(g, transfer, job.store, published)
                for g, transfer in enumerate(job.groups)
            )
        except BaseException:
            # The job fails and the manager drops every key of it: chunks already
            # published would be files nobody indexes, using space until a restart.
            for path in published:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise

    def _transfer_group(
        self, group: int, transfer: GroupTransfer, store: bool, published: list[Path]
    ) -> int:
        import torch

        spec = transfer.offload_spec
        assert isinstance(spec, FileLoadStoreSpec)
        block_ids = transfer.gpu_spec.block_ids
        per_chunk = self._per_chunk
        skip = spec.gpu_block_offset % per_chunk
        n = int(block_ids.size)
        if n == 0:
            return 0
        if not (len(spec) - 1) * per_chunk < n + skip <= len(spec) * per_chunk:
            raise ValueError(
                f"group {group}: {n} GPU blocks at offset {spec.gpu_block_offset} do not "
                f"fill {len(spec)} chunks of {per_chunk} blocks"
            )
        if store and (skip or n % per_chunk):
            raise ValueError(
                f"group {group}: a store must cover whole chunks of {per_chunk} blocks; got "
                f"{n} blocks at offset {spec.gpu_block_offset}"
            )
        if self._cuda:
            limit = min(plan.pages.shape[0] for plan in self._plans[group])
            check_ids(group, block_ids, limit, "GPU block")
        ids = torch.from_numpy(np.ascontiguousarray(block_ids)).to(self._device)
        moved = 0
        for c, (path, key) in enumerate(zip(spec.paths, spec.keys, strict=True)):
            lo = skip if c == 0 else 0
            hi = min(per_chunk, n + skip - c * per_chunk)
            first = c * per_chunk + lo - skip
            chunk_ids = ids[first : first + hi - lo]
            if store:
                self._store_chunk(group, Path(path), key, chunk_ids)
                published.append(Path(path))
            else:
                self._load_chunk(group, Path(path), key, chunk_ids, lo)
            moved += (hi - lo) * self.geometry.group_bytes_per_block[group]
        return moved

    def _rows(self, stage: torch.Tensor, plan: _Plan, lo: int, hi: int) -> torch.Tensor:
        """Sub-blocks ``lo:hi`` of one tensor's pages inside a staged chunk."""
        wide = stage.view(plan.dtype)
        begin = plan.chunk_offset_elems + lo * plan.page_elems
        return wide[begin : begin + (hi - lo) * plan.page_elems].view(hi - lo, plan.page_elems)

    def _store_chunk(self, group: int, path: Path, key: OffloadKey, ids: torch.Tensor) -> None:
        import torch

        size = self.geometry.chunk_bytes(group)
        stage = self._device_stage if self._cuda else self._host
        assert stage is not None
        for plan in self._plans[group]:
            torch.index_select(plan.pages, 0, ids, out=self._rows(stage, plan, 0, ids.numel()))
        if self._cuda:
            self._host[:size].copy_(stage[:size])
        payload = self._host_view[:size]
        header = encode_header(self.digest, key, payload)
        self.backend.write(path, header, stage[:size] if self._direct else payload, self.settings)

    def _load_chunk(
        self, group: int, path: Path, key: OffloadKey, ids: torch.Tensor, lo: int
    ) -> None:
        size = self.geometry.chunk_bytes(group)
        device_stage = self._device_stage
        target: Any = (
            device_stage[:size] if self._direct and device_stage is not None
            else self._host_view[:size]
        )
        try:
            got, file_size = self.backend.read(path, self._header, target)
            if HEADER_BYTES <= got == file_size < HEADER_BYTES + size:
                # Shorter than the chunk: stored with a codec (a tier writing with one
                # shares the namespace) unless the header says otherwise; this worker
                # reads only chunks stored as they are (verify_payload says so).
                header = decode_header(self._header, namespace_digest=self.digest, key=key)
                verify_payload(header, self._host_view[:size])
            if got < HEADER_BYTES + size or file_size != HEADER_BYTES + size:
                raise CorruptChunkError(
                    "length", f"file holds {file_size} bytes, expected {HEADER_BYTES + size}"
                )
            if self._direct:
                assert self._device_stage is not None
                self._host[:size].copy_(self._device_stage[:size])
            header = decode_header(self._header, namespace_digest=self.digest, key=key)
            verify_payload(header, self._host_view[:size])
        except CorruptChunkError as exc:
            self.bad_chunks.corrupt(path, key, exc)
            raise
        except FileNotFoundError:
            self.bad_chunks.vanished(key)
            raise
        stage = self._device_stage if self._direct else self._host
        assert stage is not None
        for plan in self._plans[group]:
            rows = self._rows(stage, plan, lo, lo + ids.numel())
            if self._cuda and not self._direct:
                rows = rows.to(self._device)
            plan.pages.index_copy_(0, ids, rows)
        if self._cuda:
            import torch

            # The scatters are asynchronous: the next chunk's read must not overwrite the
            # staging buffer under them, and the job must not report before they land.
            torch.cuda.current_stream(self._device).synchronize()

