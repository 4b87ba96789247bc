"""Where the offline tools look: a file root, ``s3://bucket/prefix`` or any fsspec URL.

A :class:`Location` is one :class:`~kvtiers.tiers.object.store.ObjectStore` and a prefix
in it: it lists namespaces (directories or prefixes holding a ``manifest.json``), lists a
namespace's entries with size and modification time, reads and deletes them, and
quarantines a corrupt chunk. Names are ``/``-separated and relative to the location. A
file root (a path or a ``file://`` URL) is a
:class:`~kvtiers.tiers.object.local.LocalStore`; S3 goes through the S3 tier's own store
(boto3, imported only then); any other URL through the fsspec tier's store.

A file root is never left through a symbolic link (see
:mod:`kvtiers.tiers.object.local`): a link is never a namespace, listings do not descend
into links, and files are opened with ``O_NOFOLLOW`` (and must be regular files), so
``gc`` never deletes and ``verify``/``inspect`` never read outside the root.

Reads are bounded whatever an entry's size: :meth:`Location.read` takes a limit,
:meth:`Location.stream` yields blocks of the size asked for (from one request on S3 and
one open file on fsspec, never the whole object at once), and :meth:`Location.quarantine`
moves an entry by name without reading it (a rename under a file root, a server-side
copy on S3, fsspec's own move elsewhere).
"""

from __future__ import annotations

import os
import secrets
import stat
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvtiers.core.publish import ensure_dir, is_temp_name
from kvtiers.errors import ConfigError
from kvtiers.filemapper import MANIFEST_NAME, QUARANTINE_DIR
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES
from kvtiers.filemapper.mapper import GENERATION_NAME, SNAPSHOT_NAME
from kvtiers.filemapper.summary import SUMMARY_NAME
from kvtiers.tiers.object.local import LocalStore
from kvtiers.tiers.object.store import ObjectInfo, ObjectMissing, ObjectStore

if TYPE_CHECKING:
    from kvtiers.tiers.fsspec.store import FsspecStore
    from kvtiers.tiers.s3.store import S3Store


@dataclass(frozen=True)
class Entry(ObjectInfo):
    """One file or object inside a namespace (``name`` relative to the location; an
    ``irregular`` entry is never read, only reported)."""

    @property
    def base(self) -> str:
        return self.name.rsplit("/", 1)[-1]


class Location(ABC):
    """The kvtiers namespaces under ``prefix`` in ``store``; each kind of store moves an
    entry aside in its own way (:meth:`_move`)."""

    def __init__(self, store: ObjectStore, prefix: str = "") -> None:
        self.store = store
        self.prefix = prefix.strip("/")

    def _full(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def describe(self) -> str:
        return self.store.describe(self.prefix)

    def namespaces(self) -> list[str]:
        """Names of the namespaces here (those whose manifest is a regular object; a
        link is never a namespace: one may lead out of the root, where gc would delete)."""
        found = set()
        for info in self.store.list(self._full("")):
            parts = self._relative(info.name).split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME and info.irregular is None:
                found.add(parts[0])
        return sorted(found)

    def entries(self, namespace: str) -> Iterator[Entry]:
        """Every entry of ``namespace`` except its manifest, its summary, a file tier's
        index snapshot and openings count, and its quarantine."""
        skip = tuple(f"{namespace}/{name}" for name in (
            MANIFEST_NAME, SUMMARY_NAME, SNAPSHOT_NAME, GENERATION_NAME
        ))
        quarantine = f"{namespace}/{QUARANTINE_DIR}/"
        for info in self.store.list(self._full(f"{namespace}/")):
            name = self._relative(info.name)
            if name not in skip and not name.startswith(quarantine):
                yield Entry(name, info.size, info.mtime, info.irregular)

    def quarantined(self, namespace: str) -> Iterator[Entry]:
        """The entries of ``namespace``'s quarantine (chunks a tier or ``verify --fix``
        set aside as corrupt; no tier reads them)."""
        quarantine = f"{namespace}/{QUARANTINE_DIR}/"
        for info in self.store.list(self._full(quarantine)):
            yield Entry(self._relative(info.name), info.size, info.mtime, info.irregular)

    def read(self, name: str, limit: int) -> bytes:
        """The first ``limit`` + 1 bytes of ``name`` at most (more than ``limit`` bytes back
        means the entry is larger than the caller accepts; see :meth:`ObjectStore.read`)."""
        return self.store.read(self._full(name), limit)

    def stream(self, name: str, offset: int, block_bytes: int) -> Generator[bytes, None, None]:
        """``name``'s bytes from ``offset`` to its end, in pieces of ``block_bytes`` at most."""
        return self.store.stream(self._full(name), offset, block_bytes)

    def delete(self, name: str) -> None:
        self.store.delete(self._full(name))

    def quarantine(self, namespace: str, name: str) -> str:
        """Move a corrupt entry to ``<namespace>/quarantine/`` by name, never reading its
        bytes; returns its name there: the entry's own, with a random suffix when that
        is taken (as the file tier names what it quarantines)."""
        base = name.rsplit("/", 1)[-1]
        target = f"{namespace}/{QUARANTINE_DIR}/{base}"
        if self.store.head(self._full(target)) is not None:
            target = f"{target}.{secrets.token_hex(4)}"
        self._move(self._full(name), self._full(target))
        return target

    @abstractmethod
    def _move(self, source: str, target: str) -> None:
        """Rename the object ``source`` to the free name ``target`` (both full names)
        with bounded memory, whatever its size."""

    def remove_namespace(self, namespace: str) -> int:
        """Delete a whole namespace; returns how many entries went."""
        return self.store.delete_prefix(self._full(f"{namespace}/"))

    def manifest(self, namespace: str) -> bytes:
        """The manifest's bytes, at most :data:`MAX_MANIFEST_BYTES` + 1 of them."""
        return self.read(f"{namespace}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)

    def close(self) -> None:
        """Release connections."""
        self.store.close()


def open_location(spec: str, *, endpoint_url: str | None = None,
                  region: str | None = None) -> Location:
    """``s3://bucket[/prefix]``, an fsspec URL (``memory://kv``, ``gcs://bucket/kv``), or a
    directory (a path or ``file://`` URL)."""
    if spec.startswith("s3://"):
        bucket, _, prefix = spec[len("s3://"):].partition("/")
        if not bucket:
            raise ConfigError(f"{spec!r} names no bucket; write s3://bucket/prefix",
                              path="location")
        from kvtiers.tiers.s3.store import S3Store

        store = S3Store(bucket, region=region or os.environ.get("AWS_DEFAULT_REGION"),
                        endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"))
        store.check_bucket(where="location")
        return S3Location(store, prefix)
    if not spec.strip():
        # An empty argument (an unset shell variable, most often) would mean the current
        # directory: refused rather than guessed.
        raise ConfigError("the location is empty; give a file tier's root, "
                          "s3://bucket/prefix or an fsspec URL", path="location")
    if spec.startswith("file://"):
        spec = spec[len("file://"):]
    elif "://" in spec:
        from kvtiers.optional import require

        require("fsspec", purpose=f"the location {spec!r}")
        from kvtiers.tiers.fsspec.store import FsspecStore

        return FsspecLocation(FsspecStore(spec))
    root = Path(spec).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give a file tier's root, "
                          "s3://bucket/prefix or an fsspec URL", path="location")
    return DirectoryLocation(LocalStore(root))


class DirectoryLocation(Location):
    """A file tier's root: entries are moved by ``rename``, never through a link."""

    def __init__(self, store: LocalStore, prefix: str = "") -> None:
        super().__init__(store, prefix)
        self.store: LocalStore = store

    def namespaces(self) -> list[str]:
        """As :meth:`Location.namespaces`, from the root's own entries: each real
        directory (not a link) whose ``manifest.json`` is a regular file. Nothing below a
        namespace is read, so finding the namespaces of a root holding millions of chunk
        files (or a directory that holds none) costs one directory listing."""
        if self.prefix:
            return super().namespaces()
        found = []
        try:
            entries = list(os.scandir(self.store.root))
        except FileNotFoundError:
            return []
        for entry in entries:
            try:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                info = os.lstat(os.path.join(entry.path, MANIFEST_NAME))
            except (FileNotFoundError, NotADirectoryError):
                continue
            if stat.S_ISREG(info.st_mode):
                found.append(entry.name)
        return sorted(found)

    def _move(self, source: str, target: str) -> None:
        root = self.store.root
        source_path, target_path = root / source, root / target
        # Both directories must be real ones below the root (a link there may lead out of
        # it); the quarantine is made if missing.
        ensure_dir(source_path.parent, root=root, sync=False)
        ensure_dir(target_path.parent, root=root, sync=False)
        try:
            os.rename(source_path, target_path)
        except FileNotFoundError:
            raise ObjectMissing(source) from None


class S3Location(Location):
    """An S3 bucket and prefix: entries are read from one streamed GET and moved by a
    server-side copy (multipart above S3's single-copy limit), then deleted."""

    def __init__(self, store: S3Store, prefix: str = "") -> None:
        super().__init__(store, prefix)
        self.store: S3Store = store

    def stream(self, name: str, offset: int, block_bytes: int) -> Generator[bytes, None, None]:
        import botocore.exceptions

        full = self._full(name)
        request: dict[str, str] = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            response = self.store.client().get_object(
                Bucket=self.store.bucket, Key=full, **request)
        except botocore.exceptions.ClientError:
            if self.store.head(full) is None:  # gone since the listing
                raise ObjectMissing(name) from None
            raise
        body = response["Body"]
        try:
            while part := body.read(block_bytes):
                yield part
        finally:
            body.close()

    def _move(self, source: str, target: str) -> None:
        import botocore.exceptions

        bucket = self.store.bucket
        try:
            self.store.client().copy({"Bucket": bucket, "Key": source}, bucket, target)
        except botocore.exceptions.ClientError:
            if self.store.head(source) is None:  # gone since the listing
                raise ObjectMissing(source) from None
            raise
        self.store.delete(source)


class FsspecLocation(Location):
    """Any other fsspec URL: entries are read through one open file and moved by the
    filesystem's own ``mv`` (a rename or a server-side copy, by backend)."""

    def __init__(self, store: FsspecStore, prefix: str = "") -> None:
        super().__init__(store, prefix)
        self.store: FsspecStore = store

    def _path(self, full: str) -> str:
        return f"{self.store.root}/{full}"

    def stream(self, name: str, offset: int, block_bytes: int) -> Generator[bytes, None, None]:
        try:
            handle = self.store.fs.open(self._path(self._full(name)), "rb",
                                        block_size=block_bytes)
        except FileNotFoundError:
            raise ObjectMissing(name) from None
        with handle:
            handle.seek(offset)
            while part := handle.read(block_bytes):
                yield part

    def _move(self, source: str, target: str) -> None:
        try:
            self.store.fs.mv(self._path(source), self._path(target))
        except FileNotFoundError:
            raise ObjectMissing(source) from None


def is_temp(entry: Entry) -> bool:
    return is_temp_name(entry.base)
