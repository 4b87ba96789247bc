"""The one builder under every object tier kind (``s3``, ``fsspec``).

A kind's factory checks its own configuration and makes its :class:`ObjectStore`; this
module turns that store into a :class:`~kvtiers.core.tier.BuiltTier`: namespace backend,
manager and mover. Invariant: a store handed to :func:`build_object_tier` is closed (with
its backend) when building fails, so a failed build leaves no connections open.
"""

from __future__ import annotations

from typing import Literal

from kvtiers.core.codec import make_codec
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.tiers.backoff import DEFAULT_LOAD_BACKOFF_MAX_S, DEFAULT_LOAD_BACKOFF_S
from kvtiers.tiers.listing import DEFAULT_LIST_MAX_CHUNKS
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
    offloading: OffloadingConfig,
    *,
    name: str,
    primary_region: HostRegion,
    retrier: Retrier,
    threads: int,
    capacity_bytes: int | None,
    shared: bool,
    admission: Literal["always", "never"],
    prefix: str = "",
    delete_corrupt: bool = True,
    load_backoff_s: float = DEFAULT_LOAD_BACKOFF_S,
    load_backoff_max_s: float = DEFAULT_LOAD_BACKOFF_MAX_S,
    codec: str = "none",
    list_interval_s: float | None = None,
    list_max_chunks: int = DEFAULT_LIST_MAX_CHUNKS,
    summary_interval_s: float | None = None,
) -> BuiltTier:
    """The object tier ``name`` over ``store``; opening the namespace (checking or
    publishing its manifest) happens here, and any failure closes the store. A key whose
    load failed is a miss for ``load_backoff_s``, doubled per failure up to
    ``load_backoff_max_s``. ``codec`` (a ``codec:`` setting) encodes stored payloads; the
    ``list_*`` and ``summary_interval_s`` settings are the background listing's
    (:mod:`kvtiers.tiers.listing`)."""
    backend = ObjectBackend(
        store,
        NamespaceIdentity.from_config(offloading),
        prefix=prefix,
        threads=threads,
        retrier=retrier,
    )
    geometry = ChunkGeometry.from_config(offloading)
    try:
        encoder = make_codec(codec, kv_dtype=offloading.model.dtype)
        manager = ObjectTierManager(
            backend,
            max_chunk_bytes=geometry.max_chunk_bytes,
            capacity_bytes=capacity_bytes,
            shared=shared,
            load_backoff_s=load_backoff_s,
            load_backoff_max_s=load_backoff_max_s,
            list_interval_s=list_interval_s,
            list_max_chunks=list_max_chunks,
            summary_interval_s=summary_interval_s,
            background_index=True,
        )
    except BaseException:
        backend.close()
        raise
    mover = ObjectMover(
        backend, primary_region, geometry, delete_corrupt=delete_corrupt, reporter=manager,
        codec=encoder,
    )
    return BuiltTier(name=name, manager=manager, mover=mover, admission=admission)
