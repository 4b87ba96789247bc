"""YAML → a running stack: the composite manager plus the worker factory of its primary.

The same stack file drives the tests, the demo, the CLI and the vLLM integration. The
engine (or the YAML ``model:`` section) supplies the cache identity; each tier kind's
factory is imported lazily, so a stack without S3 never imports boto3.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvtiers.config import StackConfig, load_stack_config, resolve_factory
from kvtiers.config.paths import join_path
from kvtiers.config.tiers import LowerTierConfig
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import GROUP_INDEX_BYTES, KeyFormat
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier, WriteRules
from kvtiers.core.worker import KVCacheTensors, OffloadingWorker
from kvtiers.errors import ConfigError
from kvtiers.logs import log_started, log_stopped
from kvtiers.policies.retention import RetentionBook
from kvtiers.stack.composite import TieredManager
from kvtiers.stack.cost import ChunkShape, CostModel, TransferEstimate
from kvtiers.stack.preflight import check_before_build

if TYPE_CHECKING:
    import torch

    from kvtiers.stack.ledger import LedgerWriter
    from kvtiers.stack.metrics import MetricsServer
    from kvtiers.stack.tenants import TenantStack


@dataclass
class Stack:
    """A built tier stack. ``manager`` runs in the scheduler; ``make_worker`` in a worker."""

    config: StackConfig
    offloading: OffloadingConfig
    tiers: list[BuiltTier]
    manager: TieredManager
    #: The Prometheus exporter, when the stack file has a ``metrics:`` section.
    metrics: MetricsServer | None = None
    #: The composite with keys scoped by tenant and quotas kept, when the stack file has a
    #: ``tenants:`` section: the manager an engine drives then (docs/tenants.md).
    tenants: TenantStack | None = None
    #: The retention ledger's writer, when ``retention.ledger`` is set.
    ledger: LedgerWriter | None = None
    _stopped: bool = field(default=False, init=False, repr=False)

    def make_worker(
        self, kv_caches: KVCacheTensors | Mapping[str, torch.Tensor]
    ) -> OffloadingWorker:
        """The primary's GPU ⇄ primary worker over the engine's KV tensors: a
        :class:`KVCacheTensors`, or ``{layer name: tensor}`` (see
        :meth:`KVCacheTensors.from_layers`)."""
        if isinstance(kv_caches, Mapping):
            kv_caches = KVCacheTensors.from_layers(kv_caches, self.offloading)
        worker = _primary_worker(self.tiers[0], kv_caches)
        if self.manager.latency is not None:
            from kvtiers.stack.metrics_latency import TimedWorker

            return TimedWorker(worker, self.manager.latency)
        return worker

    def wait_index(self) -> None:
        """Block until every tier has indexed what its medium held at start
        (:meth:`~kvtiers.core.manager.OffloadingManager.wait_index`): a warm restart's
        lookups then answer at once instead of ``RETRY``. For tests and tools."""
        for tier in self.tiers:
            tier.manager.wait_index()

    def shutdown(self) -> None:
        """Drain movers and release every tier, then log what each tier did (one line
        each: :func:`~kvtiers.logs.log_stopped`). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.manager.shutdown()
        if self.ledger is not None:
            self.ledger.close()
            self.ledger = None
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        log_stopped([tier.name for tier in self.tiers], self.manager.get_stats())

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


def load_stack(
    source: str | Path | Mapping[str, object] | StackConfig,
    identity: OffloadingConfig | None = None,
    *,
    rank: int = 0,
) -> Stack:
    """Build the stack a YAML file (path or parsed mapping) describes.

    ``identity`` is the engine's cache configuration; without it the stack file's
    ``model:`` section supplies one. Tiers are built in order, each lower tier given the
    primary's host region; if one fails, the ones already built are shut down.
    """
    # The configuration was checked when it was made (a missing prometheus_client
    # included), before any tier is built.
    config = source if isinstance(source, StackConfig) else load_stack_config(source)
    if identity is None:
        if config.model is None:
            raise ConfigError(
                "no cache identity: give load_stack an OffloadingConfig or add a model: "
                "section to the stack file",
                path="model",
                source=config.source,
            )
        identity = config.model.to_offloading_config(rank)
    # Every start-time check first (credentials, buckets, roots, ports...): a start that
    # would fail stops here, one line long, before any directory or socket exists.
    check_before_build(config, identity)
    token = _admin_token(config)
    tiers: list[BuiltTier] = []
    book = None if config.retention is None else retention_book(config, identity)
    try:
        for index in range(len(config.tiers)):
            tiers.append(_build_tier(config, index, identity, tiers[0].region if tiers else None,
                                     retention=book))
        manager = TieredManager(
            tiers,
            keys=KeyFormat.for_algorithm(len(identity.groups), identity.cache.hash_algorithm),
        )
    except BaseException:
        for tier in reversed(tiers):
            tier.shutdown()
        raise
    stack = Stack(config, identity, tiers, manager)
    if config.tenants is not None:
        from kvtiers.stack.tenants import TenantStack

        stack.tenants = TenantStack(manager, config.tenants, refresh_s=(
            1.0 if config.metrics is None else config.metrics.refresh_s))
    if book is not None:
        assert config.retention is not None
        manager.retention = book
        manager.retention_hints = config.retention.hints
        if config.retention.ledger is not None:
            from kvtiers.stack.ledger import LedgerWriter

            stack.ledger = LedgerWriter(book, Path(config.retention.ledger),
                                        config.retention.ledger_interval_s)
    if config.promotion is not None:
        manager.cost = build_cost_model(config, identity)
    if config.metrics is not None:
        from kvtiers.stack.metrics import serve_metrics
        from kvtiers.stack.metrics_latency import LatencyHistograms

        manager.stats_refresh_s = config.metrics.refresh_s
        manager.latency = LatencyHistograms()
        # Every latency series from the start, zero until a job ends.
        for tier in tiers[1:]:
            manager.latency.declare("promote", tier.name)
            manager.latency.declare("cascade", tier.name)
        for direction in ("load", "store"):
            manager.latency.declare(direction, direction)
        manager.refresh_stats_snapshot()
        try:
            stack.metrics = serve_metrics(manager, config.metrics.addr, config.metrics.port,
                                          manager.latency,
                                          admin=_admin(token, manager, stack.tenants))
            if stack.tenants is not None:
                from kvtiers.stack.tenants import (
                    PINNED_BYTES_STAT,
                    pinned_bytes_families,
                    tenant_bytes_families,
                )

                stack.metrics.add_families(tenant_bytes_families(stack.tenants))
                if book is not None:
                    # Pinned bytes per tenant: each tenant's pins have a cap of their own.
                    stack.metrics.add_families(
                        pinned_bytes_families(book, stack.tenants.keys),
                        replaces=(PINNED_BYTES_STAT,))
        except BaseException as exc:
            # Nothing built may outlive a failed start; the error says where in the file.
            stack.shutdown()
            if isinstance(exc, ConfigError):
                raise exc.with_source(config.source) from None
            raise
    log_started(config, identity)
    return stack


def build_cost_model(config: StackConfig, identity: OffloadingConfig) -> CostModel:
    """The cost model of ``config``'s ``promotion:`` section: one estimate per lower tier,
    seeded from its ``load_latency_s`` / ``load_bytes_per_s``, and each group's chunk."""
    promotion = config.promotion
    assert promotion is not None, "only a stack with a promotion: section has a cost model"
    shapes = [ChunkShape(identity.tokens_per_chunk(g), identity.chunk_bytes(g))
              for g in range(len(identity.groups))]
    estimates = {
        tier.name: TransferEstimate(tier.load_latency_s, tier.load_bytes_per_s,
                                    weight=promotion.estimate_weight)
        for tier in config.tiers[1:]
        if isinstance(tier, LowerTierConfig)
    }
    return CostModel(prefill_tokens_per_s=promotion.prefill_tokens_per_s, shapes=shapes,
                     tiers=estimates)


def build_primary_worker(
    config: StackConfig, identity: OffloadingConfig, kv_caches: KVCacheTensors
) -> tuple[OffloadingWorker, BuiltTier]:
    """Build only the primary tier of ``config`` and its worker over ``kv_caches``: what a
    worker process without the scheduler's stack needs. The caller shuts the returned
    tier down after the worker; if making the worker fails, the tier is shut down here."""
    primary = _build_tier(config, 0, identity, None)
    try:
        return _primary_worker(primary, kv_caches), primary
    except BaseException:
        primary.shutdown()
        raise


def stages(config: StackConfig) -> bool:
    """Whether ``config``'s primary stages (:mod:`kvtiers.core.primary`, "Staging"): some
    lower tier writes every chunk the primary stores through (``write: through``, no
    ``write_after_hits``, not read-only), so a store that does not fit whole may evict for
    its head, which then reaches the tiers below ("Prefixes larger than the primary" in
    docs/architecture.md)."""
    return any(
        isinstance(tier, LowerTierConfig) and tier.admission != "never"
        and tier.write == "through" and tier.write_after_hits == 0
        for tier in config.tiers[1:]
    )


def build_tier_at(
    config: StackConfig, index: int, identity: OffloadingConfig, primary_region: HostRegion | None
) -> BuiltTier:
    """Tier ``index`` of ``config`` for ``identity``, copying through ``primary_region``
    (``None``: the primary), with its write rules from the file: what ``kvtiers serve``
    builds below its own pool."""
    return _build_tier(config, index, identity, primary_region)


def retention_book(config: StackConfig, identity: OffloadingConfig) -> RetentionBook:
    """The retention book of ``config``'s ``retention:`` section: a block hash counts one
    primary slot per group; pins are capped at ``max_pinned_bytes``, by default half the
    primary's capacity (a primary without a capacity, a GDS file tier, has no default
    cap beyond its own room: the cap is then 0 unless given; a ``kind: service`` primary's
    pins are capped by the service, so the engine's own book is then not)."""
    section = config.retention
    assert section is not None, "only a stack with a retention: section has a book"
    hash_bytes = ChunkGeometry.from_config(identity).slot_bytes * len(identity.groups)
    cap: int
    if section.max_pinned_bytes is not None:
        cap = section.max_pinned_bytes
    elif config.tiers[0].kind == "service":
        cap = sys.maxsize
    else:
        capacity = getattr(config.tiers[0], "capacity", None)
        cap = 0 if capacity is None else int(capacity) // 2
    return RetentionBook(hash_bytes=hash_bytes, max_pinned_bytes=cap,
                         max_pin_s=section.max_pin_s, max_ttl_s=section.max_ttl_s,
                         cap_for=None if config.tenants is None else tenant_pin_caps(
                             config, cap))


def tenant_pin_caps(config: StackConfig, stack_cap: int) -> Callable[[str | None], int]:
    """The pin cap of each scope of a stack with a ``tenants:`` section: a tenant's own
    ``max_pinned_bytes``, else ``stack_cap`` (the retention section's), at most its
    quota on the primary; scope ``None`` (an admin pin naming no tenant) and an unlisted
    tenant have ``stack_cap``."""
    assert config.tenants is not None
    primary = config.tiers[0].name
    caps: dict[str | None, int] = {}
    for tenant in config.tenants.members:
        cap = stack_cap if tenant.max_pinned_bytes is None else tenant.max_pinned_bytes
        quota = tenant.quota_bytes().get(primary)
        caps[tenant.name] = cap if quota is None else min(cap, quota)
    return lambda scope: caps.get(scope, stack_cap)


def _admin_token(config: StackConfig) -> str | None:
    """The admin endpoint's token, when ``retention.admin_token_env`` names its variable;
    a missing or empty token is a :class:`ConfigError` (read before any tier is built)."""
    section = config.retention
    if section is None or section.admin_token_env is None:
        return None
    token = os.environ.get(section.admin_token_env, "")
    if not token:
        raise ConfigError(
            f"the environment variable {section.admin_token_env} holds no admin token; set "
            "it, or remove retention.admin_token_env (no admin endpoint)",
            path="retention.admin_token_env",
            source="" if config.source == "<mapping>" else config.source,
        )
    return token


@runtime_checkable
class RetentionOrdered(Protocol):
    """A tier that can evict in a retention book's order (the file and object tiers:
    :meth:`~kvtiers.tiers.persistent.PersistentTierManager.honour_retention`)."""

    def honour_retention(self, book: RetentionBook, groups: int) -> None: ...


def _admin(token: str | None, manager: TieredManager,
           tenants: TenantStack | None) -> Callable[[Any], Any] | None:
    """The maker of the retention admin app over the metrics app (``None``: no token);
    with ``tenants``, its calls name a tenant."""
    if token is None or manager.retention is None:
        return None
    from kvtiers.stack.admin import RetentionAdmin

    book = manager.retention
    key_bytes = manager.key_format.key_bytes
    hash_bytes = None if key_bytes is None else key_bytes - GROUP_INDEX_BYTES
    keys = None if tenants is None else tenants.keys
    return lambda app: RetentionAdmin(book, token, app, hash_bytes=hash_bytes, tenants=keys)


def _build_tier(
    config: StackConfig, index: int, identity: OffloadingConfig, primary_region: HostRegion | None,
    *, retention: RetentionBook | None = None,
) -> BuiltTier:
    tier_config = config.tiers[index]
    where = f"tiers[{index}]"
    factory = resolve_factory(tier_config.kind, path=f"{where}.kind")
    # The primary's staging is decided here, from the stack, before it is built.
    more: dict[str, object] = {"staging": stages(config)} if index == 0 else {}
    if index == 0 and retention is not None and tier_config.kind == "cpu":
        # The cpu primary's policy honours retention; a persistent tier is told below.
        more["retention"] = retention
    try:
        tier = factory(tier_config, identity, primary_region=primary_region,
                       name=tier_config.name, **more)
    except ConfigError as exc:
        # A factory names the key within its tier (``capacity``); say which tier and file.
        source = "" if config.source == "<mapping>" else config.source
        raise ConfigError(exc.message, path=join_path(where, exc.path), source=source) from None
    if retention is not None and isinstance(tier.manager, RetentionOrdered):
        # Told after it is built: a tier kind's factory need not know of retention.
        tier.manager.honour_retention(retention, len(identity.groups))
    if isinstance(tier_config, LowerTierConfig):
        # The write rules are the composite's business, the same for every kind: set here
        # rather than by each factory.
        tier.write = WriteRules(tier_config.write, tier_config.write_after_hits,
                                tier_config.write_promoted)
    return tier


def _primary_worker(primary: BuiltTier, kv_caches: KVCacheTensors) -> OffloadingWorker:
    if primary.make_worker is None:
        raise ConfigError(
            f"tier {primary.name!r} cannot be the primary (first) tier: it makes no worker; "
            "put a cpu or file tier first",
            path="tiers[0]",
        )
    return primary.make_worker(kv_caches)
