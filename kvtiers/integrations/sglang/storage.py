"""``KVTiersHiCacheStorage``: kvtiers' file, S3 and fsspec tiers as SGLang HiCache's L3.

SGLang loads it with ``--hicache-storage-backend dynamic`` and builds it as
``cls(storage_config, kwargs)``; its host memory pool stays the primary. Pages go
straight between SGLang's host pool and the tiers' movers:

* **Pages and keys.** Each SGLang key (a page hash) and each part of the page (see
  :mod:`.pages`) is one kvtiers key: the page hash (32 bytes; a key that is not 64 hex
  digits is hashed with sha256) followed by the part's group index. The groups of every
  registered pool are laid out by :mod:`.identity`, which also names the namespaces.
* **Tiers.** The tiers of ``kvtiers_config`` are built, once the host pools are known
  (``on_host_pools_registered``), with the tier kinds' own factories, over a
  :class:`LentRegion` — a host region whose slots are lent per job to views of SGLang's
  pages — and one :class:`~kvtiers.tiers.jobs.JobDriver` each, without a primary
  manager (the memory is SGLang's), as the vLLM secondary tiers are.
* **Lookups** (``batch_exists``, ``exists``, ``batch_exists_v2``): a page exists when
  every part is ready in some tier; a part still being written is not there yet. They
  read the managers' indexes only: no I/O.
* **Loads** (``batch_get_v1``, ``batch_get``, ``get``, ``batch_get_v2``): each part is
  pinned in the first tier that holds it and read into the page; a page counts as loaded
  only when every part arrived and verified.
* **Stores** (``batch_set_v1``, ``batch_set``, ``set``, ``batch_set_v2``): every writing
  tier stores the parts it does not hold yet; a page counts as stored when each part is
  stored in (or already held by) at least one tier. A failed store leaves nothing
  visible.

Threads and bounds: SGLang calls from its own I/O threads (prefetch, backup) while its
scheduler may ask ``exists``. One lock guards the managers and drivers; it is held only
for bookkeeping, never across I/O. Lookups take it and return: microseconds per page.
Loads and stores submit their jobs, release it, and wait for their own jobs
(:meth:`~kvtiers.tiers.fanout.FanOutMover.wait_job`) — they return only once no copy
touches SGLang's pages, since SGLang reuses those pages the moment a call returns. So a
load or store blocks while its tiers' I/O runs: an object tier bounds every chunk by its
``op_deadline_s`` (default 30 s; a call then ends within that per chunk and I/O thread),
a file tier by the filesystem (a local disk: milliseconds; a mount that hangs holds the
call, as it holds any reader of it). A call still waiting after :data:`SLOW_CALL_S` logs
one warning naming the tier. ``close`` stops every tier, each bounded by its mover's
shutdown timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtiers.config import resolve_factory
from kvtiers.config.tiers import FileTierConfig, LowerTierConfig
from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.integrations.sglang.config import BackendOptions, parse_options
from kvtiers.integrations.sglang.identity import (
    KV_POOL,
    Identity,
    engine_args,
    identities,
    warn_once,
)
from kvtiers.integrations.sglang.pages import PagePool
from kvtiers.tiers.fanout import FanOutMover
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold

logger = logging.getLogger(__name__)

#: A load or store still waiting for its copies after this long logs a warning, seconds.
SLOW_CALL_S = 60.0
_CTX = ReqContext(req_id="kvtiers-sglang")
_STEP = ScheduleEndContext()


def page_hash(key: str) -> bytes:
    """The 32 bytes a page key stands for: SGLang's sha256 hex digest decoded, or the
    sha256 of any other key."""
    if len(key) == 64:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raw = b""
        if len(raw) == 32:
            return raw
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class LentRegion:
    """A :class:`~kvtiers.core.mover.HostRegion` whose slots are lent, for one job, to
    views of SGLang's memory (or of staging tensors). A slot not lent any more has no
    view: a copy that reaches it fails its chunk instead of touching memory."""

    def __init__(self, slot_bytes: int) -> None:
        self._slot_bytes = slot_bytes
        self._views: dict[int, memoryview] = {}
        self._ids = itertools.count()

    @property
    def num_slots(self) -> int:
        return len(self._views)

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def lend(self, views: Sequence[memoryview]) -> list[int]:
        slots = [next(self._ids) for _ in views]
        self._views.update(zip(slots, views, strict=True))
        return slots

    def take_back(self, slots: Iterable[int]) -> None:
        for slot in slots:
            self._views.pop(slot, None)

    def view(self, slot_id: int) -> memoryview:
        return self._views[slot_id]


@runtime_checkable
class _Clearable(Protocol):
    """A persistent tier's manager that can delete every chunk it holds."""

    def clear(self) -> int: ...


@dataclass
class _Tier:
    """One built tier of one identity."""

    built: BuiltTier
    driver: JobDriver[_Job]
    mover: FanOutMover[Any]
    writes: bool


@dataclass
class _Shelf:
    """The tiers of one identity, over one lent region."""

    identity: Identity
    region: LentRegion
    tiers: list[_Tier] = field(default_factory=list)


@dataclass
class _Chunk:
    """One part of one page in a call: the page's place in the call, the chunk's key, the
    memory it is read from or into, its identity's shelf, and whether it was stored or
    loaded."""

    page: int
    key: OffloadKey
    view: memoryview
    shelf: _Shelf
    done: bool = False


@dataclass
class _Job:
    """What a job copies (a driver's tag): its chunks, and the slots lent for them."""

    chunks: list[_Chunk]
    slots: list[int]
    region: LentRegion


@dataclass
class StorageSamples:
    """What SGLang's metrics collector reads from a backend's ``get_stats``: the fields
    of its ``StorageMetrics`` (whose module imports SGLang's model configs, so it is not
    imported here). SGLang may add attributes of its own to it."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


@dataclass
class _Counters:
    """Pages and bytes since start (``kvtiers_stats``), and SGLang's per-call samples
    since the last ``get_stats``."""

    exists_pages: int = 0
    exists_hits: int = 0
    loaded_pages: int = 0
    load_failed_pages: int = 0
    stored_pages: int = 0
    store_failed_pages: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class KVTiersHiCacheStorage(HiCacheStorage):
    """SGLang HiCache's storage backend over kvtiers' lower tiers (module docstring).

    ``storage_config`` is SGLang's ``HiCacheStorageConfig``; its ``extra_config`` holds
    the kvtiers keys (:mod:`.config`). ``kwargs`` (SGLang's factory passes its extra
    keyword arguments as a dict) is not used.
    """

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.options: BackendOptions = parse_options(storage_config.extra_config)
        self._lock = threading.Lock()
        self._pools: dict[str, PagePool] = {}
        self._shelves: list[_Shelf] | None = None
        self._route: dict[str, tuple[_Shelf, int]] = {}
        self._namespaces: list[str] = []
        self._job_ids = itertools.count(1)
        # Jobs that ended and were settled, until their caller takes note.
        self._settled: set[int] = set()
        self._counters = _Counters()
        self._closed = False
        if not self.options.zero_copy_calls:
            logger.info(
                "kvtiers: SGLang will call the generic get/set path (one copy per page); "
                'add "interface_v1": 1 to the extra config for zero-copy batch_get_v1 / '
                "batch_set_v1"
            )

    # -- registration ---------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._register(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._register(str(host_pool_name), host_pool)

    def on_host_pools_registered(self) -> None:
        """Build the tiers: the identities need every pool's geometry."""
        with self._lock:
            self._build()

    def _register(self, name: str, pool: Any) -> None:
        with self._lock:
            known = self._pools.get(name)
            if known is not None:
                if known.pool is not pool:
                    raise ConfigError(
                        f"SGLang registered two host pools named {name!r}; kvtiers keeps one "
                        "set of chunks per pool name",
                        path="register_mem_host_pool_v2",
                    )
                return
            if self._shelves is not None:
                warn_once(
                    f"kvtiers: host pool {name!r} was registered after the tiers were built; "
                    "its pages are not stored (every lookup of them is a miss)"
                )
                return
            registered = PagePool.register(name, pool)
            self._pools[name] = registered
            logger.info(
                "kvtiers: host pool %r (%s): %s", name, type(pool).__name__,
                f"zero-copy, {registered.parts} part(s) per page ({registered.reason})"
                if registered.zero_copy else f"copied per page ({registered.reason})",
            )

    def _build(self) -> list[_Shelf]:
        """The shelves, built on first need (lock held)."""
        if self._shelves is not None:
            return self._shelves
        if self._closed:
            raise RuntimeError("the kvtiers storage backend is closed")
        if KV_POOL not in self._pools:
            raise ConfigError(
                "SGLang registered no KV host pool before using the storage backend",
                path="register_mem_pool_host",
            )
        order = [self._pools[KV_POOL]] + [
            self._pools[name] for name in sorted(self._pools) if name != KV_POOL
        ]
        shelves: list[_Shelf] = []
        try:
            for identity in identities(self.storage_config, order, self.options, engine_args()):
                shelves.append(self._open(identity))
        except BaseException:
            for shelf in shelves:
                _shut(shelf)
            raise
        for shelf in shelves:
            for pool in shelf.identity.pools:
                self._route[pool.name] = (shelf, shelf.identity.first_group(pool))
            self._namespaces.append(NamespaceIdentity.from_config(shelf.identity.config).namespace)
        self._shelves = shelves
        return shelves

    def _open(self, identity: Identity) -> _Shelf:
        geometry_bytes = max(g.bytes_per_block for g in identity.config.groups)
        shelf = _Shelf(identity, LentRegion(geometry_bytes))
        try:
            for tier_config in self.options.tiers:
                config = tier_config if identity.writer else _read_only(tier_config)
                factory = resolve_factory(config.kind, path=f"tiers[{config.name}].kind")
                built = factory(
                    config, identity.config, primary_region=shelf.region, name=config.name
                )
                if not isinstance(built.mover, FanOutMover):
                    built.shutdown()
                    raise ConfigError(
                        f"tier {config.name!r} ({config.kind}) has no mover kvtiers can wait "
                        "on per job; use a file, s3 or fsspec tier",
                        path="kvtiers_config",
                    )
                driver: JobDriver[_Job] = JobDriver(
                    built.manager, built.mover, self._finished, ctx=_CTX
                )
                writes = identity.writer and built.admission == "always"
                shelf.tiers.append(_Tier(built, driver, built.mover, writes))
                logger.info(
                    "kvtiers: tier %s for %s identity %s%s", config.name,
                    "replicated" if identity.replicated else "this rank's",
                    identity.config.model.name, "" if writes else " (read-only)",
                )
        except BaseException:
            _shut(shelf)
            raise
        return shelf

    # -- keys -------------------------------------------------------------------------
    def _chunks(
        self, pool_name: str, keys: Sequence[str], views: Sequence[Sequence[memoryview]] | None,
    ) -> list[_Chunk] | None:
        """One chunk per part of each page (lock held); ``None`` for a pool with no
        tiers (registered late)."""
        self._build()
        route = self._route.get(pool_name)
        if route is None:
            return None
        shelf, first = route
        tails = [
            (first + part).to_bytes(GROUP_INDEX_BYTES, "big")
            for part in range(self._pools[pool_name].parts)
        ]
        chunks = []
        for page, key in enumerate(keys):
            raw = page_hash(key)
            row = views[page] if views is not None else None
            for part, tail in enumerate(tails):
                view = row[part] if row is not None else _EMPTY
                chunks.append(_Chunk(page, OffloadKey(raw + tail), view, shelf))
        return chunks

    def _pool(self, name: str) -> PagePool | None:
        """The registered pool ``name`` whose pages are stored (none: registered late)."""
        return self._pools.get(name) if name in self._route or self._shelves is None else None

    def _host_pages(
        self, pool_name: str, keys: Sequence[str], host_indices: torch.Tensor, *, load: bool,
    ) -> tuple[PagePool, list[int], torch.Tensor | None, list[list[memoryview]]] | None:
        """Where SGLang's host pages for ``keys`` are: the pool, each page's first host
        index, a staging tensor (a load from a flat pool, else ``None``) and each page's
        buffers to load into (``load``) or store from. ``None`` (warned once when the
        indices or buffers do not fit the pool): nothing to move, every key fails."""
        pool = self._pool(pool_name)
        if pool is None or not keys:
            return None
        pages = len(keys)
        try:
            starts = pool.page_starts(host_indices, pages)
            if pool.zero_copy:
                return pool, starts, None, pool.memory_views(host_indices, pages)
            if load:
                stage, views = pool.staging(pages)
                return pool, starts, stage, views
            return pool, starts, None, pool.gather(starts)
        except ValueError as exc:
            warn_once(f"kvtiers: cannot address SGLang's host pages: {exc}")
            return None

    # -- lookups ------------------------------------------------------------------------
    def _present(self, chunks: Sequence[_Chunk]) -> list[bool]:
        """Per chunk: ready in some tier (lock held)."""
        found = []
        for chunk in chunks:
            found.append(any(
                tier.built.manager.lookup(chunk.key, _CTX) is LookupResult.HIT
                for tier in chunk.shelf.tiers
            ))
        return found

    def _exists_prefix(self, pool_name: str, keys: Sequence[str]) -> int:
        """Consecutive pages from the start whose every part is present."""
        with self._lock:
            chunks = self._chunks(pool_name, keys, None)
            if chunks is None:
                return 0
            found = self._present(chunks)
            self._step(chunks)
            pages = _pages_ok(chunks, found, len(keys))
            hits = pages.index(False) if False in pages else len(pages)
            self._counters.exists_pages += len(keys)
            self._counters.exists_hits += hits
        return hits

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self._exists_prefix(KV_POOL, keys)

    def exists(self, key: str) -> bool:
        return self._exists_prefix(KV_POOL, [key]) == 1

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest usable prefix over the KV pool and each extra pool's hit policy,
        with HiCacheFile's semantics (``ALL_PAGES``, ``TRAILING_PAGES``); a
        ``BLOCK_GROUPS`` pool gets no verdict (it never gates the KV hit)."""
        with self._lock:
            per_pool = {KV_POOL: self._page_presence(KV_POOL, keys)}
            for transfer in pool_transfers or []:
                per_pool[str(transfer.name)] = self._page_presence(str(transfer.name), keys)
        kv = per_pool[KV_POOL]
        kv_pages = kv.index(False) if False in kv else len(kv)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            present = per_pool[str(transfer.name)]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present[:kv_pages].index(False) if False in present[:kv_pages] else (
                    kv_pages)
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {
                    n for n in range(1, kv_pages + 1)
                    if all(present[i] for i in range(max(0, n - trailing), n))
                }
                boundary = max(allowed, default=0)
            else:
                continue
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [n for n in restorable if n in allowed]
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hit_count, restorable)

    def _page_presence(self, pool_name: str, keys: Sequence[str]) -> list[bool]:
        chunks = self._chunks(pool_name, keys, None)
        if chunks is None:
            return [False] * len(keys)
        found = self._present(chunks)
        self._step(chunks)
        return _pages_ok(chunks, found, len(keys))

    # -- loads ----------------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._get_pool(KV_POOL, keys, host_indices, prefetch=True)

    def _get_pool(
        self, pool_name: str, keys: Sequence[str], host_indices: torch.Tensor, *, prefetch: bool,
    ) -> list[bool]:
        addressed = self._host_pages(pool_name, keys, host_indices, load=True)
        if addressed is None:
            return [False] * len(keys)
        pool, starts, stage, views = addressed
        loaded = self._load(pool_name, keys, views, prefetch=prefetch)
        if stage is not None:
            pool.scatter(stage, starts, loaded)
        return loaded

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """SGLang's generic path: each key into its flat page tensor."""
        pool = self._pool(KV_POOL)
        targets = list(target_locations or [None] * len(keys))
        views = [None if pool is None else pool.split_flat(t) for t in targets]
        usable = [i for i, v in enumerate(views) if v is not None]
        loaded = self._load(
            KV_POOL, [keys[i] for i in usable], [views[i] or [] for i in usable], prefetch=True
        )
        result: list[torch.Tensor | None] = [None] * len(keys)
        for i, ok in zip(usable, loaded, strict=True):
            if ok:
                result[i] = targets[i]
        return result

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {
            transfer.name: self._transfer(transfer, store=False) for transfer in transfers
        }

    def _load(
        self, pool_name: str, keys: Sequence[str], views: Sequence[Sequence[memoryview]],
        *, prefetch: bool,
    ) -> list[bool]:
        """Read every part of each page into its view; per page, whether all arrived."""
        if not keys:
            return []
        start = time.perf_counter()
        jobs: list[tuple[_Tier, int]] = []
        with self._lock:
            chunks = self._chunks(pool_name, keys, views)
            if chunks is None:
                return [False] * len(keys)
            seen: set[OffloadKey] = set()
            plan: dict[int, tuple[_Tier, list[_Chunk]]] = {}
            for chunk in chunks:
                if chunk.key in seen:
                    continue  # a page listed twice loads once; the repeat reports failed
                seen.add(chunk.key)
                for tier in chunk.shelf.tiers:
                    if tier.built.manager.lookup(chunk.key, _CTX) is LookupResult.HIT:
                        plan.setdefault(id(tier), (tier, []))[1].append(chunk)
                        break
            for tier, wanted in plan.values():
                jobs.extend(self._submit_load(tier, wanted))
            self._step(chunks)
        self._wait(jobs)
        pages = _pages_ok(chunks, [c.done for c in chunks], len(keys))
        with self._lock:
            self._count(pages, sum(len(c.view) for c in chunks if c.done), start, load=True,
                        prefetch=prefetch)
        return pages

    def _submit_load(self, tier: _Tier, chunks: list[_Chunk]) -> list[tuple[_Tier, int]]:
        region = chunks[0].shelf.region
        held: list[_Chunk] = []
        slots: list[int] = []
        for chunk in chunks:
            slot = region.lend([chunk.view])[0]
            if tier.driver.hold_for_load(chunk.key, _CTX, slot=slot) is LoadHold.HELD:
                held.append(chunk)
                slots.append(slot)
            else:
                region.take_back([slot])
        if not held:
            return []
        job_id = next(self._job_ids)
        tier.driver.load_held(job_id, _Job(held, slots, region))
        return [(tier, job_id)]

    # -- stores ---------------------------------------------------------------------
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._set_pool(KV_POOL, keys, host_indices, backup=True)

    def _set_pool(
        self, pool_name: str, keys: Sequence[str], host_indices: torch.Tensor, *, backup: bool,
    ) -> list[bool]:
        addressed = self._host_pages(pool_name, keys, host_indices, load=False)
        if addressed is None:
            return [False] * len(keys)
        return self._store(pool_name, keys, addressed[3], backup=backup)

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """SGLang's generic path: each key from its flat page tensor; True when all
        were stored."""
        pool = self._pool(KV_POOL)
        values = list(values or [])
        if pool is None or len(values) != len(keys):
            return False
        views = [pool.split_flat(v) for v in values]
        if any(v is None for v in views):
            warn_once("kvtiers: SGLang's generic set passed a page that is not one flat "
                      "contiguous CPU page of the KV pool; it is not stored")
            return False
        return all(self._store(KV_POOL, keys, [v or [] for v in views], backup=True))

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return {
            transfer.name: self._transfer(transfer, store=True) for transfer in transfers
        }

    def _store(
        self, pool_name: str, keys: Sequence[str], views: Sequence[Sequence[memoryview]],
        *, backup: bool,
    ) -> list[bool]:
        """Store every part of each page into every writing tier; per page, whether
        each part is now held by some tier."""
        if not keys:
            return []
        start = time.perf_counter()
        jobs: list[tuple[_Tier, int]] = []
        with self._lock:
            chunks = self._chunks(pool_name, keys, views)
            if chunks is None:
                return [False] * len(keys)
            unique: dict[OffloadKey, _Chunk] = {}
            for chunk in chunks:
                unique.setdefault(chunk.key, chunk)
            shelf_tiers: dict[int, list[_Tier]] = {}
            for chunk in unique.values():
                shelf_tiers.setdefault(id(chunk.shelf), [t for t in chunk.shelf.tiers if t.writes])
            by_shelf: dict[int, list[_Chunk]] = {}
            for chunk in unique.values():
                by_shelf.setdefault(id(chunk.shelf), []).append(chunk)
            for shelf_id, shelf_chunks in by_shelf.items():
                for tier in shelf_tiers[shelf_id]:
                    jobs.extend(self._submit_store(tier, shelf_chunks))
            self._step(chunks)
        self._wait(jobs)
        for chunk in chunks:
            chunk.done = unique[chunk.key].done
        pages = _pages_ok(chunks, [c.done for c in chunks], len(keys))
        with self._lock:
            self._count(pages, sum(len(c.view) for c in unique.values() if c.done), start,
                        load=False, prefetch=backup)
        return pages

    def _submit_store(self, tier: _Tier, chunks: list[_Chunk]) -> list[tuple[_Tier, int]]:
        region = chunks[0].shelf.region
        slots = region.lend([c.view for c in chunks])
        slot_of = {c.key: s for c, s in zip(chunks, slots, strict=True)}
        job_id = next(self._job_ids)
        # The job's chunks are the ones the tier accepts; it settles (and gives the slots
        # back) once it ends, which may be inside store() when the submission fails.
        job = _Job([], slots, region)
        try:
            accepted = tier.driver.store(job_id, list(slot_of), _CTX, job, slots=slot_of)
        except BaseException:
            region.take_back(slots)
            raise
        if not accepted:
            region.take_back(slots)
        taken = set(accepted or ())
        for chunk in chunks if accepted is not None else ():
            if chunk.key in taken:
                job.chunks.append(chunk)
            else:
                chunk.done = True  # the tier holds it already
        return [(tier, job_id)] if accepted else []

    # -- v2 transfers -------------------------------------------------------------------
    def _transfer(self, transfer: PoolTransfer, *, store: bool) -> list[bool]:
        keys = list(transfer.keys or [])
        name = str(transfer.name)
        if transfer.host_indices is None:
            return [False] * len(keys)
        if store:
            return self._set_pool(name, keys, transfer.host_indices, backup=False)
        return self._get_pool(name, keys, transfer.host_indices, prefetch=False)

    # -- jobs ---------------------------------------------------------------------------
    def _finished(self, job: FinishedJob[_Job]) -> None:
        """A job ended (lock held: drivers call back from ``poll`` or a failed submit):
        mark the chunks that arrived, take the slots back."""
        arrived = set(job.succeeded)
        for chunk in job.tag.chunks:
            if chunk.key in arrived:
                chunk.done = True
        job.tag.region.take_back(job.tag.slots)
        self._settled.add(job.job_id)

    def _wait(self, jobs: Sequence[tuple[_Tier, int]]) -> None:
        """Block until each job ended and was settled."""
        for tier, job_id in jobs:
            waited = 0.0
            while not tier.mover.wait_job(job_id, SLOW_CALL_S):
                waited += SLOW_CALL_S
                logger.warning(
                    "kvtiers: job %d of tier %s has waited %.0f s for its I/O; SGLang's "
                    "pages stay held until it ends", job_id, tier.built.name, waited,
                )
        with self._lock:
            for tier, _ in jobs:
                tier.driver.poll()
            for _, job_id in jobs:
                self._settled.remove(job_id)

    def _step(self, chunks: Sequence[_Chunk]) -> None:
        """End a manager step for every tier touched: drain movers' reports, flush
        probes, drop events nobody reads (lock held)."""
        seen: set[int] = set()
        for chunk in chunks:
            if id(chunk.shelf) in seen:
                continue
            seen.add(id(chunk.shelf))
            for tier in chunk.shelf.tiers:
                tier.built.manager.on_schedule_end(_STEP)
                tier.built.manager.take_events()

    def _count(self, pages: list[bool], nbytes: int, start: float, *, load: bool,
               prefetch: bool) -> None:
        ok = sum(pages)
        elapsed = time.perf_counter() - start
        counters = self._counters
        if load:
            counters.loaded_pages += ok
            counters.load_failed_pages += len(pages) - ok
            counters.loaded_bytes += nbytes
        else:
            counters.stored_pages += ok
            counters.store_failed_pages += len(pages) - ok
            counters.stored_bytes += nbytes
        if prefetch and self.storage_config.enable_storage_metrics:
            samples = (counters.prefetch_pgs, counters.prefetch_bandwidth) if load else (
                counters.backup_pgs, counters.backup_bandwidth)
            samples[0].append(len(pages))
            samples[1].append(nbytes / elapsed / 1e9 if elapsed > 0 else 0.0)

    # -- the rest -----------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every stored page this rank's tiers hold that no call is reading or
        writing; other identities' namespaces are left alone."""
        with self._lock:
            for shelf in self._build():
                for tier in shelf.tiers:
                    manager = tier.built.manager
                    if tier.writes and isinstance(manager, _Clearable):
                        manager.clear()
                tier_names = ", ".join(t.built.name for t in shelf.tiers if t.writes)
                logger.info("kvtiers: cleared the pages of %s in %s",
                            shelf.identity.config.model.name, tier_names or "no tier")

    def get_stats(self) -> StorageSamples:
        """The fields of SGLang's ``StorageMetrics`` for the calls since the last one
        (pages per load and store call, GB/s); kvtiers' own counters are in
        :meth:`kvtiers_stats`."""
        metrics = StorageSamples()
        with self._lock:
            counters = self._counters
            metrics.prefetch_pgs.extend(counters.prefetch_pgs)
            metrics.backup_pgs.extend(counters.backup_pgs)
            metrics.prefetch_bandwidth.extend(counters.prefetch_bandwidth)
            metrics.backup_bandwidth.extend(counters.backup_bandwidth)
            for samples in (counters.prefetch_pgs, counters.backup_pgs,
                            counters.prefetch_bandwidth, counters.backup_bandwidth):
                samples.clear()
        return metrics

    def kvtiers_stats(self) -> dict[str, float]:
        """Pages and bytes since start, and each tier's own stats as ``<tier>.<stat>``
        (``<tier>@replicated.<stat>`` for the replicated identity's tiers)."""
        with self._lock:
            counters = self._counters
            stats: dict[str, float] = {
                name: getattr(counters, name)
                for name in ("exists_pages", "exists_hits", "loaded_pages", "load_failed_pages",
                             "stored_pages", "store_failed_pages", "loaded_bytes",
                             "stored_bytes")
            }
            for shelf in self._shelves or []:
                tag = "@replicated" if shelf.identity.replicated and len(
                    self._shelves or []) > 1 else ""
                for tier in shelf.tiers:
                    for key, value in tier.built.manager.get_stats().items():
                        stats[f"{tier.built.name}{tag}.{key}"] = value
            return stats

    def namespaces(self) -> list[str]:
        """The namespace of each identity this rank stores or reads (the same in every
        tier), once the tiers were built; still known after :meth:`close`."""
        with self._lock:
            if self._shelves is None:
                self._build()
            return list(self._namespaces)

    def wait_index(self) -> None:
        """Build the tiers if they are not yet, and block until each has indexed the pages
        its medium held at start: until then a restart's page is found once the tier's
        existence probe answers (an ``exists`` call or two later). For tests and tools."""
        with self._lock:
            for shelf in self._build():
                for tier in shelf.tiers:
                    tier.built.manager.wait_index()

    def close(self) -> None:
        """Stop every tier (each mover drained, bounded by its shutdown timeout).
        Idempotent; SGLang calls it when it detaches the backend."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            shelves, self._shelves = self._shelves or [], []
        for shelf in shelves:
            _shut(shelf)


_EMPTY = memoryview(b"")


def _pages_ok(chunks: Sequence[_Chunk], ok: Sequence[bool], pages: int) -> list[bool]:
    """Per page: every one of its chunks ``ok``."""
    result = [True] * pages
    for chunk, good in zip(chunks, ok, strict=True):
        if not good:
            result[chunk.page] = False
    return result


def _read_only(config: LowerTierConfig) -> LowerTierConfig:
    """A replicated identity's tier on a rank that does not write it: it probes for
    pages the writer stores (``shared``), never evicts (no ``capacity``) and stores
    nothing."""
    changes: dict[str, Any] = {"shared": True, "capacity": None, "admission": "never"}
    if isinstance(config, FileTierConfig):
        changes["capacity_scope"] = "namespace"
    return dataclasses.replace(config, **changes)


def _shut(shelf: _Shelf) -> None:
    for tier in shelf.tiers:
        try:
            tier.built.shutdown()
        except Exception:  # one tier failing to stop must not keep the others open
            logger.exception("kvtiers: stopping tier %s failed", tier.built.name)
