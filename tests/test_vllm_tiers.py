"""KVTiersFileTier and KVTiersS3Tier driven through vLLM's secondary-tier API (each
supported release: 0.32, 0.33, 0.34).

Tiers are built by vLLM's own ``SecondaryTierFactory`` from a ``secondary_tiers`` entry,
over a primary memoryview shaped like vLLM's CPU tier's (``(num_chunks, row_bytes)``).
Jobs go in as vLLM ``TransferJob``s and come out as ``JobResult``s; ``drain_jobs`` is the
synchronisation point, as in vLLM's ``reset_cache``.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtiers.errors import ConfigError, UnknownKeyError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.integrations.vllm import KVTiersFileTier, KVTiersS3Tier
from kvtiers.integrations.vllm.compat import EVENT_CARRIES_REQ_CONTEXT, JOB_RESULT_DEFERS_RELEASE
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers.file.manager import FileTierManager
from tests.test_vllm_tiering import BlockedLoads

F = 2
WORKER_BYTES_PER_BLOCK = 1000
CHUNK_BYTES = WORKER_BYTES_PER_BLOCK * F  # what vLLM's CPU chunk holds for one worker
ROW_BYTES = 4096  # the chunk row, aligned, as vLLM's shared region lays it out
NUM_CHUNKS = 16


class _Spec(vbase.OffloadingSpec):
    """The smallest vLLM spec: the tiers only read its ``config``."""

    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError


def make_spec() -> _Spec:
    return _Spec(
        OffloadingConfig(
            groups=(
                OffloadingGroupConfig(tokens_per_block=16, layer_names=("a",), group_id=0),
                OffloadingGroupConfig(tokens_per_block=32, layer_names=("b",), group_id=3),
            ),
            worker_kv_bytes_per_block=WORKER_BYTES_PER_BLOCK,
            enable_kv_cache_events=True,
            # Built outside a connector: no engine configs to read.
            extra_config={
                "spec_name": "TieringOffloadingSpec",
                "kvtiers_identity": "offloading-config-only",
            },
            engine_id=f"test-{uuid.uuid4().hex}",
            model=OffloadingModelConfig(name="org/model", dtype="float16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=F),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=False,
            ),
        )
    )


class Primary:
    """vLLM's primary memory as its secondary tiers see it."""

    def __init__(self) -> None:
        self.buffer = bytearray(NUM_CHUNKS * ROW_BYTES)
        self.view = memoryview(self.buffer).cast("B", (NUM_CHUNKS, ROW_BYTES))

    def row(self, chunk: int) -> bytes:
        return bytes(self.buffer[chunk * ROW_BYTES : chunk * ROW_BYTES + CHUNK_BYTES])

    def fill(self, chunk: int, seed: int) -> bytes:
        data = np.random.default_rng(seed).bytes(ROW_BYTES)
        self.buffer[chunk * ROW_BYTES : (chunk + 1) * ROW_BYTES] = data
        return data[:CHUNK_BYTES]


def keys(seed: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [vbase.make_offload_key(rng.bytes(16), (0, 3)[i % 2]) for i in range(count)]


def job(job_id: int, job_keys: list[bytes], chunks: list[int], *, promotion: bool,
        req_context: Any = None) -> Any:
    return TransferJob(
        job_id=job_id,
        keys=job_keys,
        chunk_ids=np.array(chunks, dtype=np.int32),
        is_promotion=promotion,
        req_context=req_context or vbase.ReqContext(req_id="r"),
    )


def finished(tier: Any) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


@pytest.fixture(params=["file", "s3"])
def tier_config(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        return {"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
                "root": str(tmp_path / "kv"), "io": "posix", "threads": 2}
    s3: MotoServer = request.getfixturevalue("s3_endpoint")
    return {"type": "KVTiersS3Tier", "module_path": "kvtiers.integrations.vllm",
            "bucket": BUCKET, "prefix": "vllm", "endpoint_url": s3.endpoint_url, "threads": 2}


def build(config: dict[str, Any], primary: Primary, spec: _Spec, **more: Any) -> Any:
    """The tier as vLLM's factory builds it, once it has indexed what its medium held."""
    tier = SecondaryTierFactory.create_secondary_tier({**config, **more}, primary.view, spec)
    tier.manager.wait_index()
    return tier


@pytest.fixture
def spec() -> _Spec:
    return make_spec()


@pytest.fixture
def tier(tier_config: dict[str, Any], spec: _Spec) -> Iterator[tuple[Any, Primary]]:
    primary = Primary()
    tier = build(tier_config, primary, spec, enable_kv_events=True)
    yield tier, primary
    tier.shutdown()


def test_store_then_load_round_trips_each_chunk(tier: tuple[Any, Primary]) -> None:
    t, primary = tier
    assert isinstance(t, (KVTiersFileTier, KVTiersS3Tier))
    ks = keys(1, 4)
    payloads = [primary.fill(chunk, seed=chunk) for chunk in range(4)]
    assert t.lookup(ks[0], vbase.ReqContext("r")) is vbase.LookupResult.MISS
    t.submit_store(job(1, ks, [0, 1, 2, 3], promotion=False))
    [result] = finished(t)
    assert (result.job_id, result.success) == (1, True)
    assert result.transfer_bytes >= 4 * CHUNK_BYTES  # object tiers count the headers too
    assert not t.has_pending_work()
    for key in ks:
        assert t.lookup(key, vbase.ReqContext("r")) is vbase.LookupResult.HIT
    [event] = t.take_events()
    assert (event.keys, event.removed, event.ownership) == (ks, False, t.tier_type)
    # The stored event names the job's request on vLLM 0.34 (vLLM's tracker builds the
    # chunk's payload from it); earlier releases' events have no such field.
    fields = {f.name for f in dataclasses.fields(event)}
    assert ("req_context" in fields) is EVENT_CARRIES_REQ_CONTEXT

    t.submit_load(job(2, ks[::-1], [11, 8, 10, 9], promotion=True))
    [result] = finished(t)
    assert (result.job_id, result.success, result.successful_keys) == (2, True, None)
    for chunk, payload in zip([11, 8, 10, 9], payloads[::-1], strict=True):
        assert primary.row(chunk) == payload


def test_keys_already_held_succeed_without_a_copy(tier: tuple[Any, Primary]) -> None:
    t, primary = tier
    ks = keys(2, 2)
    primary.fill(0, seed=0)
    primary.fill(1, seed=1)
    t.submit_store(job(1, ks, [0, 1], promotion=False))
    finished(t)
    t.submit_store(job(2, ks, [0, 1], promotion=False))
    assert [(r.job_id, r.success, r.transfer_bytes) for r in t.get_finished_jobs()] == [
        (2, True, None)
    ]


def test_a_load_with_a_missing_chunk_reports_the_keys_that_arrived(
    tier: tuple[Any, Primary],
) -> None:
    t, primary = tier
    stored, missing = keys(3, 1)[0], keys(4, 1)[0]
    payload = primary.fill(0, seed=5)
    t.submit_store(job(1, [stored], [0], promotion=False))
    finished(t)
    t.submit_load(job(2, [missing, stored], [6, 7], promotion=True))
    [result] = finished(t)
    assert (result.success, list(result.successful_keys)) == (False, [stored])
    assert primary.row(7) == payload


def test_a_new_tier_over_the_same_storage_hits_warm(
    tier_config: dict[str, Any], spec: _Spec
) -> None:
    first = Primary()
    ks = keys(6, 3)
    payloads = [first.fill(chunk, seed=10 + chunk) for chunk in range(3)]
    tier = build(tier_config, first, spec)
    tier.submit_store(job(1, ks, [0, 1, 2], promotion=False))
    assert [r.success for r in finished(tier)] == [True]
    tier.shutdown()

    second = Primary()
    tier = build(tier_config, second, spec)
    try:
        for key in ks:
            assert tier.lookup(key, vbase.ReqContext("r")) is vbase.LookupResult.HIT
        tier.submit_load(job(7, ks, [5, 6, 7], promotion=True))
        assert [r.success for r in finished(tier)] == [True]
        assert [second.row(c) for c in (5, 6, 7)] == payloads
    finally:
        tier.shutdown()


def test_a_restarted_tier_answers_retry_then_hit_or_miss_before_its_index_is_built(
    tier_config: dict[str, Any], spec: _Spec, held_builds: threading.Event
) -> None:
    ks = keys(12, 3)
    first = Primary()
    for chunk in range(3):
        first.fill(chunk, seed=20 + chunk)
    held_builds.set()
    tier = build(tier_config, first, spec)
    tier.submit_store(job(1, ks, [0, 1, 2], promotion=False))
    assert [r.success for r in finished(tier)] == [True]
    tier.shutdown()

    held_builds.clear()  # the restarted tier's index build waits
    tier = SecondaryTierFactory.create_secondary_tier(tier_config, Primary().view, spec)
    try:
        ctx = vbase.ReqContext("r")
        asked = [*ks, keys(13, 1)[0]]
        assert [tier.lookup(key, ctx) for key in asked] == [vbase.LookupResult.RETRY] * 4
        # vLLM steps again while the tier has work: the existence probes.
        assert tier.has_pending_work()
        tier.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        settle_probes(tier.manager)
        assert [tier.lookup(key, ctx) for key in asked] == (
            [vbase.LookupResult.HIT] * 3 + [vbase.LookupResult.MISS])
        assert not tier.manager.index_complete
    finally:
        held_builds.set()
        tier.shutdown()


def settle_probes(manager: Any) -> None:
    """Block until the manager's existence probes in flight have answered."""
    if isinstance(manager, FileTierManager):
        manager.wait_probes()
    else:
        manager.wait_background()  # the object tiers


def test_chunks_are_named_apart_from_the_spec_route(tmp_path: Path, spec: _Spec) -> None:
    primary = Primary()
    tier = build({"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
                  "root": str(tmp_path)}, primary, spec)
    identity: NamespaceIdentity = tier.tier.manager.mapper.identity
    tier.shutdown()
    # KVTiersOffloadingSpec records the engine's layout as vLLM reports it (here none, so
    # "unresolved"); this route marks its own chunk byte layout on top.
    assert identity.kv_layout == "unresolved+vllm-cpu-chunk"
    assert [g.bytes_per_block for g in identity.groups] == [WORKER_BYTES_PER_BLOCK] * 2
    assert (identity.engine, identity.hash_algorithm) == ("vllm", "vllm:sha256")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"capacity": "lots"}, "capacity"),
        ({"rooot": "/tmp"}, "unknown key 'rooot'"),
        ({"locality": "NEARBY"}, "expected LOCAL or REMOTE"),
    ],
)
def test_bad_tier_options_fail_at_start_up(
    tmp_path: Path, spec: _Spec, options: dict[str, Any], message: str
) -> None:
    config = {"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
              "root": str(tmp_path), **options}
    with pytest.raises(ConfigError, match=message):
        build(config, Primary(), spec)


def test_a_key_loaded_twice_fills_both_rows_and_leaves_no_pin(
    tier: tuple[Any, Primary],
) -> None:
    t, primary = tier
    [key] = keys(7, 1)
    payload = primary.fill(0, seed=7)
    t.submit_store(job(1, [key], [0], promotion=False))
    finished(t)
    t.submit_load(job(2, [key, key], [5, 6], promotion=True))
    [result] = finished(t)
    assert (result.success, result.successful_keys) == (True, None)
    assert [primary.row(5), primary.row(6)] == [payload, payload]
    # Only pinned (or reserved) keys have a spec: every pin the job took was dropped.
    with pytest.raises(UnknownKeyError):
        t.manager.get_spec([t._keys.to_kvtiers(key)])


class _SubmitFailed(Exception):
    """The mover's submission failed."""


def _raise_on_submit(job_id: int, src: Any, dst: Any) -> bool:
    raise _SubmitFailed(f"job {job_id}")


def test_a_store_whose_submission_raises_fails_and_frees_its_reservations(
    tier: tuple[Any, Primary], monkeypatch: pytest.MonkeyPatch
) -> None:
    t, primary = tier
    ks = keys(8, 2)
    primary.fill(0, seed=0)
    primary.fill(1, seed=1)
    monkeypatch.setattr(t._mover, "submit", _raise_on_submit)
    with pytest.raises(_SubmitFailed):
        t.submit_store(job(1, ks, [0, 1], promotion=False))
    assert not t.has_pending_work()
    assert [(r.job_id, r.success) for r in t.get_finished_jobs()] == [(1, False)]
    for key in ks:
        assert t.lookup(key, vbase.ReqContext("r")) is vbase.LookupResult.MISS


def test_a_load_whose_submission_raises_fails_and_drops_its_pins(
    tier: tuple[Any, Primary], monkeypatch: pytest.MonkeyPatch
) -> None:
    t, primary = tier
    ks = keys(9, 2)
    primary.fill(0, seed=0)
    primary.fill(1, seed=1)
    t.submit_store(job(1, ks, [0, 1], promotion=False))
    finished(t)
    monkeypatch.setattr(t._mover, "submit", _raise_on_submit)
    with pytest.raises(_SubmitFailed):
        t.submit_load(job(2, ks, [5, 6], promotion=True))
    assert not t.has_pending_work()
    results = [(r.job_id, r.success, list(r.successful_keys)) for r in t.get_finished_jobs()]
    assert results == [(2, False, [])]
    for key in ks:
        with pytest.raises(UnknownKeyError):
            t.manager.get_spec([t._keys.to_kvtiers(key)])


def test_stored_events_carry_the_request_of_the_job_that_stored_them(
    tier: tuple[Any, Primary],
) -> None:
    t, primary = tier
    first, second = vbase.ReqContext(req_id="first"), vbase.ReqContext(req_id="second")
    ks = keys(11, 3)
    for chunk in range(3):
        primary.fill(chunk, seed=chunk)
    t.submit_store(job(1, ks[:2], [0, 1], promotion=False, req_context=first))
    t.submit_store(job(2, ks[2:], [2], promotion=False, req_context=second))
    assert sorted(r.job_id for r in finished(t) if r.success) == [1, 2]
    stored = [event for event in t.take_events() if not event.removed]
    assert sorted(key for event in stored for key in event.keys) == sorted(ks)
    if not EVENT_CARRIES_REQ_CONTEXT:
        assert all(not hasattr(event, "req_context") for event in stored)
        return
    owner = {key: event.req_context for event in stored for key in event.keys}
    assert all(owner[key] is first for key in ks[:2]) and owner[ks[2]] is second


def test_promotion_deadline_is_checked_at_start_up(
    tier_config: dict[str, Any], spec: _Spec
) -> None:
    with pytest.raises(ConfigError, match="positive number of seconds"):
        build(tier_config, Primary(), spec, promotion_deadline_s=0)
    with pytest.raises(ConfigError, match="positive number of seconds"):
        build(tier_config, Primary(), spec, promotion_deadline_s="5s")
    if JOB_RESULT_DEFERS_RELEASE:
        build(tier_config, Primary(), spec, promotion_deadline_s=0.5).shutdown()
    else:
        with pytest.raises(ConfigError, match=r"needs vLLM 0\.34"):
            build(tier_config, Primary(), spec, promotion_deadline_s=0.5)


def test_a_late_promotion_defers_its_release_until_its_copies_ended(
    tier_config: dict[str, Any], spec: _Spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    primary = Primary()
    if not JOB_RESULT_DEFERS_RELEASE:
        with pytest.raises(ConfigError, match=r"needs vLLM 0\.34"):
            build(tier_config, primary, spec, promotion_deadline_s=2)
        return
    t = build(tier_config, primary, spec, promotion_deadline_s=2)
    loads = BlockedLoads(t, monkeypatch)
    try:
        now = [10.0]
        t.clock = t.manager.backoff.clock = lambda: now[0]
        ks = keys(12, 3)
        payloads = [primary.fill(chunk, seed=20 + chunk) for chunk in range(3)]
        t.submit_store(job(1, ks, [0, 1, 2], promotion=False))
        assert [r.success for r in finished(t)] == [True]

        t.submit_load(job(2, ks[:2], [5, 6], promotion=True))
        now[0] = 11.0
        t.submit_load(job(3, ks[2:], [7], promotion=True))
        assert list(t.get_finished_jobs()) == []  # both within their deadline
        now[0] = 12.0
        [late] = t.get_finished_jobs()  # job 2 only: job 3 has a second left
        assert (late.job_id, late.success, list(late.successful_keys)) == (2, False, [])
        assert late.deferred_release is not None
        assert not late.deferred_release.is_set()  # its copies are still running
        # Its keys back off, so vLLM recomputes them rather than promote them again.
        for key in ks[:2]:
            assert t.lookup(key, vbase.ReqContext("r")) is vbase.LookupResult.MISS
        now[0] = 13.0
        [later] = t.get_finished_jobs()
        assert (later.job_id, later.success) == (3, False)
        assert not later.deferred_release.is_set()
        assert list(t.get_finished_jobs()) == [] and t.has_pending_work()

        loads.release()
        t.drain_jobs()
        # Every event is set once drain_jobs returns, and the jobs are not reported again.
        assert late.deferred_release.is_set() and later.deferred_release.is_set()
        assert list(t.get_finished_jobs()) == []
        assert not t.has_pending_work()
        # The copies did write the rows vLLM held for them.
        assert [primary.row(c) for c in (5, 6, 7)] == payloads
        # A promotion that ends in time is reported as usual, without a deferral.
        now[0] = 100.0
        t.submit_load(job(4, ks, [8, 9, 10], promotion=True))
        [result] = finished(t)
        assert (result.job_id, result.success, result.deferred_release) == (4, True, None)
    finally:
        loads.release()
        t.shutdown()
