"""Atomic publish: the only way a file appears in a kvtiers store.

Steps, where the filesystem has anonymous files (Linux ``O_TMPFILE``): an unnamed file in
the target directory → the caller's writer writes every byte (short writes are checked) →
``fsync`` the file → ``linkat`` gives it the final name (through ``/proc/self/fd``) →
``fsync`` the directory. One name operation per file, and a crash at any step leaves
nothing behind: an unnamed file disappears with its last descriptor. When the final name
already exists, the file is linked under a temp name and renamed over it (the rare case:
the existing file may be one the index does not know, a torn or foreign one, and the new
bytes must replace it). Where ``O_TMPFILE`` is refused (``EOPNOTSUPP``, ``EISDIR``,
``EINVAL``: some network and older filesystems, kernels before 3.11) or ``/proc`` is not
mounted, every publish falls back to a unique temp name (``O_CREAT | O_EXCL``) →
write → ``fsync`` → ``os.replace`` onto the final name → ``fsync`` the directory; a
:class:`KnownDirs` remembers the refusal so the store asks once.

Either way a reader sees the old state or the new one, never a torn file; a crash leaves at
most a stale temp file (fallback only), which :func:`kvtiers.filemapper.remove_stale_temps`
removes at start-up. New directories are created 0700 and their parent fsynced once, so
the directory entry itself is durable.

``sync=False`` leaves out every fsync (the file's and the directories'): the publish is
still atomic for every reader and survives the crash of any process (the bytes and the
rename are in the kernel's page cache), but a power cut or kernel crash may lose recently
published files or leave them empty or torn. That is the file tier's ``durability:
process``; it is safe only for files whose readers verify them (chunk files carry a
checksum, so such a file reads as a miss, never as wrong bytes).

A :class:`KnownDirs` passed along remembers directories already checked or made, so
later publishes into them skip the walk from the root. Given the store's
root, publishing refuses to create or write through a symbolic link between the root and
the file (checked with ``lstat`` before the write; a link put there meanwhile by someone
with write access to the root is beyond what this check promises).

No-clobber mode (``replace=False``) always links (the anonymous file, or the finished temp
file with ``os.link``), which fails with :class:`FileExistsError` when the name exists: of
several processes racing to publish the same name exactly one wins and the others keep
their hands off the winner's bytes. A temp name is unlinked afterwards.

System calls go through :class:`FileOps` so tests can inject a failure at every step.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import secrets
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from kvtiers.core.buffers import Buffer
from kvtiers.errors import SymlinkEscapeError

TEMP_SUFFIX = ".kvtmp"
DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700

#: What a published file survives: ``process`` — the crash of any process (no fsync);
#: ``power`` — a power cut too (file and directory fsyncs).
Durability = Literal["process", "power"]
DURABILITIES: tuple[Durability, ...] = ("process", "power")
#: Writes every byte of the new file into ``fd`` (opened for writing at ``temp_path``; for
#: an anonymous file ``temp_path`` is ``/proc/self/fd/<fd>``).
Writer = Callable[[int, Path], object]
_O_TMPFILE = getattr(os, "O_TMPFILE", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: What ``open(O_TMPFILE)`` fails with where the filesystem or kernel has no anonymous
#: files: publishing then uses named temp files.
NO_ANONYMOUS_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EISDIR, errno.EINVAL})


class FileOps:
    """The system calls publishing uses; subclassed by tests to inject failures."""

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | extra_flags
        return os.open(path, flags, mode)

    def has_anonymous(self) -> bool:
        """Whether :meth:`open_anonymous` and :meth:`link_anonymous` may work here: the
        platform has ``O_TMPFILE`` and ``/proc/self/fd`` is mounted. A filesystem may
        still refuse (see :data:`NO_ANONYMOUS_ERRNOS`)."""
        return _anonymous_possible()

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        """An unnamed regular file in ``directory``, open for writing (``O_TMPFILE``;
        without ``O_EXCL``, which would forbid linking it)."""
        return os.open(directory, os.O_WRONLY | _O_TMPFILE | _O_CLOEXEC | extra_flags, mode)

    def link_anonymous(self, fd: int, dst: Path) -> None:
        """Give the anonymous file ``fd`` the name ``dst``; :class:`FileExistsError` when
        ``dst`` exists (nothing is replaced)."""
        # linkat(..., AT_SYMLINK_FOLLOW) of the descriptor's /proc link. os.link calls
        # plain link() (which does not follow the link: EXDEV) unless a directory
        # descriptor is given; the source path is absolute, so src_dir_fd is not used.
        os.link(f"/proc/self/fd/{fd}", dst, src_dir_fd=fd, follow_symlinks=True)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        os.link(src, dst)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: Path) -> None:
        os.unlink(path)

    def has_syncfs(self) -> bool:
        """Whether :meth:`syncfs` works on this platform (Linux)."""
        return _libc_syncfs() is not None

    def syncfs(self, path: Path) -> None:
        """Make everything written to the filesystem holding ``path`` durable (data,
        names and directories: Linux ``syncfs``); raises ``OSError`` when the flush
        fails. Only where :meth:`has_syncfs`."""
        call = _libc_syncfs()
        if call is None:
            raise OSError(errno.ENOSYS, "this platform has no syncfs")
        fd = os.open(path, os.O_RDONLY)
        try:
            if call(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"syncfs of {path}: {os.strerror(code)}", str(path))
        finally:
            os.close(fd)


@functools.cache
def _libc_syncfs() -> Callable[[int], int] | None:
    """The C library's ``syncfs``, or ``None`` where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    call = getattr(libc, "syncfs", None)
    if call is None:
        return None
    call.argtypes = [ctypes.c_int]
    call.restype = ctypes.c_int
    result: Callable[[int], int] = call
    return result


@functools.cache
def _anonymous_possible() -> bool:
    return bool(_O_TMPFILE) and os.path.isdir("/proc/self/fd")


DEFAULT_OPS = FileOps()


class KnownDirs:
    """What publishing learnt about one store's directory tree: the directories known to
    exist as real directories (not links) below its root, so that :func:`ensure_dir`
    checks and makes each one once per process instead of once per publish, and whether
    its filesystem takes anonymous files (``anonymous``; false once it refused one, or
    when made so). Thread-safe. A directory removed behind the cache's back is noticed by
    :func:`publish` (its temp file cannot be created), forgotten and made again."""

    def __init__(self, *, anonymous: bool = True) -> None:
        self._dirs: set[Path] = set()
        self._lock = threading.Lock()
        self.anonymous = anonymous

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return path in self._dirs

    def add(self, path: Path) -> None:
        with self._lock:
            self._dirs.add(path)

    def clear(self) -> None:
        with self._lock:
            self._dirs.clear()


def temp_path_for(final_path: Path) -> Path:
    """A fresh temp name beside ``final_path`` (hidden, with :data:`TEMP_SUFFIX`)."""
    return final_path.with_name(f".{final_path.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def write_all(fd: int, buffers: Sequence[Buffer], offset: int = 0) -> int:
    """Write every byte of ``buffers`` at ``offset`` with ``pwritev``, retrying short
    writes; returns the bytes written."""
    views = [memoryview(b).cast("B") for b in buffers if len(memoryview(b).cast("B"))]
    total = 0
    while views:
        written = os.pwritev(fd, views, offset + total)
        if written <= 0:
            raise OSError(errno.EIO, f"pwritev wrote {written} bytes")
        total += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return total


def ensure_dir(
    path: Path,
    *,
    mode: int = DEFAULT_DIR_MODE,
    ops: FileOps = DEFAULT_OPS,
    root: Path | None = None,
    sync: bool = True,
    known: KnownDirs | None = None,
) -> None:
    """Create ``path`` and missing parents with ``mode``, fsyncing each new directory's
    parent once so the new entry survives a power cut (not with ``sync=False``).
    ``known`` skips directories already checked and records those checked now.

    With ``root`` (an ancestor of ``path``), every directory strictly below ``root`` on
    the way to ``path`` must be a real directory: a symbolic link there (which could lead
    out of the root) raises :class:`SymlinkEscapeError` and nothing is created through it.
    ``root`` itself may be a link: the operator chose it."""
    if known is not None and path in known:
        return
    if root is None:
        if not path.is_dir():
            ensure_dir(path.parent, mode=mode, ops=ops, sync=sync)
            _make_dir(path, mode, ops, sync)
        if known is not None:
            known.add(path)
        return
    relative = path.relative_to(root)
    ensure_dir(root, mode=mode, ops=ops, sync=sync)
    current = root
    for part in relative.parts:
        current = current / part
        if known is not None and current in known:
            continue
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            _make_dir(current, mode, ops, sync)
            info = os.lstat(current)
        if stat.S_ISLNK(info.st_mode):
            raise SymlinkEscapeError(
                f"{current} is a symbolic link inside the store rooted at {root}; kvtiers "
                "never writes through links under its root (they may lead outside it): "
                "remove the link"
            )
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(
                errno.ENOTDIR, f"{current} is not a directory; remove it", str(current)
            )
        if known is not None:
            known.add(current)


def _make_dir(path: Path, mode: int, ops: FileOps, sync: bool) -> None:
    """``mkdir`` (which never follows a link at ``path``); with ``sync``, fsync the parent
    if it made it."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    if sync:
        ops.fsync_dir(path.parent)


def publish(
    final_path: Path,
    writer: Writer,
    *,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    open_flags: int = 0,
    replace: bool = True,
    ops: FileOps = DEFAULT_OPS,
    root: Path | None = None,
    sync: bool = True,
    known: KnownDirs | None = None,
    anonymous: bool = True,
) -> None:
    """Atomically make ``final_path`` hold exactly what ``writer`` writes.

    ``root``, when given, is the store's root: no directory between it and
    ``final_path`` may be a symbolic link (see :func:`ensure_dir`). ``sync=False``
    leaves out every fsync (see the module docstring); ``known`` caches directories and
    whether anonymous files work. ``anonymous=False`` always uses a named temp file (for
    writers that open the file again by its name).

    Replaces an existing file. A failure before the link (or rename) removes the
    unpublished file, leaves the final path untouched, and propagates; so does a failed
    ``close`` after the anonymous file was linked (the name is removed again: on some
    filesystems ``close`` reports write errors). A failure of the directory fsync after
    it propagates too, but the file is then in place (complete, not yet known to be
    durable): callers must not assume the old state.

    With ``replace=False`` an existing ``final_path`` is never touched: the call raises
    :class:`FileExistsError` instead (after removing its unpublished file). Should
    unlinking a temp name fail once the link is made, the error propagates with the file
    published and the temp name left for :func:`kvtiers.filemapper.remove_stale_temps`.
    """
    directory = final_path.parent
    ensure_dir(directory, mode=dir_mode, ops=ops, root=root, sync=sync, known=known)
    if anonymous and ops.has_anonymous() and (known is None or known.anonymous):
        try:
            fd = _open_in(
                directory,
                lambda: ops.open_anonymous(directory, file_mode, open_flags),
                dir_mode=dir_mode, ops=ops, root=root, sync=sync, known=known,
            )
        except OSError as exc:
            if exc.errno not in NO_ANONYMOUS_ERRNOS:
                raise
            if known is not None:
                known.anonymous = False
        else:
            _publish_anonymous(fd, final_path, writer, replace=replace, ops=ops, sync=sync)
            return
    temp = temp_path_for(final_path)
    fd = _open_in(
        directory,
        lambda: ops.open_exclusive(temp, file_mode, open_flags),
        dir_mode=dir_mode, ops=ops, root=root, sync=sync, known=known,
    )
    published = False
    try:
        try:
            writer(fd, temp)
            if sync:
                ops.fsync(fd)
        finally:
            ops.close(fd)
        if replace:
            ops.replace(temp, final_path)
            published = True
        else:
            ops.link(temp, final_path)
            published = True
            ops.unlink(temp)
        if sync:
            ops.fsync_dir(directory)
    finally:
        if not published:
            # Best effort: the error that stopped the publish is the one to report; a temp
            # name left behind is removed by remove_stale_temps at the next start.
            with contextlib.suppress(OSError):
                ops.unlink(temp)


def _open_in(
    directory: Path,
    open_file: Callable[[], int],
    *,
    dir_mode: int,
    ops: FileOps,
    root: Path | None,
    sync: bool,
    known: KnownDirs | None,
) -> int:
    """``open_file()``; if it finds no ``directory`` although ``known`` had it, the
    cached directories are forgotten, the path checked and made again, and it retries."""
    try:
        return open_file()
    except FileNotFoundError:
        if known is None or directory not in known:
            raise
    # A cached directory was removed meanwhile (a namespace dropped and reopened): check
    # and make the path again.
    known.clear()
    ensure_dir(directory, mode=dir_mode, ops=ops, root=root, sync=sync, known=known)
    return open_file()


def _publish_anonymous(
    fd: int, final_path: Path, writer: Writer, *, replace: bool, ops: FileOps, sync: bool
) -> None:
    """Write the anonymous file ``fd`` and link it as ``final_path``; closes ``fd``. An
    unlinked anonymous file vanishes with its descriptor, so a failure before the link
    leaves nothing to clean up. An existing ``final_path`` is replaced (with ``replace``)
    by linking the file under a temp name and renaming that over it."""
    temp: Path | None = None
    try:
        writer(fd, Path(f"/proc/self/fd/{fd}"))
        if sync:
            ops.fsync(fd)
        try:
            ops.link_anonymous(fd, final_path)
        except FileExistsError:
            if not replace:
                raise
            temp = temp_path_for(final_path)
            ops.link_anonymous(fd, temp)
    except BaseException:
        # The error that stopped the publish is the one to report.
        with contextlib.suppress(OSError):
            ops.close(fd)
        raise
    linked = final_path if temp is None else temp
    try:
        ops.close(fd)
        if temp is not None:
            ops.replace(temp, final_path)
    except BaseException:
        with contextlib.suppress(OSError):
            ops.unlink(linked)
        raise
    if sync:
        ops.fsync_dir(final_path.parent)


def publish_bytes(
    final_path: Path,
    buffers: Sequence[Buffer],
    *,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    replace: bool = True,
    ops: FileOps = DEFAULT_OPS,
    root: Path | None = None,
    anonymous: bool = True,
) -> None:
    """:func:`publish` of the concatenation of ``buffers``."""
    publish(
        final_path,
        lambda fd, _path: write_all(fd, buffers),
        file_mode=file_mode,
        dir_mode=dir_mode,
        replace=replace,
        ops=ops,
        root=root,
        anonymous=anonymous,
    )
