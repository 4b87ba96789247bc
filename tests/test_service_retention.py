"""Retention through ``kvtiers serve`` (docs/retention.md, "Through the node service").

The service runs in its own process with ``tenants:`` and ``retention:`` sections of its
own; each engine is a stack whose primary is ``kind: service``, whose ``tenants:``
section scopes its keys and whose ``retention:`` section reads its requests' hints (sent
on with the step's commits). Each wait is on the service's replies or on its admin
endpoint's answer, except the one on a TTL passing by time, which polls the mirror with
a deadline; no sleeps.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgspec")

from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.service import protocol as p
from kvtiers.service.client import ServiceClient, read_status
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.serve import scrape
from kvtiers.testing.service import ServiceProcess
from tests.test_service_tenants import (
    CHUNK,
    SLOTS,
    pool_name,  # noqa: F401 (a fixture)
    serve_yaml,
    service,  # noqa: F401 (a fixture)
    tenants_of,
)

TOKEN_ENV = "KVTIERS_TEST_SERVE_ADMIN"
TOKEN = "serve-admin-secret"
PIN_CAP = 4
SERVICE_RETENTION = (
    "tenants:\n"
    "  members:\n"
    f"    - {{name: a, max_pinned_bytes: {PIN_CAP * CHUNK}}}\n"
    f"    - {{name: b, max_pinned_bytes: {PIN_CAP * CHUNK}}}\n"
    "retention:\n"
    f"  max_pinned_bytes: {SLOTS * CHUNK}\n"  # the default tenant's cap: the whole pool
    f"  admin_token_env: {TOKEN_ENV}\n"
    "metrics: {}\n"
)


@pytest.fixture
def retaining(tmp_path: Path, pool_name: str,  # noqa: F811 (the fixture above)
              monkeypatch: pytest.MonkeyPatch) -> Iterator[ServiceProcess]:
    pytest.importorskip("prometheus_client")
    from kvtiers.testing.serve import free_port

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    section = SERVICE_RETENTION.replace(
        "retention:\n", f"retention:\n  ledger: {tmp_path / 'ledger.json'}\n")
    proc = ServiceProcess(serve_yaml(tmp_path, pool_name, section),
                          tmp_path / "serve.sock", slot_bytes=CHUNK, metrics_port=free_port())
    proc.start(fresh=True)
    yield proc
    proc.stop()


def hinted_engine(socket: Path) -> Stack:
    """An engine reading its requests' retention hints (reserving slots: each batch's
    eviction happens at its request, in order)."""
    return load_stack({
        "tiers": [{"kind": "service", "socket": str(socket), "lease_slots": 0}],
        "tenants": {"members": [{"name": "a"}, {"name": "b"}]},
        "retention": {},
    }, offloading_config((CHUNK,)))


def observer(socket: Path) -> Stack:
    """An engine with no retention section: its lookups are the pool's mirror alone."""
    return load_stack({
        "tiers": [{"kind": "service", "socket": str(socket), "lease_slots": 0}],
        "tenants": {"members": [{"name": "a"}, {"name": "b"}]},
    }, offloading_config((CHUNK,)))


def hinted(tenant: str, **payload: Any) -> ReqContext:
    """A request of ``tenant`` whose ``kv_hints`` ask for ``payload`` (none if empty)."""
    params: dict[str, Any] = {"kvtiers_tenant": tenant}
    if payload:
        params["kv_hints"] = {"actions": [{"action_type": "retention",
                                           "action_version": "1", "payload": payload}]}
    return ReqContext(tenant, kv_transfer_params=params)


def store_hinted(stack: Stack, keys: list[OffloadKey], tenant: str, **payload: Any) -> None:
    """Store ``keys`` for ``tenant`` with a hint (in batches, each answered)."""
    tenants, primary = tenants_of(stack)
    batch_size = SLOTS // 8
    for at in range(0, len(keys), batch_size):
        batch = keys[at : at + batch_size]
        ctx = hinted(tenant, **payload)
        assert tenants.prepare_store(batch, ctx) == batch
        tenants.get_spec(batch)
        tenants.complete_store(batch, ctx)
        primary.flush(wait=True)


def held(stack: Stack, keys: list[OffloadKey], tenant: str) -> list[bool]:
    tenants, _ = tenants_of(stack)
    ctx = hinted(tenant)
    return [tenants.lookup(k, ctx) is LookupResult.HIT for k in keys]


def keys_from(start: int, count: int) -> list[OffloadKey]:
    return [conformance_key(start + i) for i in range(count)]


def admin(proc: ServiceProcess, action: str, body: dict[str, Any],
          token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to the service's ``/admin/<action>``: (status, JSON answer)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{proc.metrics_port}/admin/{action}",
        data=json.dumps(body).encode(), method="POST",
        headers={} if token is None else {"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def hashes(keys: list[OffloadKey]) -> list[str]:
    """The block hashes of ``keys`` as the admin endpoint takes them (unscoped)."""
    return [bytes(k[:-GROUP_INDEX_BYTES]).hex() for k in keys]


def pinned(state: dict[str, Any]) -> dict[str | None, int]:
    return {pins["tenant"]: pins["pinned_bytes"] for pins in state["retention"]["pins"]}


def test_a_higher_priority_outlives_older_chunks_of_its_tenant(
    retaining: ServiceProcess,
) -> None:
    valued = keys_from(0, 8)
    plain = keys_from(100, 8)
    later = keys_from(200, 24)
    with hinted_engine(retaining.socket) as stack:
        store_hinted(stack, valued, "a", priority=5)
        store_hinted(stack, plain, "a")
        store_hinted(stack, later, "a")  # 40 chunks into 32 slots: 8 go
        # Least recently used alone would take the valued chunks (stored first); their
        # priority has the tenant's priority-0 chunks go first, oldest first.
        assert held(stack, valued, "a") == [True] * 8
        assert held(stack, plain, "a") == [False] * 8
        assert held(stack, later, "a") == [True] * 24
    state = read_status(retaining.socket)
    assert state["counters"]["evictions"] == 8
    assert state["retention"]["retention_hints"] == 2  # the valued chunks' two batches


def test_pins_hold_under_pressure_within_each_tenants_cap_then_expire(
    retaining: ServiceProcess,
) -> None:
    a_pinned = keys_from(0, PIN_CAP)
    b_pinned = keys_from(50, PIN_CAP)
    a_over = keys_from(100, 4)
    filler = keys_from(200, 40)
    with hinted_engine(retaining.socket) as stack:
        store_hinted(stack, a_pinned, "a", pin_s=3600)
        store_hinted(stack, b_pinned, "b", pin_s=3600)  # its own cap: not a's
        store_hinted(stack, a_over, "a", pin_s=3600)  # past a's cap: refused, stored
        state = read_status(retaining.socket)
        assert pinned(state) == {"default": 0, "a": PIN_CAP * CHUNK, "b": PIN_CAP * CHUNK}
        assert state["retention"]["retention_pins_refused"] == 1
        assert exported_pins(retaining) == {"default": 0, "a": PIN_CAP * CHUNK,
                                            "b": PIN_CAP * CHUNK}
        store_hinted(stack, filler, "a")  # more than the pool again
        assert held(stack, a_pinned, "a") == [True] * PIN_CAP
        assert held(stack, b_pinned, "b") == [True] * PIN_CAP
        assert held(stack, a_over, "a") == [False] * 4
        # The admin expires a's pins (as a's keys): gone from the pool at the answer.
        status, answer = admin(retaining, "expire", {"block_hashes": hashes(a_pinned),
                                                     "tenant": "a"})
        assert (status, answer) == (200, {"expired": PIN_CAP, "in_s": 0.0})
        assert held(stack, a_pinned, "a") == [False] * PIN_CAP
        # Unpinned, b's chunks are the oldest: the next stores take them.
        assert admin(retaining, "unpin", {"block_hashes": hashes(b_pinned),
                                          "tenant": "b"}) == (200, {"unpinned": PIN_CAP})
        store_hinted(stack, keys_from(300, 8), "a")
        assert held(stack, b_pinned, "b") == [False] * PIN_CAP
    state = read_status(retaining.socket)
    assert pinned(state) == {"default": 0, "a": 0, "b": 0}
    assert exported_pins(retaining) == {"default": 0, "a": 0, "b": 0}
    assert state["counters"]["retention_expired_evictions"] == PIN_CAP


def exported_pins(proc: ServiceProcess) -> dict[str, float]:
    """``kvtiers_service_retention_pinned_bytes`` per tenant, as the service's exporter
    serves it now."""
    name = "kvtiers_service_retention_pinned_bytes"
    samples = scrape(f"http://127.0.0.1:{proc.metrics_port}/metrics")
    return {series[len(name) + len('{tenant="'):-len('"}')]: value
            for series, value in samples.items() if series.startswith(name + "{")}


def test_pinned_bytes_without_tenants_are_one_series_for_the_pool() -> None:
    """A service with retention and no tenants: the pool's pins, unlabelled; without a
    retention section, no family."""
    pytest.importorskip("prometheus_client")
    from kvtiers.service.metrics import _retention_families

    pool = {"retention": {"pins": [{"tenant": None, "pinned_bytes": 3 * CHUNK,
                                    "max_pinned_bytes": SLOTS * CHUNK}]}}
    (family,) = _retention_families(pool)
    assert family.name == "kvtiers_service_retention_pinned_bytes"
    assert [(sample.labels, sample.value) for sample in family.samples] == [({}, 3 * CHUNK)]
    assert list(_retention_families({"retention": None})) == []


def test_a_pin_never_wedges_the_pool(retaining: ServiceProcess) -> None:
    pinned_keys = keys_from(0, SLOTS)
    newer = keys_from(100, 4)
    with hinted_engine(retaining.socket) as stack:
        # The default tenant's cap is the whole pool: every slot holds a pinned chunk.
        store_hinted(stack, pinned_keys, "default", pin_s=3600)
        assert pinned(read_status(retaining.socket))["default"] == SLOTS * CHUNK
        # Nothing else can make room: the oldest pinned chunks go (counted), the store
        # is not refused.
        store_hinted(stack, newer, "a")
        assert held(stack, newer, "a") == [True] * 4
        assert held(stack, pinned_keys, "default") == [False] * 4 + [True] * (SLOTS - 4)
    state = read_status(retaining.socket)
    assert state["retention"]["retention_pins_overridden"] == 4


def test_a_ttl_makes_a_miss_in_the_pool(retaining: ServiceProcess) -> None:
    now = keys_from(0, 4)
    soon = keys_from(10, 4)
    kept = keys_from(20, 4)
    with hinted_engine(retaining.socket) as stack, observer(retaining.socket) as other:
        store_hinted(stack, now, "a", ttl_s=0)
        store_hinted(stack, soon, "a", ttl_s=0.5)
        store_hinted(stack, kept, "a", ttl_s=3600)
        # Another engine reads the pool's mirror alone: the service evicted the chunks
        # whose TTL was 0 before it answered the hint.
        assert held(other, now, "a") == [False] * 4
        assert held(other, kept, "a") == [True] * 4
        # The service wakes for the next expiry by itself (no request comes meanwhile).
        deadline = time.monotonic() + 60
        while any(held(other, soon, "a")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(other, soon, "a") == [False] * 4
        assert held(other, kept, "a") == [True] * 4
        # The block hashes as tenant a's requests stored them.
        scope = tenants_of(stack)[0].keys.scope
        scoped = {bytes(scope(k, "a"))[:-GROUP_INDEX_BYTES] for k in kept}
    assert read_status(retaining.socket)["counters"]["retention_expired_evictions"] == 8
    # The service's ledger (written at its stop) gives kvtiers gc the TTLs it holds.
    assert retaining.stop() == 0
    from kvtiers.stack.ledger import read_ledgers

    expiries = read_ledgers([retaining.config.parent / "ledger.json"])
    assert scoped <= set(expiries)
    assert all(expiries[h] > time.time() + 3000 for h in scoped)


def test_the_admin_endpoint_refuses_a_call_without_the_token(
    retaining: ServiceProcess, capsys: pytest.CaptureFixture[str],
) -> None:
    keys = keys_from(0, 2)
    with hinted_engine(retaining.socket) as stack:
        store_hinted(stack, keys, "a")
        body = {"block_hashes": hashes(keys), "seconds": 60, "tenant": "a"}
        for token in (None, "not-the-token"):
            status, answer = admin(retaining, "pin", body, token=token)
            assert status == 401
            assert "Bearer" in answer["error"]
        status, answer = admin(retaining, "pin", {**body, "tenant": "c"})
        assert status == 400
        assert "no tenant 'c'" in answer["error"]
        assert pinned(read_status(retaining.socket)) == {"default": 0, "a": 0, "b": 0}
        assert admin(retaining, "pin", body) == (200, {"pinned": 2, "seconds": 60.0})
        assert pinned(read_status(retaining.socket))["a"] == 2 * CHUNK
        from kvtiers.cli import main

        assert main(["status", "--socket", str(retaining.socket)]) == 0
        assert (f"  tenant a: {2 * CHUNK} bytes pinned (cap {PIN_CAP * CHUNK})"
                in capsys.readouterr().out)
        # Past a's cap: refused whole, b's allowance untouched.
        over = {"block_hashes": hashes(keys_from(10, PIN_CAP)), "seconds": 60,
                "tenant": "a"}
        assert admin(retaining, "pin", over)[0] == 409
        assert admin(retaining, "pin", {**over, "tenant": "b"})[0] == 200


@pytest.mark.parametrize(("field", "value"), [
    ("priority", "high"), ("priority", 10**6), ("pin_s", -1.0), ("pin_s", math.nan),
    ("ttl_s", "1h"), ("ttl_s", 10.0**12), ("keys", None),
], ids=["priority-type", "priority-range", "pin-negative", "pin-nan", "ttl-type",
        "ttl-range", "too-many-keys"])
def test_a_malformed_hint_is_ignored_never_a_failed_request(
    retaining: ServiceProcess, field: str, value: object,
) -> None:
    from kvtiers.filemapper import NamespaceIdentity

    key = conformance_key(0)
    with hinted_engine(retaining.socket) as stack:
        store_hinted(stack, [key], "default")
    identity = NamespaceIdentity.from_config(offloading_config((CHUNK,))).canonical_json()
    client = ServiceClient(retaining.socket, identity, CHUNK)
    try:
        fields: dict[str, Any] = {"priority": 0, "pin_s": None, "ttl_s": 0}
        keys = [bytes(key)]
        if field == "keys":
            keys = keys * (p.MAX_RETAIN_KEYS + 1)
        else:
            fields[field] = value
        retain = p.Retain(client.next_seq(), client.ns, keys, **fields)
        lookup = p.Lookup(client.next_seq(), client.ns, [bytes(key)])
        replies = client.call([retain, lookup])
        # Answered, the connection kept, and the hint (a TTL of 0) not applied.
        assert isinstance(replies[0], p.Done)
        assert isinstance(replies[1], p.Slots) and replies[1].slots[0] >= 0
    finally:
        client.close()
    state = read_status(retaining.socket)
    assert state["retention"]["retention_hints_ignored"] == 1
    assert state["counters"].get("bad_messages", 0) == 0


def test_a_service_without_retention_gets_no_hints(
    service: ServiceProcess,  # noqa: F811 (the fixture above)
) -> None:
    keys = keys_from(0, 4)
    with hinted_engine(service.socket) as stack:
        store_hinted(stack, keys, "a", ttl_s=0)
        _, primary = tenants_of(stack)
        assert primary.stats["retention_hints_sent"] == 0
        assert primary.stats["retention_hints_unsent"] > 0
        with observer(service.socket) as other:
            assert held(other, keys, "a") == [True] * 4
    state = read_status(service.socket)
    assert state["retention"] is None
    assert state["counters"].get("bad_messages", 0) == 0



def test_a_chunk_past_its_ttl_is_not_promoted_back_from_a_lower_tier(
    tmp_path: Path, pool_name: str,  # noqa: F811 (the fixture above)
) -> None:
    from tests.test_service_lower import engine as raw_engine
    from tests.test_service_lower import resolve, wait_status
    from tests.test_service_lower import store as raw_store

    config = serve_yaml(tmp_path, pool_name, "retention: {}\n",
                        f"  - name: disk\n    kind: file\n    root: {tmp_path / 'root'}\n")
    proc = ServiceProcess(config, tmp_path / "serve.sock", slot_bytes=CHUNK)
    proc.start(fresh=True)
    try:
        stored = raw_engine(proc.socket)
        expired, kept = conformance_key(0), conformance_key(1)
        raw_store(stored, [expired, kept], settle=proc.socket)  # on the file tier too
        client = stored.client
        reply = client.call([p.Retain(client.next_seq(), client.ns, [bytes(expired)],
                                      0, None, 0)])
        assert isinstance(reply[0], p.Done)
        state = wait_status(proc.socket, lambda s: s["ready_slots"] == 1)
        assert state["lower_tiers"][0]["tiers"][0]["chunks"] == 2
        reader = raw_engine(proc.socket)
        # Held below the pool, yet past its TTL: the probe answers "held nowhere".
        assert resolve(reader, expired)[0] is LookupResult.MISS
        assert resolve(reader, kept)[0] is LookupResult.HIT
        stored.shutdown()
        reader.shutdown()
    finally:
        proc.stop()
