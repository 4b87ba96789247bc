"""What every worker that copies on its own thread shares: the job queue, the thread, the
pending set, finished results, ``wait`` and ``shutdown``; plus the wide-element helpers
its copies use and the check that the engine's KV tensors match the chunk geometry.

A subclass checks a job when it is submitted (:meth:`QueuedWorker._validate`, errors
raise in the caller) and runs it on the worker thread (:meth:`QueuedWorker._execute`,
returning the bytes moved; an exception fails that job only). Jobs run one at a time, in
submission order. Subclasses call ``super().__init__()`` last, once they are ready to
run jobs.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import GroupTransfer
from kvtiers.core.worker import KVCacheTensors, OffloadingWorker, TransferResult
from kvtiers.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def widest_element(*byte_counts: int, largest: int = 16) -> int:
    """Largest power of two up to ``largest`` dividing every count: copies move bytes as
    elements this wide (``uint8`` indexed copies run at a fraction of memory speed)."""
    common = 0
    for count in byte_counts:
        common = math.gcd(common, count)
    return next(size for size in (16, 8, 4, 2, 1) if size <= largest and common % size == 0)


def dtype_for(element_bytes: int) -> torch.dtype:
    """The torch dtype whose elements are ``element_bytes`` wide."""
    import torch

    return {
        16: torch.complex128,
        8: torch.int64,
        4: torch.int32,
        2: torch.int16,
        1: torch.uint8,
    }[element_bytes]


def check_ids(group: int, ids: npt.NDArray[np.int64], limit: int, what: str) -> None:
    """Raise ``IndexError`` unless every id lies in ``[0, limit)``. Copies check ids with
    this before they move anything: the page-copy kernel copies whatever addresses it is
    given, and an index out of range in a CUDA kernel is a device-side assert that leaves
    the process's CUDA context unusable."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        raise IndexError(f"group {group}: {what} ids must lie in [0, {limit}), got {low}..{high}")


def check_kv_geometry(kv: KVCacheTensors, geometry: ChunkGeometry) -> None:
    """Raise :class:`~kvtiers.errors.ConfigError` unless ``kv`` matches ``geometry``: the
    same number of groups, each group's bytes per block as configured, and every tensor a
    ``(num_blocks, row_bytes)`` byte view whose rows hold its pages."""
    if len(kv.groups) != geometry.num_groups:
        raise ConfigError(
            f"the engine describes {len(kv.groups)} KV-cache groups but the offloading "
            f"config has {geometry.num_groups}; they must match",
            path="groups",
        )
    for g, refs in enumerate(kv.groups):
        if kv.group_bytes_per_block(g) != geometry.group_bytes_per_block[g]:
            raise ConfigError(
                f"group {g}: its tensors hold {kv.group_bytes_per_block(g)} bytes per "
                f"block but the config says {geometry.group_bytes_per_block[g]}",
                path=f"groups[{g}].bytes_per_block",
            )
        for ref in refs:
            tensor = kv.tensors[ref.tensor_idx]
            if tensor.dim() != 2 or tensor.element_size() != 1 or tensor.stride(1) != 1:
                raise ConfigError(
                    f"KV tensor {ref.tensor_idx} must be a (num_blocks, page_bytes) "
                    f"byte view, got shape {tuple(tensor.shape)} {tensor.dtype}",
                    path="kv_tensors",
                )
            if ref.page_bytes > tensor.shape[1]:
                raise ConfigError(
                    f"KV tensor {ref.tensor_idx}: page_bytes {ref.page_bytes} exceeds "
                    f"its row of {tensor.shape[1]} bytes",
                    path="kv_tensors",
                )


@dataclass(frozen=True)
class QueuedJob:
    """A submitted job. ``ready`` is whatever :meth:`QueuedWorker._ready_marker` gave at
    submission (a CUDA event for GPU tensors)."""

    job_id: int
    store: bool
    groups: tuple[GroupTransfer, ...]
    ready: Any = None


class QueuedWorker(OffloadingWorker):
    """An :class:`OffloadingWorker` that runs jobs on one thread; see the module docstring."""

    thread_name = "kvtiers-worker"

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[QueuedJob | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        self._finished: list[TransferResult] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    # -- what a subclass provides ---------------------------------------------------
    @abstractmethod
    def _validate(self, groups: Sequence[GroupTransfer], store: bool) -> None:
        """Raise ``ValueError`` / ``TypeError`` for a job this worker cannot run."""

    @abstractmethod
    def _execute(self, job: QueuedJob) -> int:
        """Run ``job`` on the worker thread; return the bytes moved."""

    def _ready_marker(self) -> Any:
        """Taken on the submitting thread and handed to the job (default: nothing)."""
        return None

    def _on_thread_start(self) -> None:
        """Called once on the worker thread before the first job."""

    # -- the contract ---------------------------------------------------------------
    def submit_store(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        return self._submit(job_id, groups, store=True)

    def submit_load(self, job_id: int, groups: Sequence[GroupTransfer]) -> bool:
        return self._submit(job_id, groups, store=False)

    def _submit(self, job_id: int, groups: Sequence[GroupTransfer], *, store: bool) -> bool:
        self._validate(groups, store)
        ready = self._ready_marker()
        with self._cond:
            if self._closed:
                return False
            self._pending.add(job_id)
            # Queued under the lock: shutdown's end marker can never overtake the job.
            self._jobs.put(QueuedJob(job_id, store, tuple(groups), ready))
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._cond:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: Collection[int]) -> None:
        wanted = set(job_ids)
        with self._cond:
            self._cond.wait_for(lambda: not (wanted & self._pending))

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop the thread. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._jobs.put(None)
        self._thread.join()

    # -- the worker thread ----------------------------------------------------------
    def _run(self) -> None:
        self._on_thread_start()
        while (job := self._jobs.get()) is not None:
            start = time.perf_counter()
            try:
                moved = self._execute(job)
                success = True
            except Exception as exc:
                # A failed job is an expected outcome (a corrupt chunk, a full disk): one
                # line; the traceback only at debug level.
                logger.warning("%s job %d failed: %s", self.thread_name, job.job_id, exc)
                logger.debug("job %d traceback", job.job_id, exc_info=True)
                moved, success = 0, False
            result = TransferResult(job.job_id, success, moved, time.perf_counter() - start)
            with self._cond:
                self._pending.discard(job.job_id)
                self._finished.append(result)
                self._cond.notify_all()
