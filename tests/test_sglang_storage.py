"""kvtiers as SGLang HiCache's storage backend, with SGLang 0.5.23's own classes: the
backend factory, ``HiCacheStorageConfig``, ``PoolTransfer`` and the hit policies. The
host pools are the doubles of :mod:`kvtiers.testing.sglang` (SGLang's cannot be imported
on a CPU torch; see there).

What is checked: the ``dynamic`` factory builds the backend; pages round-trip byte-exact
through file and S3 tiers, zero-copy (page-first layouts) and copied (``layer_first``,
a gathered state pool), through the v1, generic and v2 calls; a restart finds every
page; a change of identity is a cold miss; a damaged page is a miss; calls from several
threads at once; per-rank namespaces; the extra config's errors; clear; stats.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtiers.testing.sglang import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvtiers.core.chunkformat import HEADER_BYTES  # noqa: E402
from kvtiers.core.keys import OffloadKey  # noqa: E402
from kvtiers.core.specs import (  # noqa: E402
    CPULoadStoreSpec,
    FileLoadStoreSpec,
    LoadStoreSpec,
)
from kvtiers.errors import ConfigError, UnsupportedVersionError  # noqa: E402
from kvtiers.integrations.sglang import KVTiersHiCacheStorage  # noqa: E402
from kvtiers.integrations.sglang.version import check_sglang_version  # noqa: E402
from kvtiers.testing.s3 import BUCKET, MotoServer  # noqa: E402
from kvtiers.testing.sglang import (  # noqa: E402
    DYNAMIC_EXTRA,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    StatePoolHost,
    StorageConfig,
    build_backend,
    page_indices,
    page_keys,
    storage_config,
)
from kvtiers.tiers.fanout import ChunkCopy, FanOutJob, FanOutMover, plan_chunks  # noqa: E402

PAGE = 4
DYNAMIC = DYNAMIC_EXTRA


def mha(layout: str = "page_first", **kw: Any) -> MHATokenToKVPoolHost:
    pool = MHATokenToKVPoolHost(pages=32, page_size=PAGE, layers=2, heads=2, head_dim=8,
                                layout=layout, **kw)
    pool.fill_random(torch.Generator().manual_seed(7))
    return pool


def backend(tiers: list[dict[str, Any]], pool: Any, **kw: Any) -> KVTiersHiCacheStorage:
    built = build_backend(tiers, pool, **kw)
    assert isinstance(built, KVTiersHiCacheStorage)
    return built


def file_tier(root: Path, **kw: Any) -> list[dict[str, Any]]:
    return [{"kind": "file", "root": str(root), **kw}]


def pages_of(pool: Any, pages: list[int]) -> list[bytes]:
    return [pool.page_bytes(p * pool.page_size) for p in pages]


@pytest.fixture
def s3_tier(s3_endpoint: MotoServer) -> list[dict[str, Any]]:
    return [{"kind": "s3", "bucket": BUCKET, "prefix": "sglang",
             "endpoint_url": s3_endpoint.endpoint_url, "threads": 2}]


# -- the factory and the round trip -------------------------------------------------------
def test_the_dynamic_factory_builds_the_backend(tmp_path: Path) -> None:
    store = backend(file_tier(tmp_path), mha())
    try:
        assert store.namespaces()[0].startswith("org__model-")
    finally:
        store.close()


@pytest.mark.parametrize(
    ("layout", "zero_copy"),
    [("page_first", True), ("page_first_direct", True), ("page_head", True),
     ("layer_first", False)],
)
def test_pages_round_trip_byte_exact_through_a_file_tier(
    tmp_path: Path, layout: str, zero_copy: bool
) -> None:
    pool = mha(layout)
    store = backend(file_tier(tmp_path), pool)
    try:
        assert store._pools["kv"].zero_copy is zero_copy
        keys = page_keys(6)
        want = pages_of(pool, [1, 2, 3, 4, 5, 6])
        assert store.batch_set_v1(keys, page_indices([1, 2, 3, 4, 5, 6], PAGE)) == [True] * 6
        assert store.batch_exists(keys) == 6
        pool.zero()
        assert store.batch_get_v1(keys, page_indices([9, 10, 11, 12, 13, 14], PAGE)) == [True] * 6
        assert pages_of(pool, [9, 10, 11, 12, 13, 14]) == want
    finally:
        store.close()


def test_zero_copy_parts_are_views_of_the_host_pool(tmp_path: Path) -> None:
    """A page-first page's parts are the pool's own memory: a load lands in the pool's
    tensor itself, and a store reads it there."""
    pool = mha()
    store = backend(file_tier(tmp_path), pool)
    try:
        registered = store._pools["kv"]
        views = registered.memory_views(page_indices([3], PAGE), 1)[0]
        assert [len(v) for v in views] == list(registered.part_bytes) and len(views) == 2
        views[0][0] = 0xAB
        assert pool.kv_buffer[0, 3 * PAGE].view(torch.uint8).flatten()[0] == 0xAB
    finally:
        store.close()


def test_mla_pages_round_trip_in_one_part(tmp_path: Path) -> None:
    pool = MLATokenToKVPoolHost(pages=16, page_size=PAGE, layers=3, kv_cache_dim=24)
    pool.fill_random(torch.Generator().manual_seed(3))
    store = backend(file_tier(tmp_path), pool, is_mla_model=True)
    try:
        assert store._pools["kv"].parts == 1 and store._pools["kv"].zero_copy
        keys = page_keys(3)
        want = pages_of(pool, [1, 2, 3])
        assert store.batch_set_v1(keys, page_indices([1, 2, 3], PAGE)) == [True] * 3
        pool.zero()
        assert store.batch_get_v1(keys, page_indices([4, 5, 6], PAGE)) == [True] * 3
        assert pages_of(pool, [4, 5, 6]) == want
    finally:
        store.close()


def test_pages_round_trip_through_s3(tmp_path: Path, s3_tier: list[dict[str, Any]]) -> None:
    pool = mha()
    store = backend(s3_tier, pool)
    keys = page_keys(5)
    want = pages_of(pool, [0, 1, 2, 3, 4])
    try:
        assert store.batch_set_v1(keys, page_indices([0, 1, 2, 3, 4], PAGE)) == [True] * 5
    finally:
        store.close()
    # A restart over the bucket: the index is rebuilt from its listing.
    pool.zero()
    again = backend(s3_tier, pool)
    again.wait_index()
    try:
        assert again.batch_exists(keys) == 5
        assert again.batch_get_v1(keys, page_indices([5, 6, 7, 8, 9], PAGE)) == [True] * 5
        assert pages_of(pool, [5, 6, 7, 8, 9]) == want
    finally:
        again.close()


def test_a_file_tier_above_s3_serves_what_either_holds(
    tmp_path: Path, s3_tier: list[dict[str, Any]]
) -> None:
    pool = mha()
    keys = page_keys(4)
    want = pages_of(pool, [0, 1, 2, 3])
    only_s3 = backend(s3_tier, pool)
    try:
        assert only_s3.batch_set_v1(keys[2:], page_indices([2, 3], PAGE)) == [True, True]
    finally:
        only_s3.close()
    store = backend(file_tier(tmp_path) + s3_tier, pool)
    store.wait_index()
    try:
        assert store.batch_set_v1(keys[:2], page_indices([0, 1], PAGE)) == [True, True]
        assert store.batch_exists(keys) == 4
        pool.zero()
        assert store.batch_get_v1(keys, page_indices([4, 5, 6, 7], PAGE)) == [True] * 4
        assert pages_of(pool, [4, 5, 6, 7]) == want
        stats = store.kvtiers_stats()
        assert stats["file.chunks"] == 4 and stats["s3.chunks"] == 8
    finally:
        store.close()


def test_the_generic_path_stores_what_the_zero_copy_path_loads(tmp_path: Path) -> None:
    """SGLang without ``interface_v1`` calls batch_set/batch_get with flat pages; their
    chunks are the zero-copy parts, so either path reads what the other wrote."""
    pool = mha()
    store = backend(file_tier(tmp_path), pool)
    try:
        keys = page_keys(3)
        want = pages_of(pool, [0, 1, 2])
        values = [pool.get_data_page(p * PAGE, flat=True).contiguous() for p in (0, 1, 2)]
        assert store.batch_set(keys, values) is True
        pool.zero()
        assert store.batch_get_v1(keys, page_indices([3, 4, 5], PAGE)) == [True] * 3
        assert pages_of(pool, [3, 4, 5]) == want
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        got = store.batch_get(
            keys + page_keys(1, "missing"), [*targets, pool.get_dummy_flat_data_page()])
        assert got[3] is None
        assert [bytes(t.view(torch.uint8).numpy()) for t in got[:3] if t is not None] == want
        assert store.exists(keys[0]) and not store.exists(page_keys(1, "missing")[0])
        assert store.get(keys[1], pool.get_dummy_flat_data_page()) is not None
        assert store.set(page_keys(1, "one")[0], values[0]) is True
    finally:
        store.close()


# -- restart, identity, damage ------------------------------------------------------------
def test_a_restart_finds_every_page(tmp_path: Path) -> None:
    pool = mha()
    keys = page_keys(20)
    want = pages_of(pool, list(range(20)))
    first = backend(file_tier(tmp_path), pool)
    assert first.batch_set_v1(keys, page_indices(list(range(20)), PAGE)) == [True] * 20
    first.close()
    fresh = mha()
    fresh.zero()
    second = backend(file_tier(tmp_path), fresh)
    second.wait_index()
    try:
        assert second.batch_exists(keys) == 20
        assert second.batch_get_v1(keys, page_indices(list(range(20)), PAGE)) == [True] * 20
        assert pages_of(fresh, list(range(20))) == want
    finally:
        second.close()


@pytest.mark.parametrize(
    "change",
    [
        {"model": "org/other-model"},
        {"pool": {"dtype": torch.float16}},  # same bytes per page, other dtype
        {"pool": {"layout": "page_first_direct"}},
        {"tp_size": 2},
        {"extra": {"kvtiers_salt": "tenant-b"}},
        {"extra": {"model_revision": "0123456789abcdef0123456789abcdef01234567"}},
    ],
    ids=["model", "dtype", "layout", "tp_size", "salt", "revision"],
)
def test_a_config_change_is_a_cold_miss(tmp_path: Path, change: dict[str, Any]) -> None:
    keys = page_keys(4)
    first = backend(file_tier(tmp_path), mha())
    assert first.batch_set_v1(keys, page_indices([0, 1, 2, 3], PAGE)) == [True] * 4
    before = first.namespaces()
    first.close()
    options = dict(change)
    pool = mha(**options.pop("pool", {}))
    other = backend(file_tier(tmp_path), pool, **options)
    try:
        assert other.batch_exists(keys) == 0
        assert other.namespaces() != before
    finally:
        other.close()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_page_is_a_miss_and_quarantined(tmp_path: Path) -> None:
    pool = mha()
    store = backend(file_tier(tmp_path), pool)
    try:
        keys = page_keys(4)
        assert store.batch_set_v1(keys, page_indices([0, 1, 2, 3], PAGE)) == [True] * 4
        (chunk,) = tmp_path.glob(f"*/*/*/{keys[2]}_g1.kvc")
        _flip(chunk, HEADER_BYTES + 5)
        got = store.batch_get_v1(keys, page_indices([4, 5, 6, 7], PAGE))
        assert got == [True, True, False, True]
        assert store.batch_exists(keys) == 2
        assert list(tmp_path.glob("*/quarantine/*"))
        assert store.kvtiers_stats()["file.corrupt_chunks"] == 1
    finally:
        store.close()


# -- threads -------------------------------------------------------------------------------
def test_calls_from_several_threads_at_once_all_end_with_the_right_bytes(
    tmp_path: Path,
) -> None:
    """Prefetch, backup and scheduler threads call at once: each waits for its own jobs
    only, and every page round-trips."""
    pool = MHATokenToKVPoolHost(pages=96, page_size=PAGE, layers=2, heads=2, head_dim=8)
    pool.fill_random(torch.Generator().manual_seed(11))
    store = backend(file_tier(tmp_path, threads=2), pool)
    groups = [page_keys(8, f"t{t}") for t in range(3)]
    want = [pages_of(pool, list(range(8 * t, 8 * t + 8))) for t in range(3)]
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                own = list(range(8 * t, 8 * t + 8))
                assert store.batch_set_v1(groups[t], page_indices(own, PAGE)) == [True] * 8
                assert store.batch_exists(groups[t]) == 8
                into = [48 + p for p in own]
                assert store.batch_get_v1(groups[t], page_indices(into, PAGE)) == [True] * 8
                assert pages_of(pool, into) == want[t]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads)
        assert not errors, errors
    finally:
        store.close()


def test_wait_job_waits_for_one_job_only() -> None:
    """FanOutMover.wait_job returns once its job ended while another is still running,
    and at once for a job never accepted."""
    gates = {1: threading.Event(), 2: threading.Event()}

    class Gated(FanOutMover[FanOutJob]):
        def _plan(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec) -> FanOutJob:
            assert isinstance(src, CPULoadStoreSpec) and isinstance(dst, FileLoadStoreSpec)
            return FanOutJob(job_id, True, plan_chunks(src.slot_ids, dst.keys, dst.paths))

        def _start_task(self, task: Callable[[], None]) -> None:
            threading.Thread(target=task, daemon=True).start()

        def _copy(self, job: FanOutJob, chunk: ChunkCopy) -> int:
            assert gates[job.job_id].wait(30)
            return 1

    mover = Gated("gated")
    key = OffloadKey(bytes(36))
    for job_id in (1, 2):
        mover.submit(job_id, CPULoadStoreSpec([job_id]), FileLoadStoreSpec(["x"], [key]))
    gates[2].set()
    assert mover.wait_job(2, 30) is True
    assert mover.wait_job(1, 0.05) is False  # its gate is shut: still in flight
    assert mover.wait_job(99, 0) is True
    gates[1].set()
    assert mover.wait_job(1, 30) is True
    assert sorted(r.job_id for r in mover.get_finished()) == [1, 2]


# -- ranks ----------------------------------------------------------------------------------
def test_each_tp_rank_has_its_own_namespace_and_mla_ranks_share_one(tmp_path: Path) -> None:
    ranks = [backend(file_tier(tmp_path), mha(), tp_size=2, tp_rank=r) for r in (0, 1)]
    try:
        assert ranks[0].namespaces() != ranks[1].namespaces()
    finally:
        for rank in ranks:
            rank.close()
    mla = [
        MLATokenToKVPoolHost(pages=16, page_size=PAGE, layers=2, kv_cache_dim=16)
        for _ in (0, 1)
    ]
    mla[0].fill_random(torch.Generator().manual_seed(5))
    keys = page_keys(3)
    want = pages_of(mla[0], [0, 1, 2])
    writer = backend(file_tier(tmp_path / "mla"), mla[0], is_mla_model=True, tp_size=2, tp_rank=0)
    reader = backend(file_tier(tmp_path / "mla"), mla[1], is_mla_model=True, tp_size=2, tp_rank=1)
    try:
        assert writer.namespaces() == reader.namespaces()
        assert writer.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        # The reader never stores (SGLang skips its backups; a call is refused).
        assert reader.batch_set_v1(page_keys(1, "r"), page_indices([5], PAGE)) == [False]
        # It finds what the writer stored after it started by a probe: the first query
        # starts it, a later one sees the page.
        first = reader.batch_exists(keys)
        reader._build()[0].tiers[0].built.manager.wait_probes()
        assert first == 0 and reader.batch_exists(keys) == 3
        assert reader.batch_get_v1(keys, page_indices([4, 5, 6], PAGE)) == [True] * 3
        assert pages_of(mla[1], [4, 5, 6]) == want
    finally:
        writer.close()
        reader.close()


# -- hybrid models: v2 ---------------------------------------------------------------------
def test_extra_pools_round_trip_through_the_v2_calls(tmp_path: Path) -> None:
    pool = mha()
    state = StatePoolHost(pages=32, page_size=PAGE, layers=2, state_dim=6)
    state.fill_random(torch.Generator().manual_seed(9))
    store = backend(file_tier(tmp_path), pool, extra_pools=(("mamba", state),))
    try:
        assert not store._pools["mamba"].zero_copy
        keys = page_keys(3)
        assert store.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        want = pages_of(state, [2])
        put = PoolTransfer(name=PoolName.MAMBA, host_indices=page_indices([2], PAGE),
                           keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)
        assert store.batch_set_v2([put]) == {PoolName.MAMBA: [True]}
        result = store.batch_exists_v2(keys, [put])
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (3, [3])
        state.zero()
        get = PoolTransfer(name=PoolName.MAMBA, host_indices=page_indices([7], PAGE),
                           keys=keys[2:])
        assert store.batch_get_v2([get]) == {PoolName.MAMBA: [True]}
        assert pages_of(state, [7]) == want
    finally:
        store.close()


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"kvtiers_cofig": "x.yaml"}, "hicache_storage_backend_extra_config.kvtiers_cofig"),
        ({}, "hicache_storage_backend_extra_config.kvtiers_config"),
        ({"kvtiers_config": {"tiers": [{"kind": "cpu", "capacity": "1GiB"}]}},
         "hicache_storage_backend_extra_config.kvtiers_config.tiers[0].kind"),
        ({"kvtiers_config": {"tiers": [{"kind": "file", "root": "/tmp/x", "write": "back"}]}},
         "hicache_storage_backend_extra_config.kvtiers_config.tiers[0].write"),
        ({"kvtiers_config": {"tiers": [{"kind": "file", "root": "/tmp/x", "capacity": 8}]}},
         "hicache_storage_backend_extra_config.kvtiers_config.tiers[0].capacity"),
        ({"kvtiers_salt": 3, "kvtiers_config": {"tiers": []}},
         "hicache_storage_backend_extra_config.kvtiers_salt"),
    ],
    ids=["misspelt-key", "no-stack", "cpu-tier", "write-back", "bare-capacity", "salt-type"],
)
def test_a_bad_extra_config_is_one_line_naming_the_key(
    extra: dict[str, Any], path: str
) -> None:
    config = storage_config(StorageConfig(model_name="m", extra_config={**DYNAMIC, **extra}))
    with pytest.raises(ConfigError) as raised:
        StorageBackendFactory.create_backend("dynamic", config, mha())
    assert raised.value.path == path
    assert "\n" not in str(raised.value)


def test_a_stack_file_error_names_its_file_and_line(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("tiers:\n  - kind: file\n    root: /tmp/x\n    threads: 0\n")
    config = storage_config(StorageConfig(
        model_name="m", extra_config={**DYNAMIC, "kvtiers_config": str(stack)}))
    with pytest.raises(ConfigError) as raised:
        StorageBackendFactory.create_backend("dynamic", config, mha())
    assert raised.value.source == f"{stack}:4" and raised.value.path == "tiers[0].threads"


def test_another_sglang_release_is_refused_in_one_line() -> None:
    assert check_sglang_version("0.5.23") == "0.5.23"
    with pytest.raises(UnsupportedVersionError, match=r"supports SGLang ==0\.5\.23"):
        check_sglang_version("0.5.22")


# -- the rest --------------------------------------------------------------------------------
def test_clear_deletes_every_page(tmp_path: Path) -> None:
    store = backend(file_tier(tmp_path), mha())
    try:
        keys = page_keys(3)
        assert store.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        store.clear()
        assert store.batch_exists(keys) == 0
        store._build()[0].tiers[0].built.manager.wait_deletions()
        assert not list(tmp_path.glob("*/*/*/*.kvc"))
    finally:
        store.close()


def test_get_stats_gives_sglang_its_storage_metrics(tmp_path: Path) -> None:
    store = backend(file_tier(tmp_path), mha(), enable_storage_metrics=True)
    try:
        keys = page_keys(2)
        store.batch_set_v1(keys, page_indices([0, 1], PAGE))
        store.batch_get_v1(keys, page_indices([2, 3], PAGE))
        metrics = store.get_stats()
        assert (metrics.prefetch_pgs, metrics.backup_pgs) == ([2], [2])
        assert store.get_stats().prefetch_pgs == []
        stats = store.kvtiers_stats()
        assert (stats["loaded_pages"], stats["stored_pages"]) == (2, 2)
    finally:
        store.close()


def test_pages_already_stored_are_not_written_again(tmp_path: Path) -> None:
    store = backend(file_tier(tmp_path), mha())
    try:
        keys = page_keys(4)
        assert store.batch_set_v1(keys, page_indices([0, 1, 2, 3], PAGE)) == [True] * 4
        before = store.kvtiers_stats()["file.stores"]
        assert store.batch_set_v1(keys, page_indices([4, 5, 6, 7], PAGE)) == [True] * 4
        assert store.kvtiers_stats()["file.stores"] == before == 8
    finally:
        store.close()


def test_a_tier_that_cannot_take_a_page_stores_nothing_visible(tmp_path: Path) -> None:
    """A capacity below one chunk's blob: every store is refused, reported not stored,
    and nothing is found afterwards."""
    store = backend(file_tier(tmp_path, capacity="4KiB"), mha())
    try:
        keys = page_keys(2)
        assert store.batch_set_v1(keys, page_indices([0, 1], PAGE)) == [False, False]
        assert store.batch_exists(keys) == 0
        assert not list(tmp_path.glob("*/*/*/*.kvc"))
    finally:
        store.close()


def test_an_fsspec_tier_round_trips(tmp_path: Path) -> None:
    pool = mha()
    store = backend([{"kind": "fsspec", "url": f"memory://{tmp_path.name}"}], pool)
    try:
        keys = page_keys(3)
        want = pages_of(pool, [0, 1, 2])
        assert store.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        pool.zero()
        assert store.batch_get_v1(keys, page_indices([3, 4, 5], PAGE)) == [True] * 3
        assert pages_of(pool, [3, 4, 5]) == want
    finally:
        store.close()


def test_mla_layer_first_pages_are_copied_and_round_trip(tmp_path: Path) -> None:
    pool = MLATokenToKVPoolHost(pages=16, page_size=PAGE, layers=3, kv_cache_dim=8,
                                layout="layer_first")
    pool.fill_random(torch.Generator().manual_seed(4))
    store = backend(file_tier(tmp_path), pool, is_mla_model=True)
    try:
        assert not store._pools["kv"].zero_copy
        keys = page_keys(2)
        want = pages_of(pool, [0, 1])
        assert store.batch_set_v1(keys, page_indices([0, 1], PAGE)) == [True, True]
        pool.zero()
        assert store.batch_get_v1(keys, page_indices([2, 3], PAGE)) == [True, True]
        assert pages_of(pool, [2, 3]) == want
    finally:
        store.close()


def test_keys_that_are_not_sha256_hex_are_hashed() -> None:
    from kvtiers.integrations.sglang.storage import page_hash

    digest = page_keys(1)[0]
    assert page_hash(digest) == bytes.fromhex(digest)
    assert page_hash("page-7") == hashlib.sha256(b"page-7").digest()
    assert page_hash("zz" * 32) == hashlib.sha256(("zz" * 32).encode()).digest()


def test_a_pool_registered_after_the_tiers_were_built_is_a_miss(tmp_path: Path) -> None:
    pool = mha()
    store = backend(file_tier(tmp_path), pool)
    try:
        late = StatePoolHost(pages=8, page_size=PAGE, layers=1, state_dim=4)
        store.register_mem_host_pool_v2(late, "mamba")
        transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=page_indices([0], PAGE),
                                keys=page_keys(1))
        assert store.batch_set_v2([transfer]) == {PoolName.MAMBA: [False]}
        assert store.batch_get_v2([transfer]) == {PoolName.MAMBA: [False]}
    finally:
        store.close()


class _Args:
    """SGLang's server arguments, as far as the identity reads them."""

    def __init__(self, **values: Any) -> None:
        self.model_path = "org/model"
        self.revision: str | None = None
        self.kv_cache_dtype = "auto"
        self.dtype = "auto"
        self.quantization: str | None = None
        self.json_model_override_args = "{}"
        self.speculative_algorithm: str | None = None
        self.__dict__.update(values)


@pytest.mark.parametrize(
    "values",
    [{"kv_cache_dtype": "fp8_e5m2"}, {"quantization": "awq"}, {"dtype": "float16"},
     {"json_model_override_args": '{"rope_scaling": {"factor": 4}}'},
     {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "org/draft"},
     {"revision": "0123456789abcdef0123456789abcdef01234567"}],
    ids=["kv-dtype", "quantization", "dtype", "overrides", "draft", "revision"],
)
def test_server_arguments_that_change_the_bytes_change_the_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, values: dict[str, Any]
) -> None:
    from kvtiers.integrations.sglang import storage

    monkeypatch.setattr(storage, "engine_args", lambda: _Args(kv_cache_dtype="fp8_e4m3"))
    base = backend(file_tier(tmp_path), mha())
    base.close()
    changed = {"kv_cache_dtype": "fp8_e4m3", **values}
    monkeypatch.setattr(storage, "engine_args", lambda: _Args(**changed))
    other = backend(file_tier(tmp_path), mha())
    other.close()
    assert base.namespaces() != other.namespaces()


def test_a_revision_that_disagrees_with_sglangs_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtiers.integrations.sglang import storage

    monkeypatch.setattr(storage, "engine_args", lambda: _Args(revision="a" * 40))
    with pytest.raises(ConfigError, match="disagrees with SGLang's --revision"):
        backend(file_tier(tmp_path), mha(), extra={"model_revision": "b" * 40})


def test_layer_names_carry_the_stage_and_packed_draft_layers(tmp_path: Path) -> None:
    pool = MHATokenToKVPoolHost(pages=8, page_size=PAGE, layers=3, heads=1, head_dim=8,
                                start_layer=4)
    pool.end_layer = 6  # a stage of layers 4-5 with one draft layer packed after them
    store = backend(file_tier(tmp_path), pool, pp_size=2, pp_rank=1)
    try:
        names = store._build()[0].identity.config.groups[1].layer_names
        assert names == ("kv.part1of2.layer4@pp1of2", "kv.part1of2.layer5@pp1of2",
                         "kv.part1of2.draft0@pp1of2")
    finally:
        store.close()


def test_a_file_tier_capacity_holds_under_sglangs_stores(tmp_path: Path) -> None:
    """Room for 8 chunks (4 pages of 2 parts): storing 8 pages keeps the 4 newest, and the
    tier stays within its capacity."""
    # A header and one part: tokens x layers x heads x head dim x 2 bytes (bf16).
    blob = HEADER_BYTES + PAGE * 2 * 2 * 8 * 2
    store = backend(file_tier(tmp_path, capacity=8 * blob), mha())
    try:
        keys = page_keys(8)
        for i, key in enumerate(keys):
            assert store.batch_set_v1([key], page_indices([i], PAGE)) == [True]
        assert [store.exists(key) for key in keys] == [False] * 4 + [True] * 4
        stats = store.kvtiers_stats()
        assert stats["file.usage_bytes"] <= 8 * blob and stats["file.evictions"] == 8
    finally:
        store.close()


def test_clear_deletes_every_object_of_an_s3_tier(
    tmp_path: Path, s3_tier: list[dict[str, Any]]
) -> None:
    store = backend(s3_tier, mha())
    keys = page_keys(3)
    try:
        assert store.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        store.clear()
        assert store.batch_exists(keys) == 0
        store._build()[0].tiers[0].built.manager.wait_background()
    finally:
        store.close()
    again = backend(s3_tier, mha())
    try:
        assert again.batch_exists(keys) == 0  # gone from the bucket, not only the index
    finally:
        again.close()


def test_a_load_from_an_s3_server_that_fails_every_request_ends_as_a_miss(
    s3_endpoint: MotoServer,
) -> None:
    """Every GET reset: the load's chunks fail once their attempts run out, the call
    returns (no page is reported loaded), and the pages are misses while they back off;
    a flipped bit in transit is refused the same way."""
    from urllib.parse import urlsplit

    from tests.s3_fault_proxy import FaultProxy

    upstream = urlsplit(s3_endpoint.endpoint_url)
    assert upstream.hostname is not None and upstream.port is not None
    proxy = FaultProxy(upstream.hostname, upstream.port)
    tier = [{"kind": "s3", "bucket": BUCKET, "prefix": "faults", "threads": 2,
             "endpoint_url": proxy.endpoint_url, "max_attempts": 2, "backoff_base_s": 0.001,
             "backoff_max_s": 0.002, "op_deadline_s": 5.0}]
    pool = mha()
    store = backend(tier, pool)
    try:
        keys = page_keys(3)
        assert store.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        # Chunk reads only (".kvc"): the tier's background listing is a GET too, and one
        # that took a fault meant for the chunks left a read of the page unharmed.
        proxy.arm("reset", 100, "GET", ".kvc")
        assert store.batch_get_v1(keys, page_indices([3, 4, 5], PAGE)) == [False] * 3
        assert store.batch_exists(keys) == 0  # backing off: a miss, not a hang
        assert store.kvtiers_stats()["s3.load_failures"] == 6
        proxy.clear()
        flipped = page_keys(1, "flip")
        assert store.batch_set_v1(flipped, page_indices([6], PAGE)) == [True]
        proxy.arm("flip", 4, "GET", ".kvc")  # every read of the page, and its re-read
        assert store.batch_get_v1(flipped, page_indices([7], PAGE)) == [False]
    finally:
        store.close()
        proxy.close()
