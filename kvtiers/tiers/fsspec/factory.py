"""Builds the ``fsspec`` tier from its YAML config: store, namespace backend, manager,
mover. Retries use the defaults of :class:`~kvtiers.tiers.object.retry.Retrier`, under the
tier's ``op_deadline_s``."""

from __future__ import annotations

from kvtiers.config.tiers import FsspecTierConfig
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.tiers.fsspec.store import FsspecStore
from kvtiers.tiers.object.factory import build_object_tier, lower_tier_region
from kvtiers.tiers.object.retry import Retrier


def build_tier(
    config: FsspecTierConfig,
    offloading: OffloadingConfig,
    *,
    primary_region: HostRegion | None,
    name: str,
) -> BuiltTier:
    """The fsspec tier ``name``; a lower tier only (it needs the primary's host region)."""
    region = lower_tier_region("an fsspec", name, primary_region)
    store = FsspecStore(config.url, config.storage_options)
    return build_object_tier(
        store, config, offloading, name=name, primary_region=region,
        retrier=Retrier(store.is_transient, deadline_s=config.op_deadline_s),
    )
