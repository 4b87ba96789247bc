"""Opening a file that must be a regular file, without ever blocking in ``open``.

Chunk files and manifests are only ever regular files. Anything else found at their path
(a FIFO, a device, a directory, a socket, a symlink loop) is an operator's mistake or an
attack, and opening it the ordinary way can block forever: ``open`` of a FIFO waits for a
writer. :func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO then opens at once), and
with ``O_NOFOLLOW`` unless symlinks are wanted, then checks with ``fstat`` that the
descriptor is a regular file; if not it closes it and raises :class:`NotRegularFileError`,
an ``OSError`` that names the path and what was found there. ``O_NONBLOCK`` has no effect
on reads of regular files, so the descriptor is used as is.

Invariant: no call here waits on anything but the filesystem itself.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
)


class NotRegularFileError(OSError):
    """Something other than a regular file is where a regular file must be."""


def describe_mode(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``a regular file``, ``a FIFO``, ``a directory``..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], flags: int = 0, *, follow_symlinks: bool = False
                 ) -> int:
    """A read-only descriptor of the regular file at ``path``, opened with ``flags`` added.

    Never blocks on a FIFO or a device. Raises :class:`NotRegularFileError` (``EISDIR``
    for a directory, ``EINVAL`` for anything else that is not a regular file) and, like
    ``os.open``, ``OSError`` with ``ELOOP`` for a symlink when ``follow_symlinks`` is false
    (or for a symlink loop).
    """
    extra = _O_NONBLOCK | _O_CLOEXEC | (0 if follow_symlinks else _O_NOFOLLOW)
    fd = os.open(path, os.O_RDONLY | flags | extra)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(mode):
        return fd
    os.close(fd)
    code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    raise NotRegularFileError(
        code, f"{describe_mode(mode)} is where a regular file must be", str(Path(path))
    )


def read_regular(path: str | os.PathLike[str], limit: int, *, follow_symlinks: bool = False
                 ) -> bytes:
    """At most ``limit`` bytes from the start of the regular file at ``path`` (see
    :func:`open_regular`)."""
    fd = open_regular(path, follow_symlinks=follow_symlinks)
    with os.fdopen(fd, "rb") as f:
        # One byte past the size shows a file that grew; never a ``limit``-sized buffer.
        return f.read(min(limit, os.fstat(fd).st_size + 1))
