"""The s3 tier end to end on a moto server: restart in a new process, identity, racing
writers, capacity deletes, corruption, shared-namespace probes and start-up errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
import xxhash

from kvtiers.config.tiers import S3TierConfig
from kvtiers.core import chunkformat
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError, NamespaceMismatchError
from kvtiers.filemapper import MANIFEST_NAME, NamespaceIdentity
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers.s3.factory import build_tier

CTX = ReqContext("test")
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


@pytest.fixture
def make_tier(s3_endpoint: MotoServer) -> Iterator[Callable[..., TierDriver]]:
    """Builds s3 tiers on the test's moto server; every one is shut down afterwards."""
    built: list[BuiltTier] = []

    def make(
        offloading: Any = None, *, hooks: Any = (), region_slots: int = 8, **fields: Any
    ) -> TierDriver:
        offloading = offloading or offloading_config()
        geometry = ChunkGeometry.from_config(offloading)
        region = BytearrayRegion(region_slots, geometry.slot_bytes)
        settings: dict[str, Any] = {"name": "s3", "bucket": BUCKET, "prefix": "kv",
                                    "endpoint_url": s3_endpoint.endpoint_url, "threads": 4,
                                    "backoff_base_s": 0.001, "backoff_max_s": 0.002}
        settings.update(fields)
        tier = build_tier(S3TierConfig(**settings), offloading, primary_region=region,
                          name="s3", event_hooks=hooks)
        built.append(tier)
        return TierDriver(tier, region, geometry)

    yield make
    for tier in built:
        tier.shutdown()


def payloads(ids: range | list[int], size: int = 8192) -> dict[OffloadKey, bytes]:
    return {conformance_key(i): conformance_payload(i, size) for i in ids}


def bucket_objects(prefix: str = "") -> dict[str, bytes]:
    client = boto3.client("s3", endpoint_url=os.environ["KVTIERS_TEST_S3"])
    names = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=prefix) for o in page.get("Contents", ())]
    return {n: client.get_object(Bucket=BUCKET, Key=n)["Body"].read() for n in names}


@pytest.fixture(autouse=True)
def _endpoint_env(s3_endpoint: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIERS_TEST_S3", s3_endpoint.endpoint_url)


# -- persistence ------------------------------------------------------------------------
_CHILD = """
import json, os, sys, xxhash
from kvtiers.config.tiers import S3TierConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.manager import ReqContext
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.s3.factory import build_tier
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
offloading = offloading_config()
geometry = ChunkGeometry.from_config(offloading)
region = BytearrayRegion(8, geometry.slot_bytes)
config = S3TierConfig(name="s3", bucket=sys.argv[1], prefix="kv",
                      endpoint_url=os.environ["KVTIERS_TEST_S3"])
tier = build_tier(config, offloading, primary_region=region, name="s3")
driver = TierDriver(tier, region, geometry)
keys = [conformance_key(i) for i in range(int(sys.argv[2]))]
states = [tier.manager.lookup(k, ReqContext("child")).name for k in keys]
result, data = driver.load(keys)
print(json.dumps({"states": states, "chunks": tier.manager.get_stats()["chunks"],
                  "digests": [xxhash.xxh3_128_hexdigest(data[k]) for k in keys]}))
tier.shutdown()
"""


def test_a_new_process_rebuilds_the_index_and_loads_byte_exact(
    make_tier: Callable[..., TierDriver],
) -> None:
    driver = make_tier()
    stored = payloads(range(5))
    assert driver.store(stored).success
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, BUCKET, "5"], capture_output=True, text=True,
        check=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    child = json.loads(out.stdout)
    assert child["states"] == ["HIT"] * 5
    assert child["chunks"] == 5
    assert child["digests"] == [xxhash.xxh3_128_hexdigest(p) for p in stored.values()]


def test_a_reopened_tier_enforces_capacity_over_listed_objects(
    make_tier: Callable[..., TierDriver],
) -> None:
    # Objects of a known size: stored as they are (the test payloads compress).
    driver = make_tier(codec="none")
    for i in range(3):
        driver.store(payloads([i]))
    reopened = make_tier(capacity=3 * (chunkformat.HEADER_BYTES + 8192), codec="none")
    reopened.store(payloads([10]))
    # LastModified has one-second resolution, so which chunk goes is not pinned here.
    assert reopened.manager.get_stats()["evictions"] == 1
    assert reopened.manager.get_stats()["chunks"] == 3


# -- identity ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changed",
    [
        offloading_config(model="org/other"),
        offloading_config(salt="pepper"),
        offloading_config((8192, 4096)),
    ],
    ids=["model", "salt", "groups"],
)
def test_any_identity_change_sees_zero_hits(
    make_tier: Callable[..., TierDriver], changed: Any
) -> None:
    driver = make_tier()
    driver.store(payloads(range(4)))
    other = make_tier(changed)
    assert [other.manager.lookup(conformance_key(i), CTX) for i in range(4)] == [MISS] * 4
    assert other.manager.get_stats()["chunks"] == 0


def test_a_tampered_manifest_fails_closed(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    name = driver.manager.backend.manifest_name
    client = boto3.client("s3", endpoint_url=os.environ["KVTIERS_TEST_S3"])
    document = json.loads(client.get_object(Bucket=BUCKET, Key=name)["Body"].read())
    document["identity"]["tokens_per_hash"] += 1
    client.put_object(Bucket=BUCKET, Key=name, Body=json.dumps(document).encode())
    with pytest.raises(NamespaceMismatchError, match="tokens_per_hash"):
        make_tier()


def test_the_manifest_is_published_once(make_tier: Callable[..., TierDriver]) -> None:
    make_tier()
    first = bucket_objects("kv/")
    make_tier()
    manifests = [n for n in bucket_objects("kv/") if n.endswith(MANIFEST_NAME)]
    assert len(manifests) == 1 and bucket_objects("kv/") == first


# -- racing writers ---------------------------------------------------------------------
def test_eight_racing_writers_leave_one_valid_object(
    make_tier: Callable[..., TierDriver],
) -> None:
    barrier = threading.Barrier(8, timeout=30)

    def hold_puts(request: Any, **_: Any) -> None:
        if request.method == "PUT" and request.url.endswith(".kvc"):
            barrier.wait()  # every writer's PUT is in flight before any reaches the server

    writers = [make_tier(hooks=[("before-send.s3", hold_puts)], threads=1) for _ in range(8)]
    key, payload = next(iter(payloads([7]).items()))
    results: list[Any] = [None] * 8

    def write(i: int) -> None:
        results[i] = writers[i].store({key: payload})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.succeeded_keys == (key,) for r in results)
    chunks = {n: b for n, b in bucket_objects("kv/").items() if n.endswith(".kvc")}
    assert len(chunks) == 1
    (blob,) = chunks.values()
    digest = NamespaceIdentity.from_config(offloading_config()).digest
    assert bytes(chunkformat.decode(blob, namespace_digest=digest, key=key)) == payload


# -- capacity ---------------------------------------------------------------------------
def test_capacity_deletes_the_least_recently_used_objects(
    make_tier: Callable[..., TierDriver],
) -> None:
    driver = make_tier(capacity=2 * (chunkformat.HEADER_BYTES + 8192))
    driver.store(payloads([0]))
    driver.store(payloads([1]))
    driver.manager.touch([conformance_key(0)], CTX)
    driver.store(payloads([2]))
    driver.manager.wait_background()
    names = {n.rpartition("/")[2] for n in bucket_objects("kv/") if n.endswith(".kvc")}
    expected = {driver.manager.backend.object_key(conformance_key(i)).rpartition("/")[2]
                for i in (0, 2)}
    assert names == expected
    removed = [k for e in driver.manager.take_events() if e.removed for k in e.keys]
    assert removed == [conformance_key(1)]


def test_a_key_being_deleted_is_not_stored_again_until_the_delete_is_done(
    make_tier: Callable[..., TierDriver],
) -> None:
    release = threading.Event()

    def hold_deletes(request: Any, **_: Any) -> None:
        # Chunk deletes only: the start-up probe of conditional writes deletes its own.
        if request.method == "DELETE" and request.url.endswith(".kvc"):
            release.wait(timeout=30)

    driver = make_tier(hooks=[("before-send.s3", hold_deletes)],
                       capacity=1 * (chunkformat.HEADER_BYTES + 8192))
    driver.store(payloads([0]))
    driver.store(payloads([1]))
    k0, k1, k2 = (conformance_key(i) for i in range(3))
    # "Cannot store now", changing nothing: k1 is not evicted, k2 not reserved.
    assert driver.manager.prepare_store([k0], CTX) is None
    assert driver.manager.prepare_store([k2, k0], CTX) is None
    assert driver.manager.lookup(k1, CTX) is HIT
    assert driver.manager.lookup(k2, CTX) is MISS
    release.set()
    driver.manager.wait_background()
    assert driver.manager.prepare_store([k0], CTX) == [k0]


# -- corruption -------------------------------------------------------------------------
@pytest.mark.parametrize("delete_corrupt", [True, False])
def test_a_flipped_byte_is_a_counted_miss(
    make_tier: Callable[..., TierDriver], delete_corrupt: bool
) -> None:
    driver = make_tier(delete_corrupt=delete_corrupt, codec="none")
    driver.store(payloads([0, 1]))
    client = boto3.client("s3", endpoint_url=os.environ["KVTIERS_TEST_S3"])
    name = driver.manager.backend.object_key(conformance_key(0))
    blob = bytearray(client.get_object(Bucket=BUCKET, Key=name)["Body"].read())
    blob[chunkformat.HEADER_BYTES + 100] ^= 0x01
    client.put_object(Bucket=BUCKET, Key=name, Body=bytes(blob))
    result, data = driver.load([conformance_key(0), conformance_key(1)])
    assert result.failed_keys == (conformance_key(0),)
    assert result.corrupt_keys == (conformance_key(0),)
    assert list(data) == [conformance_key(1)]
    assert data[conformance_key(1)] == payloads([1])[conformance_key(1)]
    assert driver.manager.lookup(conformance_key(0), CTX) is MISS
    assert driver.manager.get_stats()["corrupt_chunks"] == 1
    assert (name in bucket_objects("kv/")) is not delete_corrupt


def test_an_object_of_another_key_is_corrupt(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    driver.store(payloads([0, 1]))
    client = boto3.client("s3", endpoint_url=os.environ["KVTIERS_TEST_S3"])
    names = [driver.manager.backend.object_key(conformance_key(i)) for i in (0, 1)]
    other = client.get_object(Bucket=BUCKET, Key=names[1])["Body"].read()
    client.put_object(Bucket=BUCKET, Key=names[0], Body=other)
    result, data = driver.load([conformance_key(0)])
    assert result.corrupt_keys == (conformance_key(0),) and data == {}


def test_a_vanished_object_is_a_miss_not_corrupt(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    driver.store(payloads([0]))
    client = boto3.client("s3", endpoint_url=os.environ["KVTIERS_TEST_S3"])
    client.delete_object(Bucket=BUCKET, Key=driver.manager.backend.object_key(conformance_key(0)))
    result, data = driver.load([conformance_key(0)])
    assert result.failed_keys == (conformance_key(0),) and result.corrupt_keys == ()
    assert data == {}
    assert driver.manager.lookup(conformance_key(0), CTX) is MISS


# -- shared namespaces ------------------------------------------------------------------
def test_shared_tier_probes_misses_in_the_background(
    make_tier: Callable[..., TierDriver],
) -> None:
    release = threading.Event()

    def hold_heads(request: Any, **_: Any) -> None:
        if request.method == "HEAD" and request.url.endswith(".kvc"):
            release.wait(timeout=30)

    reader = make_tier(shared=True, hooks=[("before-send.s3", hold_heads)])
    writer = make_tier()
    writer.store(payloads([0]))
    manager = reader.manager
    keys = [conformance_key(0), conformance_key(1)]
    assert [manager.lookup(k, CTX) for k in keys] == [RETRY, RETRY]
    assert manager.has_pending_work()
    manager.on_schedule_end(ScheduleEndContext())
    assert [manager.lookup(k, CTX) for k in keys] == [RETRY, RETRY]
    release.set()
    manager.wait_background()
    assert [manager.lookup(k, CTX) for k in keys] == [HIT, MISS]
    assert not manager.has_pending_work()
    assert manager.get_stats()["probes"] == 2
    manager.on_schedule_end(ScheduleEndContext())
    assert manager.lookup(conformance_key(1), CTX) is MISS
    assert manager.get_stats()["probes"] == 2
    _, data = reader.load([conformance_key(0)])
    assert data == payloads([0])


def test_unshared_tier_misses_at_once(make_tier: Callable[..., TierDriver]) -> None:
    reader = make_tier()
    make_tier().store(payloads([0]))
    assert reader.manager.lookup(conformance_key(0), CTX) is MISS
    assert not reader.manager.has_pending_work()


# -- start-up errors --------------------------------------------------------------------
def test_unknown_bucket_is_a_config_error(make_tier: Callable[..., TierDriver]) -> None:
    with pytest.raises(ConfigError, match="'no-such-bucket' does not exist") as info:
        make_tier(bucket="no-such-bucket")
    assert info.value.path == "bucket"


def test_missing_credentials_are_a_config_error(
    make_tier: Callable[..., TierDriver], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="no AWS credentials"):
        make_tier()


def test_unreachable_endpoint_is_a_config_error(make_tier: Callable[..., TierDriver]) -> None:
    with pytest.raises(ConfigError, match="check endpoint_url"):
        make_tier(endpoint_url="http://127.0.0.1:9", max_attempts=1, timeout_s=1.0)


def test_s3_cannot_be_the_primary() -> None:
    config = S3TierConfig(name="s3", bucket=BUCKET)
    with pytest.raises(ConfigError, match="cannot be the first tier"):
        build_tier(config, offloading_config(), primary_region=None, name="s3")


def test_embedded_endpoint_serves_a_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    offloading = offloading_config()
    geometry = ChunkGeometry.from_config(offloading)
    region = BytearrayRegion(2, geometry.slot_bytes)
    config = S3TierConfig(name="s3", bucket="kvtiers-embedded", endpoint_url="embedded")
    tier = build_tier(config, offloading, primary_region=region, name="s3")
    try:
        driver = TierDriver(tier, region, geometry)
        assert driver.store(payloads([0])).success
        assert driver.load([conformance_key(0)])[1] == payloads([0])
        assert "AWS_ACCESS_KEY_ID" not in os.environ
    finally:
        tier.shutdown()
