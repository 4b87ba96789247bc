"""The manager of an object tier (``s3``, ``fsspec``): an in-memory index of one namespace.

The index is rebuilt at start from one paginated listing of the namespace (sizes, and
modification times as recency) — never a request per key — and kept in LRU order. It
never decodes a key's group: a reservation is accounted at ``HEADER_BYTES +
max_chunk_bytes``, a listed or probed object at its real size. With a ``capacity``
(bytes) the least recently used ready, unpinned chunks are dropped from the index at once
and their objects deleted on the I/O pool — to make room for a store (never evicting a key
of the same batch that is already present) or for chunks a probe found. A key whose
delete is still running is not stored again until the delete is done (``prepare_store``
answers ``None``), so a delete never removes a newer copy.

Everything here runs on the scheduler thread and never waits for I/O. Work finished on
I/O threads (deletes, existence probes, chunks the mover found corrupt or missing) comes
back through thread-safe queues drained at the start of the next call.

``shared: true`` is for namespaces other engines write into: an index miss queues the key
for a batched existence probe (sent in :meth:`on_schedule_end`) and answers ``RETRY``
until it resolves to ``HIT`` or ``MISS``; negative answers are remembered for
``negative_ttl_s`` so a cold key is not probed every step.
"""

from __future__ import annotations

import functools
import queue
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.specs import ObjectLoadStoreSpec
from kvtiers.errors import UnknownKeyError
from kvtiers.tiers.object.backend import ObjectBackend

#: Remembered negative probe answers are pruned of expired ones beyond this many.
_NEGATIVE_PRUNE_AT = 4096


@dataclass
class _Entry:
    size: int
    ready: bool
    pins: int = 0


class ObjectTierManager(OffloadingManager):
    """Bookkeeping of one namespace of an object store. See the module docstring."""

    capabilities = TierCapabilities(persistent=True, evicts=True, recency=True, events=True)
    medium = Medium.STORAGE
    locality = Locality.REMOTE

    def __init__(
        self,
        backend: ObjectBackend,
        *,
        max_chunk_bytes: int,
        capacity_bytes: int | None = None,
        shared: bool = False,
        negative_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.reserve_bytes = HEADER_BYTES + max_chunk_bytes
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.negative_ttl_s = negative_ttl_s
        self._clock = clock
        self._entries: OrderedDict[OffloadKey, _Entry] = OrderedDict()
        self._usage = 0
        self._events: list[OffloadingEvent] = []
        self._stats = {"hits": 0, "misses": 0, "stores": 0, "store_failures": 0,
                       "evictions": 0, "loads": 0, "probes": 0, "forgotten": 0}
        # Filled on I/O threads, drained on the scheduler thread.
        self._forgotten: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._deleted: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._probed: queue.SimpleQueue[tuple[OffloadKey, int | None]] = queue.SimpleQueue()
        self._doomed: set[OffloadKey] = set()
        self._deleting: set[OffloadKey] = set()
        self._to_probe: dict[OffloadKey, None] = {}
        self._probing: set[OffloadKey] = set()
        self._negative: dict[OffloadKey, float] = {}
        self._background: list[Future[None]] = []
        self._closed = False
        backend.open_namespace()
        self._rebuild()

    # -- start-up -------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index every chunk object of the namespace, oldest modification first."""
        found = []
        for info in self.backend.retrier.call(
            lambda: list(self.backend.store.list(self.backend.namespace_prefix + "/")),
            bounded=False,  # one listing is many pages; each is bounded by the store
        ):
            key = self.backend.key_of(info.name)
            if key is not None:
                found.append((info.mtime, info.name, key, info.size))
        found.sort()
        for _, _, key, size in found:
            self._entries[key] = _Entry(size=size, ready=True)
            self._usage += size

    # -- messages from I/O threads --------------------------------------------------
    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """Drop ``keys`` from the index at the next scheduler call (their objects are
        corrupt or gone). Thread-safe; pinned keys go when their last pin is dropped."""
        for key in keys:
            self._forgotten.put(key)

    def _drain(self) -> None:
        while not self._deleted.empty():
            self._deleting.discard(self._deleted.get())
        while not self._forgotten.empty():
            self._doomed.add(self._forgotten.get())
        for key in list(self._doomed):
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                self._doomed.discard(key)
            elif entry.pins == 0:
                self._doomed.discard(key)
                self._remove(key)
                self._stats["forgotten"] += 1
                self._events.append(self._event([key], removed=True))
        found = False
        while not self._probed.empty():
            key, size = self._probed.get()
            self._probing.discard(key)
            if size is None:
                self._negative[key] = self._clock() + self.negative_ttl_s
            # A closed tier takes no new entries: it could not delete any to stay in capacity.
            elif key not in self._entries and key not in self._deleting and not self._closed:
                self._entries[key] = _Entry(size=size, ready=True)
                self._usage += size
                found = True
        if found and self.capacity_bytes is not None:
            # The new entries are ready and unpinned, so they can always be evicted
            # themselves (last, being the most recently used) if nothing older can.
            victims, _ = self._pick_victims(self._usage - self.capacity_bytes, set())
            if victims:
                self._evict(victims)

    def _remove(self, key: OffloadKey) -> None:
        self._usage -= self._entries.pop(key).size

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=self.medium, removed=removed,
                               locality=self.locality)

    # -- the contract ---------------------------------------------------------------
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._drain()
        entry = self._entries.get(key)
        if entry is not None:
            if not entry.ready:
                return LookupResult.HIT_PENDING
            self._stats["hits"] += 1
            return LookupResult.HIT
        if self.shared:
            expiry = self._negative.get(key)
            if expiry is None or expiry <= self._clock():
                self._negative.pop(key, None)
                if key not in self._probing:
                    self._to_probe[key] = None
                return LookupResult.RETRY
        self._stats["misses"] += 1
        return LookupResult.MISS

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        self._drain()
        wanted: dict[OffloadKey, None] = {}
        present: set[OffloadKey] = set()
        for key in keys:
            if key in self._entries:
                present.add(key)
            elif key in self._deleting:
                # Its old object is still being deleted; a store now could be removed by
                # that delete, and leaving the key out would claim it is present.
                return None
            else:
                wanted[key] = None
        if not wanted:
            return []
        need = len(wanted) * self.reserve_bytes
        victims: list[OffloadKey] = []
        if self.capacity_bytes is not None:
            # Keys of this batch that are present stay: the caller is told they are.
            victims, short = self._pick_victims(
                self._usage + need - self.capacity_bytes, present
            )
            if short > 0:
                return None
        if victims:
            self._evict(victims)
        for key in wanted:
            self._entries[key] = _Entry(size=self.reserve_bytes, ready=False)
            self._negative.pop(key, None)
        self._usage += need
        return list(wanted)

    def _pick_victims(
        self, excess: int, protected: set[OffloadKey]
    ) -> tuple[list[OffloadKey], int]:
        """The least recently used ready, unpinned, unprotected keys that free ``excess``
        bytes, and how many bytes they fall short of it (> 0 when they cannot). Changes
        nothing."""
        victims: list[OffloadKey] = []
        for key, entry in self._entries.items():
            if excess <= 0:
                break
            if entry.ready and entry.pins == 0 and key not in protected:
                victims.append(key)
                excess -= entry.size
        return victims, excess

    def _evict(self, victims: list[OffloadKey]) -> None:
        self._background = [f for f in self._background if not f.done()]
        for key in victims:
            self._remove(key)
            self._deleting.add(key)
            self._background.append(self.backend.submit(self._delete_job(key)))
        self._stats["evictions"] += len(victims)
        self._events.append(self._event(victims, removed=True))

    def _delete_job(self, key: OffloadKey) -> Callable[[], None]:
        name = self.backend.object_key(key)

        def run() -> None:
            try:
                self.backend.delete_quietly(name)
            finally:
                self._deleted.put(key)

        return run

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self._drain()
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                raise UnknownKeyError(f"cannot load {key.hex()}: not a ready chunk of this tier")
        for key in keys:
            self._entries[key].pins += 1
            self._entries.move_to_end(key)
        self._stats["loads"] += len(keys)

    def get_spec(self, keys: Collection[OffloadKey]) -> ObjectLoadStoreSpec:
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or (entry.ready and entry.pins == 0):
                raise UnknownKeyError(
                    f"no spec for {key.hex()}: only reserved or pinned keys have one"
                )
        return ObjectLoadStoreSpec(
            self.backend.store.bucket, [self.backend.object_key(k) for k in keys], list(keys)
        )

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.ready:
                self._entries.move_to_end(key)

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        done: list[OffloadKey] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            if success:
                entry.ready = True
                self._entries.move_to_end(key)
                done.append(key)
            else:
                self._remove(key)
                self._stats["store_failures"] += 1
        if done:
            self._stats["stores"] += len(done)
            self._events.append(self._event(done, removed=False))
        self._drain()

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
        self._drain()

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._drain()
        events, self._events = self._events, []
        return events

    # -- shared namespaces: batched existence probes --------------------------------
    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self._drain()
        self._background = [f for f in self._background if not f.done()]
        if len(self._negative) > _NEGATIVE_PRUNE_AT:
            now = self._clock()
            self._negative = {k: t for k, t in self._negative.items() if t > now}
        if not self._to_probe or self._closed:
            return
        batch = list(self._to_probe)
        self._to_probe.clear()
        self._probing.update(batch)
        self._stats["probes"] += len(batch)
        # One task per I/O thread at most: a batch costs a few round trips, not one each.
        parts = min(self.backend.threads, len(batch))
        for i in range(parts):
            self._background.append(self.backend.submit(self._probe_job(batch[i::parts])))

    def _probe_job(self, keys: list[OffloadKey]) -> Callable[[], None]:
        def run() -> None:
            store = self.backend.store
            for key in keys:
                name = self.backend.object_key(key)
                try:
                    size = self.backend.retrier.call(functools.partial(store.head, name))
                except Exception:  # an unanswered probe is a miss; the key is probed again later
                    size = None
                self._probed.put((key, size))

        return run

    def wait_background(self) -> None:
        """Block until every delete and probe started so far is done (tests, demos);
        their results are taken in at the next call."""
        wait(self._background)

    def has_pending_work(self) -> bool:
        return bool(self._to_probe or self._probing)

    # -- the rest -------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Persistent: the chunks stay; only queued probes are dropped."""
        self._to_probe.clear()

    def get_stats(self) -> Mapping[str, float]:
        self._drain()
        stats: dict[str, float] = dict(self._stats)
        stats["chunks"] = sum(1 for e in self._entries.values() if e.ready)
        stats["usage_bytes"] = self._usage
        # 0 = no capacity limit (bounded only by the store).
        stats["capacity_bytes"] = self.capacity_bytes or 0
        stats["corrupt_chunks"] = self.backend.corrupt_chunks
        stats["retries"] = self.backend.retries
        return stats

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.backend.close()
