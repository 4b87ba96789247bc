"""Builds the ``s3`` tier from its YAML config: store, namespace backend, manager, mover.

The bucket is checked at build time (HeadBucket, retried like every request), so a wrong
bucket, missing credentials or an unreachable endpoint is a start-up
:class:`~kvtiers.errors.ConfigError`, not a stream of failed stores; so is an endpoint
that does not honour conditional writes, found by a probe (two put-if-absent of one
sentinel object; the second must be refused) unless ``conditional_writes: false`` accepts
last writer wins. A namespace listing that still fails after botocore's per-page retries
is one :class:`~kvtiers.errors.BackendUnavailableError` naming the endpoint.
``endpoint_url: embedded`` starts (or reuses) the process's local moto server and creates
the bucket there.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtiers.config.tiers import S3TierConfig
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.tiers.object.factory import build_object_tier, lower_tier_region
from kvtiers.tiers.object.retry import Retrier
from kvtiers.tiers.s3.store import EventHook, S3Store


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
        region=config.region,
        endpoint_url=endpoint_url,
        profile=config.profile,
        timeout_s=config.timeout_s,
        max_connections=config.threads,
        retry_mode=config.retry_mode,
        max_attempts=config.max_attempts,
        backoff_max_s=config.backoff_max_s,
        conditional_writes=config.conditional_writes,
        credentials=credentials,
        event_hooks=event_hooks,
    )
    if embedded:
        store.create_bucket()
    store.check_bucket()
    if config.conditional_writes:
        store.check_conditional_writes(config.prefix)
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
    return build_object_tier(
        store, config, offloading, name=name, primary_region=region, retrier=retrier,
        prefix=config.prefix, delete_corrupt=config.delete_corrupt,
    )
