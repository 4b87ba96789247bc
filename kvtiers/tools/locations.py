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
``gc`` never deletes and ``verify``/``inspect`` never read outside the root. Reads are
bounded: :meth:`Location.read` takes a limit, :meth:`Location.stream` yields bounded
blocks (object stores without ranged reads hold one object in memory at a time).
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtiers.core.publish import is_temp_name
from kvtiers.errors import ConfigError
from kvtiers.filemapper import MANIFEST_NAME, QUARANTINE_DIR
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES
from kvtiers.filemapper.summary import SUMMARY_NAME
from kvtiers.tiers.object.local import LocalStore
from kvtiers.tiers.object.store import ObjectInfo, ObjectStore

_WHOLE_OBJECT = 1 << 40


@dataclass(frozen=True)
class Entry(ObjectInfo):
    """One file or object inside a namespace (``name`` relative to the location; an
    ``irregular`` entry is never read, only reported)."""

    @property
    def base(self) -> str:
        return self.name.rsplit("/", 1)[-1]


class Location:
    """The kvtiers namespaces under ``prefix`` in ``store``."""

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
        """Every entry of ``namespace`` except its manifest, its summary and its
        quarantine."""
        skip = (f"{namespace}/{MANIFEST_NAME}", f"{namespace}/{SUMMARY_NAME}")
        quarantine = f"{namespace}/{QUARANTINE_DIR}/"
        for info in self.store.list(self._full(f"{namespace}/")):
            name = self._relative(info.name)
            if name not in skip and not name.startswith(quarantine):
                yield Entry(name, info.size, info.mtime, info.irregular)

    def read(self, name: str, limit: int) -> bytes:
        """The first ``limit`` + 1 bytes of ``name`` at most (more than ``limit`` bytes back
        means the entry is larger than the caller accepts; see :meth:`ObjectStore.read`)."""
        return self.store.read(self._full(name), limit)

    def stream(self, name: str, offset: int, block_bytes: int) -> Generator[bytes, None, None]:
        """``name``'s bytes from ``offset`` to its end, in pieces of ``block_bytes`` at most."""
        return self.store.stream(self._full(name), offset, block_bytes)

    def delete(self, name: str) -> None:
        self.store.delete(self._full(name))

    def quarantine(self, namespace: str, name: str) -> None:
        """Move a corrupt entry to ``<namespace>/quarantine/`` (copy, then delete)."""
        data = self.store.read(self._full(name), _WHOLE_OBJECT)
        base = name.rsplit("/", 1)[-1]
        self.store.put_if_absent(self._full(f"{namespace}/{QUARANTINE_DIR}/{base}"), [data])
        self.delete(name)

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
        return Location(store, prefix)
    if spec.startswith("file://"):
        spec = spec[len("file://"):]
    elif "://" in spec:
        from kvtiers.optional import require

        require("fsspec", purpose=f"the location {spec!r}")
        from kvtiers.tiers.fsspec.store import FsspecStore

        return Location(FsspecStore(spec))
    root = Path(spec).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give a file tier's root, "
                          "s3://bucket/prefix or an fsspec URL", path="location")
    return Location(LocalStore(root))


def is_temp(entry: Entry) -> bool:
    return is_temp_name(entry.base)
