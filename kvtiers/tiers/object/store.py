"""The small object-store interface the object tiers (``s3``, ``fsspec``) are built on.

An :class:`ObjectStore` names objects by ``/``-separated strings relative to its own root
(a bucket, or an fsspec URL) and offers the handful of primitives the shared manager and
mover need: a paginated listing with sizes and modification times, reading an object
into caller-owned buffers, a put that never overwrites, a delete and an existence probe.

Contract for implementers:

- a missing object is :class:`ObjectMissing` from :meth:`ObjectStore.get_into` and
  :meth:`ObjectStore.read`, and ``None`` from :meth:`ObjectStore.head`; deleting a
  missing object is not an error;
- :meth:`ObjectStore.put_if_absent` returns ``False`` (and writes nothing) when the
  object already exists — a racing writer has stored it, which for a chunk means the
  chunk is there; :meth:`ObjectStore.put` replaces an object whole (the namespace
  summary is rewritten that way);
- :meth:`ObjectStore.is_transient` says which exceptions are worth retrying by the caller
  (throttling, server errors other than 501 Not Implemented, dropped connections,
  timeouts — or, for a store whose client retries its own requests, only what that
  client cannot retry, such as a response body cut in transit); the caller owns that
  retry loop, and :attr:`ObjectStore.retries` counts the store's own.
"""

from __future__ import annotations

import bisect
import io
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtiers.core.buffers import Buffer


class Hasher(Protocol):
    """A streaming hash (``xxhash.xxh3_128()``): fed the bytes as they arrive."""

    def update(self, data: Buffer, /) -> object: ...


class ObjectMissing(Exception):
    """The named object does not exist."""


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its name (relative to the store's root), size and mtime."""

    name: str
    size: int
    # Seconds since the epoch; 0.0 when the backend does not report one.
    mtime: float
    #: What the entry is when it is not a plain object (``a FIFO``, ``a symbolic link``
    #: in a local directory): such an entry is never read, only reported.
    irregular: str | None = None


class ObjectStore(ABC):
    """Objects under one root. Methods are safe to call from several threads at once."""

    #: What :class:`~kvtiers.core.specs.ObjectLoadStoreSpec` carries as ``bucket``.
    bucket: str

    @abstractmethod
    def describe(self, name: str = "") -> str:
        """A URL of ``name`` (or of the root) for messages, e.g. ``s3://bucket/name``."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix``, page by page."""

    @abstractmethod
    def head(self, name: str) -> int | None:
        """The size of ``name``, or ``None`` when it does not exist."""

    @abstractmethod
    def get_into(self, name: str, buffers: Sequence[memoryview]) -> int:
        """Fill ``buffers`` in order with the object's bytes; return its size.

        An object no larger than the buffers' total is read whole: the buffers are
        filled in order up to its size, and the rest of them is left as it was (a chunk
        stored encoded is shorter than the chunk). A larger one may leave the buffers
        untouched: the caller treats it as not what it expected."""

    def get_hashed(self, name: str, buffers: Sequence[memoryview], hasher: Hasher) -> int:
        """:meth:`get_into`, also feeding ``hasher`` every byte that lands in
        ``buffers[1:]`` (those after the first, a chunk's header), in order.

        Note to implementers: the default hashes the bytes after the read; a backend that
        reads in pieces overrides it to hash each piece as it lands."""
        size = self.get_into(name, buffers)
        if size <= sum(len(b) for b in buffers):
            left = size - len(buffers[0])
            for buffer in buffers[1:]:
                if left <= 0:
                    break
                hasher.update(buffer[: min(len(buffer), left)])
                left -= len(buffer)
        return size

    @abstractmethod
    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        """Store the concatenation of ``parts`` unless ``name`` exists; True if stored."""

    @abstractmethod
    def put(self, name: str, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` as ``name``, replacing any object there in
        one step: a reader gets the old object or the new one whole. For objects that
        are rewritten (the namespace summary), never for chunks."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` (absent is fine)."""

    @abstractmethod
    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a failure worth retrying."""

    @property
    def retries(self) -> int:
        """Retries the store made inside its own requests (a client library's retry
        mode); 0 for a store that leaves every retry to its caller."""
        return 0

    def read(self, name: str, limit: int) -> bytes:
        """The whole of an object of at most ``limit`` bytes; for a larger one, ``limit`` +
        1 bytes (not necessarily its first ones) that say it is larger than the caller
        accepts.

        Note to implementers: the default uses :meth:`head` then :meth:`get_into`; a
        backend with a cheaper whole-object read overrides it."""
        size = self.head(name)
        if size is None:
            raise ObjectMissing(name)
        buffer = bytearray(min(size, limit + 1))
        self.get_into(name, [memoryview(buffer)])
        return bytes(buffer)

    def stream(self, name: str, offset: int, block_bytes: int) -> Generator[bytes, None, None]:
        """``name``'s bytes from ``offset`` to its end, in pieces of ``block_bytes`` at most.

        Note to implementers: the default reads the whole object once (held in memory);
        a backend with ranged reads overrides it."""
        data = memoryview(self.read(name, 1 << 40))[offset:]
        for start in range(0, len(data), block_bytes):
            yield bytes(data[start : start + block_bytes])

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose name starts with ``prefix``; returns how many."""
        names = [info.name for info in self.list(prefix)]
        for name in names:
            self.delete(name)
        return len(names)

    def close(self) -> None:
        """Release connections. Idempotent."""


class PartsReader(io.RawIOBase):
    """A read-only, seekable file over the concatenation of ``parts``, without joining
    them: a request body (a client library seeks back to hash it and to retry) whose
    bytes are copied only as each block is read. The parts must not change while it is
    in use."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        super().__init__()
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._starts: list[int] = []
        total = 0
        for part in self._parts:
            self._starts.append(total)
            total += part.nbytes
        self._size = total
        self._position = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        for start, part in zip(self._starts, self._parts, strict=True):
            if done == out.nbytes:
                break
            end = start + part.nbytes
            if end <= self._position + done:
                continue
            offset = self._position + done - start
            count = min(part.nbytes - offset, out.nbytes - done)
            out[done : done + count] = part[offset : offset + count]
            done += count
        self._position += done
        return done

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._size - self._position)
        count = left if size is None or size < 0 else min(size, left)
        # The common case, a block inside one part (a client reads 8-16 KiB blocks): one
        # slice, no loop.
        index = bisect.bisect_right(self._starts, self._position) - 1
        if index >= 0:
            offset = self._position - self._starts[index]
            part = self._parts[index]
            if offset + count <= part.nbytes:
                self._position += count
                return part[offset : offset + count].tobytes()
        pieces = []
        position = self._position
        for start, part in zip(self._starts, self._parts, strict=True):
            if count == 0:
                break
            end = start + part.nbytes
            if end <= position:
                continue
            offset = position - start
            take = min(part.nbytes - offset, count)
            pieces.append(part[offset : offset + take])
            position += take
            count -= take
        self._position = position
        return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)
