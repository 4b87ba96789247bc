"""The CPU tier's host memory: one contiguous region of ``num_slots x slot_bytes``.

The region is an anonymous ``mmap`` by default, or a named file under ``/dev/shm`` when
engine processes must share it. The shared file is private to the user running kvtiers:

* it is made exclusively under a temp name (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600),
  sized and locked, then linked to its name, so it never appears half made;
* attaching opens it with ``O_NOFOLLOW`` and refuses (:class:`~kvtiers.errors.ConfigError`)
  anything but a regular file owned by this user with no group or other permissions:
  a file another user planted, or a symbolic link, is never written into;
* every process mapping it holds a shared ``flock`` while it does. A file nobody holds is
  a left-over of a crashed process; once it passed the checks above it is ours, and it is
  removed (with a warning) and replaced, never reused. The last process to
  :meth:`SlotRegion.close` it removes it, if the name still refers to it.

It implements
:class:`~kvtiers.core.mover.HostRegion`: movers get zero-copy ``memoryview`` slots, the
GPU worker a torch ``uint8`` view of the whole region (:meth:`SlotRegion.tensor`).

When CUDA is available the region is registered as pinned (page-locked) memory so device
copies run at full DMA speed. Nothing is pinned on machines without CUDA: torch's
``pin_memory`` raises there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtiers.config.sizes import format_size
from kvtiers.errors import CapacityError, ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_TEMP_SUFFIX = ".kvtmp"
_OPEN_ATTEMPTS = 8


def _lock_alone(fd: int) -> bool:
    """Whether no other process holds a lock on ``fd``'s file (then this one holds it
    exclusively until it asks for a shared lock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _refusal(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} {why}; the CPU tier maps only a regular file of this user (uid "
        f"{os.geteuid()}) with mode 0600, which it creates itself. Another user or program "
        "may have placed it there: remove it, or choose another shared_memory_name",
        path="shared_memory_name",
    )


def _check_private(path: Path, info: os.stat_result) -> None:
    """Refuse a region file that is not a regular file of this user with mode 0600."""
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(path, "is not a regular file")
    if info.st_uid != os.geteuid():
        raise _refusal(path, f"is owned by uid {info.st_uid}")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise _refusal(
            path, f"has mode {stat.S_IMODE(info.st_mode):04o} (group or others may use it)"
        )


def _names_same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed) still names the file open as ``fd``."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def _remove_if_same(path: Path, fd: int) -> None:
    """Unlink ``path`` if it still names ``fd``'s file (never another file put there)."""
    if _names_same_file(path, fd):
        path.unlink(missing_ok=True)


def engine_region_prefix() -> str:
    """How the names of the regions vLLM engines of this user make for their cpu primary
    begin (``kvtiers-<uid>-``; the rest is per engine, see
    :func:`kvtiers.integrations.vllm.worker.shared_memory_name`)."""
    return f"kvtiers-{os.geteuid()}-"


@dataclass(frozen=True)
class RegionFile:
    """A region file of this user: where, how large, and whether a process maps it."""

    path: Path
    size: int
    in_use: bool


def region_files(prefix: str, *, shm_dir: Path = SHM_DIR, remove: bool = False
                 ) -> list[RegionFile]:
    """The region files in ``shm_dir`` whose names start with ``prefix``, each marked in
    use when some process maps it (holds its lock); with ``remove``, those nobody maps
    (what crashed processes of this user left) are removed, and listed as not in use.

    A file that fails the ownership and mode checks or a temp file still being made is
    neither listed nor touched, so this is safe while other engines run: every process
    mapping a region holds its lock from before the name exists until it closes, and the
    lock is held while a file is found unused and removed."""
    found: list[RegionFile] = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return found
    for name in names:
        if not name.startswith(prefix) or name.endswith(_TEMP_SUFFIX):
            continue
        path = shm_dir / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile, a link, or not ours to open
        try:
            info = os.fstat(fd)
            private = (
                stat.S_ISREG(info.st_mode)
                and info.st_uid == os.geteuid()
                and not stat.S_IMODE(info.st_mode) & 0o077
            )
            if not private:
                continue
            unused = _lock_alone(fd)
            # Checked with the lock held: the name may have been given to a new region.
            if not _names_same_file(path, fd):
                continue
            if unused and remove:
                path.unlink(missing_ok=True)
            found.append(RegionFile(path, info.st_size, in_use=not unused))
        finally:
            os.close(fd)
    return found


def remove_left_overs(prefix: str, *, shm_dir: Path = SHM_DIR) -> list[Path]:
    """Remove the region files in ``shm_dir`` whose names start with ``prefix`` that no
    process maps (see :func:`region_files`); the removed paths.

    For callers whose region names are per run (a random engine id): a crashed run's name
    is never used again, so the replacement :class:`SlotRegion` does on attach never sees
    it."""
    removed = [f.path for f in region_files(prefix, shm_dir=shm_dir, remove=True)
               if not f.in_use]
    if removed:
        logger.warning(
            "CPU tier: removed %d shared-memory region(s) that ended processes of this user "
            "left in %s (%s)", len(removed), shm_dir, ", ".join(p.name for p in removed),
        )
    return removed


def _format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _too_large(nbytes: int, exc: BaseException) -> ConfigError:
    """The system refused a private region of ``nbytes`` (``exc``): what, how much, and
    what to do, at the tier's ``capacity``."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        memory = ""
    else:
        memory = f"; this machine has {format_size(physical)} of memory"
    return ConfigError(
        f"the CPU tier's region of {format_size(nbytes)} ({nbytes} bytes) cannot be "
        f"allocated ({why}){memory}: lower the tier's capacity",
        path="capacity",
    )


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
        self._lock_fd: int | None = None
        if shared_memory_name is None:
            try:
                self._mmap = mmap.mmap(-1, self.nbytes)
            except (OSError, OverflowError) as exc:
                raise _too_large(self.nbytes, exc) from None
        else:
            self._mmap = self._map_shared(shm_dir, shared_memory_name)
        self._view = memoryview(self._mmap)
        self._tensor: torch.Tensor | None = None
        self._pinned_ptr: int | None = None
        self._pin_if_cuda()

    def _map_shared(self, shm_dir: Path, name: str) -> mmap.mmap:
        if not name or "/" in name or name in (".", "..") or name.startswith("."):
            raise ConfigError(
                f"{name!r} is not a plain file name; use e.g. 'kvtiers-cpu'",
                path="shared_memory_name",
            )
        path = shm_dir / name
        # A race with another process creating or removing the file sends us round again;
        # each round either maps the file or sees a change another process made.
        for _ in range(_OPEN_ATTEMPTS):
            fd = self._open_existing(path)
            created = fd is None
            if fd is None:
                fd = self._create(path)
                if fd is None:
                    continue  # another process linked its file in first: attach to it
            elif _lock_alone(fd):
                # Every user holds a shared lock for as long as it maps the file: a file
                # nobody locks, that passed the owner and mode checks, is a crashed
                # process's left-over of ours. Replace it rather than reuse stale bytes.
                _remove_if_same(path, fd)
                os.close(fd)
                logger.warning(
                    "CPU tier: removed %s, left by a process of this user that ended "
                    "without removing it; a fresh region replaces it", path,
                )
                continue
            else:
                fcntl.flock(fd, fcntl.LOCK_SH)
                if not _names_same_file(path, fd):
                    os.close(fd)  # removed as a left-over while we waited for the lock
                    continue
            try:
                size = os.fstat(fd).st_size
                if size != self.nbytes:
                    raise CapacityError(
                        f"{path} exists with {size} bytes but this CPU tier needs "
                        f"{self.nbytes}; give every sharing process the same capacity and "
                        "geometry, or stop them all and remove it"
                    )
                mapping = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED)
            except BaseException:
                if created:
                    _remove_if_same(path, fd)
                os.close(fd)
                raise
            self._lock_fd = fd
            self.path = path
            return mapping
        raise CapacityError(
            f"{path} kept being created and removed by other processes while this CPU tier "
            "tried to attach to it; check which processes use that shared_memory_name"
        )

    def _open_existing(self, path: Path) -> int | None:
        """An open, checked descriptor of the existing region file; ``None`` when absent.

        The file must be a regular file (not a symbolic link: ``O_NOFOLLOW``) owned by
        this user with no group or other permission bits, so no other user can have
        planted it or read the KV written into it."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise _refusal(path, "is not a regular file") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refusal(path, "is a symbolic link") from None
            raise
        try:
            _check_private(path, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _create(self, path: Path) -> int | None:
        """A new region file at ``path``, sized, owned by this user, mode 0600 and held
        with a shared lock; ``None`` when another process created ``path`` first.

        The file is made under a private temp name (``O_CREAT | O_EXCL | O_NOFOLLOW``),
        filled and locked there, and only then linked to ``path``, which fails if the name
        exists: nobody ever sees it half made, unlocked, or under another owner or mode."""
        temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{_TEMP_SUFFIX}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask left
            self._reserve(fd, path)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                os.link(temp, path, follow_symlinks=False)
            except FileExistsError:
                os.close(fd)
                return None
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        finally:
            temp.unlink(missing_ok=True)
        return fd

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
        """Unpin, unmap and, if no other process maps it, remove the ``/dev/shm`` file.
        Idempotent.

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
        if self._lock_fd is not None:
            if self.path is not None and _lock_alone(self._lock_fd):
                # The last process out removes the file; the name may meanwhile have been
                # taken by a new region, which stays.
                _remove_if_same(self.path, self._lock_fd)
            os.close(self._lock_fd)  # releases this process's shared lock
            self._lock_fd = None
