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
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError
from kvtiers.tiers.object.factory import build_object_tier, lower_tier_region
from kvtiers.tiers.object.retry import Retrier
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
    region = lower_tier_region("an s3", name, primary_region)
    store = make_store(config, event_hooks=event_hooks)
    retrier = Retrier(
        store.is_transient,
        max_attempts=config.max_attempts,
        base_s=config.backoff_base_s,
        max_s=config.backoff_max_s,
        deadline_s=config.op_deadline_s,
    )
    try:
        return build_object_tier(
            store, offloading, name=name, primary_region=region, retrier=retrier,
            threads=config.threads, capacity_bytes=config.capacity, shared=config.shared,
            admission=config.admission, prefix=config.prefix,
            delete_corrupt=config.delete_corrupt,
        )
    except BaseException as exc:
        if lacks_conditional_writes(exc):  # the namespace manifest is the first put
            raise ConfigError(
                f"the S3 endpoint {config.endpoint_url or 'AWS S3'} does not support "
                "conditional writes (PutObject with If-None-Match), which kvtiers needs so "
                "that racing writers never overwrite each other; use a store that supports "
                "them",
                path="endpoint_url",
            ) from None
        raise
