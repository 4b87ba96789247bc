"""vLLM route 2 through ``kvtiers serve``: :class:`KVTiersServiceTier` built by vLLM's own
``SecondaryTierFactory`` over a primary memoryview shaped like vLLM's CPU tier's, the
service in its own process (docs/service.md).

Each test synchronises on the service (its ready line, its replies, the reaped process
after ``kill -9``) and on the tier's ``drain_jobs``; a copy held back waits on an event.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("msgspec")

from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.service_tier import KVTiersServiceTier, PoolMover
from kvtiers.service.pool import tag_of
from kvtiers.testing.service import ServiceProcess, remove_pool
from tests.test_service import fill_until_refilled
from tests.test_vllm_tiering import (
    CHUNK_BYTES,
    NO_STEP_CONTEXT,
    chunks,
    primary_rows,
    settle,
    store_through_primary,
    tiering_manager,
)
from tests.test_vllm_tiers import (
    Primary,
    _Spec,
    finished,
    job,
    keys,
    make_spec,
)

HIT, MISS = vbase.LookupResult.HIT, vbase.LookupResult.MISS
R = vbase.ReqContext("r")
END = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    pool = f"kvtiers-route2-test-{os.getpid()}-{tmp_path.name}"
    config = tmp_path / "serve.yaml"
    config.write_text(f"tiers:\n  - kind: cpu\n    capacity: 1MiB\n"
                      f"    shared_memory_name: {pool}\n")
    proc = ServiceProcess(config, tmp_path / "serve.sock")
    proc.start(fresh=True)
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop()
    remove_pool(pool)


@pytest.fixture
def spec() -> _Spec:
    return make_spec()


def build(service: ServiceProcess | Path, primary: Primary, spec: _Spec, **more: Any) -> Any:
    """The tier as vLLM's factory builds it from a ``secondary_tiers`` entry (``service``:
    the service, or its socket)."""
    socket = service.socket if isinstance(service, ServiceProcess) else service
    config = {"type": "KVTiersServiceTier", "module_path": "kvtiers.integrations.vllm",
              "socket": str(socket), "retry_s": 0.001, "lease_slots": 8, **more}
    return SecondaryTierFactory.create_secondary_tier(config, primary.view, spec)


def commit(tier: Any) -> None:
    """The step's end (its commits sent), and the service's replies taken in."""
    tier.on_schedule_end(END)
    tier.manager.flush(wait=True)


def notice_now(tier: Any) -> None:
    """The next lookup polls the socket (and a down service is tried again) at once,
    rather than after the liveness and retry intervals."""
    tier.manager._checked_at = -1.0
    tier.manager.client._next_try = 0.0


def stored(service: ServiceProcess | Path, spec: _Spec, ks: list[bytes]) -> list[bytes]:
    """Store ``ks`` through one engine's tier (rows 0..), commit, and detach; the
    payloads."""
    primary = Primary()
    payloads = [primary.fill(row, seed=100 + row) for row in range(len(ks))]
    first = build(service, primary, spec)
    try:
        first.submit_store(job(1, ks, list(range(len(ks))), promotion=False))
        [result] = finished(first)
        assert (result.job_id, result.success, result.transfer_bytes) == (
            1, True, len(ks) * first._mover.chunk_bytes)
        commit(first)
    finally:
        first.shutdown()
    return payloads


def store_in_child(socket: str, seed: int, count: int) -> None:
    """An engine process of its own: store ``keys(seed, count)`` through its tier (the
    payloads :func:`stored` gives them), then exit."""
    stored(Path(socket), make_spec(), keys(seed, count))


def test_a_chunk_stored_by_one_engine_is_a_pool_hit_loaded_byte_exact_by_another(
    service: ServiceProcess, spec: _Spec,
) -> None:
    ks = keys(1, 4)
    # One engine process stores and exits...
    subprocess.run(
        [sys.executable, "-c", "import sys; from tests.test_vllm_service_tier import "
         "store_in_child; store_in_child(sys.argv[1], 1, 4)", str(service.socket)],
        check=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    payloads = [Primary().fill(row, seed=100 + row) for row in range(len(ks))]
    # ...and another, with its own connection and mapping, finds its chunks in the pool.
    primary = Primary()
    second = build(service, primary, spec)
    try:
        assert isinstance(second, KVTiersServiceTier)
        assert [second.lookup(k, R) for k in ks] == [HIT] * 4
        assert second.lookup(keys(2, 1)[0], R) is MISS
        second.submit_load(job(2, ks[::-1], [11, 8, 10, 9], promotion=True))
        [result] = finished(second)
        assert (result.job_id, result.success, result.successful_keys) == (2, True, None)
        for row, payload in zip([11, 8, 10, 9], payloads[::-1], strict=True):
            assert primary.row(row) == payload
        # Held already: a store of them succeeds without a copy.
        second.submit_store(job(3, ks, [0, 1, 2, 3], promotion=False))
        assert [(r.job_id, r.success) for r in second.get_finished_jobs()] == [(3, True)]
        assert not second.has_pending_work()
    finally:
        second.shutdown()


def test_under_vllms_tiering_manager_a_cascade_is_promoted_in_a_new_engine(
    service: ServiceProcess,
) -> None:
    """vLLM's own TieringOffloadingManager cascades its CPU chunks into the pool; a new
    engine's lookups find them there and vLLM promotes them into its CPU rows."""
    tier = {"type": "KVTiersServiceTier", "module_path": "kvtiers.integrations.vllm",
            "socket": str(service.socket)}
    keys_, payloads = chunks(7, 3)
    cold = tiering_manager(tier)
    try:
        assert isinstance(cold.secondary_tiers[0], KVTiersServiceTier)
        store_through_primary(cold, keys_, payloads, "cold")
    finally:
        cold.shutdown()  # its commits are taken in before it detaches

    warm = tiering_manager(tier)
    try:
        ctx = vbase.ReqContext(req_id="warm")
        warm.on_new_request(ctx)
        for key in keys_:
            assert warm.lookup(key, ctx) is vbase.LookupResult.HIT_PENDING
        warm.on_schedule_end(NO_STEP_CONTEXT)  # submits the promotion
        settle(warm)
        for key in keys_:
            assert warm.lookup(key, ctx) is vbase.LookupResult.HIT
        spec = warm.prepare_load(keys_, ctx)
        rows = primary_rows(warm)
        for chunk, payload in zip(spec.block_ids, payloads, strict=True):
            assert np.array_equal(rows[chunk, :CHUNK_BYTES], payload)
        warm.complete_load(keys_, ctx)
        warm.on_request_finished(ctx)
    finally:
        warm.shutdown()


def test_the_identity_is_route_twos_as_the_file_tiers(service: ServiceProcess, spec: _Spec,
                                                      tmp_path: Path) -> None:
    primary = Primary()
    tier = build(service, primary, spec)
    file_tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
         "root": str(tmp_path / "kv")}, primary.view, spec)
    try:
        identity = file_tier.tier.manager.mapper.identity
        assert identity.kv_layout.endswith("+vllm-cpu-chunk")
        assert tier.manager.client.identity == identity.canonical_json()
    finally:
        file_tier.shutdown()
        tier.shutdown()


def test_a_slot_refilled_after_the_load_was_planned_fails_it(
    service: ServiceProcess, spec: _Spec,
) -> None:
    ks = keys(3, 1)
    stored(service, spec, ks)
    primary = Primary()
    tier = build(service, primary, spec)
    gate = threading.Event()
    try:
        evicted = tier._keys.to_kvtiers(ks[0])
        tag = tag_of(tier.manager.client.digest, evicted)
        slot = tier.manager.region.find(tag)
        assert slot >= 0
        # The mover's one load thread waits on the gate: the job is planned (slot and
        # generation taken) and its copy queues behind it.
        mover = tier._mover
        assert isinstance(mover, PoolMover)
        mover._loads.submit(gate.wait)
        tier.submit_load(job(2, ks, [5], promotion=True))
        fill_until_refilled(service, tier.manager, slot, tag, 40)
        gate.set()
        [result] = finished(tier)
        assert (result.success, list(result.successful_keys)) == (False, [])
        assert not any(primary.row(5))  # nothing of the chunk now in that slot
        assert mover.stale == 1
        assert tier.lookup(ks[0], R) is MISS
    finally:
        gate.set()
        tier.shutdown()


def test_a_slot_refilled_during_the_copy_fails_the_load(
    service: ServiceProcess, spec: _Spec,
) -> None:
    ks = keys(4, 1)
    stored(service, spec, ks)
    primary = Primary()
    tier = build(service, primary, spec)
    mover = tier._mover
    assert isinstance(mover, PoolMover)
    key = tier._keys.to_kvtiers(ks[0])
    tag = tag_of(tier.manager.client.digest, key)
    slot = tier.manager.region.find(tag)
    errors: list[BaseException] = []
    move = mover._move

    def refill_then_move(dst: memoryview, src: memoryview) -> None:
        # Between the copy's first header check and its bytes: another engine's stores
        # evict the chunk and the slot takes another one.
        try:
            fill_until_refilled(service, tier.manager, slot, tag, 60)
        except BaseException as exc:  # reported by the test's thread below
            errors.append(exc)
        move(dst, src)

    mover._move = refill_then_move  # type: ignore[method-assign]
    try:
        tier.submit_load(job(2, ks, [3], promotion=True))
        [result] = finished(tier)
        assert not errors
        # The bytes copied were the new chunk's: the second header read fails the key.
        assert result.success is False
        assert list(result.successful_keys) == []
        assert mover.stale == 1
    finally:
        tier.shutdown()


def test_a_dead_service_misses_at_once_drops_stores_and_is_reattached(
    service: ServiceProcess, spec: _Spec,
) -> None:
    ks = keys(5, 2)
    payloads = stored(service, spec, ks)
    primary = Primary()
    tier = build(service, primary, spec)
    gate = threading.Event()
    try:
        assert tier.lookup(ks[0], R) is HIT
        tier._mover._loads.submit(gate.wait)
        tier.submit_load(job(2, ks[:1], [4], promotion=True))  # planned, not copied yet
        service.kill()
        notice_now(tier)
        assert [tier.lookup(k, R) for k in ks] == [MISS, MISS]
        # A store is refused at once, its job failed; nothing waits for the service.
        primary.fill(7, seed=7)
        tier.submit_store(job(3, keys(6, 1), [7], promotion=False))
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(3, False)]
        tier.on_schedule_end(END)  # the step's end write waits for nothing
        gate.set()
        # The load planned before the death reads the slot it found, whose header no one
        # changed: the chunk's bytes, exact.
        assert [(r.job_id, r.success) for r in finished(tier)] == [(2, True)]
        assert primary.row(4) == payloads[0]
        # The restarted service re-adopts the chunks; the tier reattaches at a call.
        assert "adopted 2" in service.start()
        notice_now(tier)
        assert [tier.lookup(k, R) for k in ks] == [HIT, HIT]
        tier.submit_load(job(4, ks, [8, 9], promotion=True))
        assert [(r.job_id, r.success) for r in finished(tier)] == [(4, True)]
        assert [primary.row(8), primary.row(9)] == payloads
        assert tier.manager.client.reattaches == 1
    finally:
        gate.set()
        tier.shutdown()


def test_a_store_planned_before_a_service_restart_writes_nothing(
    service: ServiceProcess, spec: _Spec,
) -> None:
    primary = Primary()
    tier = build(service, primary, spec)
    gate = threading.Event()
    try:
        # The mover's one store thread waits on the gate: the store has its leased slot
        # (WRITING, its generation taken) and its copy queues behind it.
        tier._mover._stores.submit(gate.wait)
        ks = keys(7, 1)
        primary.fill(2, seed=2)
        tier.submit_store(job(1, ks, [2], promotion=False))
        [slot] = tier.manager._reserved.values()
        service.kill()
        service.start()  # the restart frees the slots that were being written
        gate.set()
        [result] = finished(tier)
        assert (result.job_id, result.success) == (1, False)
        # Not a byte written into a slot the new service may hand to another engine.
        assert not any(tier.manager.region.view(slot))
        assert tier._mover.stale == 1
    finally:
        gate.set()
        tier.shutdown()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tenants": {"default": "a"}}, "unknown key 'tenants'"),
        ({"promotion_deadline_s": 1.0}, "promotion_deadline_s"),
        ({"lease_slots": -1}, "lease_slots"),
        ({"capacity": "1GiB"}, "unknown key 'capacity'"),
    ],
)
def test_options_it_does_not_take_are_refused(service: ServiceProcess, spec: _Spec,
                                              options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(service, Primary(), spec, **options)


def test_no_service_no_tier(tmp_path: Path, spec: _Spec) -> None:
    config = {"type": "KVTiersServiceTier", "module_path": "kvtiers.integrations.vllm",
              "socket": str(tmp_path / "none.sock")}
    with pytest.raises(ConfigError, match="start it with kvtiers serve") as raised:
        SecondaryTierFactory.create_secondary_tier(config, Primary().view, spec)
    assert "socket" in str(raised.value)
