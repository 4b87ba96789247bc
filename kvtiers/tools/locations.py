"""Where the offline tools look: a file root, or ``s3://bucket/prefix``.

A :class:`Location` lists namespaces (directories or prefixes holding a
``manifest.json``), lists a namespace's entries with size and modification time, reads
and deletes them, and quarantines a corrupt chunk. Names are ``/``-separated and relative
to the location. File roots are walked with ``os.scandir``; S3 goes through the S3 tier's
own store (boto3, imported only then).

A file root is never left through a symbolic link: a link is never a namespace, walks do
not descend into links, and files are opened with ``O_NOFOLLOW`` (and must be regular
files), so ``gc`` never deletes and ``verify``/``inspect`` never read outside the root.
Reads are bounded: :meth:`Location.read` takes a limit, :meth:`Location.stream` yields
bounded blocks.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtiers.core.publish import ensure_dir, is_temp_name
from kvtiers.core.regular import describe_mode, open_regular
from kvtiers.errors import ConfigError, SymlinkEscapeError
from kvtiers.filemapper import MANIFEST_NAME
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    from kvtiers.tiers.object.store import ObjectStore

QUARANTINE_DIR = "quarantine"
_READ_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One file or object inside a namespace (``name`` relative to the location)."""

    name: str
    size: int
    mtime: float
    #: What the entry is when it is not a regular file (``a FIFO``, ``a symbolic link``):
    #: such an entry is never read, only reported. ``None`` for regular files and objects.
    irregular: str | None = None

    @property
    def base(self) -> str:
        return self.name.rsplit("/", 1)[-1]


class Location(ABC):
    """A file root or an object prefix holding kvtiers namespaces."""

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def namespaces(self) -> list[str]:
        """Names of the namespaces here (those with a manifest)."""

    @abstractmethod
    def entries(self, namespace: str) -> Iterator[Entry]:
        """Every entry of ``namespace`` except its manifest and its quarantine."""

    @abstractmethod
    def read(self, name: str, limit: int) -> bytes:
        """The first ``limit`` + 1 bytes of ``name`` at most (more than ``limit`` bytes back
        means the entry is larger than the caller accepts)."""

    @abstractmethod
    def stream(self, name: str, offset: int, block_bytes: int) -> Iterator[bytes]:
        """``name``'s bytes from ``offset`` to its end, in pieces of ``block_bytes`` at most."""

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def quarantine(self, namespace: str, name: str) -> None:
        """Move a corrupt entry to ``<namespace>/quarantine/`` (objects: copy, then delete)."""

    @abstractmethod
    def remove_namespace(self, namespace: str) -> int:
        """Delete a whole namespace; returns how many entries went."""

    def manifest(self, namespace: str) -> bytes:
        """The manifest's bytes, at most :data:`MAX_MANIFEST_BYTES` + 1 of them."""
        return self.read(f"{namespace}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)

    def close(self) -> None:
        """Release connections."""


class FileLocation(Location):
    def __init__(self, root: Path) -> None:
        if not root.is_dir():
            raise ConfigError(f"{root} is not a directory; give a file tier's root or "
                              "s3://bucket/prefix", path="location")
        self.root = root

    def describe(self) -> str:
        return str(self.root)

    def namespaces(self) -> list[str]:
        # Links are never namespaces: one may lead out of the root, where gc would delete.
        with os.scandir(self.root) as it:
            return sorted(e.name for e in it
                          if e.is_dir(follow_symlinks=False) and _is_regular(
                              Path(e.path) / MANIFEST_NAME))

    def entries(self, namespace: str) -> Iterator[Entry]:
        stack = [self.root / namespace]
        while stack:
            for entry in os.scandir(stack.pop()):
                if entry.is_dir(follow_symlinks=False):
                    if not (entry.name == QUARANTINE_DIR and Path(entry.path).parent.name
                            == namespace):
                        stack.append(Path(entry.path))
                    continue
                name = Path(entry.path).relative_to(self.root).as_posix()
                if name == f"{namespace}/{MANIFEST_NAME}":
                    continue
                st = entry.stat(follow_symlinks=False)
                irregular = None if stat.S_ISREG(st.st_mode) else describe_mode(st.st_mode)
                yield Entry(name, st.st_size, st.st_mtime, irregular)

    def _open(self, name: str) -> int:
        """A read descriptor of the regular file ``name``, never through a link at its
        name (directories above it are never links: :meth:`entries` does not follow them)."""
        path = self.root / name
        try:
            return open_regular(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SymlinkEscapeError(
                    errno.ELOOP, "a symbolic link, not followed", str(path)
                ) from None
            raise

    def read(self, name: str, limit: int) -> bytes:
        fd = self._open(name)
        try:
            parts: list[bytes] = []
            wanted = limit + 1
            while wanted > 0:
                part = os.read(fd, min(wanted, _READ_BLOCK_BYTES))
                if not part:
                    break
                parts.append(part)
                wanted -= len(part)
            return b"".join(parts)
        finally:
            os.close(fd)

    def stream(self, name: str, offset: int, block_bytes: int) -> Iterator[bytes]:
        fd = self._open(name)
        try:
            while part := os.pread(fd, block_bytes, offset):
                offset += len(part)
                yield part
        finally:
            os.close(fd)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def quarantine(self, namespace: str, name: str) -> None:
        target = self.root / namespace / QUARANTINE_DIR
        ensure_dir(target, root=self.root)
        os.replace(self.root / name, target / Path(name).name)

    def remove_namespace(self, namespace: str) -> int:
        count = sum(1 for _ in self.entries(namespace)) + 1
        shutil.rmtree(self.root / namespace)
        return count


class ObjectLocation(Location):
    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.strip("/")

    def _full(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def describe(self) -> str:
        return self.store.describe(self.prefix)

    def namespaces(self) -> list[str]:
        found = set()
        for info in self.store.list(self._full("")):
            parts = self._relative(info.name).split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME:
                found.add(parts[0])
        return sorted(found)

    def entries(self, namespace: str) -> Iterator[Entry]:
        skip = {f"{namespace}/{MANIFEST_NAME}"}
        quarantine = f"{namespace}/{QUARANTINE_DIR}/"
        for info in self.store.list(self._full(f"{namespace}/")):
            name = self._relative(info.name)
            if name not in skip and not name.startswith(quarantine):
                yield Entry(name, info.size, info.mtime)

    def read(self, name: str, limit: int) -> bytes:
        # The store reads an object only whole; keep the bytes the caller accepts.
        return self.store.read(self._full(name), 1 << 40)[: limit + 1]

    def stream(self, name: str, offset: int, block_bytes: int) -> Iterator[bytes]:
        # The object store interface reads whole objects: an object is held in memory once
        # here (file roots stream in bounded blocks).
        data = memoryview(self.store.read(self._full(name), 1 << 40))[offset:]
        for start in range(0, len(data), block_bytes):
            yield bytes(data[start : start + block_bytes])

    def delete(self, name: str) -> None:
        self.store.delete(self._full(name))

    def quarantine(self, namespace: str, name: str) -> None:
        data = self.store.read(self._full(name), 1 << 40)
        base = name.rsplit("/", 1)[-1]
        self.store.put_if_absent(self._full(f"{namespace}/{QUARANTINE_DIR}/{base}"), [data])
        self.delete(name)

    def remove_namespace(self, namespace: str) -> int:
        names = [info.name for info in self.store.list(self._full(f"{namespace}/"))]
        for name in names:
            self.store.delete(name)
        return len(names)

    def close(self) -> None:
        self.store.close()


def open_location(spec: str, *, endpoint_url: str | None = None,
                  region: str | None = None) -> Location:
    """``s3://bucket[/prefix]`` or a directory path."""
    if spec.startswith("s3://"):
        bucket, _, prefix = spec[len("s3://"):].partition("/")
        if not bucket:
            raise ConfigError(f"{spec!r} names no bucket; write s3://bucket/prefix",
                              path="location")
        from kvtiers.tiers.s3.store import S3Store

        store = S3Store(bucket, region=region or os.environ.get("AWS_DEFAULT_REGION"),
                        endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"))
        store.check_bucket(where="location")
        return ObjectLocation(store, prefix)
    if "://" in spec:
        raise ConfigError(f"{spec!r}: only file roots and s3:// locations are supported",
                          path="location")
    return FileLocation(Path(spec).expanduser())


def _is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file, not a link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def is_temp(entry: Entry) -> bool:
    return is_temp_name(entry.base)
