"""The one builder under every object tier kind (``s3``, ``fsspec``).

A kind's factory checks its own configuration and makes its :class:`ObjectStore`; this
module turns that store into a :class:`~kvtiers.core.tier.BuiltTier`: namespace backend,
manager and mover. Invariant: a store handed to :func:`build_object_tier` is closed (with
its backend) when building fails, so a failed build leaves no connections open.
"""

from __future__ import annotations

from kvtiers.config.tiers import ObjectTierConfig
from kvtiers.core.codec import make_codec
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.tiers.backoff import BackoffSettings
from kvtiers.tiers.listing import ListingSettings
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.manager import ObjectTierManager
from kvtiers.tiers.object.mover import ObjectMover
from kvtiers.tiers.object.retry import Retrier
from kvtiers.tiers.object.store import ObjectStore


def lower_tier_region(kind: str, name: str, primary_region: HostRegion | None) -> HostRegion:
    """The primary's host region an object tier's mover copies through; an object tier
    asked to be the first tier of a stack is a :class:`ConfigError`."""
    if primary_region is None:
        raise ConfigError(
            f"tier {name!r}: {kind} tier cannot be the first tier of a stack; put a cpu "
            "tier above it",
            path="kind",
        )
    return primary_region


def build_object_tier(
    store: ObjectStore,
    config: ObjectTierConfig,
    offloading: OffloadingConfig,
    *,
    name: str,
    primary_region: HostRegion,
    retrier: Retrier,
    prefix: str = "",
    delete_corrupt: bool = True,
) -> BuiltTier:
    """The object tier ``name`` over ``store``, as its section ``config`` sets it (threads,
    capacity, ``shared``, admission, codec, load back-off, background listing); ``prefix``
    and ``delete_corrupt`` are those of the kinds that have them (s3). Opening the
    namespace (checking or publishing its manifest) happens here, and any failure closes
    the store."""
    backend = ObjectBackend(
        store,
        NamespaceIdentity.from_config(offloading),
        prefix=prefix,
        threads=config.threads,
        retrier=retrier,
    )
    geometry = ChunkGeometry.from_config(offloading)
    try:
        encoder = make_codec(config.codec, kv_dtype=offloading.model.dtype)
        manager = ObjectTierManager(
            backend,
            max_chunk_bytes=geometry.max_chunk_bytes,
            capacity_bytes=config.capacity,
            shared=config.shared,
            load_backoff=BackoffSettings.from_config(config),
            listing=ListingSettings.from_config(config),
            background_index=True,
        )
    except BaseException:
        backend.close()
        raise
    mover = ObjectMover(
        backend, primary_region, geometry, delete_corrupt=delete_corrupt, reporter=manager,
        codec=encoder,
    )
    return BuiltTier(name=name, manager=manager, mover=mover, admission=config.admission)
