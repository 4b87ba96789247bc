"""An s3 tier under a cpu primary, built from a stack description: cascades reach the
bucket, and a restarted stack promotes them back byte-exact (on moto and on SeaweedFS)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET, S3Server

CTX = ReqContext("stack")
CHUNK = 8192


@pytest.fixture
def stacks(any_s3: S3Server) -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        stack.shutdown()


def build(made: list[Stack], endpoint: str) -> Stack:
    description = {"tiers": [
        {"kind": "cpu", "capacity": 4 * CHUNK},
        {"kind": "s3", "bucket": BUCKET, "prefix": "stack", "endpoint_url": endpoint,
         "threads": 2},
    ]}
    stack = load_stack(description, offloading_config())
    made.append(stack)
    stack.wait_index()
    return stack


def test_cascade_then_promote_after_restart(stacks: list[Stack], any_s3: S3Server) -> None:
    stack = build(stacks, any_s3.endpoint_url)
    manager, region = stack.manager, stack.tiers[0].region
    assert region is not None
    keys = [conformance_key(i) for i in range(3)]
    accepted = manager.prepare_store(keys, CTX)
    assert accepted == keys
    spec = manager.get_spec(keys)
    assert isinstance(spec, CPULoadStoreSpec)
    for slot, i in zip(spec.slot_ids, range(3), strict=True):
        region.view(int(slot))[:CHUNK] = conformance_payload(i, CHUNK)
    manager.complete_store(keys, CTX)
    manager.wait_idle()
    s3 = stack.tiers[1].manager
    assert [s3.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 3
    stack.shutdown()

    restarted = build(stacks, any_s3.endpoint_url)
    manager, region = restarted.manager, restarted.tiers[0].region
    assert region is not None
    assert [manager.lookup(k, CTX) for k in keys] == [LookupResult.HIT_PENDING] * 3
    manager.wait_idle()
    assert [manager.lookup(k, CTX) for k in keys] == [LookupResult.HIT] * 3
    manager.prepare_load(keys, CTX)
    spec = manager.get_spec(keys)
    assert isinstance(spec, CPULoadStoreSpec)
    loaded = [bytes(region.view(int(slot))[:CHUNK]) for slot in spec.slot_ids]
    manager.complete_load(keys, CTX)
    assert loaded == [conformance_payload(i, CHUNK) for i in range(3)]
