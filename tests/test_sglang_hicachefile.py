"""The kvtiers backend beside SGLang's own ``HiCacheFile`` on the same calls, and kvtiers'
tools on the namespaces the backend writes.

One scenario runs against both stores: the same pages stored, the same lookups, the same
loads, through the calls both implement (SGLang's generic ``batch_set`` / ``batch_get`` /
``batch_exists``, and ``batch_exists_v2`` with an extra pool). The hits must be equal
call for call, until a stored page is damaged on disk: then HiCacheFile serves the
damaged bytes and kvtiers refuses the page.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtiers.testing.sglang import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorage,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from kvtiers import cli  # noqa: E402
from kvtiers.core.chunkformat import HEADER_BYTES  # noqa: E402
from kvtiers.integrations.sglang import KVTiersHiCacheStorage  # noqa: E402
from kvtiers.testing.sglang import (  # noqa: E402
    MHATokenToKVPoolHost,
    StatePoolHost,
    StorageConfig,
    build_backend,
    page_indices,
    page_keys,
    storage_config,
)

PAGE = 4


def mha() -> MHATokenToKVPoolHost:
    pool = MHATokenToKVPoolHost(pages=32, page_size=PAGE, layers=2, heads=2, head_dim=8)
    pool.fill_random(torch.Generator().manual_seed(7))
    return pool


def file_tier(root: Path) -> list[dict[str, Any]]:
    return [{"kind": "file", "root": str(root)}]


def hicache_file(root: Path, pool: Any, extra_pools: tuple[tuple[str, Any], ...] = ()) -> Any:
    config = storage_config(StorageConfig(
        model_name="org/model", extra_config={"file_storage_path": str(root)}))
    store = HiCacheFile(config)
    store.register_mem_pool_host(pool)
    for name, extra in extra_pools:
        store.register_mem_host_pool_v2(extra, name)
    return store


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[HiCacheStorage, HiCacheStorage, MHATokenToKVPoolHost]]:
    pool = mha()
    theirs = hicache_file(tmp_path / "hicache", pool)
    ours = build_backend(file_tier(tmp_path / "kvtiers"), pool, extra={"interface_v1": 0})
    yield theirs, ours, pool
    ours.close()


def flat(pool: MHATokenToKVPoolHost, page: int) -> torch.Tensor:
    return pool.get_data_page(page * PAGE, flat=True).contiguous()


def loaded(
    store: HiCacheStorage, pool: MHATokenToKVPoolHost, keys: list[str]
) -> list[bytes | None]:
    got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert isinstance(got, list)
    return [None if t is None else bytes(t.view(torch.uint8).numpy()) for t in got]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_the_same_calls_give_the_same_hits_until_a_page_is_damaged(
    tmp_path: Path, pair: tuple[HiCacheStorage, HiCacheStorage, MHATokenToKVPoolHost]
) -> None:
    theirs, ours, pool = pair
    a, b, stray = page_keys(8, "a"), page_keys(3, "b"), page_keys(1, "x")[0]
    originals = [pool.page_bytes(p * PAGE) for p in range(6)]
    lookups = [
        a[:6], a, [stray, *a[:5]], [a[0], a[1], stray, a[3]], b, a[:1], [],
    ]

    def run(store: HiCacheStorage) -> list[object]:
        seen: list[object] = []
        seen.append(store.batch_set(a[:6], [flat(pool, p) for p in range(6)]))
        seen += [store.batch_exists(keys) for keys in lookups]
        seen.append(store.batch_set(b, [flat(pool, p) for p in range(6, 9)]))
        seen += [store.batch_exists(keys) for keys in lookups]
        seen.append([page is not None for page in loaded(store, pool, a)])
        seen.append([store.exists(key) for key in (a[0], a[6], b[2], stray)])
        return seen

    assert run(theirs) == run(ours)
    assert loaded(theirs, pool, a[:6]) == originals == loaded(ours, pool, a[:6])

    # One payload byte of page a[2] flipped in each store.
    (their_file,) = (tmp_path / "hicache").glob(f"{a[2]}*.bin")
    _flip(their_file, 7)
    (our_file,) = (tmp_path / "kvtiers").glob(f"*/*/*/{a[2]}_g0.kvc")
    _flip(our_file, HEADER_BYTES + 7)
    assert theirs.batch_exists(a[:6]) == ours.batch_exists(a[:6]) == 6

    their_pages, our_pages = loaded(theirs, pool, a[:6]), loaded(ours, pool, a[:6])
    assert their_pages[2] is not None and their_pages[2] != originals[2]  # served, wrong
    assert our_pages[2] is None  # refused
    assert [p for i, p in enumerate(our_pages) if i != 2] == originals[:2] + originals[3:]
    assert theirs.batch_exists(a[:6]) == 6 and ours.batch_exists(a[:6]) == 2


@pytest.mark.parametrize("policy", [PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES])
def test_batch_exists_v2_matches_hicachefile(tmp_path: Path, policy: PoolHitPolicy) -> None:
    pool = mha()
    state = StatePoolHost(pages=32, page_size=PAGE, layers=2, state_dim=4)
    state.fill_random(torch.Generator().manual_seed(2))
    extra = (("mamba", state),)
    theirs = hicache_file(tmp_path / "hicache", pool, extra)
    ours = build_backend(file_tier(tmp_path / "kvtiers"), pool, extra_pools=extra)
    try:
        keys = page_keys(6)
        results = []
        for store in (theirs, ours):
            store.batch_set(keys[:5], [
                pool.get_data_page(p * PAGE, flat=True).contiguous() for p in range(5)])
            store.batch_set_v2([PoolTransfer(
                name=PoolName.MAMBA, host_indices=page_indices([1, 3, 4], PAGE),
                keys=[keys[1], keys[3], keys[4]])])
            answers = []
            for queried, window in ((keys, 1), (keys[:4], 1), (keys[:5], 2), (keys[:3], 3)):
                transfer = PoolTransfer(name=PoolName.MAMBA, keys=queried[-window:],
                                        hit_policy=policy)
                result = store.batch_exists_v2(queried, [transfer])
                answers.append((result.kv_hit_pages, dict(result.extra_pool_hit_pages),
                                result.restorable_prefix_pages))
            results.append(answers)
        assert results[0] == results[1]
    finally:
        ours.close()


# -- kvtiers' tools on these namespaces -------------------------------------------------
def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(list(argv))
    return status, out.getvalue()


def test_inspect_verify_diff_and_gc_work_on_the_backend_namespaces(tmp_path: Path) -> None:
    root = tmp_path / "root"
    keys = page_keys(3)
    namespaces = []
    for rank in (0, 1):
        store = build_backend(file_tier(root), mha(), tp_size=2, tp_rank=rank)
        assert store.batch_set_v1(keys, page_indices([0, 1, 2], PAGE)) == [True] * 3
        namespaces += store.namespaces()
        store.close()

    status, text = _cli("inspect", str(root), "--json")
    assert status == 0
    listed = json.loads(text)
    found = {entry["namespace"]: entry for entry in listed["namespaces"]}
    assert set(found) == set(namespaces)
    assert {entry["manifest"]["identity"]["engine"] for entry in found.values()} == {"sglang"}
    assert all(entry["chunks"] == 6 for entry in found.values())

    status, text = _cli("diff", str(root), *namespaces)
    assert status == 1 and "groups" in text  # diff: the identities differ

    assert _cli("verify", str(root))[0] == 0
    (chunk,) = root.glob(f"{namespaces[0]}/*/*/{keys[1]}_g1.kvc")
    _flip(chunk, HEADER_BYTES + 1)
    assert _cli("verify", str(root))[0] == 1
    assert _cli("verify", str(root), "--fix")[0] == 0  # quarantined: fixed
    assert _cli("verify", str(root))[0] == 0
    again = build_backend(file_tier(root), mha(), tp_size=2, tp_rank=0)
    assert isinstance(again, KVTiersHiCacheStorage)
    again.wait_index()
    try:
        assert again.batch_exists(keys) == 1  # the page whose part was quarantined is gone
    finally:
        again.close()

    assert _cli("gc", str(root), "--namespace", namespaces[1])[0] == 0
    status, text = _cli("inspect", str(root), "--json")
    assert [entry["namespace"] for entry in json.loads(text)["namespaces"]] == [namespaces[0]]
