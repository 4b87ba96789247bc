"""Retention (kvtiers.policies.retention): kv_hints priority, pins and TTL through a
stack's composite and cpu primary, the pin cap, malformed hints; the admin endpoint on
the metrics server. Time is a hand-moved clock: nothing sleeps."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.errors import ConfigError
from kvtiers.filemapper import key_from_chunk_name
from kvtiers.policies.retention import RetentionBook
from kvtiers.stack.builder import Stack, load_stack

# Chunks of 2 pages of 4 KiB: an 8 KiB slot; a 32 KiB primary holds 4 chunks.
MODEL = {"name": "m", "tokens_per_hash": 16, "blocks_per_chunk": 2,
         "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}]}
SLOT = 8192
TOKEN = "s3cret-token"


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(16, "big"), 0)


def hints(**payload: Any) -> dict[str, Any]:
    """A kv_hints envelope (as plain JSON) with one retention action."""
    return {"protocol_version": "1", "message_id": "m", "actions": [
        {"action_id": "a", "action_type": "retention", "action_version": "1",
         "payload": payload}]}


def request(name: str, envelope: Any = None, *, in_params: bool = False) -> ReqContext:
    if in_params:
        return ReqContext(req_id=name, kv_transfer_params={"kv_hints": envelope})
    return ReqContext(req_id=name, kv_hints=envelope)


def build(retention: dict[str, Any] | None = None, capacity: str = "32KiB",
          **more: Any) -> tuple[Stack, Clock]:
    stack = load_stack({"tiers": [{"kind": "cpu", "capacity": capacity}], "model": MODEL,
                        "retention": {} if retention is None else retention, **more})
    clock = Clock()
    book = stack.manager.retention
    assert book is not None
    book.clock = clock
    book.bad_hints.clock = book.refused_pins.clock = clock
    return stack, clock


@pytest.fixture
def stack_clock() -> Iterator[tuple[Stack, Clock]]:
    stack, clock = build()
    with stack:
        yield stack, clock


def store_each(stack: Stack, keys: list[OffloadKey]) -> None:
    """Store ``keys`` one request each, in order (a request's own chunks are ordered by
    the tier's prefix rules, not by recency)."""
    for k in keys:
        store(stack, [k], request(f"plain-{k.hex()}"))


def store(stack: Stack, keys: list[OffloadKey], ctx: ReqContext) -> None:
    manager = stack.manager
    manager.on_new_request(ctx)
    accepted = manager.prepare_store(keys, ctx)
    assert accepted is not None
    manager.complete_store(accepted, ctx)
    manager.on_request_finished(ctx)


def evicted(stack: Stack) -> list[OffloadKey]:
    return [k for e in stack.manager.take_events() if e.removed for k in e.keys]


def held(stack: Stack, keys: list[OffloadKey]) -> list[bool]:
    ctx = ReqContext(req_id="probe")
    return [stack.manager.lookup(k, ctx) is LookupResult.HIT for k in keys]


def stats(stack: Stack) -> dict[str, float]:
    return dict(stack.manager.get_stats())


def test_priority_changes_eviction_order(stack_clock: tuple[Stack, Clock]) -> None:
    stack, _ = stack_clock
    # Without hints the oldest chunk (key 0) is the LRU victim; priority 5 keeps it.
    store(stack, [key(0)], request("hi", hints(priority=5)))
    store_each(stack, [key(1), key(2), key(3)])
    stack.manager.take_events()
    store(stack, [key(4)], request("next"))
    assert evicted(stack) == [key(1)]
    # Negative priority goes first, however recent.
    store(stack, [key(5)], request("lo", hints(priority=-1)))
    assert evicted(stack) == [key(2)]
    store(stack, [key(6)], request("more"))
    assert evicted(stack) == [key(5)]
    assert stats(stack)["retention_hints"] == 2


def test_hints_in_kv_transfer_params_work_too(stack_clock: tuple[Stack, Clock]) -> None:
    stack, _ = stack_clock
    store(stack, [key(0)], request("hi", hints(priority=5), in_params=True))
    store_each(stack, [key(1), key(2), key(3), key(4)])
    assert held(stack, [key(0)]) == [True]


def test_pins_hold_until_their_deadline(stack_clock: tuple[Stack, Clock]) -> None:
    stack, clock = stack_clock
    store(stack, [key(0)], request("pin", hints(pin_s=100)))
    store_each(stack, [key(i) for i in range(1, 7)])  # evicts 1, 2, 3
    assert held(stack, [key(0), key(1)]) == [True, False]
    clock.now += 101  # the pin ran out: key 0 is the least recently used again
    stack.manager.take_events()
    store(stack, [key(7)], request("c"))
    assert evicted(stack) == [key(0)]
    assert stats(stack)["retention_pins"] == 1


def test_over_cap_pin_is_refused_whole_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    # The cap: 2 chunks; a pin of 3 is refused whole, twice, warned about once.
    stack, _ = build({"max_pinned_bytes": 2 * SLOT})
    with stack, caplog.at_level(logging.WARNING, "kvtiers.policies.retention"):
        store(stack, [key(0), key(1), key(2)], request("big", hints(pin_s=100)))
        store(stack, [key(3), key(4), key(5)], request("big2", hints(pin_s=100)))
        book = stack.manager.retention
        assert book is not None
        assert not any(book.is_pinned(key(i)) for i in range(6))
        assert stats(stack)["retention_pins_refused"] == 2
        assert stats(stack)["retention_pinned_bytes"] == 0
        warned = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(warned) == 1
        # Within the cap it is granted.
        store(stack, [key(6), key(7)], request("ok", hints(pin_s=100)))
        assert stats(stack)["retention_pinned_bytes"] == 2 * SLOT


def test_a_pin_never_makes_a_store_fail() -> None:
    # A cap as large as the tier: every slot pinned, a new store still lands, evicting the
    # least recently used pinned chunk (counted).
    stack, _ = build({"max_pinned_bytes": 4 * SLOT})
    with stack:
        for i in range(4):
            store(stack, [key(i)], request(f"pin{i}", hints(pin_s=100)))
        stack.manager.take_events()
        store(stack, [key(9)], request("new"))
        assert evicted(stack) == [key(0)]
        assert stats(stack)["retention_pins_overridden"] == 1


def test_the_default_cap_is_half_the_primary() -> None:
    stack, _ = build()
    with stack:
        book = stack.manager.retention
        assert book is not None
        assert book.max_pinned_bytes == 2 * SLOT


def test_ttl_expiry_by_the_tier(stack_clock: tuple[Stack, Clock]) -> None:
    stack, clock = stack_clock
    store(stack, [key(0)], request("ttl", hints(ttl_s=10)))
    store_each(stack, [key(1), key(2), key(3)])
    stack.manager.touch([key(0)], ReqContext(req_id="use"))  # the most recent now
    assert held(stack, [key(0)]) == [True]
    clock.now += 11
    assert held(stack, [key(0)]) == [False]
    assert stats(stack)["retention_expired_misses"] == 1
    # The expired chunk goes first, though the least recently used is key 1.
    stack.manager.take_events()
    store(stack, [key(4)], request("b"))
    assert evicted(stack) == [key(0)]


def test_a_chunk_expired_after_it_was_stored_goes_first(
        stack_clock: tuple[Stack, Clock]) -> None:
    """An expiry set later (the admin's, a later request's hint) orders evictions too."""
    stack, _ = stack_clock
    store_each(stack, [key(0), key(1), key(2), key(3)])
    book = stack.manager.retention
    assert book is not None
    book.expire_hashes([key(2)[:-4]])
    stack.manager.take_events()
    store(stack, [key(4)], request("next"))
    assert evicted(stack) == [key(2)]


def test_an_expired_chunk_stored_again_without_a_hint_is_fresh(
        stack_clock: tuple[Stack, Clock]) -> None:
    stack, clock = stack_clock
    store(stack, [key(0)], request("ttl", hints(ttl_s=10)))
    clock.now += 11
    assert held(stack, [key(0)]) == [False]
    store(stack, [key(0)], request("again"))
    assert held(stack, [key(0)]) == [True]


@pytest.mark.parametrize("envelope", [
    hints(priority="high"),
    hints(pin_s=-1),
    hints(ttl_s=10**12),
    hints(keep="forever"),
    {"actions": "retain"},
    {"actions": [{"action_type": "retention", "action_version": "9", "payload": {}}]},
    {"actions": [{"action_type": "prefetch", "action_version": "1", "payload": {}}]},
    {"actions": [{"action_type": "retention", "action_version": "1", "payload": [1]}]},
])
def test_a_malformed_or_unknown_hint_is_ignored(
        envelope: Any, stack_clock: tuple[Stack, Clock], caplog: pytest.LogCaptureFixture
) -> None:
    stack, _ = stack_clock
    with caplog.at_level(logging.WARNING, "kvtiers.policies.retention"):
        for name in ("r1", "r2", "r3"):
            store(stack, [key(0), key(1)], request(name, envelope))
    assert held(stack, [key(0), key(1)]) == [True, True]
    records = [r for r in caplog.records if r.name == "kvtiers.policies.retention"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "r1" in records[0].getMessage()
    assert stats(stack)["retention_hints_ignored"] == 3
    assert stats(stack)["retention_hints"] == 0


def test_hints_off_reads_none() -> None:
    stack, _ = build({"hints": False})
    with stack:
        store(stack, [key(0)], request("r", hints(pin_s=100)))
        assert stats(stack)["retention_pins"] == 0


def test_vllm_hint_envelope_reaches_the_context() -> None:
    protocol = pytest.importorskip("vllm.v1.kv_hints")
    from vllm.v1.kv_offload import base as vbase

    from kvtiers.integrations.vllm.translate import kvtiers_context

    envelope = protocol.KvHintsEnvelope(
        protocol_version="1", message_id="m",
        actions=[protocol.KvHintAction(action_id="a", action_type="retention",
                                       action_version="1", payload={"priority": 3})])
    ctx = kvtiers_context(vbase.ReqContext(req_id="r", kv_hints=envelope))
    book = RetentionBook(hash_bytes=SLOT, max_pinned_bytes=0)
    from kvtiers.policies.retention import parse_hint

    hint = parse_hint(ctx, book)
    assert hint is not None and hint.priority == 3


def test_ttl_expiry_by_gc(tmp_path: Path) -> None:
    """The engine's ledger names each TTL; ``gc --expired`` removes the file tier's chunks
    past theirs and keeps the rest (one without a TTL, one whose TTL runs on)."""
    from kvtiers.stack.ledger import read_ledgers
    from kvtiers.tools.commands import GcRules, gc
    from kvtiers.tools.locations import open_location

    root, ledger = tmp_path / "root", tmp_path / "ledger.json"
    stack, clock = build({"ledger": str(ledger)}, tiers=[
        {"kind": "cpu", "capacity": "32KiB"},
        {"kind": "file", "root": str(root), "io": "posix", "threads": 2}])
    with stack:
        store(stack, [key(0)], request("old", hints(ttl_s=10)))  # expired long ago
        clock.now = time.time()
        store(stack, [key(1)], request("new", hints(ttl_s=3600)))
        store(stack, [key(2)], request("plain"))
        stack.manager.wait_idle()
        stack.manager.on_schedule_end(ScheduleEndContext())
    expiries = read_ledgers([ledger])
    assert set(expiries) == {key(0)[:-4], key(1)[:-4]}
    location = open_location(str(root))
    try:
        [namespace] = location.namespaces()
        out = io.StringIO()
        assert gc(location, GcRules(expired=expiries), out) == 0
        left = {key_from_chunk_name(e.base) for e in location.entries(namespace)} - {None}
    finally:
        location.close()
    assert left == {key(1), key(2)}, out.getvalue()
    assert "removed 1 files" in out.getvalue()


def test_a_bad_ledger_is_a_config_error(tmp_path: Path) -> None:
    from kvtiers.stack.ledger import read_ledgers

    path = tmp_path / "ledger.json"
    path.write_text('{"version": 1, "expires": {"zz": 1}}')
    with pytest.raises(ConfigError, match="not a hex block hash"):
        read_ledgers([path])
    with pytest.raises(ConfigError, match="cannot read"):
        read_ledgers([tmp_path / "missing.json"])


def test_route1_reads_vllm_hints_and_never_skips_the_composite(tmp_path: Path) -> None:
    """Through vLLM's manager API (route 1, a one-tier stack): the request's
    ``KvHintsEnvelope`` reaches the book, and the direct mode (which would skip the
    composite's expiry check) is not taken."""
    protocol = pytest.importorskip("vllm.v1.kv_hints")
    from vllm.v1.kv_offload import base as vbase
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtiers.integrations.vllm.direct import KVTiersDirectManager
    from tests.test_vllm_spec import make_request, vllm_config

    config = vllm_config(tmp_path, kvtiers={"tiers": [{"kind": "cpu", "capacity": "16KiB"}],
                                            "retention": {}})
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        assert not isinstance(manager, KVTiersDirectManager)
        envelope = protocol.KvHintsEnvelope(
            protocol_version="1", message_id="m",
            actions=[protocol.KvHintAction(action_id="a", action_type="retention",
                                           action_version="1", payload={"priority": 7})])
        ctx = vbase.ReqContext(req_id="r", kv_hints=envelope)
        manager.on_new_request(ctx)
        keys = [make_request(1, first_block=0).keys[0][0]]
        assert manager.prepare_store(keys, ctx) is not None
        book = manager.stack.manager.retention
        assert book is not None and book.priority(keys[0]) == 7
    finally:
        manager.shutdown()


# -- the admin endpoint --------------------------------------------------------------

def call(port: int, path: str, body: Any = None, token: str | None = TOKEN,
         method: str = "POST") -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes)
                                      else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture
def admin(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Stack, int, Clock]]:
    pytest.importorskip("prometheus_client")
    monkeypatch.setenv("KVT_TEST_ADMIN", TOKEN)
    stack, clock = build({"admin_token_env": "KVT_TEST_ADMIN"}, metrics={"port": 0})
    with stack:
        assert stack.metrics is not None
        yield stack, stack.metrics.port, clock


HASH = (7).to_bytes(16, "big").hex()


def test_admin_refuses_an_unauthenticated_call(admin: tuple[Stack, int, Clock]) -> None:
    stack, port, _ = admin
    for token in (None, "wrong"):
        status, body = call(port, "/admin/pin", {"block_hashes": [HASH], "seconds": 60},
                            token=token)
        assert status == 401 and "Bearer" in body["error"]
    book = stack.manager.retention
    assert book is not None and not book.is_pinned(key(7))


@pytest.mark.parametrize(("path", "body", "phrase"), [
    ("/admin/pin", b"not json", "not JSON"),
    ("/admin/pin", [HASH], "JSON object"),
    ("/admin/pin", {"block_hashes": [HASH]}, "give seconds"),
    ("/admin/pin", {"block_hashes": [HASH], "seconds": -5}, "seconds must be"),
    ("/admin/pin", {"block_hashes": ["xyz"], "seconds": 5}, "block_hashes[0] is not"),
    ("/admin/pin", {"block_hashes": ["abcd"], "seconds": 5}, "has 2 bytes"),
    ("/admin/pin", {"block_hashes": [], "seconds": 5}, "block_hashes must be"),
    ("/admin/pin", {"token_ids": [1, 2], "seconds": 5}, "token ids are not accepted"),
    ("/admin/unpin", {"block_hashes": [HASH], "seconds": 5}, "unpin takes no seconds"),
    ("/admin/pin", {"block_hashes": [HASH], "seconds": 5, "tenant": "a"},
     "tenant needs a stack with a tenants: section"),
])
def test_admin_bad_input_is_a_400(admin: tuple[Stack, int, Clock], path: str, body: Any,
                                  phrase: str) -> None:
    _, port, _ = admin
    status, answer = call(port, path, body)
    assert status == 400
    assert phrase in answer["error"]


def test_admin_pins_unpins_and_expires(admin: tuple[Stack, int, Clock]) -> None:
    stack, port, clock = admin
    book = stack.manager.retention
    assert book is not None
    assert call(port, "/admin/pin", {"block_hashes": [HASH], "seconds": 60}) == (
        200, {"pinned": 1, "seconds": 60.0})
    assert book.is_pinned(key(7))
    assert call(port, "/admin/unpin", {"block_hashes": [HASH]}) == (200, {"unpinned": 1})
    assert not book.is_pinned(key(7))
    store(stack, [key(7)], request("r"))
    assert held(stack, [key(7)]) == [True]
    assert call(port, "/admin/expire", {"block_hashes": [HASH]}) == (
        200, {"expired": 1, "in_s": 0.0})
    assert held(stack, [key(7)]) == [False]
    # Over the cap (2 chunks): 409, nothing pinned.
    many = [(i).to_bytes(16, "big").hex() for i in range(20, 23)]
    status, answer = call(port, "/admin/pin", {"block_hashes": many, "seconds": 60})
    assert status == 409 and "max_pinned_bytes" in answer["error"]
    # The metrics are still served by the same server.
    status, text = call(port, "/metrics", method="GET", token=None)
    assert status == 200 and "kvtiers_stack_retention_pins_total" in text
    clock.now += 1
    status, _ = call(port, "/admin/nothing", {"block_hashes": [HASH]})
    assert status == 404


def test_admin_needs_a_token_and_a_metrics_section(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    monkeypatch.delenv("KVT_TEST_ADMIN", raising=False)
    with pytest.raises(ConfigError, match="holds no admin token"):
        build({"admin_token_env": "KVT_TEST_ADMIN"}, metrics={"port": 0})
    with pytest.raises(ConfigError, match="add a metrics: section"):
        build({"admin_token_env": "KVT_TEST_ADMIN"})


# -- pins per tenant -----------------------------------------------------------------

def tenant_request(name: str, tenant: str, envelope: Any = None) -> ReqContext:
    params: dict[str, Any] = {"kvtiers_tenant": tenant}
    if envelope is not None:
        params["kv_hints"] = envelope
    return ReqContext(req_id=name, kv_transfer_params=params)


def tenant_store(stack: Stack, keys: list[OffloadKey], ctx: ReqContext) -> None:
    """``store`` through the stack's tenant layer (keys scoped by ``ctx``'s tenant)."""
    manager = stack.tenants
    assert manager is not None
    manager.on_new_request(ctx)
    accepted = manager.prepare_store(keys, ctx)
    assert accepted is not None
    manager.complete_store(accepted, ctx)
    manager.on_request_finished(ctx)


def tenant_build(members: list[dict[str, Any]], cap: int = 2 * SLOT) -> tuple[Stack, Clock]:
    """A 128 KiB primary (16 chunks), pins capped at ``cap``, tenants ``members``."""
    return build({"max_pinned_bytes": cap}, capacity="128KiB",
                 tenants={"members": members})


def test_each_tenant_pins_up_to_its_own_cap() -> None:
    # The cap is 2 chunks per tenant: a's pins up to it leave b's allowance whole; a's
    # next pin is refused (counted) while b's succeeds.
    stack, _ = tenant_build([{"name": "a"}, {"name": "b"}])
    with stack:
        book = stack.manager.retention
        assert book is not None
        tenant_store(stack, [key(0), key(1)], tenant_request("a1", "a", hints(pin_s=100)))
        assert book.pinned_bytes("a") == 2 * SLOT
        assert book.pinned_bytes("b") == 0
        tenant_store(stack, [key(2), key(3)], tenant_request("b1", "b", hints(pin_s=100)))
        assert book.pinned_bytes("b") == 2 * SLOT
        tenant_store(stack, [key(4)], tenant_request("a2", "a", hints(pin_s=100)))
        assert stats(stack)["retention_pins_refused"] == 1
        assert book.pinned_bytes("a") == 2 * SLOT
        assert stats(stack)["retention_pinned_bytes"] == 4 * SLOT
        # b, at its cap too, is refused alike; the default tenant still has its own.
        tenant_store(stack, [key(5)], tenant_request("b2", "b", hints(pin_s=100)))
        assert stats(stack)["retention_pins_refused"] == 2
        tenant_store(stack, [key(6)], request("d1", hints(pin_s=100)))
        assert book.pinned_bytes("default") == SLOT
        assert stats(stack)["retention_pins"] == 3


def test_a_tenants_cap_is_its_own_at_most_its_cpu_quota() -> None:
    stack, _ = tenant_build([
        {"name": "big", "max_pinned_bytes": 6 * SLOT},
        {"name": "quota", "max_pinned_bytes": 6 * SLOT, "quota": {"cpu": 3 * SLOT}},
        {"name": "plain"},
    ])
    with stack:
        book = stack.manager.retention
        assert book is not None
        assert [book.cap(t) for t in ("big", "quota", "plain", "default")] == [
            6 * SLOT, 3 * SLOT, 2 * SLOT, 2 * SLOT]
        tenant_store(stack, [key(i) for i in range(5)],
                     tenant_request("big", "big", hints(pin_s=100)))
        assert book.pinned_bytes("big") == 5 * SLOT


def test_without_tenants_every_pin_shares_the_stacks_cap() -> None:
    # Requests naming tenants are one scope when the stack has no tenants: section.
    stack, _ = build({"max_pinned_bytes": 2 * SLOT}, capacity="128KiB")
    with stack:
        assert stack.tenants is None and stack.manager.retention_scope is None
        store(stack, [key(0), key(1)], tenant_request("a1", "a", hints(pin_s=100)))
        store(stack, [key(2)], tenant_request("b1", "b", hints(pin_s=100)))
        assert stats(stack)["retention_pins_refused"] == 1
        assert stats(stack)["retention_pinned_bytes"] == 2 * SLOT


def test_admin_pins_by_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    # A tenant's hashes are scoped as its requests' keys are, and its pins count against
    # its own cap (2 chunks): a's over-cap pin is a 409, b's pin after it lands.
    pytest.importorskip("prometheus_client")
    monkeypatch.setenv("KVT_TEST_ADMIN", TOKEN)
    stack, _ = build({"admin_token_env": "KVT_TEST_ADMIN", "max_pinned_bytes": 2 * SLOT},
                     capacity="128KiB", metrics={"port": 0},
                     tenants={"members": [{"name": "a"}, {"name": "b"}]})
    with stack:
        assert stack.metrics is not None and stack.tenants is not None
        port = stack.metrics.port
        book = stack.manager.retention
        assert book is not None
        scope = stack.tenants.keys.scope
        two = [(i).to_bytes(16, "big").hex() for i in (7, 8)]
        assert call(port, "/admin/pin", {"block_hashes": two, "seconds": 60,
                                         "tenant": "a"}) == (200, {"pinned": 2, "seconds": 60.0})
        assert book.is_pinned(scope(key(7), "a")) and not book.is_pinned(key(7))
        assert book.pinned_bytes("a") == 2 * SLOT
        status, answer = call(port, "/admin/pin", {"block_hashes": [(9).to_bytes(16, "big").hex()],
                                                   "seconds": 60, "tenant": "a"})
        assert status == 409 and "tenant 'a'" in answer["error"]
        assert call(port, "/admin/pin", {"block_hashes": two, "seconds": 60,
                                         "tenant": "b"})[0] == 200
        assert book.is_pinned(scope(key(7), "b"))
        # No tenant named: the default tenant's chunks (keys unchanged), its own cap.
        assert call(port, "/admin/pin", {"block_hashes": [HASH], "seconds": 60})[0] == 200
        assert book.is_pinned(key(7)) and book.pinned_bytes("default") == SLOT
        status, answer = call(port, "/admin/unpin", {"block_hashes": [HASH], "tenant": "c"})
        assert status == 400 and "no tenant 'c'" in answer["error"]
        assert call(port, "/admin/unpin", {"block_hashes": two, "tenant": "a"}) == (
            200, {"unpinned": 2})
        assert book.pinned_bytes("a") == 0


def scrape_pinned(port: int) -> dict[tuple[tuple[str, str], ...], float]:
    """The ``kvtiers_stack_retention_pinned_bytes`` samples of one scrape, by labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "kvtiers_stack_retention_pinned_bytes"]
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def test_pinned_bytes_are_exported_per_tenant_with_tenants() -> None:
    pytest.importorskip("prometheus_client")
    stack, _ = build({"max_pinned_bytes": 2 * SLOT}, capacity="128KiB", metrics={"port": 0},
                     tenants={"members": [{"name": "a"}, {"name": "b"}]})
    with stack:
        assert stack.metrics is not None
        tenant_store(stack, [key(0), key(1)], tenant_request("a1", "a", hints(pin_s=100)))
        tenant_store(stack, [key(2)], request("d1", hints(pin_s=100)))
        stack.manager.refresh_stats_snapshot()
        # One labelled series per tenant (every tenant, pinned or not); no unlabelled one.
        assert scrape_pinned(stack.metrics.port) == {
            (("tenant", "a"),): 2 * SLOT, (("tenant", "b"),): 0.0,
            (("tenant", "default"),): SLOT}


def test_pinned_bytes_are_one_series_without_tenants(admin: tuple[Stack, int, Clock]) -> None:
    stack, port, _ = admin
    store(stack, [key(0)], request("p", hints(pin_s=100)))
    stack.manager.refresh_stats_snapshot()
    assert scrape_pinned(port) == {(): SLOT}
