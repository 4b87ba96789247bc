"""The s3 tier behind a loopback fault proxy (tests/s3_fault_proxy.py), on moto and on
SeaweedFS: start-up survives a SlowDown, listings retry one page not the whole namespace,
bodies cut in transit or responses cut inside their headers are read again, a bit flipped
in transit never deletes the intact object, and an endpoint that ignores If-None-Match is
refused unless ``conditional_writes: false``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvtiers.config.tiers import S3TierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import BackendUnavailableError, ConfigError
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET, S3Server
from kvtiers.tiers.s3.factory import build_tier
from kvtiers.tiers.s3.store import S3Store
from tests.s3_fault_proxy import FaultProxy


@pytest.fixture
def proxy(any_s3: S3Server) -> Iterator[FaultProxy]:
    upstream = urlsplit(any_s3.endpoint_url)
    assert upstream.hostname is not None and upstream.port is not None
    fault_proxy = FaultProxy(upstream.hostname, upstream.port)
    yield fault_proxy
    fault_proxy.close()


@pytest.fixture
def make_tier(proxy: FaultProxy) -> Iterator[Callable[..., TierDriver]]:
    built: list[BuiltTier] = []

    def make(*, hooks: Any = (), **fields: Any) -> TierDriver:
        offloading = offloading_config()
        geometry = ChunkGeometry.from_config(offloading)
        region = BytearrayRegion(4, geometry.slot_bytes)
        settings: dict[str, Any] = {"name": "s3", "bucket": BUCKET, "prefix": "px",
                                    "endpoint_url": proxy.endpoint_url, "threads": 2,
                                    "max_attempts": 3, "backoff_base_s": 0.001,
                                    "backoff_max_s": 0.002, "timeout_s": 10.0}
        settings.update(fields)
        tier = build_tier(S3TierConfig(**settings), offloading, primary_region=region,
                          name="s3", event_hooks=hooks)
        built.append(tier)
        return TierDriver(tier, region, geometry)

    yield make
    for tier in built:
        tier.shutdown()


def chunk(i: int) -> dict[Any, bytes]:
    return {conformance_key(i): conformance_payload(i, 8192)}


def test_start_up_survives_a_slowdown_and_a_reset(
    make_tier: Callable[..., TierDriver], proxy: FaultProxy
) -> None:
    proxy.arm("slowdown", 1, "HEAD")
    proxy.arm("reset", 1, "GET", "list-type=2")
    tier = make_tier()
    assert proxy.injected == 2
    assert tier.store(chunk(0)).success
    assert tier.manager.get_stats()["retries"] >= 2


@pytest.mark.parametrize("fault", ["slowdown", "reset", "cut_body", "cut_headers"])
def test_a_load_survives_one_fault_in_transit(
    make_tier: Callable[..., TierDriver], proxy: FaultProxy, fault: str
) -> None:
    tier = make_tier()
    assert tier.store(chunk(0)).success
    proxy.arm(fault, 1, "GET", ".kvc")
    result, data = tier.load([conformance_key(0)])
    assert proxy.injected == 1
    assert result.succeeded_keys == (conformance_key(0),) and data == chunk(0)
    assert tier.manager.get_stats()["retries"] == 1


def test_a_probe_survives_a_200_cut_inside_its_headers(proxy: FaultProxy) -> None:
    store = S3Store(BUCKET, endpoint_url=proxy.endpoint_url, max_attempts=3,
                    backoff_max_s=0.002)
    from kvtiers.tiers.object.retry import Retrier

    retrier = Retrier(store.is_transient, base_s=0.001, max_s=0.002)
    assert store.put_if_absent("px/a", [b"12345"])
    proxy.arm("cut_headers", 1, "HEAD", "px/a")
    assert retrier.call(lambda: store.head("px/a")) == 5
    assert proxy.injected == 1 and retrier.retries == 1


def test_a_bit_flipped_in_transit_is_read_again_not_deleted(
    make_tier: Callable[..., TierDriver], proxy: FaultProxy
) -> None:
    tier = make_tier()
    assert tier.store(chunk(0)).success
    proxy.arm("flip", 1, "GET", ".kvc")
    result, data = tier.load([conformance_key(0)])
    assert result.succeeded_keys == (conformance_key(0),) and data == chunk(0)
    assert proxy.count("DELETE", ".kvc") == 0
    assert tier.manager.get_stats()["corrupt_chunks"] == 0


def test_a_listing_retries_the_faulted_page_only(proxy: FaultProxy) -> None:
    store = S3Store(BUCKET, endpoint_url=proxy.endpoint_url, max_attempts=3,
                    backoff_max_s=0.002, list_page_size=2)
    for i in range(7):
        assert store.put_if_absent(f"ls/{i}", [b"x"])
    proxy.arm("slowdown", 1, "GET", "continuation-token")
    proxy.arm("cut_body", 1, "GET", "continuation-token")
    assert sorted(info.name for info in store.list("ls/")) == [f"ls/{i}" for i in range(7)]
    # 4 pages, and one retry for each of the two faults: no page asked for twice over.
    assert proxy.count("GET", "list-type=2") == 4 + 2
    assert store.retries == 2


def test_a_listing_that_keeps_failing_is_one_error_naming_the_endpoint(
    proxy: FaultProxy,
) -> None:
    store = S3Store(BUCKET, endpoint_url=proxy.endpoint_url, max_attempts=2,
                    backoff_max_s=0.002, list_page_size=2)
    for i in range(3):
        store.put_if_absent(f"ls/{i}", [b"x"])
    proxy.arm("slowdown", 2, "GET", "continuation-token")
    with pytest.raises(BackendUnavailableError, match="failed on page 2 after 2") as info:
        list(store.list("ls/"))
    assert proxy.endpoint_url in str(info.value)


def _ignore_if_none_match(params: dict[str, Any], **_: Any) -> None:
    params.pop("IfNoneMatch", None)  # as an endpoint that ignores the condition behaves


def test_an_endpoint_ignoring_if_none_match_is_refused(
    make_tier: Callable[..., TierDriver],
) -> None:
    hooks = [("before-parameter-build.s3.PutObject", _ignore_if_none_match)]
    with pytest.raises(ConfigError, match="ignores conditional writes") as info:
        make_tier(hooks=hooks)
    assert info.value.path == "endpoint_url"
    assert "conditional_writes: false" in str(info.value)
    tier = make_tier(hooks=hooks, conditional_writes=False)
    assert tier.store(chunk(0)).success
    assert tier.store(chunk(0)).success  # last writer wins
    assert tier.load([conformance_key(0)])[1] == chunk(0)
