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

from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass

from kvtiers.core.buffers import Buffer


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
        """Fill ``buffers`` in order with the object's leading bytes; return its size.

        When the size differs from the buffers' total length the buffers may be left
        untouched: the caller treats such an object as not what it expected."""

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
