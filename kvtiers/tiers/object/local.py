"""An :class:`ObjectStore` over a local directory that never leaves it.

The offline tools read file tiers' roots through it, so a root is served by the same
code as any object store. Names are ``/``-separated paths relative to the root.
Invariants, for a directory another user may have written into:

- no symbolic link is followed: listings never descend into one (a link is listed as an
  irregular entry), a name whose directories include a link is treated as missing, and
  files open with ``O_NOFOLLOW`` (:func:`~kvtiers.core.regular.open_regular`), so no read
  or delete reaches outside the root;
- only regular files are read; anything else under a name (a FIFO, a device, a
  directory standing where a chunk should be) is listed with ``irregular`` set and is
  never opened the ordinary way, so no call blocks on it;
- reads are bounded: :meth:`LocalStore.read` keeps at most ``limit`` + 1 bytes and
  :meth:`LocalStore.stream` yields blocks of the size asked for;
- writes go through :func:`~kvtiers.core.publish.publish_bytes` with the root given, so a
  put never creates or writes through a link.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path

from kvtiers.core.buffers import Buffer
from kvtiers.core.publish import publish_bytes
from kvtiers.core.regular import describe_mode, open_regular
from kvtiers.errors import SymlinkEscapeError
from kvtiers.filemapper import scan_namespace
from kvtiers.tiers.object.store import ObjectInfo, ObjectMissing, ObjectStore

_READ_BLOCK_BYTES = 1 << 20


class LocalStore(ObjectStore):
    """Objects under the directory ``root`` (which must exist)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bucket = str(root)

    def describe(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def _directory(self, relative: str) -> Path | None:
        """The real directory ``root/relative``; ``None`` when a part of it is missing,
        a link or not a directory."""
        path = self.root
        for part in (p for p in relative.split("/") if p):
            path = path / part
            try:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    return None
            except FileNotFoundError:
                return None
        return path

    def _path(self, name: str) -> Path:
        """Where ``name`` lives; :class:`ObjectMissing` when its directories are not real
        directories under the root."""
        directory, _, base = name.rpartition("/")
        parent = self._directory(directory)
        if parent is None or not base or base in (".", ".."):
            raise ObjectMissing(name)
        return parent / base

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        directory, _, _ = prefix.rpartition("/")
        start = self._directory(directory)
        if start is None:
            return
        lead = f"{directory}/" if directory else ""
        for item in sorted(scan_namespace(start, skip_quarantine=False), key=lambda i: i.name):
            name = lead + item.name
            if not name.startswith(prefix):
                continue
            try:
                st = item.entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            irregular = None if stat.S_ISREG(st.st_mode) else describe_mode(st.st_mode)
            yield ObjectInfo(name, st.st_size, st.st_mtime, irregular)

    def head(self, name: str) -> int | None:
        try:
            st = os.lstat(self._path(name))
        except (FileNotFoundError, ObjectMissing):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _open(self, name: str) -> int:
        path = self._path(name)
        try:
            return open_regular(path)
        except FileNotFoundError:
            raise ObjectMissing(name) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SymlinkEscapeError(
                    errno.ELOOP, "a symbolic link, not followed", str(path)
                ) from None
            raise

    def get_into(self, name: str, buffers: Sequence[memoryview]) -> int:
        fd = self._open(name)
        try:
            size = os.fstat(fd).st_size
            if size <= sum(len(b) for b in buffers):
                offset = 0
                for buffer in buffers:
                    part = buffer[: max(0, min(len(buffer), size - offset))]
                    if part and os.preadv(fd, [part], offset) != len(part):
                        raise OSError(errno.EIO, "short read", self.describe(name))
                    offset += len(part)
            return size
        finally:
            os.close(fd)

    def read(self, name: str, limit: int) -> bytes:
        parts: list[bytes] = []
        wanted = limit + 1
        for part in self.stream(name, 0, min(wanted, _READ_BLOCK_BYTES)):
            parts.append(part[:wanted])
            wanted -= len(parts[-1])
            if wanted <= 0:
                break
        return b"".join(parts)

    def stream(self, name: str, offset: int, block_bytes: int) -> Generator[bytes, None, None]:
        fd = self._open(name)
        try:
            while part := os.pread(fd, block_bytes, offset):
                offset += len(part)
                yield part
        finally:
            os.close(fd)

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        try:
            publish_bytes(self.root / name, parts, replace=False, root=self.root)
        except FileExistsError:
            return False
        return True

    def put(self, name: str, parts: Sequence[Buffer]) -> None:
        publish_bytes(self.root / name, parts, root=self.root)

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except ObjectMissing:
            return

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under the directory ``prefix`` names (``ns/``), the
        directories with them; returns how many objects went."""
        count = sum(1 for _ in self.list(prefix))
        directory = self._directory(prefix.rstrip("/"))
        if directory is not None and directory != self.root:
            shutil.rmtree(directory)
        return count

    def is_transient(self, exc: BaseException) -> bool:
        return False
