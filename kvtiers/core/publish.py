"""Atomic publish: the only way a file appears in a kvtiers store.

Steps: a unique temp name in the target directory (``O_CREAT | O_EXCL``) → the caller's
writer writes every byte (short writes are checked) → ``fsync`` the file →
``os.replace`` onto the final name → ``fsync`` the directory. A reader therefore sees the
old state or the new one, never a torn file; a crash leaves at most a stale temp file,
which :func:`cleanup_stale_temps` removes at start-up. New directories are created 0700 and
their parent fsynced once, so the directory entry itself is durable. Given the store's
root, publishing refuses to create or write through a symbolic link between the root and
the file (checked with ``lstat`` before the write; a link put there meanwhile by someone
with write access to the root is beyond what this check promises).

No-clobber mode (``replace=False``) links the finished temp file to the final name with
``os.link`` instead, which fails with :class:`FileExistsError` when the name exists: of
several processes racing to publish the same name exactly one wins and the others keep
their hands off the winner's bytes. The temp name is unlinked afterwards.

System calls go through :class:`FileOps` so tests can inject a failure at every step.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtiers.errors import SymlinkEscapeError

TEMP_SUFFIX = ".kvtmp"
DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700

Buffer = bytes | bytearray | memoryview
#: Writes every byte of the new file into ``fd`` (opened for writing at ``temp_path``).
Writer = Callable[[int, Path], object]


class FileOps:
    """The system calls publishing uses; subclassed by tests to inject failures."""

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | extra_flags
        return os.open(path, flags, mode)

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


DEFAULT_OPS = FileOps()


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
) -> None:
    """Create ``path`` and missing parents with ``mode``, fsyncing each new directory's
    parent once so the new entry survives a crash.

    With ``root`` (an ancestor of ``path``), every directory strictly below ``root`` on
    the way to ``path`` must be a real directory: a symbolic link there (which could lead
    out of the root) raises :class:`SymlinkEscapeError` and nothing is created through it.
    ``root`` itself may be a link: the operator chose it."""
    if root is None:
        if path.is_dir():
            return
        ensure_dir(path.parent, mode=mode, ops=ops)
        _make_dir(path, mode, ops)
        return
    relative = path.relative_to(root)
    ensure_dir(root, mode=mode, ops=ops)
    current = root
    for part in relative.parts:
        current = current / part
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            _make_dir(current, mode, ops)
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


def _make_dir(path: Path, mode: int, ops: FileOps) -> None:
    """``mkdir`` (which never follows a link at ``path``); fsync the parent if it made it."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
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
) -> None:
    """Atomically make ``final_path`` hold exactly what ``writer`` writes.

    ``root``, when given, is the store's root: no directory between it and
    ``final_path`` may be a symbolic link (see :func:`ensure_dir`).

    Replaces an existing file. A failure before the rename (or link) removes the temp
    file, leaves the final path untouched, and propagates. A failure of the directory
    fsync after it propagates too, but the file is then in place (complete, not yet
    known to be durable): callers must not assume the old state.

    With ``replace=False`` an existing ``final_path`` is never touched: the call raises
    :class:`FileExistsError` instead (after removing its temp file). Should unlinking the
    temp name fail once the link is made, the error propagates with the file published
    and the temp name left for :func:`cleanup_stale_temps`.
    """
    ensure_dir(final_path.parent, mode=dir_mode, ops=ops, root=root)
    temp = temp_path_for(final_path)
    fd = ops.open_exclusive(temp, file_mode, open_flags)
    published = False
    try:
        try:
            writer(fd, temp)
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
        ops.fsync_dir(final_path.parent)
    finally:
        if not published:
            # Best effort: the error that stopped the publish is the one to report; a temp
            # name left behind is removed by cleanup_stale_temps at the next start.
            with contextlib.suppress(OSError):
                ops.unlink(temp)


def publish_bytes(
    final_path: Path,
    buffers: Sequence[Buffer],
    *,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    replace: bool = True,
    ops: FileOps = DEFAULT_OPS,
    root: Path | None = None,
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
    )


def cleanup_stale_temps(root: Path, *, older_than_s: float = 0.0) -> int:
    """Remove temp files left by interrupted publishes under ``root`` (recursively);
    returns how many. On a shared directory pass ``older_than_s`` so another live
    writer's temp files are left alone. Temp files that cannot be removed (a read-only
    filesystem) stay where they are."""
    cutoff = time.time() - older_than_s
    removed = 0
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif is_temp_name(entry.name):
                try:
                    if older_than_s <= 0 or entry.stat(follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                except OSError:
                    # Gone already, or a read-only filesystem: a temp name is never read
                    # as data, so leaving it is safe.
                    continue
    return removed
