"""The fault matrix of docs/architecture.md, "Liveness", through both vLLM routes, driven
class-level with vLLM 0.33.0's own classes:

- route 1: ``KVTiersOffloadingSpec`` (kvtiers' composite is vLLM's manager) over a file,
  S3 (moto) or fsspec lower tier;
- route 2: ``KVTiersFileTier`` / ``KVTiersS3Tier`` as secondary tiers under vLLM's
  ``TieringOffloadingManager`` (vLLM's CPU primary; this route has no fsspec tier).

Each fault of ``tests/test_fault_matrix.py`` (a directory or a symlink loop at a chunk
path, an injected ``EIO`` on one chunk, an S3 server that is down, access denied) meets a
prompt's chunks that live in the lower tier only. Each case asserts that vLLM's lookups
of the prompt's keys resolve to ``HIT`` or ``MISS`` within :data:`BOUND_STEPS` scheduler
steps, that the keys that hit carry exactly the stored bytes, that the failed key is not
promoted again while it backs off, and that after the fault ends the tier serves every
key again. Back-offs run on the fake clock the test advances; nothing waits on time.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.test_fault_matrix import FAULTS, LASTING, MATRIX, Bench, Fault, bench
from tests.test_vllm_spec import (
    NUM_BLOCKS,
    F,
    Request,
    canonical_kv,
    ctx,
    gpu_spec,
    make_kv,
    make_request,
    run,
    store,
    vllm_config,
)
from tests.test_vllm_tiering import (
    CHUNK_BYTES,
    NO_STEP_CONTEXT,
    primary_rows,
    settle,
    tiering_manager,
)

__all__ = ["bench"]  # the fixture, parametrised per lower-tier kind

#: Scheduler steps within which every lookup of the prompt resolves under a fault: one
#: step to submit the promotions, the next sees the failed one and answers ``MISS``.
BOUND_STEPS = 2
RESOLVED = (vbase.LookupResult.HIT, vbase.LookupResult.MISS)
ROUTE_2_MATRIX = [(kind, name) for kind, name in MATRIX if kind != "fsspec"]
ROUTE_2_LASTING = [(kind, name) for kind, name in LASTING if kind != "fsspec"]


def resolve(lookup: Callable[[bytes], Any], step: Callable[[], None], keys: list[bytes]) -> Any:
    """Look every key up once per scheduler step until none is pending; the answers and
    the steps it took (at most ``BOUND_STEPS + 1`` tried, so a hang fails the bound)."""
    for steps in range(BOUND_STEPS + 2):
        answers = [lookup(key) for key in keys]
        if all(answer in RESOLVED for answer in answers):
            return answers, steps
        step()
    raise AssertionError(f"lookups still pending after {BOUND_STEPS + 1} steps: {answers}")


def expected(keys: list[bytes], bad: bytes, fault: Fault) -> list[Any]:
    """What the lookups resolve to under ``fault``: a miss for the failed key (for every
    key when the whole tier fails), a hit for the rest."""
    hit, miss = vbase.LookupResult.HIT, vbase.LookupResult.MISS
    return [miss if fault.whole_tier or key == bad else hit for key in keys]


# -- route 1: KVTiersOffloadingSpec ----------------------------------------------------
@dataclass
class _Route1:
    """One scheduler-side spec and manager, with a worker of its own spec instance."""

    spec: Any
    manager: Any
    worker: Any

    def close(self) -> None:
        self.worker.shutdown()
        self.manager.shutdown()

    def step(self) -> None:
        self.manager.on_schedule_end(NO_STEP_CONTEXT)
        self.manager.stack.manager.wait_idle()


def _route1(bench: Bench, kv: list[torch.Tensor]) -> _Route1:
    lower = {**bench.tier, "io": "posix"} if bench.kind == "file" else bench.tier
    config = vllm_config(
        bench.tmp / "unused",
        kvtiers={"tiers": [{"kind": "cpu", "capacity": "64KiB"}, lower]},
    )
    spec = OffloadingSpecFactory.create_spec(config)
    manager = spec.get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    return _Route1(spec, manager, worker)


def _route1_keys(req: Request) -> list[bytes]:
    return [key for group in req.keys for key in group]


def _check_bytes(
    engine: _Route1, req: Request, kv: list[torch.Tensor], originals: list[torch.Tensor],
    chunks: list[range], job_id: int,
) -> None:
    """Load ``chunks[g]`` of each group into fresh GPU blocks; every byte must equal the
    original block's."""
    keys = [req.keys[g][c] for g, rng in enumerate(chunks) for c in rng]
    if not keys:
        return
    src = engine.manager.prepare_load(keys, ctx())
    parts: list[tuple[list[int], int]] = []
    pairs: list[tuple[int, int]] = []
    next_free = NUM_BLOCKS - 16
    for g, rng in enumerate(chunks):
        sources = req.blocks[g][rng.start * F : rng.stop * F]
        targets = list(range(next_free, next_free + len(sources)))
        next_free += len(sources)
        parts.append((targets, rng.start * F))
        pairs.extend(zip(sources, targets, strict=True))
    for t in kv:
        t[NUM_BLOCKS - 16 :] = 0
    run(engine.worker, job_id, lambda j: engine.worker.submit_load(
        j, pickle.loads(pickle.dumps(src)), gpu_spec(parts)))
    engine.manager.complete_load(keys, ctx())
    for source, target in pairs:
        for t, original in zip(kv, originals, strict=True):
            assert torch.equal(t[target], original[source]), (source, target)


def _usable(keys: list[bytes], answers: list[Any], req: Request) -> list[range]:
    """Per group, the leading chunks that hit."""
    hits = {key for key, answer in zip(keys, answers, strict=True)
            if answer is vbase.LookupResult.HIT}
    usable = []
    for group in req.keys:
        count = 0
        while count < len(group) and group[count] in hits:
            count += 1
        usable.append(range(count))
    return usable


@pytest.mark.parametrize(("bench", "fault_name"), MATRIX, indirect=["bench"])
def test_route1_a_fault_resolves_backs_off_and_heals(bench: Bench, fault_name: str) -> None:
    _, make = FAULTS[fault_name]
    kv = make_kv()
    originals = [t.clone() for t in kv]
    req = make_request(3, first_block=0)
    keys = _route1_keys(req)
    bad = req.keys[0][1]

    publisher = _route1(bench, kv)
    try:
        store(publisher.manager, publisher.worker, req, [range(4), range(2)], job_id=1)
        publisher.manager.stack.manager.wait_idle()
    finally:
        publisher.close()

    engine = _route1(bench, kv)
    try:
        stack = engine.manager.stack
        stack.wait_index()  # the restart's chunks are indexed before the fault starts
        lower = stack.tiers[1].manager
        lower.backoff.clock = bench.clock
        fault = make(bench, stack, engine.spec.keys.to_kvtiers(bad))
        fault.start()

        def lookup(key: bytes) -> Any:
            return engine.manager.lookup(key, ctx())

        answers, steps = resolve(lookup, engine.step, keys)
        assert steps <= BOUND_STEPS
        assert answers == expected(keys, bad, fault)
        failures = lower.get_stats()["load_failures"]
        assert failures == (len(keys) if fault.whole_tier else 1)
        _check_bytes(engine, req, kv, originals, _usable(keys, answers, req), job_id=2)

        # Within the back-off the failed key is a miss at once: no new promotion.
        engine.step()
        assert lookup(bad) is vbase.LookupResult.MISS
        engine.step()
        assert lower.get_stats()["load_failures"] == failures

        fault.end()
        bench.clock.now += 3600.0  # past every back-off
        answers, _ = resolve(lookup, engine.step, keys)
        assert answers == [vbase.LookupResult.HIT] * len(keys)
        _check_bytes(engine, req, kv, originals, [range(4), range(2)], job_id=3)
    finally:
        engine.close()


# -- route 2: secondary tiers under vLLM's tiering manager -----------------------------
@dataclass
class _TierStack:
    """Shapes a route-2 tier like a stack for the fault makers: ``tiers[1]`` is the tier."""

    tiers: list[Any]


def _as_stack(tier: Any) -> Any:
    return _TierStack([None, tier])


def _route2_config(bench: Bench) -> dict[str, Any]:
    options = {k: v for k, v in bench.tier.items() if k != "kind"}
    if bench.kind == "file":
        return {"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
                "io": "posix", **options}
    return {"type": "KVTiersS3Tier", "module_path": "kvtiers.integrations.vllm", **options}


def _route2_publish(config: dict[str, Any]) -> dict[bytes, np.ndarray]:
    """Store four chunks through an engine that then stops; their keys and bytes."""
    rng = np.random.default_rng(11)
    keys = [vbase.make_offload_key(rng.bytes(16), 0) for _ in range(4)]
    payloads = {key: rng.integers(-128, 128, CHUNK_BYTES, dtype=np.int8) for key in keys}
    cold = tiering_manager(config)
    try:
        request = vbase.ReqContext(req_id="publish")
        cold.on_new_request(request)
        out = cold.prepare_store(keys, request)
        rows = primary_rows(cold)
        for chunk, key in zip(out.store_spec.block_ids, keys, strict=True):
            rows[chunk, :CHUNK_BYTES] = payloads[key]  # what vLLM's GPU worker would write
        cold.complete_store(keys, request)
        cold.on_request_finished(request)
        settle(cold)
    finally:
        cold.shutdown()
    return payloads


@pytest.mark.parametrize(("bench", "fault_name"), ROUTE_2_MATRIX, indirect=["bench"])
def test_route2_a_fault_resolves_backs_off_and_heals(bench: Bench, fault_name: str) -> None:
    _, make = FAULTS[fault_name]
    config = _route2_config(bench)
    payloads = _route2_publish(config)
    keys = list(payloads)
    bad = keys[1]
    warm = tiering_manager(config)
    try:
        tier = warm.secondary_tiers[0]
        tier.manager.wait_index()  # the restart's chunks are indexed before the fault
        tier.manager.backoff.clock = bench.clock
        fault = make(bench, _as_stack(tier.tier), tier._keys.to_kvtiers(bad))
        fault.start()
        request = vbase.ReqContext(req_id="faulted")
        warm.on_new_request(request)

        def lookup(key: bytes) -> Any:
            return warm.lookup(key, request)

        def step() -> None:
            warm.on_schedule_end(NO_STEP_CONTEXT)
            tier.drain_jobs()

        def check_bytes(hits: list[bytes]) -> None:
            if not hits:
                return
            spec = warm.prepare_load(hits, request)
            rows = primary_rows(warm)
            for chunk, key in zip(spec.block_ids, hits, strict=True):
                assert np.array_equal(rows[chunk, :CHUNK_BYTES], payloads[key])
            warm.complete_load(hits, request)

        answers, steps = resolve(lookup, step, keys)
        assert steps <= BOUND_STEPS
        assert answers == expected(keys, bad, fault)
        failures = tier.manager.get_stats()["load_failures"]
        assert failures == (len(keys) if fault.whole_tier else 1)
        check_bytes([k for k, a in zip(keys, answers, strict=True)
                     if a is vbase.LookupResult.HIT])

        # Within the back-off the failed key is a miss at once: no new promotion.
        assert lookup(bad) is vbase.LookupResult.MISS
        step()
        assert lookup(bad) is vbase.LookupResult.MISS
        assert tier.manager.get_stats()["load_failures"] == failures

        fault.end()
        bench.clock.now += 3600.0  # past every back-off
        answers, _ = resolve(lookup, step, keys)
        assert answers == [vbase.LookupResult.HIT] * len(keys)
        check_bytes(keys)
        warm.on_request_finished(request)
    finally:
        warm.shutdown()


@pytest.mark.parametrize(("bench", "fault_name"), ROUTE_2_LASTING, indirect=["bench"])
def test_route2_a_lasting_failure_is_forgotten_after_repeated_tries(
    bench: Bench, fault_name: str
) -> None:
    _, make = FAULTS[fault_name]
    config = _route2_config(bench)
    keys = list(_route2_publish(config))
    bad = keys[1]
    warm = tiering_manager(config)
    try:
        tier = warm.secondary_tiers[0]
        tier.manager.wait_index()  # the restart's chunks are indexed before the fault
        tier.manager.backoff.clock = bench.clock
        make(bench, _as_stack(tier.tier), tier._keys.to_kvtiers(bad)).start()
        request = vbase.ReqContext(req_id="lasting")
        warm.on_new_request(request)
        for _ in range(2):
            bench.clock.now += 3600.0  # past the back-off of the previous try
            assert warm.lookup(bad, request) is vbase.LookupResult.HIT_PENDING
            warm.on_schedule_end(NO_STEP_CONTEXT)
            tier.drain_jobs()
            assert warm.lookup(bad, request) is vbase.LookupResult.MISS
        stats = tier.manager.get_stats()
        assert (stats["load_failures"], stats["unreadable_chunks"]) == (2, 1)
        # Forgotten: a miss through vLLM's manager for the longest back-off.
        bench.clock.now += 30.0
        assert warm.lookup(bad, request) is vbase.LookupResult.MISS
        assert tier.lookup(bad, request) is vbase.LookupResult.MISS
        warm.on_request_finished(request)
    finally:
        warm.shutdown()
