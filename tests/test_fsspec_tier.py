"""The fsspec tier end to end on memory:// and file://: factory, reopen, identity,
corruption, racing writers, listing details and configuration errors."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.config.tiers import FsspecTierConfig
from kvtiers.core import chunkformat
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError, NamespaceMismatchError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
from kvtiers.tiers.fsspec.factory import build_tier
from kvtiers.tiers.fsspec.store import FsspecStore

CTX = ReqContext("test")


@pytest.fixture(params=["memory", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://kvtiers-{uuid.uuid4().hex}/cache"
    return f"file://{tmp_path}/cache"


@pytest.fixture
def make_tier(url: str) -> Iterator[Callable[..., TierDriver]]:
    built: list[BuiltTier] = []

    def make(offloading: Any = None, **fields: Any) -> TierDriver:
        offloading = offloading or offloading_config()
        geometry = ChunkGeometry.from_config(offloading)
        region = BytearrayRegion(8, geometry.slot_bytes)
        config = FsspecTierConfig(**{"name": "f", "url": url, "threads": 4, **fields})
        tier = build_tier(config, offloading, primary_region=region, name="f")
        built.append(tier)
        return TierDriver(tier, region, geometry)

    yield make
    for tier in built:
        tier.shutdown()


def payloads(ids: range | list[int]) -> dict[OffloadKey, bytes]:
    return {conformance_key(i): conformance_payload(i, 8192) for i in ids}


def test_chunks_round_trip_and_survive_reopen(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    assert driver.store(payloads(range(3))).success
    reopened = make_tier()
    assert reopened.manager.get_stats()["chunks"] == 3
    result, data = reopened.load([conformance_key(i) for i in range(3)])
    assert result.success and data == payloads(range(3))


def test_identity_change_sees_zero_hits(make_tier: Callable[..., TierDriver]) -> None:
    make_tier().store(payloads(range(2)))
    other = make_tier(offloading_config(salt="other"))
    assert [other.manager.lookup(conformance_key(i), CTX) for i in range(2)] == [
        LookupResult.MISS
    ] * 2


def test_tampered_manifest_fails_closed(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    store = driver.manager.backend.store
    name = driver.manager.backend.manifest_name
    store.fs.pipe_file(store._path(name), b'{"identity": {}}')
    with pytest.raises(NamespaceMismatchError):
        make_tier()


def test_flipped_byte_is_a_counted_miss_and_deleted(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    driver.store(payloads([0]))
    store = driver.manager.backend.store
    path = store._path(driver.manager.backend.object_key(conformance_key(0)))
    blob = bytearray(store.fs.cat_file(path))
    blob[-1] ^= 0x80
    store.fs.pipe_file(path, bytes(blob))
    result, data = driver.load([conformance_key(0)])
    assert result.corrupt_keys == (conformance_key(0),) and data == {}
    assert driver.manager.get_stats()["corrupt_chunks"] == 1
    assert not store.fs.exists(path)
    assert driver.manager.lookup(conformance_key(0), CTX) is LookupResult.MISS


# -- capacity ---------------------------------------------------------------------------
CHUNK_BYTES = chunkformat.HEADER_BYTES + 8192


def removed_keys(driver: TierDriver) -> list[OffloadKey]:
    return [k for e in driver.manager.take_events() if e.removed for k in e.keys]


def test_a_store_never_evicts_a_present_key_of_its_own_batch(
    make_tier: Callable[..., TierDriver],
) -> None:
    driver = make_tier(capacity=2 * CHUNK_BYTES)
    driver.store(payloads([0]))
    driver.store(payloads([1]))
    k0, k1, k2 = (conformance_key(i) for i in range(3))
    assert driver.manager.prepare_store([k0, k2], CTX) == [k2]
    assert removed_keys(driver) == [k1]
    assert driver.manager.lookup(k0, CTX) is LookupResult.HIT


def test_probe_hits_are_held_within_capacity(make_tier: Callable[..., TierDriver]) -> None:
    from kvtiers.core.manager import ScheduleEndContext

    reader = make_tier(shared=True, capacity=2 * CHUNK_BYTES)
    reader.store(payloads([0]))
    make_tier().store(payloads([1, 2]))
    manager = reader.manager
    for i in (1, 2):
        assert manager.lookup(conformance_key(i), CTX) is LookupResult.RETRY
        manager.on_schedule_end(ScheduleEndContext())
        manager.wait_background()
        assert manager.lookup(conformance_key(i), CTX) is LookupResult.HIT
    assert manager.get_stats()["usage_bytes"] <= 2 * CHUNK_BYTES
    assert removed_keys(reader) == [conformance_key(0)]
    manager.wait_background()
    store = manager.backend.store
    assert store.head(manager.backend.object_key(conformance_key(0))) is None


def test_racing_writers_leave_one_valid_object(url: str) -> None:
    store = FsspecStore(url)
    digest = NamespaceIdentity.from_config(offloading_config()).digest
    key = conformance_key(3)
    barrier = threading.Barrier(8, timeout=30)
    created: list[bool] = []
    lock = threading.Lock()

    def write(i: int) -> None:
        blob = chunkformat.encode(digest, key, conformance_payload(3, 8192))
        barrier.wait()
        won = store.put_if_absent("race/chunk.kvc", [blob])
        with lock:
            created.append(won)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(created) == 8 and any(created)
    if url.startswith("file://"):
        assert created.count(True) == 1  # the publish helper never clobbers
    (info,) = list(store.list("race/"))
    blob = store.fs.cat_file(store._path(info.name))
    assert bytes(chunkformat.decode(blob, namespace_digest=digest, key=key)) == (
        conformance_payload(3, 8192)
    )


def test_listing_ignores_strays_and_reports_sizes(make_tier: Callable[..., TierDriver]) -> None:
    driver = make_tier()
    driver.store(payloads([0]))
    store = driver.manager.backend.store
    namespace = driver.manager.backend.namespace_prefix
    store.put_if_absent(f"{namespace}/00/00/stray.txt", [b"x"])
    store.put_if_absent(f"{namespace}/ff/ff/{conformance_key(0)[:-4].hex()}_g0.kvc", [b"y"])
    sizes = {i.name: i.size for i in store.list(namespace + "/")}
    assert sizes[driver.manager.backend.object_key(conformance_key(0))] == (
        chunkformat.HEADER_BYTES + 8192
    )
    assert make_tier().manager.get_stats()["chunks"] == 1


def test_fsspec_cannot_be_the_primary() -> None:
    config = FsspecTierConfig(name="f", url="memory://x")
    with pytest.raises(ConfigError, match="cannot be the first tier"):
        build_tier(config, offloading_config(), primary_region=None, name="f")


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot open 'nosuchproto://x'"):
        FsspecStore("nosuchproto://x")


@pytest.mark.parametrize("bare", ["memory://", "memory:///", "file:///", "file://"])
def test_a_url_without_a_path_is_a_config_error(bare: str) -> None:
    with pytest.raises(ConfigError, match="names no directory") as info:
        FsspecStore(bare)
    assert info.value.path == "url"


@pytest.mark.parametrize("url", [f"memory://kvtiers-{uuid.uuid4().hex}"])
def test_a_one_level_memory_url_survives_reopen(make_tier: Callable[..., TierDriver]) -> None:
    make_tier().store(payloads([0, 1]))
    reopened = make_tier()
    assert reopened.manager.get_stats()["chunks"] == 2
    assert reopened.load([conformance_key(0), conformance_key(1)])[1] == payloads([0, 1])


def test_negative_probe_answers_expire() -> None:
    from kvtiers.core.manager import ScheduleEndContext
    from kvtiers.tiers.object import ObjectBackend, ObjectTierManager

    now = [0.0]
    store = FsspecStore(f"memory://kvtiers-{uuid.uuid4().hex}")
    backend = ObjectBackend(store, NamespaceIdentity.from_config(offloading_config()))
    manager = ObjectTierManager(backend, max_chunk_bytes=8192, shared=True,
                                negative_ttl_s=5.0, clock=lambda: now[0])
    key = conformance_key(0)
    try:
        assert manager.lookup(key, CTX) is LookupResult.RETRY
        manager.on_schedule_end(ScheduleEndContext())
        manager.wait_background()
        assert manager.lookup(key, CTX) is LookupResult.MISS
        now[0] = 4.9
        assert manager.lookup(key, CTX) is LookupResult.MISS
        now[0] = 5.0
        assert manager.lookup(key, CTX) is LookupResult.RETRY
        assert manager.get_stats()["probes"] == 1
    finally:
        manager.shutdown()


def test_a_local_store_removes_stale_temps_at_start(tmp_path: Path) -> None:
    from kvtiers.tiers.fsspec.store import STALE_TEMP_AGE_S, FsspecStore

    nested = tmp_path / "ns" / "ab"
    nested.mkdir(parents=True)
    stale = nested / ".x.kvc.0123.kvtmp"
    fresh = nested / ".y.kvc.4567.kvtmp"
    chunk = nested / "ab12_g0.kvc"
    for path in (stale, fresh, chunk):
        path.write_bytes(b"data")
    old = time.time() - 2 * STALE_TEMP_AGE_S
    os.utime(stale, (old, old))
    os.utime(chunk, (old, old))
    FsspecStore(f"file://{tmp_path}").close()
    assert not stale.exists()
    assert fresh.exists() and chunk.exists()
