"""The CPU tier's host memory: one contiguous region of ``num_slots x slot_bytes``.

The region is an anonymous ``mmap`` by default, or a named file under ``/dev/shm`` when
engine processes must share it (the process that creates the file removes it on
:meth:`SlotRegion.close`; others attach to it, with a warning naming the file, since a
file left by a crashed process is attached to the same way and never removed). It implements
:class:`~kvtiers.core.mover.HostRegion`: movers get zero-copy ``memoryview`` slots, the
GPU worker a torch ``uint8`` view of the whole region (:meth:`SlotRegion.tensor`).

When CUDA is available the region is registered as pinned (page-locked) memory so device
copies run at full DMA speed. Nothing is pinned on machines without CUDA: torch's
``pin_memory`` raises there.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvtiers.errors import CapacityError, ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")


def _lock_alone(fd: int) -> bool:
    """Whether no other process holds a lock on ``fd``'s file (then this one holds it
    exclusively until it asks for a shared lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class SlotRegion:
    """Fixed-size slots over one mapping. ``shared_memory_name`` names a ``/dev/shm`` file."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        shared_memory_name: str | None = None,
        *,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"a region needs slots, got {num_slots} x {slot_bytes} bytes")
        self._num_slots = num_slots
        self._slot_bytes = slot_bytes
        self.nbytes = num_slots * slot_bytes
        self.path: Path | None = None
        self._owns_file = False
        self._lock_fd: int | None = None
        if shared_memory_name is None:
            self._mmap = mmap.mmap(-1, self.nbytes)
        else:
            self._mmap = self._map_shared(shm_dir, shared_memory_name)
        self._view = memoryview(self._mmap)
        self._tensor: torch.Tensor | None = None
        self._pinned_ptr: int | None = None
        self._pin_if_cuda()

    def _map_shared(self, shm_dir: Path, name: str) -> mmap.mmap:
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError(
                f"{name!r} is not a plain file name; use e.g. 'kvtiers-cpu'",
                path="shared_memory_name",
            )
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            created = False
        try:
            size = os.fstat(fd).st_size
            if not created and size != self.nbytes:
                raise CapacityError(
                    f"{path} exists with {size} bytes but this CPU tier needs {self.nbytes}; "
                    "give every sharing process the same capacity and geometry, or remove it"
                )
            if created:
                self._reserve(fd, path)
            mapping = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED)
            # Every process using the region holds a shared lock on it while it does. An
            # attacher that can take the lock exclusively is alone: the file was left by a
            # process that ended without removing it (a crash).
            left_over = not created and _lock_alone(fd)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            if created:
                path.unlink(missing_ok=True)
            raise
        self._lock_fd = fd
        if left_over:
            logger.warning(
                "CPU tier: %s was left by a process that ended without removing it; its "
                "contents are reused and it is left in place on close. To start clean, "
                "stop the engine and remove it (rm %s)",
                path, path,
            )
        self.path = path
        self._owns_file = created
        return mapping

    def _reserve(self, fd: int, path: Path) -> None:
        stats = os.statvfs(path.parent)
        available = stats.f_bavail * stats.f_frsize
        if available < self.nbytes:
            raise CapacityError(
                f"{path.parent} has {_format_bytes(available)} free but the CPU tier needs "
                f"{_format_bytes(self.nbytes)}; lower the tier's capacity, drop "
                "shared_memory_name, or enlarge /dev/shm (docker: --shm-size)"
            )
        try:
            # Allocate every page now: tmpfs otherwise fails later with SIGBUS on first touch.
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as exc:
            raise CapacityError(
                f"cannot reserve {_format_bytes(self.nbytes)} in {path}: {exc}; lower the "
                "tier's capacity or enlarge /dev/shm"
            ) from exc

    def _pin_if_cuda(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        ptr = self.tensor().data_ptr()
        # cudaHostRegisterPortable (1): pinned for every CUDA context in this process.
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 1)
        if int(err) != 0:
            raise CapacityError(
                f"cudaHostRegister of {_format_bytes(self.nbytes)} failed with error "
                f"{int(err)}; lower the tier's capacity or raise the locked-memory limit"
            )
        self._pinned_ptr = ptr

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def pinned(self) -> bool:
        return self._pinned_ptr is not None

    def view(self, slot_id: int) -> memoryview:
        """A writable, zero-copy view of slot ``slot_id`` (``slot_bytes`` long)."""
        if not 0 <= slot_id < self._num_slots:
            raise IndexError(f"slot {slot_id} outside [0, {self._num_slots})")
        start = slot_id * self._slot_bytes
        return self._view[start : start + self._slot_bytes]

    def tensor(self) -> torch.Tensor:
        """The whole region as one flat ``torch.uint8`` tensor (zero-copy)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        return self._tensor

    def close(self) -> None:
        """Unpin, unmap and (for the creator) remove the ``/dev/shm`` file. Idempotent.

        Views handed out must be released first; while one is alive the mapping stays
        until it is garbage-collected.
        """
        if self._pinned_ptr is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self._tensor = None
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:
            # A view is still alive (a tensor or an exported buffer): the mapping goes
            # away when the last one is collected.
            pass
        if self._owns_file and self.path is not None:
            self.path.unlink(missing_ok=True)
            self._owns_file = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases this process's shared lock
            self._lock_fd = None
