"""Tenants through ``kvtiers serve`` (docs/tenants.md, "The node service").

The service runs in its own process with a ``tenants:`` section of its own; each tenant's
engine is a stack whose primary is ``kind: service`` and whose ``tenants:`` section scopes
its keys (the tag the service reads them by). Each wait is on the service's replies (a
store's commit is flushed and answered before the next); no sleeps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgspec")

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.service.client import read_status
from kvtiers.service.tier import ServiceTierManager
from kvtiers.service.worker import CheckedSlots
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.stack.tenants import TenantStack
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.service import ServiceProcess, remove_pool

CHUNK = 4096
SLOTS = 32
#: A connection holds an eighth of the pool at once: stores go in batches of this.
BATCH = SLOTS // 8
QUIET_SHARE = 8
NOISY_QUOTA = 24
SMALL_QUOTA = 4
SERVICE_TENANTS = (
    "tenants:\n"
    "  members:\n"
    f"    - {{name: quiet, protected: {{pool: {QUIET_SHARE * CHUNK}}}}}\n"
    f"    - {{name: noisy, quota: {{pool: {NOISY_QUOTA * CHUNK}}}}}\n"
    f"    - {{name: small, quota: {{pool: {SMALL_QUOTA * CHUNK}}}}}\n"
)


@pytest.fixture
def pool_name(tmp_path: Path) -> Iterator[str]:
    name = f"kvtiers-test-{os.getpid()}-{tmp_path.name}"
    yield name
    remove_pool(name)


def serve_yaml(tmp_path: Path, pool_name: str, tenants: str, lower: str = "") -> Path:
    config = tmp_path / "serve.yaml"
    config.write_text(f"tiers:\n  - name: pool\n    kind: cpu\n    capacity: {SLOTS * CHUNK}\n"
                      f"    shared_memory_name: {pool_name}\n{lower}{tenants}")
    return config


@pytest.fixture
def service(tmp_path: Path, pool_name: str) -> Iterator[ServiceProcess]:
    pytest.importorskip("prometheus_client")
    from kvtiers.testing.serve import free_port

    proc = ServiceProcess(serve_yaml(tmp_path, pool_name, SERVICE_TENANTS),
                          tmp_path / "serve.sock", slot_bytes=CHUNK, metrics_port=free_port())
    proc.start(fresh=True)
    yield proc
    proc.stop()


def engine(socket: Path, lease_slots: int) -> Stack:
    """An engine's stack: the service as its primary, the two tenants named (no quotas:
    those are the service's)."""
    return load_stack({
        "tiers": [{"kind": "service", "socket": str(socket), "lease_slots": lease_slots}],
        "tenants": {"members": [{"name": "quiet"}, {"name": "noisy"}, {"name": "small"}]},
    }, offloading_config((CHUNK,)))


def tenants_of(stack: Stack) -> tuple[TenantStack, ServiceTierManager]:
    assert isinstance(stack.tenants, TenantStack)
    primary = stack.tiers[0].manager
    assert isinstance(primary, ServiceTierManager)
    return stack.tenants, primary


def ctx_of(tenant: str) -> ReqContext:
    return ReqContext(tenant, kv_transfer_params={"kvtiers_tenant": tenant})


def store(stack: Stack, keys: list[OffloadKey], tenant: str) -> None:
    """Store ``keys`` for ``tenant`` in batches, each batch's commit answered before the
    next batch asks for slots."""
    tenants, primary = tenants_of(stack)
    for at in range(0, len(keys), BATCH):
        batch = keys[at : at + BATCH]
        ctx = ctx_of(tenant)
        accepted = tenants.prepare_store(batch, ctx)
        assert accepted == batch
        spec = tenants.get_spec(batch)
        assert isinstance(spec, CheckedSlots)
        for k, slot in zip(batch, spec.block_ids, strict=True):
            primary.region.view(int(slot))[:CHUNK] = conformance_payload(keys.index(k), CHUNK)
        tenants.complete_store(batch, ctx)
        primary.flush(wait=True)


def held(stack: Stack, keys: list[OffloadKey], tenant: str) -> list[bool]:
    """Whether each key is in the pool for ``tenant`` (a lookup of the mirror)."""
    tenants, _ = tenants_of(stack)
    ctx = ctx_of(tenant)
    return [tenants.lookup(k, ctx) is LookupResult.HIT for k in keys]


def usage(state: dict[str, Any]) -> dict[str, int]:
    return {t["name"]: t["chunks"] for t in state["tenants"]}


@pytest.mark.parametrize("lease_slots", [0, BATCH], ids=["reserve", "lease"])
def test_a_noisy_tenant_evicts_its_own_chunks_never_the_quiet_share(
    service: ServiceProcess, lease_slots: int,
) -> None:
    from kvtiers.testing.serve import scrape

    quiet_keys = [conformance_key(i) for i in range(12)]
    noisy_keys = [conformance_key(100 + i) for i in range(40)]
    with engine(service.socket, lease_slots) as quiet, \
            engine(service.socket, lease_slots) as noisy:
        store(quiet, quiet_keys, "quiet")
        assert usage(read_status(service.socket)) == {"default": 0, "quiet": 12, "noisy": 0,
                                                      "small": 0}
        # The same prompts, another tenant: scoped keys, no hit on the quiet tenant's.
        assert held(noisy, quiet_keys, "noisy") == [False] * 12
        store(noisy, noisy_keys, "noisy")  # 40 chunks into a pool of 32 slots
        state = read_status(service.socket)
        counts = usage(state)
        # The pool filled: the quiet tenant lost its least recently used chunks down to
        # its protected share and no further; the noisy one then made room from its own.
        assert counts["quiet"] == QUIET_SHARE
        assert held(quiet, quiet_keys, "quiet") == [False] * 4 + [True] * QUIET_SHARE
        if lease_slots == 0:
            # Reserved slots count at once: the noisy tenant holds exactly its quota,
            # its most recent chunks, and made room from them once there.
            assert counts["noisy"] == NOISY_QUOTA
            # Every eviction was one of the quiet tenant's four or the noisy one's own.
            assert state["counters"]["evictions"] == 4 + 40 - NOISY_QUOTA
            assert state["counters"]["tenant_quota_evictions"] > 0
            assert held(noisy, noisy_keys, "noisy") == (
                [False] * (40 - NOISY_QUOTA) + [True] * NOISY_QUOTA)
        else:
            # Leased slots hold nothing (each engine keeps some empty); a lease names no
            # tenant, so it spared every protected share and took the rest.
            assert 0 < counts["noisy"] <= NOISY_QUOTA
            assert counts["noisy"] + QUIET_SHARE + state["leased_slots"] == SLOTS
            assert held(noisy, noisy_keys[-counts["noisy"]:], "noisy") == [True] * counts[
                "noisy"]
        assert state["tenants"][1] == {"name": "quiet", "chunks": QUIET_SHARE,
                                       "bytes": QUIET_SHARE * CHUNK, "quota_bytes": None,
                                       "protected_bytes": QUIET_SHARE * CHUNK,
                                       "lower_bytes": {}, "lower_quota_bytes": {}}
        samples = scrape(f"http://127.0.0.1:{service.metrics_port}/metrics")
        for name, count in counts.items():
            assert samples[f'kvtiers_service_tenant_bytes{{tenant="{name}"}}'] == count * CHUNK
            assert samples[f'kvtiers_service_tenant_chunks{{tenant="{name}"}}'] == count


def test_a_tenant_over_its_quota_by_leases_is_trimmed_at_commit(
    service: ServiceProcess,
) -> None:
    keys = [conformance_key(i) for i in range(3 * BATCH)]
    with engine(service.socket, BATCH) as small:
        store(small, keys, "small")  # leased slots: the tenant is known at the commit
        state = read_status(service.socket)
        assert usage(state)["small"] == SMALL_QUOTA
        assert held(small, keys, "small") == [False] * (len(keys) - SMALL_QUOTA) + [
            True] * SMALL_QUOTA
    assert state["counters"]["tenant_quota_evictions"] == len(keys) - SMALL_QUOTA


def test_kvtiers_status_shows_usage_per_tenant(service: ServiceProcess,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvtiers.cli import main

    with engine(service.socket, 0) as noisy:
        store(noisy, [conformance_key(i) for i in range(BATCH)], "noisy")
        assert main(["status", "--socket", str(service.socket), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert usage(shown) == {"default": 0, "quiet": 0, "noisy": BATCH, "small": 0}
        assert main(["status", "--socket", str(service.socket)]) == 0
        text = capsys.readouterr().out
    assert (f"tenant noisy: {BATCH} chunks, {BATCH * CHUNK} bytes in the pool "
            f"(quota {NOISY_QUOTA * CHUNK}, protected 0)") in text


@pytest.mark.parametrize(("tenants", "lower", "line", "path", "words"), [
    ("tenants:\n  members:\n    - name: a\n      protected: {lower: 1MiB}\n",
     "  - name: lower\n    kind: file\n    root: ROOT\n", 12,
     "tenants.members[0].protected.lower",
     "kvtiers serve protects tenants' shares in its pool (tier 'pool') only"),
    ("tenants:\n  members:\n    - name: a\n      quota: {pool: 4KiB}\n"
     "      protected: {pool: 8KiB}\n", "", 10, "tenants.members[0].protected.pool",
     "larger than the quota"),
    ("tenants:\n  members:\n    - name: a\n      quota: {disk: 4KiB}\n", "", 9,
     "tenants.members[0].quota.disk", "no tier is named 'disk'"),
], ids=["share-below-the-pool", "share-over-quota", "unknown-tier"])
def test_a_bad_tenants_section_is_refused_at_start(
    tmp_path: Path, pool_name: str, tenants: str, lower: str, line: int, path: str,
    words: str,
) -> None:
    config = serve_yaml(tmp_path, pool_name, tenants, lower.replace("ROOT", str(tmp_path)))
    done = subprocess.run(
        [sys.executable, "-m", "kvtiers", "serve", "--config", str(config), "--socket",
         str(tmp_path / "serve.sock"), "--slot-bytes", str(CHUNK)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 2
    assert f"{config}:{line}: {path}: " in done.stderr
    assert words in done.stderr
    assert not (tmp_path / "serve.sock").exists()


#: The quiet tenant's quota on the tier below the pool, bytes of that tier.
LOWER_QUOTA_BYTES = 4 * CHUNK


def test_a_tenants_quota_on_a_tier_below_the_pool_is_kept_there(
    tmp_path: Path, pool_name: str,
) -> None:
    from tests.test_service_lower import wait_status

    tenants = ("tenants:\n  members:\n"
               f"    - {{name: quiet, quota: {{disk: {LOWER_QUOTA_BYTES}}}}}\n"
               "    - {name: noisy}\n")
    disk = f"  - name: disk\n    kind: file\n    root: {tmp_path / 'root'}\n"
    proc = ServiceProcess(serve_yaml(tmp_path, pool_name, tenants, disk),
                          tmp_path / "serve.sock", slot_bytes=CHUNK)
    proc.start(fresh=True)
    try:
        with engine(proc.socket, 0) as stack:
            store(stack, [conformance_key(100 + i) for i in range(8)], "noisy")
            store(stack, [conformance_key(i) for i in range(12)], "quiet")

            def lower_bytes(state: dict[str, Any], tenant: str) -> int:
                row = next(t for t in state["tenants"] if t["name"] == tenant)
                return int(row["lower_bytes"]["disk"])

            # Written behind, then trimmed once no copy is in flight (the one wait that
            # polls: on the service's own report).
            state = wait_status(proc.socket, lambda s: bool(s["lower_tiers"]) and (
                s["lower_tiers"][0]["cascades"] >= 20
                and 0 < lower_bytes(s, "quiet") <= LOWER_QUOTA_BYTES))
        # A chunk on the file tier takes more than its payload: count in its own size.
        per_chunk = lower_bytes(state, "noisy") // 8
        assert per_chunk >= CHUNK and lower_bytes(state, "noisy") == 8 * per_chunk
        quiet_chunks = lower_bytes(state, "quiet") // per_chunk
        assert quiet_chunks == LOWER_QUOTA_BYTES // per_chunk
        # Only the quiet tenant's own chunks went; every one of them stays in the pool.
        assert state["lower_tiers"][0]["tiers"][0]["chunks"] == 8 + quiet_chunks
        assert state["counters"]["tenant_lower_quota_evictions"] == 12 - quiet_chunks
        assert usage(state) == {"default": 0, "quiet": 12, "noisy": 8}
        row = next(t for t in state["tenants"] if t["name"] == "quiet")
        assert row["lower_quota_bytes"] == {"disk": LOWER_QUOTA_BYTES}
    finally:
        proc.stop()
