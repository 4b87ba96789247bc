"""Tenants over one stack (kvtiers.stack.tenants): a `tenants:` section is checked with
paths; two tenants over one shared file root and one bucket never hit each other's chunks,
a noisy tenant's burst stays within its quotas without touching the quiet tenant's
protected share, and usage per tenant and tier is reported."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.config.stack import load_stack_config
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.errors import ConfigError
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.stack.tenants import TenantStack, tenant_bytes_families
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET, MotoServer

CHUNK = 8192


def _contexts() -> tuple[ReqContext, ReqContext, ReqContext]:
    """A request of each tenant: the quiet one by its salt, the noisy one by
    ``kv_transfer_params``, the default one unnamed (fresh for each test: a context
    keeps what its lookups found)."""
    return (ReqContext("quiet", cache_salt="salt-q"),
            ReqContext("noisy", kv_transfer_params={"kvtiers_tenant": "noisy"}),
            ReqContext("plain"))


TENANTS: dict[str, Any] = {
    "members": [
        {"name": "quiet", "salts": ["salt-q"], "protected": {"cpu": 4 * CHUNK}},
        {"name": "noisy", "quota": {"cpu": 3 * CHUNK, "lower": 5 * (CHUNK + 4096)}},
    ],
}


def _tiers(lower: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"kind": "cpu", "capacity": 8 * CHUNK}, {"name": "lower", **lower}]


# -- the section --------------------------------------------------------------------
@pytest.mark.parametrize(("tenants", "path", "words"), [
    ({"members": [{"name": "a"}, {"name": "a"}]}, "tenants.members[1].name",
     "already used"),
    ({"members": [{"name": "a", "quota": {"disk": "1GiB"}}]},
     "tenants.members[0].quota.disk", "no tier is named 'disk'"),
    ({"members": [{"name": "a", "quota": {"cpu": "lots"}}]},
     "tenants.members[0].quota.cpu", "size"),
    ({"members": [{"name": "a", "quota": {"cpu": "1MiB"}, "protected": {"cpu": "2MiB"}}]},
     "tenants.members[0].protected.cpu", "larger than the quota"),
    ({"members": [{"name": "a", "salts": ["s"]}, {"name": "b", "salts": ["s"]}]},
     "tenants.members[1].salts[0]", "belongs to one tenant"),
    ({"members": [{"name": "a b"}]}, "tenants.members[0].name", "tenant name"),
    ({"member": []}, "tenants.member", "did you mean 'members'"),
    ({"members": [{"name": "a", "salts": "s"}]}, "tenants.members[0].salts", "list"),
])
def test_a_bad_tenants_section_names_its_path(tenants: dict[str, Any], path: str,
                                               words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_stack_config({"tiers": [{"kind": "cpu", "capacity": "1GiB"}],
                           "tenants": tenants})
    assert caught.value.path == path
    assert words in caught.value.message


def test_a_bad_tenants_section_in_a_file_names_file_and_line(tmp_path: Path) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text("tiers:\n  - kind: cpu\n    capacity: 1GiB\ntenants:\n  members:\n"
                     "    - name: a\n      quota:\n        disk: 1GiB\n")
    with pytest.raises(ConfigError) as caught:
        load_stack_config(stack)
    assert caught.value.source == f"{stack}:8"
    assert "tenants.members[0].quota.disk" in str(caught.value)


# -- two tenants over one shared place ---------------------------------------------
@pytest.fixture(params=["file", "s3"])
def lower(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    if request.param == "file":
        return {"kind": "file", "root": str(tmp_path / "root")}
    moto: MotoServer = request.getfixturevalue("s3_endpoint")
    return {"kind": "s3", "bucket": BUCKET, "prefix": "tenants",
            "endpoint_url": moto.endpoint_url, "threads": 2}


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    made: list[Stack] = []
    yield made
    for stack in made:
        stack.shutdown()


def _build(made: list[Stack], lower: dict[str, Any]) -> tuple[Stack, TenantStack]:
    stack = load_stack({"tiers": _tiers(lower), "tenants": TENANTS}, offloading_config())
    made.append(stack)
    stack.wait_index()
    assert isinstance(stack.tenants, TenantStack)
    assert stack.config.tenants is not None
    # The usage snapshot taken at every step's end (not once a second), for the exporter.
    return stack, TenantStack(stack.manager, stack.config.tenants, refresh_s=0)


def _store(stack: Stack, tenants: TenantStack, keys: list[OffloadKey],
           ctx: ReqContext) -> list[OffloadKey]:
    """Store ``keys`` for ``ctx``'s tenant, each chunk its own payload; end the step."""
    accepted = tenants.prepare_store(keys, ctx) or []
    region = stack.tiers[0].region
    assert region is not None
    if accepted:
        spec = tenants.get_spec(accepted)
        assert isinstance(spec, CPULoadStoreSpec)
        for slot, key in zip(spec.slot_ids, accepted, strict=True):
            region.view(int(slot))[:CHUNK] = conformance_payload(keys.index(key), CHUNK)
        tenants.complete_store(accepted, ctx)
    stack.manager.wait_idle()
    tenants.on_schedule_end(ScheduleEndContext())
    return accepted


def _ready(tenants: TenantStack, key: OffloadKey, ctx: ReqContext) -> LookupResult:
    """The answer once any promotion the lookup started has landed."""
    result = tenants.lookup(key, ctx)
    if result is LookupResult.HIT_PENDING:
        tenants.inner.wait_idle()
        tenants.on_schedule_end(ScheduleEndContext())
        result = tenants.lookup(key, ctx)
    return result


def test_no_tenant_is_served_another_tenants_chunk(stacks: list[Stack],
                                                   lower: dict[str, Any]) -> None:
    quiet_ctx, noisy_ctx, plain_ctx = _contexts()
    stack, tenants = _build(stacks, lower)
    keys = [conformance_key(i) for i in range(3)]
    assert _store(stack, tenants, keys, quiet_ctx) == keys
    for key in keys:
        assert tenants.lookup(key, quiet_ctx) is LookupResult.HIT
        assert tenants.lookup(key, noisy_ctx) is LookupResult.MISS
        assert tenants.lookup(key, plain_ctx) is LookupResult.MISS
    stack.shutdown()

    # A restarted stack over the same root or bucket: the lower tier alone holds them.
    stack, tenants = _build(stacks, lower)
    for key in keys:
        assert _ready(tenants, key, noisy_ctx) is LookupResult.MISS
        assert _ready(tenants, key, plain_ctx) is LookupResult.MISS
        assert _ready(tenants, key, quiet_ctx) is LookupResult.HIT
    tenants.prepare_load(keys, quiet_ctx)
    spec = tenants.get_spec(keys)
    assert isinstance(spec, CPULoadStoreSpec)
    region = stack.tiers[0].region
    assert region is not None
    loaded = [bytes(region.view(int(slot))[:CHUNK]) for slot in spec.slot_ids]
    tenants.complete_load(keys, quiet_ctx)
    assert loaded == [conformance_payload(i, CHUNK) for i in range(3)]
    usage = tenants.usage()
    assert usage["lower"]["quiet"] > 0
    assert usage["lower"]["noisy"] == usage["lower"]["default"] == 0


def test_a_burst_keeps_to_its_quotas_and_spares_the_protected_share(
        stacks: list[Stack], lower: dict[str, Any]) -> None:
    quiet_ctx, noisy_ctx, plain_ctx = _contexts()
    stack, tenants = _build(stacks, lower)
    quiet = [conformance_key(i) for i in range(4)]
    _store(stack, tenants, quiet, quiet_ctx)
    burst = [conformance_key(100 + i) for i in range(24)]
    for start in range(0, len(burst), 2):
        _store(stack, tenants, burst[start:start + 2], noisy_ctx)
        usage = tenants.usage()
        assert usage["cpu"]["noisy"] <= 3 * CHUNK, usage
        assert usage["lower"]["noisy"] <= 5 * (CHUNK + 4096), usage
        assert usage["cpu"]["quiet"] == 4 * CHUNK, usage
    # The noisy tenant kept its latest chunks: its own oldest made way for them.
    assert tenants.lookup(burst[-1], noisy_ctx) is LookupResult.HIT
    assert tenants.lookup(burst[0], noisy_ctx) is LookupResult.MISS
    for key in quiet:
        assert tenants.lookup(key, quiet_ctx) is LookupResult.HIT
    # An unquoted tenant (the default) may still use the room nobody protects.
    plain = [conformance_key(200 + i) for i in range(6)]
    _store(stack, tenants, plain, plain_ctx)
    usage = tenants.usage()
    assert usage["cpu"]["quiet"] == 4 * CHUNK, usage
    assert usage["cpu"]["default"] > 0, usage
    # The exporter's family reads the snapshot the last step took.
    tenants.on_schedule_end(ScheduleEndContext())
    (family,) = tenant_bytes_families(tenants)()
    samples = {(s.labels["tenant"], s.labels["tier"]): s.value for s in family.samples}
    assert family.name == "kvtiers_tenant_bytes"
    assert samples[("quiet", "cpu")] == 4 * CHUNK
    assert samples[("noisy", "lower")] == usage["lower"]["noisy"]


def test_inspect_counts_each_tenants_chunks(stacks: list[Stack], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from kvtiers.cli import main

    quiet_ctx, noisy_ctx, plain_ctx = _contexts()
    root = tmp_path / "root"
    stack, tenants = _build(stacks, {"kind": "file", "root": str(root)})
    _store(stack, tenants, [conformance_key(i) for i in range(3)], quiet_ctx)
    _store(stack, tenants, [conformance_key(i) for i in range(2)], noisy_ctx)
    _store(stack, tenants, [conformance_key(9)], plain_ctx)
    stack.shutdown()
    capsys.readouterr()
    assert main(["inspect", "--json", "--tenant", "quiet", "--tenant", "noisy",
                 str(root)]) == 0
    (namespace,) = json.loads(capsys.readouterr().out)["namespaces"]
    counted = {name: use["chunks"] for name, use in namespace["tenants"].items()}
    assert counted == {"quiet": 3, "noisy": 2, "(untagged)": 1}
    assert sum(use["bytes"] for use in namespace["tenants"].values()) == \
        namespace["chunk_bytes"]


def test_the_simulated_engine_keeps_a_tenants_quota(tmp_path: Path) -> None:
    from kvtiers.engine.simulator import SimulatedEngine
    from kvtiers.engine.workload import WorkloadSpec, conversation_requests

    quota = 256 * 1024
    stack = load_stack({
        "tiers": [{"kind": "cpu", "capacity": "2MiB"},
                  {"kind": "file", "root": str(tmp_path / "root")}],
        "model": {"name": "team/model", "tokens_per_hash": 16, "blocks_per_chunk": 2,
                  "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "2KiB"}]},
        "tenants": {"members": [{"name": "default", "quota": {"cpu": quota}}]},
    })
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    assert stack.tenants is not None
    reused = verified = 0
    workload = WorkloadSpec(conversations=4, system_prompts=1, turns=2,
                            system_tokens=(200, 260))
    try:
        for request in conversation_requests(workload):
            report = engine.run_request(request.req_id, request.token_ids)
            assert report.verification_failures == 0
            reused += report.reused_tokens
            verified += report.verified_blocks
            assert 0 < stack.tenants.usage()["cpu"]["default"] <= quota
    finally:
        engine.shutdown()
        stack.shutdown()
    assert reused > 0 and verified > 0


def test_a_promotion_keeps_to_the_tenants_primary_quota(stacks: list[Stack],
                                                         tmp_path: Path) -> None:
    _, noisy_ctx, _ = _contexts()
    stack, tenants = _build(stacks, {"kind": "file", "root": str(tmp_path / "root")})
    first = [conformance_key(i) for i in range(3)]
    _store(stack, tenants, first, noisy_ctx)
    _store(stack, tenants, [conformance_key(10 + i) for i in range(3)], noisy_ctx)
    assert tenants.usage()["cpu"]["noisy"] == 3 * CHUNK
    # Its first chunks are in the lower tier only now: a lookup promotes one.
    assert tenants.lookup(first[2], noisy_ctx) is LookupResult.HIT_PENDING
    assert tenants.usage()["cpu"]["noisy"] <= 3 * CHUNK
    assert _ready(tenants, first[2], noisy_ctx) is LookupResult.HIT
