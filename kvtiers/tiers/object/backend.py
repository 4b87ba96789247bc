"""What the manager and the mover of one object tier share: the store, the namespace
layout, the retry policy, the I/O thread pools and the counters both sides update.

Two pools (docs/architecture.md, "Two classes of work"): reads a waiting request needs
(loads, existence probes) run on threads at the engine's priority (:meth:`ObjectBackend.submit`);
write-behind (puts, deletes) on threads of their own below it
(:meth:`ObjectBackend.submit_background`), so a read never queues behind a put.

Layout: the chunk of ``key`` is the object
``<prefix>/<namespace>/<hh>/<hh>/<hash hex>_g<group>.kvc`` (see
:class:`~kvtiers.filemapper.FileMapper`), next to ``<prefix>/<namespace>/manifest.json``.
:meth:`ObjectBackend.open_namespace` reads the manifest and compares it with this
tier's identity (fail closed on any difference), publishing it with a put-if-absent when
there is none yet; a writer that loses that race reads the winner's manifest and checks it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from kvtiers.core.keys import OffloadKey
from kvtiers.core.mover import SHUTDOWN_TIMEOUT_S
from kvtiers.filemapper import MANIFEST_NAME, FileMapper, check_manifest, manifest_bytes
from kvtiers.filemapper.identity import NamespaceIdentity
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES
from kvtiers.tiers.iopool import IOPool
from kvtiers.tiers.object.retry import Retrier
from kvtiers.tiers.object.store import ObjectMissing, ObjectStore

_T = TypeVar("_T")

log = logging.getLogger(__name__)


class ObjectBackend:
    """One namespace of an :class:`ObjectStore`, with two bounded pools of ``threads`` I/O
    threads each: reads, and write-behind."""

    def __init__(
        self,
        store: ObjectStore,
        identity: NamespaceIdentity,
        *,
        prefix: str = "",
        threads: int = 8,
        retrier: Retrier | None = None,
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.identity = identity
        self.prefix = prefix.strip("/")
        self.mapper = FileMapper("", identity)
        self.namespace_prefix = (
            f"{self.prefix}/{identity.namespace}" if self.prefix else identity.namespace
        )
        self.manifest_name = f"{self.namespace_prefix}/{MANIFEST_NAME}"
        self.retrier = retrier or Retrier(store.is_transient)
        self.threads = threads
        self.shutdown_timeout_s = shutdown_timeout_s
        self._pool = IOPool(threads, "kvtiers-object")
        self._background = IOPool(threads, "kvtiers-object-store", background=True)
        self._lock = threading.Lock()
        self._corrupt_chunks = 0
        self._closed = False
        self._store_closed = False
        self._shutdown_by: float | None = None

    # -- names ----------------------------------------------------------------------
    def object_key(self, key: OffloadKey) -> str:
        """The object name of ``key``'s chunk."""
        return self.mapper.object_key(key, self.prefix)

    def key_of(self, name: str) -> OffloadKey | None:
        """The key whose chunk object is ``name``; ``None`` for any other object (the
        manifest, stray or misplaced objects)."""
        key = self.mapper.key_from_name(name.rpartition("/")[2])
        if key is None or self.object_key(key) != name:
            return None
        return key

    # -- the namespace --------------------------------------------------------------
    def open_namespace(self) -> None:
        """Check the namespace manifest, publishing it first if there is none.

        Raises :class:`~kvtiers.errors.NamespaceMismatchError` when it disagrees with
        this tier's identity."""
        store, name = self.store, self.manifest_name
        where = store.describe(name)
        try:
            data = self.retrier.call(lambda: store.read(name, MAX_MANIFEST_BYTES))
        except ObjectMissing:
            document = manifest_bytes(self.identity)
            if self.retrier.call(lambda: store.put_if_absent(name, [document])):
                return
            data = self.retrier.call(lambda: store.read(name, MAX_MANIFEST_BYTES))
        check_manifest(data, self.identity, where=where)

    # -- background work ------------------------------------------------------------
    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` (a read a request may wait for) on the pool at the engine's
        priority. Raises ``RuntimeError`` once closed."""
        return self._pool.submit(fn)

    def submit_background(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run ``fn`` (write-behind: a put, a delete) on the pool below the engine's
        priority. Raises ``RuntimeError`` once closed."""
        return self._background.submit(fn)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- shared counters ------------------------------------------------------------
    def count_corrupt(self, n: int = 1) -> None:
        with self._lock:
            self._corrupt_chunks += n

    @property
    def corrupt_chunks(self) -> int:
        return self._corrupt_chunks

    @property
    def retries(self) -> int:
        """Retries of this tier's requests: the retrier's and the store's own."""
        return self.retrier.retries + self.store.retries

    def delete_quietly(self, name: str) -> bool:
        """Delete ``name`` with retries; a failure is logged, not raised. True if done."""
        try:
            self.retrier.call(lambda: self.store.delete(name))
        except Exception as exc:  # a failed delete only leaves an object behind
            log.warning("could not delete %s: %s", self.store.describe(name), type(exc).__name__)
            return False
        return True

    def shutdown_deadline(self) -> float:
        """The ``time.monotonic()`` by which shutdown gives up on running requests: set
        by the first call (the mover's shutdown, or the pool's own), so the mover's wait
        and the pool's together never exceed ``shutdown_timeout_s``."""
        with self._lock:
            if self._shutdown_by is None:
                self._shutdown_by = time.monotonic() + self.shutdown_timeout_s
            return self._shutdown_by

    def stop_threads(self) -> None:
        """Finish queued work and stop the pool, leaving the store open (for callers
        that share one store between backends); all within ``shutdown_timeout_s`` of the
        shutdown's start, after which work not started is dropped and threads still in a
        request are abandoned with a warning. Idempotent."""
        if self._closed:
            return
        self._closed = True
        ended = all([
            pool.shutdown(max(0.0, self.shutdown_deadline() - time.monotonic()))
            for pool in (self._pool, self._background)
        ])
        if not ended:
            log.warning(
                "%s: requests still running %g s after shutdown began; their threads are "
                "abandoned", self.store.describe(), self.shutdown_timeout_s,
            )

    def close(self) -> None:
        """Finish queued work, stop the pool and close the store. Idempotent."""
        if self._store_closed:
            return
        self._store_closed = True
        self.stop_threads()
        self.store.close()
