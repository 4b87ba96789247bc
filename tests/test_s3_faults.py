"""Faults between the s3 tier's clients and the server: throttling, 500s, dropped
connections, read timeouts and slow responses are retried with backoff, then fail the
key cleanly; no wrong bytes are ever reported; the tier works again once faults stop.
A 501 (no conditional writes) is not retried, and at start-up is a configuration error.
Also the retry policy on its own, with an injected clock."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtiers.config.tiers import S3TierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.errors import ConfigError
from kvtiers.filemapper import MANIFEST_NAME
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.base import BuiltTier
from kvtiers.tiers.object.retry import Retrier
from kvtiers.tiers.s3.factory import build_tier
from tests.conftest import (
    BUCKET,
    FaultInjector,
    MotoServer,
    TierDriver,
    _Body,
    offloading_config,
)

ATTEMPTS = 3
KINDS = ["throttle", "server_error", "drop", "timeout"]


@pytest.fixture
def tier(s3_endpoint: MotoServer, faults: FaultInjector) -> Iterator[TierDriver]:
    offloading = offloading_config()
    geometry = ChunkGeometry.from_config(offloading)
    region = BytearrayRegion(4, geometry.slot_bytes)
    config = S3TierConfig(name="s3", bucket=BUCKET, endpoint_url=s3_endpoint.endpoint_url,
                          threads=1, max_attempts=ATTEMPTS, backoff_base_s=0.001,
                          backoff_max_s=0.002, timeout_s=5.0)
    built: BuiltTier = build_tier(config, offloading, primary_region=region, name="s3",
                                  event_hooks=faults.hooks())
    yield TierDriver(built, region, geometry)
    built.shutdown()


def arm(faults: FaultInjector, kind: str, n: int, method: str) -> None:
    knob: Callable[[int, str], None] = getattr(faults, kind)
    knob(n, method)


def chunk(i: int) -> dict[Any, bytes]:
    return {conformance_key(i): conformance_payload(i, 8192)}


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_is_retried_through_transient_faults(
    tier: TierDriver, faults: FaultInjector, kind: str
) -> None:
    arm(faults, kind, ATTEMPTS - 1, "PUT")
    assert tier.store(chunk(0)).succeeded_keys == (conformance_key(0),)
    assert faults.injected == ATTEMPTS - 1
    assert tier.manager.get_stats()["retries"] == ATTEMPTS - 1
    assert tier.load([conformance_key(0)])[1] == chunk(0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_store_fails_cleanly_when_attempts_run_out(
    tier: TierDriver, faults: FaultInjector, kind: str
) -> None:
    arm(faults, kind, ATTEMPTS, "PUT")
    result = tier.store({**chunk(0), **chunk(1)})
    assert result.failed_keys == (conformance_key(0),)
    assert result.succeeded_keys == (conformance_key(1),)
    assert tier.manager.lookup(conformance_key(0), ReqContext("t")) is LookupResult.MISS
    assert tier.manager.get_stats()["store_failures"] == 1
    assert tier.store(chunk(0)).succeeded_keys == (conformance_key(0),)


@pytest.mark.parametrize("kind", KINDS)
def test_a_load_is_retried_then_fails_without_wrong_bytes(
    tier: TierDriver, faults: FaultInjector, kind: str
) -> None:
    tier.store({**chunk(0), **chunk(1)})
    keys = [conformance_key(0), conformance_key(1)]
    arm(faults, kind, ATTEMPTS - 1, "GET")
    result, data = tier.load(keys)
    assert result.succeeded_keys == tuple(keys)
    assert data == {**chunk(0), **chunk(1)}

    arm(faults, kind, ATTEMPTS, "GET")
    result, data = tier.load(keys)
    assert result.failed_keys == (conformance_key(0),) and result.corrupt_keys == ()
    assert data == chunk(1)
    # A transient failure backs the key off (a miss for now) but keeps it indexed.
    assert tier.manager.lookup(conformance_key(0), ReqContext("t")) is LookupResult.MISS
    stats = tier.manager.get_stats()
    assert stats["chunks"] == 2 and stats["unreadable_chunks"] == 0

    result, data = tier.load(keys)
    assert result.success and data == {**chunk(0), **chunk(1)}


def test_slow_responses_still_succeed(tier: TierDriver, faults: FaultInjector) -> None:
    faults.slow(2, 0.05)
    assert tier.store(chunk(0)).success
    assert tier.load([conformance_key(0)])[1] == chunk(0)
    assert tier.manager.get_stats()["retries"] == 0


def test_a_permanent_error_is_not_retried(tier: TierDriver, faults: FaultInjector) -> None:
    client = tier.manager.backend.store.client()
    name = tier.manager.backend.object_key(conformance_key(0))
    tier.store(chunk(0))
    client.put_object(Bucket=BUCKET, Key=name, Body=b"x")
    before = faults.passed
    result, data = tier.load([conformance_key(0)])
    assert result.corrupt_keys == (conformance_key(0),) and data == {}
    # One GET (wrong length: not read), then one DELETE of the corrupt object.
    assert faults.passed - before == 2
    assert tier.manager.get_stats()["retries"] == 0


# -- stores without conditional writes --------------------------------------------------
class NotImplementedPuts:
    """Answers PUTs of objects named ``*suffix`` with 501 Not Implemented, as a store
    without conditional writes answers a put with If-None-Match; counts them."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.answered = 0
        self._lock = threading.Lock()

    def __call__(self, request: Any, **_: Any) -> Any:
        from botocore.awsrequest import AWSResponse

        if request.method != "PUT" or not request.url.endswith(self.suffix):
            return None
        with self._lock:
            self.answered += 1
        body = b"<Error><Code>NotImplemented</Code><Message>injected</Message></Error>"
        return AWSResponse(request.url, 501, {"Content-Type": "application/xml"}, _Body(body))


def build(endpoint: MotoServer, hook: NotImplementedPuts) -> tuple[BuiltTier, TierDriver]:
    offloading = offloading_config()
    geometry = ChunkGeometry.from_config(offloading)
    region = BytearrayRegion(2, geometry.slot_bytes)
    config = S3TierConfig(name="s3", bucket=BUCKET, endpoint_url=endpoint.endpoint_url,
                          threads=1, max_attempts=ATTEMPTS, backoff_base_s=0.001,
                          backoff_max_s=0.002)
    built = build_tier(config, offloading, primary_region=region, name="s3",
                       event_hooks=[(FaultInjector.EVENT, hook)])
    return built, TierDriver(built, region, geometry)


def test_not_implemented_is_not_retried(s3_endpoint: MotoServer) -> None:
    hook = NotImplementedPuts(".kvc")
    built, driver = build(s3_endpoint, hook)
    try:
        assert driver.store(chunk(0)).failed_keys == (conformance_key(0),)
        assert hook.answered == 1
        assert driver.manager.get_stats()["retries"] == 0
    finally:
        built.shutdown()


def test_no_conditional_writes_is_a_config_error(s3_endpoint: MotoServer) -> None:
    hook = NotImplementedPuts(MANIFEST_NAME)
    with pytest.raises(ConfigError, match="does not support conditional writes") as info:
        build(s3_endpoint, hook)
    assert info.value.path == "endpoint_url"
    assert hook.answered == 1


# -- the retry policy -------------------------------------------------------------------
class Flaky:
    def __init__(self, failures: int, exc: Exception) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return "ok"


def test_retrier_backs_off_exponentially_with_full_jitter() -> None:
    slept: list[float] = []
    retrier = Retrier(lambda e: True, max_attempts=6, base_s=0.1, max_s=0.5,
                      sleep=slept.append, rng=lambda: 1.0)
    assert retrier.call(Flaky(5, OSError())) == "ok"
    assert slept == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert retrier.retries == 5
    halves: list[float] = []
    Retrier(lambda e: True, base_s=0.1, sleep=halves.append, rng=lambda: 0.5).call(
        Flaky(2, OSError()))
    assert halves == pytest.approx([0.05, 0.1])


def test_retrier_gives_up_after_max_attempts() -> None:
    flaky = Flaky(10, TimeoutError("slow"))
    retrier = Retrier(lambda e: True, max_attempts=3, sleep=lambda s: None)
    with pytest.raises(TimeoutError):
        retrier.call(flaky)
    assert flaky.calls == 3


def test_retrier_raises_permanent_errors_at_once() -> None:
    flaky = Flaky(1, ValueError("bad"))
    retrier = Retrier(lambda e: isinstance(e, OSError), sleep=lambda s: None)
    with pytest.raises(ValueError):
        retrier.call(flaky)
    assert flaky.calls == 1 and retrier.retries == 0
