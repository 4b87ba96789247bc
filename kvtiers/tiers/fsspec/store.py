"""The fsspec adapter of the object-store interface: any fsspec URL as an object tier.

Objects are files under the URL's path, which must name a directory below the root;
names are ``/``-separated paths below it.
Listing uses ``fs.find(detail=True)`` (one recursive listing, sizes and times included).

Time: on an asynchronous filesystem (``gcs://``, ``az://``, ``s3://`` through s3fs ...)
every call made inside :meth:`Retrier.call <kvtiers.tiers.object.retry.Retrier.call>` is
given the time left to that call's deadline as fsspec's ``timeout`` (the coroutine is
cancelled when it runs out), so a stalled request fails the operation within its
deadline. Synchronous filesystems (``file://``, ``memory://``) cannot be interrupted; the
movers' bounded shutdown covers an I/O call stuck in one of them.

Put-if-absent, and the atomicity each backend gives:

- ``file://`` (local or a mounted shared filesystem): the project's publish helper —
  unique temp file, fsync, no-clobber link into place, fsync of the directory. Atomic and
  never clobbers: of racing writers exactly one wins; readers never see a torn chunk.
- ``memory://``: ``pipe_file(mode="create")`` — an existence check then an in-memory
  commit; a torn object is impossible, but two writers racing between check and commit
  may both "win" (the second overwrites the first with an equally valid chunk).
- every other backend (``gcs://``, ``az://``, ``s3://`` through s3fs ...):
  ``pipe_file(mode="create")`` — atomic where the backend implements a conditional
  create, otherwise check-then-write as above. Object stores write whole objects, so
  readers see either no object or a complete one. Every chunk is self-verifying, so a
  lost race can cost a rewrite, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtiers.core.publish import publish_bytes
from kvtiers.core.regular import open_regular
from kvtiers.errors import ConfigError
from kvtiers.filemapper import remove_stale_temps
from kvtiers.tiers.object.retry import remaining_s
from kvtiers.tiers.object.store import Buffer, ObjectInfo, ObjectMissing, ObjectStore

STALE_TEMP_AGE_S = 3600.0
#: The shortest timeout a call is given, even with its deadline all but spent.
_MIN_WAIT_S = 0.001
_TIME_FIELDS = ("mtime", "LastModified", "updated", "last_modified", "created")


def _mtime(info: Mapping[str, Any]) -> float:
    for name in _TIME_FIELDS:
        value = info.get(name)
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


class FsspecStore(ObjectStore):
    """Objects under one fsspec URL."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        try:
            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise ConfigError(
                f"cannot open {url!r} with fsspec ({exc}); install the fsspec backend for "
                "its protocol or fix the url",
                path="url",
            ) from None
        self.fs = fs
        self.url = url
        self.bucket = url
        self.root = str(root).rstrip("/")
        # At a bare root (memory://, file:///) listed names come back with a leading "/"
        # and local names would resolve against the working directory; a bare file://
        # means the working directory itself. None of them is a place to keep a cache.
        if not self.root or not url.partition("://")[2].strip("/"):
            raise ConfigError(
                f"{url!r} names no directory; give a path below the root, e.g. "
                "memory://kvtiers or file:///var/cache/kvtiers",
                path="url",
            )
        self._local = isinstance(fs, LocalFileSystem)
        # fsspec's generated sync wrappers of an async filesystem take ``timeout``.
        self._async = bool(getattr(fs, "async_impl", False)) and bool(
            getattr(fs, "mirror_sync_methods", False)
        )
        if self._local:
            # Temp files of publishes a crash interrupted; younger ones may belong to a
            # live writer on a shared directory and are left to it.
            remove_stale_temps(Path(self.root), older_than_s=STALE_TEMP_AGE_S)

    def _bounded(self) -> dict[str, float]:
        """fsspec's ``timeout`` for the next call: the time left to the calling operation's
        deadline, on asynchronous filesystems only (synchronous ones take no such
        argument)."""
        left = remaining_s()
        if left is None or not self._async:
            return {}
        return {"timeout": max(_MIN_WAIT_S, left)}

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def describe(self, name: str = "") -> str:
        return f"{self.url.rstrip('/')}/{name}"

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        if not self.fs.exists(base, **self._bounded()):
            return
        skip = len(self.root) + 1
        found = self.fs.find(base, detail=True, **self._bounded())
        for path, info in sorted(found.items()):
            if info.get("type", "file") != "file":
                continue
            name = self.fs._strip_protocol(path)[skip:]
            yield ObjectInfo(name, int(info.get("size") or 0), _mtime(info))

    def head(self, name: str) -> int | None:
        try:
            info = self.fs.info(self._path(name), **self._bounded())
        except FileNotFoundError:
            return None
        return int(info.get("size") or 0)

    def get_into(self, name: str, buffers: Sequence[memoryview]) -> int:
        path = self._path(name)
        try:
            if self._local:
                # Never blocks on a FIFO or device put where a chunk should be.
                with os.fdopen(open_regular(path), "rb") as f:
                    size = f.seek(0, 2)
                    f.seek(0)
                    if size <= sum(len(b) for b in buffers):
                        offset = 0
                        for buffer in buffers:
                            part = buffer[: max(0, min(len(buffer), size - offset))]
                            if part and f.readinto(part) != len(part):
                                raise OSError(f"{path}: short read")
                            offset += len(part)
                    return size
            data = self.fs.cat_file(path, **self._bounded())
        except FileNotFoundError:
            raise ObjectMissing(name) from None
        if len(data) <= sum(len(b) for b in buffers):
            offset = 0
            for buffer in buffers:
                part = buffer[: max(0, min(len(buffer), len(data) - offset))]
                part[:] = data[offset : offset + len(part)]
                offset += len(part)
        return len(data)

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        path = self._path(name)
        try:
            if self._local:
                publish_bytes(Path(path), parts, replace=False)
            else:
                self.fs.pipe_file(path, b"".join(parts), mode="create", **self._bounded())
        except FileExistsError:
            return False
        return True

    def put(self, name: str, parts: Sequence[Buffer]) -> None:
        path = self._path(name)
        if self._local:
            publish_bytes(Path(path), parts)
        else:
            self.fs.pipe_file(path, b"".join(parts), **self._bounded())

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name), **self._bounded())

    def is_transient(self, exc: BaseException) -> bool:
        # Timeouts and dropped connections; a missing or existing file is an answer.
        return isinstance(exc, (TimeoutError, ConnectionError))
