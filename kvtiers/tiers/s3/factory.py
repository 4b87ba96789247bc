"""Builds the ``s3`` tier from its YAML config: store, namespace backend, manager, mover.

The bucket is checked at build time (HeadBucket), so a wrong bucket, missing credentials
or an unreachable endpoint is a start-up :class:`~kvtiers.errors.ConfigError`, not a
stream of failed stores; so is an endpoint without conditional writes, found when the
namespace manifest is first published. ``endpoint_url: embedded`` starts (or reuses) the
process's local moto server and creates the bucket there.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtiers.config.tiers import S3TierConfig
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.mover import HostRegion
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.tiers.base import BuiltTier
from kvtiers.tiers.object import ObjectBackend, ObjectMover, ObjectTierManager, Retrier
from kvtiers.tiers.s3.store import EventHook, S3Store, lacks_conditional_writes


def make_store(config: S3TierConfig, *, event_hooks: Sequence[EventHook] = ()) -> S3Store:
    """The checked :class:`S3Store` of ``config`` (its bucket exists and is reachable)."""
    endpoint_url = config.endpoint_url
    credentials = None
    embedded = endpoint_url == "embedded"
    if embedded:
        from kvtiers.tiers.s3.embedded import embedded_server

        server = embedded_server()
        endpoint_url, credentials = server.endpoint_url, server.credentials
    store = S3Store(
        config.bucket,
        region=config.region or "us-east-1",
        endpoint_url=endpoint_url,
        timeout_s=config.timeout_s,
        max_connections=config.threads,
        credentials=credentials,
        event_hooks=event_hooks,
    )
    if embedded:
        store.create_bucket()
    store.check_bucket()
    return store


def build_tier(
    config: S3TierConfig,
    offloading: OffloadingConfig,
    *,
    primary_region: HostRegion | None,
    name: str,
    event_hooks: Sequence[EventHook] = (),
) -> BuiltTier:
    """The s3 tier ``name``; a lower tier only (it needs the primary's host region).

    ``event_hooks`` are botocore event handlers registered on every client (tests use
    them to inject faults)."""
    if primary_region is None:
        raise ConfigError(
            f"tier {name!r}: an s3 tier cannot be the first tier of a stack; put a cpu "
            "tier above it",
            path="kind",
        )
    store = make_store(config, event_hooks=event_hooks)
    retrier = Retrier(
        store.is_transient,
        max_attempts=config.max_attempts,
        base_s=config.backoff_base_s,
        max_s=config.backoff_max_s,
        deadline_s=config.op_deadline_s,
    )
    backend = ObjectBackend(
        store,
        NamespaceIdentity.from_config(offloading),
        prefix=config.prefix,
        threads=config.threads,
        retrier=retrier,
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
    except BaseException as exc:
        backend.close()
        if lacks_conditional_writes(exc):  # the namespace manifest is the first put
            raise ConfigError(
                f"the S3 endpoint {config.endpoint_url or 'AWS S3'} does not support "
                "conditional writes (PutObject with If-None-Match), which kvtiers needs so "
                "that racing writers never overwrite each other; use a store that supports "
                "them",
                path="endpoint_url",
            ) from None
        raise
    mover = ObjectMover(
        backend, primary_region, geometry,
        delete_corrupt=config.delete_corrupt, reporter=manager,
    )
    return BuiltTier(name=name, manager=manager, mover=mover, admission=config.admission)
