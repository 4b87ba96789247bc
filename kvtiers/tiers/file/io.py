"""I/O backends of the file tier: how a chunk blob gets from memory into a file and back.

One small interface, :class:`IOBackend`: ``write`` publishes a header and a payload as one
file through :func:`kvtiers.core.publish.publish` (so every file still appears atomically;
:class:`PublishSettings` ``durability`` says whether it is fsynced), ``read`` fills a
header buffer and a payload buffer from a file and reports the file's size. Two implementations:

* ``posix`` — ``os.pwritev`` / ``os.preadv`` from and into the caller's buffers, no extra
  copy. With ``o_direct`` the page cache is bypassed when the payload allows it: a
  4096-byte aligned start (CPU-tier slots are) and a whole number of 4096-byte blocks
  (the header always is); any other payload goes through the page cache, so no transfer
  ever touches bytes outside its buffer. Whether the filesystem takes O_DIRECT at all is
  probed once at start-up (:func:`probe_o_direct`).
* ``kvikio`` — GPUDirect Storage through kvikio's ``CuFile`` (``pread``/``pwrite``
  futures), into host or device memory; ``CuFile`` opens by name, so its stores publish
  through named temp files (posix ones through anonymous files where possible). kvikio
  is imported lazily and used only when ``libcuda.so.1`` loads and a tiny write/read
  probe succeeds (:func:`kvikio_status`).

:func:`select_backend` turns the YAML ``io: auto | posix | kvikio`` into a backend: ``auto``
picks kvikio only when usable and logs once which path is active; an explicit ``kvikio``
that cannot work raises :class:`~kvtiers.errors.BackendUnavailableError` at start-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.geometry import ALIGNMENT
from kvtiers.core.publish import (
    DEFAULT_OPS,
    Durability,
    FileOps,
    KnownDirs,
    publish,
    write_all,
)
from kvtiers.core.regular import open_regular
from kvtiers.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

#: A header made once the payload is written (it carries the payload's checksum).
LateHeader = Callable[[], bytes]

#: Numeric codes of the active I/O path, for ``get_stats`` (whose values are numbers).
IO_POSIX = 0
IO_POSIX_DIRECT = 1
IO_KVIKIO = 2

_O_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class PublishSettings:
    """How new chunk files and directories are created."""

    file_mode: int = 0o600
    dir_mode: int = 0o700
    ops: FileOps = DEFAULT_OPS
    #: The store's root: no directory below it on a chunk's path may be a symbolic link.
    root: Path | None = None
    #: ``process``: publish without fsyncs; ``power``: fsync files and directories.
    durability: Durability = "process"
    #: Directories already checked or made (shared by every copy of these settings).
    known_dirs: KnownDirs = field(default_factory=KnownDirs, compare=False)

    @property
    def sync(self) -> bool:
        """Whether publishes fsync (``durability: power``)."""
        return self.durability == "power"


class IOBackend(ABC):
    """Moves one chunk blob (header + payload) between buffers and a file.

    Buffers are anything exposing the buffer protocol (a host ``memoryview``) or, for
    backends with ``device_memory``, a CUDA tensor. Implementations are thread-safe.
    """

    #: Short name reported in logs and stats (``posix``, ``posix+o_direct``, ``kvikio``).
    name: str
    #: Numeric code of :attr:`name` for ``get_stats``.
    code: int
    #: Whether :meth:`write` and :meth:`read` accept device (CUDA) buffers.
    device_memory: bool = False
    #: Whether :meth:`write` takes the header as a callable it calls once the payload is
    #: written (:data:`LateHeader`), so the payload's checksum may be computed meanwhile.
    late_header: bool = False

    @abstractmethod
    def write(self, path: Path, header: bytes | LateHeader, payload: Any,
              settings: PublishSettings) -> None:
        """Publish ``header`` followed by ``payload`` as ``path``; raises ``OSError`` on
        failure (the temp file is removed and ``path`` untouched). A callable ``header``
        (only where :attr:`late_header`) is called after the payload is written and
        before the file is published."""

    @abstractmethod
    def read(self, path: Path, header: memoryview, payload: Any) -> tuple[int, int]:
        """Fill ``header`` (4096 bytes) and ``payload`` from ``path``; returns
        ``(bytes read, file size)``. A short file reads short; the caller verifies.
        Anything at ``path`` that is not a regular file (a FIFO, a directory, a symlink)
        raises ``OSError`` at once (:func:`~kvtiers.core.regular.open_regular`): a read
        never blocks on one."""


def _address(view: memoryview) -> int:
    """Address of a writable host buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _aligned(view: memoryview) -> bool:
    return view.nbytes == 0 or (not view.readonly and _address(view) % ALIGNMENT == 0)


class AlignedHeaders(threading.local):
    """One page-aligned 4096-byte buffer per thread (``view``), for headers O_DIRECT may
    write from or read into."""

    def __init__(self) -> None:
        self.page = mmap.mmap(-1, HEADER_BYTES)
        self.view = memoryview(self.page)


class PosixBackend(IOBackend):
    """``pwritev``/``preadv`` on plain file descriptors; see the module docstring."""

    def __init__(self, *, o_direct: bool = False) -> None:
        self.o_direct = o_direct and bool(_O_DIRECT)
        self.name = "posix+o_direct" if self.o_direct else "posix"
        self.code = IO_POSIX_DIRECT if self.o_direct else IO_POSIX
        self._headers = AlignedHeaders()

    def _direct(self, payload: memoryview) -> bool:
        """Whether O_DIRECT may move ``payload``: a 4096-byte aligned start and a whole
        number of 4096-byte blocks (other buffers go through the page cache)."""
        return self.o_direct and payload.nbytes % ALIGNMENT == 0 and _aligned(payload)

    late_header = True

    def write(self, path: Path, header: bytes | LateHeader, payload: Any,
              settings: PublishSettings) -> None:
        view = memoryview(payload).cast("B")
        direct = self._direct(view)
        flags = _O_DIRECT if direct else 0

        def writer(fd: int, _temp: Path) -> None:
            if callable(header):
                # The payload first, past the header's place; then the header, whose
                # checksum was computed on another thread meanwhile.
                write_all(fd, [view], HEADER_BYTES)
                head: bytes | memoryview = header()
            else:
                head = header
            if direct:
                aligned_header = self._headers.view
                aligned_header[:] = head
                head = aligned_header
            write_all(fd, [head] if callable(header) else [head, view])

        publish(
            path,
            writer,
            file_mode=settings.file_mode,
            dir_mode=settings.dir_mode,
            open_flags=flags,
            ops=settings.ops,
            root=settings.root,
            sync=settings.sync,
            known=settings.known_dirs,
        )

    def read(self, path: Path, header: memoryview, payload: Any) -> tuple[int, int]:
        view = memoryview(payload).cast("B")
        flags = _O_DIRECT if self._direct(view) and _aligned(header) else 0
        buffers = [header, view]
        fd = open_regular(path, flags)
        try:
            size = os.fstat(fd).st_size
            total = _read_all(fd, buffers)
        finally:
            os.close(fd)
        return min(total, HEADER_BYTES + view.nbytes), size


def _read_all(fd: int, buffers: list[memoryview]) -> int:
    """``preadv`` until the buffers are full or the file ends; returns bytes read."""
    views = [b for b in buffers if b.nbytes]
    total = 0
    while views:
        got = os.preadv(fd, views, total)
        if got <= 0:
            break
        total += got
        while views and got >= views[0].nbytes:
            got -= views[0].nbytes
            views.pop(0)
        if views and got:
            views[0] = views[0][got:]
    return total


def probe_o_direct(directory: Path) -> str | None:
    """Write one aligned block with O_DIRECT in ``directory``; ``None`` when it works,
    else the reason it does not."""
    if not _O_DIRECT:
        return "this platform has no O_DIRECT"
    page = mmap.mmap(-1, ALIGNMENT)
    probe = directory / f".o_direct_probe.{os.getpid()}.{threading.get_ident()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o600)
        try:
            os.pwrite(fd, memoryview(page), 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{exc.strerror or exc} ({directory})"
    finally:
        page.close()
        with contextlib.suppress(OSError):
            os.unlink(probe)
    return None


# -- kvikio --------------------------------------------------------------------------
_KVIKIO_LOCK = threading.Lock()
_KVIKIO_STATUS: dict[str, str | None] = {}


def _import_kvikio() -> Any:
    # kvikio reads KVIKIO_COMPAT_MODE at import; an empty value is not a mode.
    if os.environ.get("KVIKIO_COMPAT_MODE") == "":
        del os.environ["KVIKIO_COMPAT_MODE"]
    import kvikio

    return kvikio


def kvikio_status(directory: Path) -> str | None:
    """``None`` when kvikio can do file I/O in ``directory`` on this machine, else why not.

    Usable means: ``libcuda.so.1`` loads (a driver is present — finding the CUDA toolkit
    is not enough), kvikio imports, and a 4096-byte write and read-back through
    ``CuFile`` round-trips. The answer is cached per directory.
    """
    key = str(directory)
    with _KVIKIO_LOCK:
        if key in _KVIKIO_STATUS:
            return _KVIKIO_STATUS[key]
        reason = _kvikio_probe(directory)
        _KVIKIO_STATUS[key] = reason
        return reason


def _kvikio_probe(directory: Path) -> str | None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 does not load, so there is no NVIDIA driver ({exc})"
    try:
        kvikio = _import_kvikio()
    except ImportError as exc:
        return f"kvikio is not installed ({exc}); install kvikio-cu12 or kvikio-cu13"
    import numpy as np

    probe = directory / f".kvikio_probe.{os.getpid()}.{threading.get_ident()}"
    data = np.arange(ALIGNMENT, dtype=np.uint8)
    back = np.zeros(ALIGNMENT, dtype=np.uint8)
    try:
        with kvikio.CuFile(str(probe), "w") as f:
            written = f.pwrite(data).get()
        with kvikio.CuFile(str(probe), "r") as f:
            read = f.pread(back).get()
    except Exception as exc:  # kvikio raises RuntimeError subclasses from its C++ core
        return f"a kvikio write/read probe in {directory} failed ({exc})"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    if written != ALIGNMENT or read != ALIGNMENT or not (back == data).all():
        return f"a kvikio write/read probe in {directory} returned wrong bytes"
    return None


def _host_array(buffer: Any) -> Any:
    """A host buffer as a numpy byte array kvikio accepts; device tensors pass through."""
    if isinstance(buffer, memoryview | bytes | bytearray):
        import numpy as np

        return np.frombuffer(buffer, dtype=np.uint8)
    return buffer


class KvikioBackend(IOBackend):
    """kvikio ``CuFile`` I/O into host or device memory (GPUDirect Storage when the
    driver and filesystem allow it, kvikio's own POSIX path otherwise)."""

    name = "kvikio"
    code = IO_KVIKIO
    device_memory = True

    def __init__(self) -> None:
        self._kvikio = _import_kvikio()

    def write(self, path: Path, header: bytes | LateHeader, payload: Any,
              settings: PublishSettings) -> None:
        head = _host_array(header() if callable(header) else header)
        body = _host_array(payload)
        size = HEADER_BYTES + _nbytes(payload)

        def writer(_fd: int, temp: Path) -> None:
            with self._kvikio.CuFile(str(temp), "w") as f:
                first = f.pwrite(head, file_offset=0)
                second = f.pwrite(body, file_offset=HEADER_BYTES)
                written = first.get() + second.get()
            if written != size:
                raise OSError(f"kvikio wrote {written} of {size} bytes to {temp}")

        publish(
            path,
            writer,
            file_mode=settings.file_mode,
            dir_mode=settings.dir_mode,
            ops=settings.ops,
            root=settings.root,
            sync=settings.sync,
            known=settings.known_dirs,
            # CuFile opens the file again by its name: a named temp file.
            anonymous=False,
        )

    def read(self, path: Path, header: memoryview, payload: Any) -> tuple[int, int]:
        # CuFile opens by name and would block on a FIFO: check what is there first.
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        with self._kvikio.CuFile(str(path), "r") as f:
            want = min(_nbytes(payload), max(0, size - HEADER_BYTES))
            first = f.pread(_host_array(header), file_offset=0)
            got = first.get()
            if want:
                got += f.pread(_host_array(payload), size=want, file_offset=HEADER_BYTES).get()
        return got, size


def _nbytes(buffer: Any) -> int:
    if isinstance(buffer, memoryview | bytes | bytearray):
        return memoryview(buffer).nbytes
    return int(buffer.numel() * buffer.element_size())


def select_backend(io: str, *, o_direct: bool, directory: Path) -> IOBackend:
    """The backend for the YAML ``io`` setting, probed in ``directory``; logs the choice.

    ``auto`` → kvikio when :func:`kvikio_status` finds it usable, else posix;
    ``kvikio`` → kvikio or :class:`~kvtiers.errors.BackendUnavailableError`;
    ``posix`` → posix. ``o_direct`` asks posix to bypass the page cache; a filesystem
    that refuses O_DIRECT falls back to buffered I/O with one log line.
    """
    if io not in ("auto", "posix", "kvikio"):
        raise ValueError(f"unknown io backend {io!r}")
    if io in ("auto", "kvikio"):
        reason = kvikio_status(directory)
        if reason is None:
            logger.info("file tier at %s: I/O through kvikio (GPUDirect Storage)", directory)
            return KvikioBackend()
        if io == "kvikio":
            raise BackendUnavailableError(
                f"io: kvikio was requested for the file tier at {directory}, but {reason}. "
                "Use io: auto or io: posix on machines without a GPU driver."
            )
        logger.info("file tier at %s: kvikio unusable (%s); I/O through posix", directory, reason)
    if o_direct:
        failure = probe_o_direct(directory)
        if failure is not None:
            logger.warning(
                "file tier at %s: O_DIRECT refused (%s); using the page cache", directory, failure
            )
            o_direct = False
    backend = PosixBackend(o_direct=o_direct)
    logger.info("file tier at %s: I/O through %s", directory, backend.name)
    return backend
