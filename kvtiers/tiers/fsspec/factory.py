"""Builds the ``fsspec`` tier from its YAML config: store, namespace backend, manager,
mover. Retries use the defaults of :class:`~kvtiers.tiers.object.retry.Retrier`, under the
tier's ``op_deadline_s``."""

from __future__ import annotations

from kvtiers.config.tiers import FsspecTierConfig
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.mover import HostRegion
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.tiers.base import BuiltTier
from kvtiers.tiers.fsspec.store import FsspecStore
from kvtiers.tiers.object import ObjectBackend, ObjectMover, ObjectTierManager, Retrier


def build_tier(
    config: FsspecTierConfig,
    offloading: OffloadingConfig,
    *,
    primary_region: HostRegion | None,
    name: str,
) -> BuiltTier:
    """The fsspec tier ``name``; a lower tier only (it needs the primary's host region)."""
    if primary_region is None:
        raise ConfigError(
            f"tier {name!r}: an fsspec tier cannot be the first tier of a stack; put a cpu "
            "tier above it",
            path="kind",
        )
    store = FsspecStore(config.url, config.storage_options)
    backend = ObjectBackend(
        store,
        NamespaceIdentity.from_config(offloading),
        threads=config.threads,
        retrier=Retrier(store.is_transient, deadline_s=config.op_deadline_s),
    )
    geometry = ChunkGeometry.from_config(offloading)
    try:
        manager = ObjectTierManager(
            backend,
            max_chunk_bytes=geometry.max_chunk_bytes,
            capacity_bytes=config.capacity,
            shared=config.shared,
            load_backoff_s=config.load_backoff_s,
            load_backoff_max_s=config.load_backoff_max_s,
        )
    except BaseException:
        backend.close()
        raise
    mover = ObjectMover(backend, primary_region, geometry, reporter=manager)
    return BuiltTier(name=name, manager=manager, mover=mover, admission=config.admission)
