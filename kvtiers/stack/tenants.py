"""Tenants over one stack: keys kept apart, bytes counted and capped per tier.

:class:`TenantStack` is an :class:`~kvtiers.core.manager.OffloadingManager` over a
:class:`~kvtiers.stack.composite.TieredManager`, built from a ``tenants:`` section
(:mod:`kvtiers.config.tenants`). Three promises:

* **Isolation by key.** Every key of a tenant other than the default one is *scoped*
  before any tier sees it: its hash becomes the tenant's 8-byte tag followed by a keyed
  hash (BLAKE2b) of the tenant's name and the engine's hash, as long as the hash was; the
  group stays. Two tenants asking for the same prompt ask for different keys, so no tier —
  CPU, a shared file root, a shared bucket, after a restart, from another server — can
  answer one tenant with another's chunk. (vLLM's ``cache_salt`` already changes every
  block hash of a salted request; a tenant named only by ``kv_transfer_params`` has no
  salt, hence the scoping. A default-tenant key is the engine's own: existing caches and
  routers that recompute the engine's hashes keep working for it.) Keys must be at least
  16 bytes of hash; scoping costs a hash per key per call.
* **Attribution from the key alone.** The tag says whose a scoped chunk is, so usage per
  tenant is counted from any tier's index, in any process, after any restart, with no
  table to keep; a key with no tenant's tag is the default tenant's.
* **Quotas.** Before a tenant's store into the primary, the tenant's own least recently
  used chunks go until the store fits its ``quota`` there; room the primary lacks is then
  made by evicting, least recently used first, chunks of any tenant except another
  tenant's chunks within its ``protected`` share; keys that still find no room are not
  stored (the leading ones are). A promotion into the primary (a lookup's
  ``HIT_PENDING``) is followed by the same trim of the tenant's own chunks back to its
  quota, sparing what the request keeps. In each lower tier with quotas, at the end of
  every step a tenant over its quota has its own least recently used chunks evicted back
  under it (a step's cascades may overshoot until then).

What it does not do (docs/tenants.md): the slot a promotion takes in a full primary is
freed by the primary's own policy (another tenant's protected share included), and a
lower tier's own capacity eviction is not tenant-aware (keep the quotas of a lower tier
within its capacity). Usage is counted by walking each tier's keys: O(chunks held) per
primary store, per promotion of a capped tenant and per step — sized for stacks of up to
some hundred thousand chunks.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvtiers.config.tenants import TAG_BYTES, TenantsConfig, tenant_tag
from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.core.manager import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierCapabilities,
)
from kvtiers.core.specs import LoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import InvalidKeyError
from kvtiers.policies.retention import RetentionBook
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.metrics_catalog import STACK, with_unit

logger = logging.getLogger(__name__)

#: The shortest hash a key may carry to be scoped (a tag and 8 bytes of keyed hash).
MIN_HASH_BYTES = 16


@dataclass(frozen=True)
class _Tenant:
    """A request's tenant, kept in its context once resolved."""

    name: str


@runtime_checkable
class AccountedPrimary(Protocol):
    """A primary whose chunks a quota can count and evict by owner (the cpu tier)."""

    slot_bytes: int

    @property
    def free_slots(self) -> int: ...

    def slot_of(self, key: OffloadKey) -> int | None: ...

    def held_keys(self) -> list[OffloadKey]: ...

    def evict_held(
        self, count: int, protected: Collection[OffloadKey] = ()
    ) -> dict[OffloadKey, int]: ...

    def release_held(self, slots: Iterable[int]) -> None: ...


class _Entry(Protocol):
    @property
    def size(self) -> int: ...


class _Index(Protocol):
    def items(self) -> Iterator[tuple[OffloadKey, _Entry]]: ...


@runtime_checkable
class AccountedTier(Protocol):
    """A lower tier whose chunks a quota can count and evict by owner (file, object)."""

    @property
    def index(self) -> _Index: ...

    def evict_outside(self, nbytes: int, protected: Collection[OffloadKey]
                      ) -> list[OffloadKey]: ...


def trim_to_quotas(manager: AccountedTier, quotas: Mapping[str, int],
                   owner: Callable[[OffloadKey], str]) -> tuple[Counter[str], int]:
    """Evict, in the lower tier ``manager``, each tenant's own chunks (the tier's least
    recently used first) until it holds at most its quota (``quotas``: tenant → bytes;
    ``owner`` names a key's tenant). Returns the bytes each tenant holds there then and
    how many chunks went. A walk of the tier's index: O(chunks held)."""
    sizes: dict[OffloadKey, tuple[str, int]] = {
        key: (owner(key), entry.size) for key, entry in manager.index.items()}
    usage: Counter[str] = Counter()
    for name, size in sizes.values():
        usage[name] += size
    evicted = 0
    for tenant, quota in quotas.items():
        over = usage.get(tenant, 0) - quota
        if over > 0:
            others = {key for key, (name, _) in sizes.items() if name != tenant}
            for key in manager.evict_outside(over, others):
                usage[tenant] -= sizes[key][1] if key in sizes else 0
                evicted += 1
    return usage, evicted


class TenantKeys:
    """Which tenant a request is, a tenant's keys, and whose a key is."""

    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self.default = config.default
        self.names = config.names()
        self._by_salt = {salt: t.name for t in config.members for salt in t.salts}
        self._tags = {tenant_tag(name): name for name in self.names if name != self.default}
        self._tag_of = {name: tag for tag, name in self._tags.items()}
        self._warned: set[str] = set()

    def tenant_of(self, ctx: ReqContext) -> str:
        """``ctx``'s tenant: by ``cache_salt``, then by ``kv_transfer_params[param]``,
        else the default. A named tenant that is not configured is the default's (logged
        once per name)."""
        known = ctx.get_state(_Tenant)
        if known is not None:
            return known.name
        name = self._resolve(ctx)
        ctx.set_state(_Tenant(name))
        return name

    def _resolve(self, ctx: ReqContext) -> str:
        if ctx.cache_salt is not None and ctx.cache_salt in self._by_salt:
            return self._by_salt[ctx.cache_salt]
        params = ctx.kv_transfer_params
        named = params.get(self.config.param) if isinstance(params, Mapping) else None
        if named is None:
            return self.default
        if isinstance(named, str) and named in self.names:
            return named
        shown = repr(named)[:80]
        if shown not in self._warned and len(self._warned) < 100:
            self._warned.add(shown)
            logger.warning("request %s names tenant %s in kv_transfer_params[%r], which "
                           "the tenants: section does not list; it is the default "
                           "tenant's (%s)", ctx.req_id, shown, self.config.param,
                           self.default)
        return self.default

    def scope(self, key: OffloadKey, tenant: str) -> OffloadKey:
        """``key`` as tenant ``tenant`` stores it (the default tenant's: unchanged)."""
        tag = self._tag_of.get(tenant)
        if tag is None:
            return key
        digest = key[:-GROUP_INDEX_BYTES]
        if len(digest) < MIN_HASH_BYTES:
            raise InvalidKeyError(
                f"key {bytes(key).hex()}: tenants need hashes of at least {MIN_HASH_BYTES} "
                f"bytes, this one has {len(digest)}"
            )
        keyed = hashlib.blake2b(tenant.encode() + b"\0" + digest,
                                digest_size=len(digest) - TAG_BYTES).digest()
        return OffloadKey(tag + keyed + key[-GROUP_INDEX_BYTES:])

    def owner(self, key: OffloadKey) -> str:
        """Whose chunk ``key`` is: the tenant its tag names, else the default tenant."""
        return self._tags.get(bytes(key[:TAG_BYTES]), self.default)


class TenantStack(OffloadingManager):
    """``inner`` with keys scoped by tenant and quotas per tier (module docstring).

    ``get_spec`` answers for the keys of the latest ``prepare_store`` or
    ``prepare_load`` that named them (engines ask right after the call that reserved or
    pinned them, as kvtiers' scheduler and vLLM's do). :attr:`usage_snapshot` is
    refreshed at the end of a step at most every ``refresh_s`` seconds (0: every step)."""

    def __init__(self, inner: TieredManager, config: TenantsConfig, *,
                 refresh_s: float = 1.0) -> None:
        self.inner = inner
        self.keys = TenantKeys(config)
        # A request's pins count against its tenant's cap (the book's cap_for).
        inner.retention_scope = self.keys.tenant_of
        names = [tier.name for tier in inner.tiers]
        self._quota: list[dict[str, int]] = [{} for _ in names]
        self._protected: list[dict[str, int]] = [{} for _ in names]
        for tenant in config.members:
            for tier, size in tenant.quota_bytes().items():
                self._quota[names.index(tier)][tenant.name] = size
            for tier, size in tenant.protected_bytes().items():
                self._protected[names.index(tier)][tenant.name] = size
        primary = inner.tiers[0].manager
        self._primary = primary if isinstance(primary, AccountedPrimary) else None
        # The stack's configuration allows quotas on a cpu primary only (the one kind
        # whose chunks can be counted and evicted by owner).
        assert self._primary is not None or not (self._quota[0] or self._protected[0])
        # The scoped key of each engine key the latest prepare named (for get_spec).
        self._live: dict[OffloadKey, OffloadKey] = {}
        # The engine key and scoped key of the latest lookup (for promotion_source).
        self._looked: tuple[OffloadKey, OffloadKey] | None = None
        #: :meth:`usage` as of the latest refresh (replaced whole, never changed: another
        #: thread, the metrics exporter's, reads it).
        self.usage_snapshot: Mapping[str, Mapping[str, int]] = {}
        self._refresh_s = refresh_s
        self._refreshed_at: float | None = None

    @property
    def capabilities(self) -> TierCapabilities:  # type: ignore[override]
        return self.inner.capabilities

    # -- keys -----------------------------------------------------------------------
    def _scoped(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        tenant = self.keys.tenant_of(ctx)
        scope = self.keys.scope
        return [scope(key, tenant) for key in keys]

    def scoped_keys(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> list[OffloadKey]:
        """``keys`` as this layer hands them to the tiers for ``ctx``'s request: scoped by
        its tenant, in order (the default tenant's: unchanged). An engine that checks what
        the primary holds by key (a sharded vLLM engine's shard check) asks by these."""
        return self._scoped(keys, ctx)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        tenant = self.keys.tenant_of(ctx)
        scoped = self.keys.scope(key, tenant)
        self._looked = (key, scoped)
        result = self.inner.lookup(scoped, ctx)
        if result is LookupResult.HIT_PENDING and tenant in self._quota[0]:
            self._trim_primary(tenant, ctx)
        return result

    def prepare_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext
    ) -> list[OffloadKey] | None:
        tenant = self.keys.tenant_of(ctx)
        scoped = self._scoped(keys, ctx)
        by_scoped = dict(zip(scoped, keys, strict=True))
        if self._primary is not None:
            scoped = self._make_room(tenant, scoped, ctx)
            if not scoped:
                return None
        accepted = self.inner.prepare_store(scoped, ctx)
        if accepted is None:
            return None
        for key in accepted:
            self._live[by_scoped[key]] = key
        return [by_scoped[key] for key in accepted]

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        scoped = self._scoped(keys, ctx)
        self.inner.prepare_load(scoped, ctx)
        self._live.update(zip(keys, scoped, strict=True))

    def get_spec(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        live = self._live
        return self.inner.get_spec([live.get(key, key) for key in keys])

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.inner.touch(self._scoped(keys, ctx), ctx)

    def complete_store(
        self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True, *,
        generation: int | None = None,
    ) -> None:
        self._forget(keys)
        self.inner.complete_store(self._scoped(keys, ctx), ctx, success, generation=generation)

    def complete_load(
        self, keys: Collection[OffloadKey], ctx: ReqContext, *, generation: int | None = None
    ) -> None:
        self._forget(keys)
        self.inner.complete_load(self._scoped(keys, ctx), ctx, generation=generation)

    def _forget(self, keys: Iterable[OffloadKey]) -> None:
        live = self._live
        if live:
            for key in keys:
                live.pop(key, None)

    # -- quotas ---------------------------------------------------------------------
    def _make_room(self, tenant: str, scoped: list[OffloadKey],
                   ctx: ReqContext) -> list[OffloadKey]:
        """Evict for a store of ``scoped`` into the primary as the module docstring says;
        the leading keys that then fit (those already held always do). Never evicted for
        it: the keys it names (the caller counts those held as stored) and the request's
        own ``ctx.keep``, as the primary's own eviction spares them."""
        primary = self._primary
        assert primary is not None
        new = [key for key in dict.fromkeys(scoped) if primary.slot_of(key) is None]
        if not new:
            return scoped
        chunk = primary.slot_bytes
        held_keys = primary.held_keys()
        owner = self.keys.owner
        usage = self._count(held_keys, chunk)
        room = len(new)
        spared = set(scoped) | ctx.keep
        quota = self._quota[0].get(tenant)
        if quota is not None:
            over = usage[tenant] + room * chunk - quota
            if over > 0:
                others = {key for key in held_keys if owner(key) != tenant}
                held = primary.evict_held(math.ceil(over / chunk), others | spared)
                primary.release_held(held.values())
                usage[tenant] -= len(held) * chunk
            room = min(room, max(0, (quota - usage[tenant]) // chunk))
        short = room - primary.free_slots
        shares = {who: share for who, share in self._protected[0].items()
                  if who != tenant and share > 0}
        while short > 0:
            # Chunks another tenant may still lose before it is down to its protected
            # share; its chunks are shielded once that is none. Each round evicts no more
            # than the smallest such allowance, so no share is crossed within a round.
            allowance = {who: (usage[who] - share) // chunk for who, share in shares.items()}
            shielded = {key for key in primary.held_keys()
                        if allowance.get(owner(key), 1) <= 0} | spared
            step = min([short, *(left for left in allowance.values() if left > 0)])
            held = primary.evict_held(step, shielded)
            if not held:
                break
            primary.release_held(held.values())
            for victim in held:
                usage[owner(victim)] -= chunk
            short -= len(held)
        room = min(room, primary.free_slots)
        if room >= len(new):
            return scoped
        fits = set(new[:room])
        return [key for key in scoped if key in fits or primary.slot_of(key) is not None]

    def _trim_primary(self, tenant: str, ctx: ReqContext) -> None:
        """A promotion took a primary slot for ``tenant``: past its quota there, its own
        least recently used chunks go (never those the request keeps for itself)."""
        primary = self._primary
        assert primary is not None
        chunk = primary.slot_bytes
        held_keys = primary.held_keys()
        over = self._count(held_keys, chunk)[tenant] - self._quota[0][tenant]
        if over > 0:
            owner = self.keys.owner
            keep = {key for key in held_keys if owner(key) != tenant} | ctx.keep
            held = primary.evict_held(math.ceil(over / chunk), keep)
            primary.release_held(held.values())

    def _count(self, keys: Iterable[OffloadKey], size: int) -> Counter[str]:
        owner = self.keys.owner
        return self._tally((owner(key), size) for key in keys)

    def _tally(self, sized: Iterable[tuple[str, int]]) -> Counter[str]:
        usage: Counter[str] = Counter()
        for name, size in sized:
            usage[name] += size
        return usage

    def _enforce_lower(self) -> None:
        """Evict each lower tier's over-quota tenants' own chunks back under quota."""
        for index, tier in enumerate(self.inner.tiers):
            quotas = self._quota[index]
            manager = tier.manager
            if index == 0 or not quotas or not isinstance(manager, AccountedTier):
                continue
            trim_to_quotas(manager, quotas, self.keys.owner)

    def _persistent_usage(self, manager: AccountedTier) -> Counter[str]:
        owner = self.keys.owner
        return self._tally((owner(key), entry.size) for key, entry in manager.index.items())

    def usage(self) -> dict[str, dict[str, int]]:
        """Bytes per tenant (every configured one, 0 included) per tier name, counted
        from what each tier holds now; a tier whose keys cannot be walked (the node
        service's) is left out."""
        result: dict[str, dict[str, int]] = {}
        for tier in self.inner.tiers:
            manager = tier.manager
            if isinstance(manager, AccountedPrimary):
                counted = self._count(manager.held_keys(), manager.slot_bytes)
            elif isinstance(manager, AccountedTier):
                counted = self._persistent_usage(manager)
            else:
                continue
            result[tier.name] = {name: counted.get(name, 0) for name in
                                 (*self.keys.names, *sorted(set(counted) - set(self.keys.names)))}
        return result

    # -- the rest of the contract, forwarded ---------------------------------------
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        self.keys.tenant_of(ctx)
        return self.inner.on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self.inner.on_request_finished(ctx)

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self.inner.take_events()

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.inner.on_schedule_end(ctx)
        self._enforce_lower()
        now = time.monotonic()
        if self._refreshed_at is None or now - self._refreshed_at >= self._refresh_s:
            self._refreshed_at = now
            self.usage_snapshot = self.usage()

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    @property
    def generation(self) -> int:
        return self.inner.generation

    def reset_cache(self) -> None:
        self._live.clear()
        self.inner.reset_cache()

    def on_reset_flushed(self) -> None:
        self.inner.on_reset_flushed()

    def get_stats(self) -> Mapping[str, float]:
        return self.inner.get_stats()

    # -- what an engine integration reads of the composite (vLLM's route 1) --------
    def promotion_source(self, key: OffloadKey) -> BuiltTier | None:
        """The composite's answer for the scoped key of the latest lookup, when that
        lookup was of ``key``; else ``None``. Ask right after the lookup."""
        looked = self._looked
        if looked is None or looked[0] != key:
            return None
        return self.inner.promotion_source(looked[1])

    @property
    def tiers(self) -> list[BuiltTier]:
        return self.inner.tiers

    @property
    def stats_refresh_s(self) -> float | None:
        return self.inner.stats_refresh_s

    def refresh_stats_snapshot(self) -> None:
        self.inner.refresh_stats_snapshot()

    def count_torn(self, chunks: int) -> None:
        self.inner.count_torn(chunks)

    def wait_index(self) -> None:
        self.inner.wait_index()

    def shutdown(self) -> None:
        self.inner.shutdown()


#: The Prometheus family of :meth:`TenantStack.usage_snapshot`.
TENANT_BYTES = "kvtiers_tenant_bytes"


#: The composite's stat that :func:`pinned_bytes_families` exports per tenant.
PINNED_BYTES_STAT = "retention_pinned_bytes"


def pinned_bytes_families(book: RetentionBook, keys: TenantKeys
                          ) -> Callable[[], Iterator[Any]]:
    """A :meth:`~kvtiers.stack.metrics.MetricsServer.add_families` source, replacing the
    composite's :data:`PINNED_BYTES_STAT`: ``kvtiers_stack_retention_pinned_bytes{tenant}``,
    the bytes each tenant's retention pins hold now (every tenant from the first scrape;
    a pin of no scope, which only a direct call on the book makes, counts as the default
    tenant's). Read from the book under its lock at each scrape (the admin endpoint's
    threads share it the same way)."""
    spec = STACK[PINNED_BYTES_STAT]

    def families() -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        pinned = dict.fromkeys(keys.names, 0)
        for scope, nbytes in book.pinned_bytes_by_scope().items():
            name = keys.default if scope is None else scope
            pinned[name] = pinned.get(name, 0) + nbytes
        family = GaugeMetricFamily(spec.name, with_unit(spec), labels=["tenant"])
        for tenant, nbytes in pinned.items():
            family.add_metric([tenant], float(nbytes))
        yield family

    return families


def tenant_bytes_families(tenants: TenantStack) -> Callable[[], Iterator[Any]]:
    """A :meth:`~kvtiers.stack.metrics.MetricsServer.add_families` source:
    ``kvtiers_tenant_bytes{tenant, tier}``, the bytes each tenant's chunks take in each
    tier, from the latest snapshot (prometheus-client is imported at the first scrape)."""

    def families() -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily(
            TENANT_BYTES, "Bytes a tenant's chunks take in a tier (tenants: section). "
            "Unit: bytes.", labels=["tenant", "tier"])
        for tier, by_tenant in tenants.usage_snapshot.items():
            for tenant, used in by_tenant.items():
                family.add_metric([tenant, tier], float(used))
        yield family

    return families
