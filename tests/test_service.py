"""``kvtiers serve`` with the service in its own process (docs/service.md).

Each test synchronises on the service itself: its ready line, its replies, the reaped
process after ``kill -9``. No sleeps.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("msgspec")

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.service import protocol as p
from kvtiers.service.client import ServiceClient, ServiceDown, read_status
from kvtiers.service.pool import SLOT_HEADER, Pool, SlotState, tag_of
from kvtiers.service.server import Service, peer_allowed
from kvtiers.service.tier import ServiceTierManager
from kvtiers.service.worker import CheckedSlots, ServiceWorker
from kvtiers.testing.service import ServiceProcess, chunk_bytes_of, remove_pool, run_peer

IDENTITY = b'{"model_name":"test/model","x":1}'
OTHER_IDENTITY = b'{"model_name":"test/other","x":2}'
SLOT = 4096
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def keys(n: int, salt: int = 0) -> list[OffloadKey]:
    return [OffloadKey(bytes([salt, i]) * 18) for i in range(n)]


@pytest.fixture
def pool_name(tmp_path: Path) -> Iterator[str]:
    name = f"kvtiers-test-{os.getpid()}-{tmp_path.name}"
    yield name
    remove_pool(name)


def _started(tmp_path: Path, pool_name: str, metrics_port: int | None = None
             ) -> ServiceProcess:
    """A service over a fresh 1 MiB pool ``pool_name`` (its exporter on ``metrics_port``)."""
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"tiers:\n  - kind: cpu\n    capacity: 1MiB\n    shared_memory_name: {pool_name}\n"
    )
    proc = ServiceProcess(config, tmp_path / "serve.sock", slot_bytes=SLOT,
                          metrics_port=metrics_port)
    proc.start(fresh=True)
    return proc


@pytest.fixture
def service(tmp_path: Path, pool_name: str) -> Iterator[ServiceProcess]:
    proc = _started(tmp_path, pool_name)
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop()


@pytest.fixture
def exported(tmp_path: Path, pool_name: str) -> Iterator[tuple[ServiceProcess, str]]:
    """A service with its exporter listening, and the exporter's URL; stopped cleanly."""
    pytest.importorskip("prometheus_client")
    from kvtiers.testing.serve import free_port

    port = free_port()
    proc = _started(tmp_path, pool_name, port)
    yield proc, f"http://127.0.0.1:{port}/metrics"
    assert proc.stop() == 0


def engine(service: ServiceProcess, identity: bytes = IDENTITY, *, lease: int = 8
           ) -> ServiceTierManager:
    """An engine's tier that notices a dead service at its next call and retries at once;
    ``lease`` 0 reserves by round trip."""
    client = ServiceClient(service.socket, identity, SLOT, timeout_s=5.0, retry_s=0.0)
    return ServiceTierManager(client, liveness_s=0.0, lease_slots=lease)


def store(manager: ServiceTierManager, wanted: list[OffloadKey]) -> list[OffloadKey]:
    ctx = ReqContext("store")
    accepted = manager.prepare_store(wanted, ctx)
    assert accepted is not None
    for key, slot in zip(accepted, manager.get_spec(accepted).block_ids, strict=True):
        manager.region.view(int(slot))[:SLOT] = chunk_bytes_of(key, SLOT)
    manager.complete_store(accepted, ctx)
    manager.flush(wait=True)
    return accepted


def read_exact(manager: ServiceTierManager, wanted: list[OffloadKey]) -> bool:
    ctx = ReqContext("load")
    manager.prepare_load(wanted, ctx)
    slots = manager.get_spec(wanted).block_ids
    exact = all(
        bytes(manager.region.view(int(s))[:SLOT]) == chunk_bytes_of(k, SLOT)
        for k, s in zip(wanted, slots, strict=True)
    )
    manager.complete_load(wanted, ctx)
    manager.flush(wait=True)
    return exact


def test_a_chunk_stored_by_one_engine_is_a_hit_for_another(service: ServiceProcess) -> None:
    stored = keys(3)
    assert run_peer(service.socket, IDENTITY, "store", stored)["stored"] == 3
    mine = engine(service)
    ctx = ReqContext("r")
    assert [mine.lookup(k, ctx) for k in stored] == [HIT] * 3
    assert read_exact(mine, stored)
    # And the other way round, through a second process.
    more = keys(2, salt=1)
    store(mine, more)
    assert run_peer(service.socket, IDENTITY, "read", more) == {
        "op": "read", "hits": 2, "exact": True}
    # Another identity reaches none of them.
    other = engine(service, OTHER_IDENTITY)
    assert [other.lookup(k, ctx) for k in stored + more] == [MISS] * 5
    mine.shutdown()
    other.shutdown()


def test_the_same_key_stored_by_two_engines_at_once_is_written_once(
    service: ServiceProcess,
) -> None:
    first, second = engine(service, lease=0), engine(service, lease=0)
    ctx = ReqContext("r")
    wanted = keys(4)
    # Both reserve before either commits: only the first gets slots.
    got_first = first.prepare_store(wanted, ctx)
    got_second = second.prepare_store(wanted, ctx)
    assert got_first == wanted and got_second == []
    for key, slot in zip(wanted, first.get_spec(wanted).block_ids, strict=True):
        first.region.view(int(slot))[:SLOT] = chunk_bytes_of(key, SLOT)
    first.complete_store(wanted, ctx)
    first.flush(wait=True)
    state = read_status(service.socket)
    assert state["used_slots"] == 4
    assert [ns["chunks"] for ns in state["namespaces"]] == [4]
    assert read_exact(second, wanted)
    first.shutdown()
    second.shutdown()


def test_with_leases_the_same_key_stored_by_two_engines_at_once_is_held_once(
    service: ServiceProcess,
) -> None:
    first, second = engine(service), engine(service)
    ctx = ReqContext("r")
    wanted = keys(4)
    # Leased slots: both engines take slots and write, without a round trip.
    assert first.prepare_store(wanted, ctx) == wanted
    assert second.prepare_store(wanted, ctx) == wanted
    for manager in (first, second):
        for key, slot in zip(wanted, manager.get_spec(wanted).block_ids, strict=True):
            manager.region.view(int(slot))[:SLOT] = chunk_bytes_of(key, SLOT)
        manager.complete_store(wanted, ctx)
        manager.flush(wait=True)
    state = read_status(service.socket)
    assert [ns["chunks"] for ns in state["namespaces"]] == [4]
    assert state["counters"]["duplicate_stores"] == 4
    assert second.get_stats()["duplicate_stores"] == 4
    # The second engine's slots went back to its lease, and the chunks read back exact.
    assert state["leased_slots"] == len(first._lease) + len(second._lease) > 0
    assert read_exact(second, wanted) and read_exact(first, wanted)
    # Nothing is stored again once present.
    assert first.prepare_store(wanted, ctx) == []
    first.shutdown()
    second.shutdown()


def test_kill_9_makes_lookups_miss_and_a_restart_readopts(service: ServiceProcess) -> None:
    mine = engine(service)
    ctx = ReqContext("r")
    stored = store(mine, keys(5))
    loading = keys(1)
    mine.prepare_load(loading, ctx)  # a load in flight when the service dies
    service.kill()
    # Every call resolves at once: lookups miss, stores are refused, loads are lost.
    assert [mine.lookup(k, ctx) for k in stored] == [MISS] * 5
    assert mine.prepare_store(keys(2, salt=9), ctx) is None
    mine.prepare_load(stored[1:2], ctx)
    assert list(mine.get_spec(stored[1:2]).block_ids) == [mine.num_slots]
    mine.complete_load(stored[1:2], ctx)
    mine.complete_load(loading, ctx)
    assert mine.get_stats()["service_up"] == 0.0
    # Back: the pool's chunks are re-adopted after their checks, byte-exact.
    assert "adopted 5" in service.start()
    assert [mine.lookup(k, ctx) for k in stored] == [HIT] * 5
    assert read_exact(mine, stored)
    assert mine.get_stats()["service_reattaches"] == 1
    mine.shutdown()


def test_an_engine_never_uses_a_pool_made_again_under_its_name(service: ServiceProcess
                                                               ) -> None:
    mine = engine(service)
    store(mine, keys(2))
    assert service.stop() == 0
    service.start(fresh=True)  # a new file at the same name: the engine maps the old one
    ctx = ReqContext("r")
    assert mine.lookup(keys(2)[0], ctx) is MISS
    assert mine.prepare_store(keys(1, salt=5), ctx) is None
    assert not mine.client.up
    assert read_status(service.socket)["engines"] == []
    mine.shutdown()


def test_sigterm_drains_and_the_next_start_readopts(service: ServiceProcess) -> None:
    mine = engine(service)
    stored = store(mine, keys(8))
    assert service.stop() == 0
    assert not service.socket.exists()
    assert "adopted 8" in service.start()
    assert read_exact(mine, stored)
    state = read_status(service.socket)
    assert state["counters"]["adopted"] == 8
    mine.shutdown()


def _header(pool: Pool, slot: int) -> int:
    return pool.layout.headers_at + slot * SLOT_HEADER


def test_torn_corrupt_and_foreign_slots_are_not_adopted(
    service: ServiceProcess, pool_name: str
) -> None:
    mine = engine(service)
    stored = store(mine, keys(4))
    ctx = ReqContext("r")
    mine.prepare_load(stored, ctx)
    slots = [int(s) for s in mine.get_spec(stored).block_ids]
    mine.complete_load(stored, ctx)
    mine.flush(wait=True)
    mine.shutdown()
    assert service.stop() == 0
    path = Path("/dev/shm", pool_name)
    from kvtiers.service.pool import Layout

    pool = Pool(path, Layout(256, SLOT))
    # Slot of key 0: one flipped byte. Key 1: its header back to WRITING (a crash
    # mid-store). Key 2: another namespace's digest.
    pool.view(slots[0])[100] ^= 0xFF
    struct.pack_into("<I", pool.buffer, _header(pool, slots[1]) + 8, SlotState.WRITING)
    pool.buffer[_header(pool, slots[2]) + 56 : _header(pool, slots[2]) + 88] = bytes(32)
    pool.close()
    service.start()
    state = read_status(service.socket)
    counters = state["counters"]
    assert (counters["adopted"], counters["adopt_corrupt"], counters["adopt_torn"],
            counters["adopt_foreign"]) == (1, 1, 1, 1)
    again = engine(service)
    assert [again.lookup(k, ctx) for k in stored] == [MISS, MISS, MISS, HIT]
    assert read_exact(again, stored[3:])
    again.shutdown()


def _raw(service: ServiceProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(service.socket))
    return sock


def _reply_then_closed(sock: socket.socket) -> p.Reply:
    """The one reply the service sent before closing ``sock``."""
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    (size,) = p.FRAME.unpack_from(data)
    assert len(data) == 4 + size, "more than one reply before the close"
    sock.close()
    return p.decode_reply(bytes(data[4:]))


def _framed(message: object) -> bytes:
    import msgspec

    payload = msgspec.msgpack.encode(message)
    return p.FRAME.pack(len(payload)) + payload


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(p.FRAME.pack(p.MAX_FRAME + 1), id="oversized"),
        pytest.param(p.FRAME.pack(5) + b"\xc1" * 5, id="garbage"),
        pytest.param(_framed(["Reserve", 1, "x", [b"k" * 36]]), id="wrong-types"),
        pytest.param(_framed(["Shutdown", 1]), id="unknown-message"),
        pytest.param(_framed(["Reserve", 1, 0, [b"k" * 36]]), id="not-attached"),
        pytest.param(_framed(["Status"]), id="missing-field"),
    ],
)
def test_a_hostile_message_gets_an_error_and_a_close_while_others_are_served(
    service: ServiceProcess, payload: bytes
) -> None:
    good = engine(service)
    stored = store(good, keys(2))
    bad = _raw(service)
    bad.sendall(payload)
    reply = _reply_then_closed(bad)
    assert isinstance(reply, p.Error)
    assert read_exact(good, stored)
    assert store(good, keys(1, salt=3)) == keys(1, salt=3)
    assert read_status(service.socket)["counters"]["bad_messages"] >= 1
    good.shutdown()


def test_a_commit_of_a_slot_not_reserved_is_refused(service: ServiceProcess) -> None:
    good = engine(service)
    stored = store(good, keys(1))
    slot = int(good.get_spec([]).block_ids.size)
    bad = ServiceClient(service.socket, IDENTITY, SLOT, timeout_s=5.0)
    with pytest.raises(ServiceDown, match="neither leased"):
        bad.call([p.Commit(bad.next_seq(), bad.ns, list(stored), [slot], [SLOT])])
    assert read_exact(good, stored)
    good.shutdown()
    bad.close()


def test_one_connection_holds_an_eighth_of_the_pool_at_most(service: ServiceProcess) -> None:
    greedy = engine(service, lease=0)
    ctx = ReqContext("r")
    # 256 slots: a reservation of all of them gets the first 32 (and frees nothing).
    accepted = greedy.prepare_store(keys(200) + keys(56, salt=7), ctx)
    assert accepted is not None and len(accepted) == 32
    other = engine(service)
    assert store(other, keys(4, salt=8)) == keys(4, salt=8)
    greedy.shutdown()
    other.shutdown()


def test_an_unpin_drops_only_its_own_connections_pins(service: ServiceProcess) -> None:
    good = engine(service)
    stored = store(good, keys(1))
    slot = good.region.find(tag_of(good.client.digest, stored[0]))
    pinner = ServiceClient(service.socket, IDENTITY, SLOT, timeout_s=5.0)
    reply = pinner.call([p.Pin(pinner.next_seq(), pinner.ns, list(stored), [slot])])[0]
    assert isinstance(reply, p.Slots) and reply.slots == [slot]
    bad = ServiceClient(service.socket, IDENTITY, SLOT, timeout_s=5.0)
    # A slot it holds no pin of is skipped (its Pin may have found the key gone)...
    bad.call([p.Unpin(bad.next_seq(), bad.ns, [slot])])
    assert read_status(service.socket)["pinned_slots"] == 1
    # ...a slot out of range is refused.
    with pytest.raises(ServiceDown, match="outside"):
        bad.call([p.Unpin(bad.next_seq(), bad.ns, [good.num_slots])])
    pinner.call([p.Unpin(pinner.next_seq(), pinner.ns, [slot])])
    assert read_status(service.socket)["pinned_slots"] == 0
    assert read_exact(good, stored)
    good.shutdown()
    pinner.close()
    bad.close()


# -- in-process service: peer credentials and a client that stops reading ------------------
@pytest.fixture
def local_service(tmp_path: Path, pool_name: str) -> Iterator[Service]:
    from kvtiers.service.pool import Layout

    pool = Pool(Path("/dev/shm", pool_name), Layout(16, SLOT), fresh=True)
    svc = Service(pool, tmp_path / "local.sock", max_output=1 << 16)
    thread = threading.Thread(target=svc.serve)
    thread.start()
    yield svc
    svc.stop()
    thread.join()
    pool.close()


def test_peer_allowed() -> None:
    assert peer_allowed(1000, 1000, set(), owner=1000, group=None)
    assert not peer_allowed(1001, 1001, set(), owner=1000, group=None)
    assert not peer_allowed(1001, 1001, {5}, owner=1000, group=None)
    assert peer_allowed(1001, 50, set(), owner=1000, group=50)
    assert peer_allowed(1001, 1001, {50}, owner=1000, group=50)
    assert not peer_allowed(1001, 1001, {51}, owner=1000, group=50)


def test_a_peer_of_another_user_is_refused(local_service: Service,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import kvtiers.service.server as server

    monkeypatch.setattr(server, "peer_credentials", lambda sock: (1, os.geteuid() + 1, 0))
    with pytest.raises(ServiceDown):
        ServiceClient(local_service.socket_path, IDENTITY, SLOT, timeout_s=5.0)
    monkeypatch.undo()
    assert read_status(local_service.socket_path)["counters"]["refused_peers"] == 1


def test_a_client_that_stops_reading_is_closed(local_service: Service) -> None:
    good = ServiceClient(local_service.socket_path, IDENTITY, SLOT, timeout_s=5.0)
    lazy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lazy.connect(str(local_service.socket_path))
    request = p.frame(p.Status(1))
    lazy.settimeout(10)
    # Asks and never reads, until the service hangs up (its queue went over the bound).
    with pytest.raises(OSError):
        for _ in range(100_000):
            lazy.sendall(request * 64)
    lazy.close()
    assert good.status()["counters"]["slow_clients"] == 1
    good.close()


def test_status_cli_prints_json(service: ServiceProcess, capsys: pytest.CaptureFixture[str]
                                ) -> None:
    from kvtiers.cli import main

    mine = engine(service)
    store(mine, keys(2))
    assert main(["status", "--socket", str(service.socket), "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["ready_slots"] == 2 and len(state["engines"]) == 1
    assert main(["status", "--socket", str(service.socket)]) == 0
    assert "2 chunks" in capsys.readouterr().out
    mine.shutdown()
    service.stop()
    assert main(["status", "--socket", str(service.socket)]) == 1


# -- engines with a kind: service stack: real worker copies through the mapped pool -------
MODEL = {
    "name": "service/model",
    "tokens_per_hash": 16,
    "blocks_per_chunk": 2,
    "groups": [{"tokens_per_block": 16, "num_layers": 2, "page_bytes": "1KiB"}],
}


def test_two_simulated_engines_share_prefixes_through_the_pool(
    service: ServiceProcess,
) -> None:
    from kvtiers.engine.simulator import SimulatedEngine
    from kvtiers.engine.workload import WorkloadSpec, conversation_requests
    from kvtiers.stack.builder import load_stack

    config = {"tiers": [{"kind": "service", "socket": str(service.socket)}], "model": MODEL}
    spec = WorkloadSpec(conversations=3, system_prompts=1, turns=1, system_tokens=(128, 160))
    requests = list(conversation_requests(spec))
    with load_stack(config) as first_stack, load_stack(config) as second_stack:
        first = SimulatedEngine(first_stack, num_gpu_blocks=128)
        firsts = [first.run_request(r.req_id, r.token_ids) for r in requests]
        first.glue.end_step()  # the step's commits are sent...
        first_stack.tiers[0].manager.flush(wait=True)  # ...and taken in
        second = SimulatedEngine(second_stack, num_gpu_blocks=128)
        seconds = [second.run_request(r.req_id, r.token_ids) for r in requests]
        first.shutdown()
        second.shutdown()
    assert sum(r.stored_bytes for r in firsts) > 0
    # The second engine stores nothing the first stored: every chunk is a pool hit,
    # copied into its own KV tensors and verified block by block.
    assert [r.reused_tokens for r in seconds] == [
        (r.prompt_tokens - 1) // 32 * 32 for r in seconds  # whole chunks, one token left
    ]
    assert sum(r.verified_blocks for r in seconds) > 0
    assert sum(r.verification_failures + r.load_failures for r in seconds) == 0


def test_a_service_stack_without_a_service_is_refused(tmp_path: Path) -> None:
    from kvtiers.errors import ConfigError
    from kvtiers.stack.builder import load_stack

    config = {"tiers": [{"kind": "service", "socket": str(tmp_path / "none.sock")}],
              "model": MODEL}
    with pytest.raises(ConfigError, match="no kvtiers service answers") as info:
        load_stack(config)
    assert info.value.path == "tiers[0].socket"  # found by the start-time checks


def test_kvtiers_check_probes_the_service_socket(service: ServiceProcess, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvtiers.cli import main

    stack = tmp_path / "engine.yaml"
    stack.write_text(f"tiers:\n  - kind: service\n    socket: {service.socket}\n")
    assert main(["check", str(stack)]) == 0
    service.stop()
    assert main(["check", str(stack)]) != 0
    assert "no kvtiers service answers" in capsys.readouterr().err


def test_metrics_export_the_pool_namespaces_and_engines(
    exported: tuple[ServiceProcess, str],
) -> None:
    from kvtiers.testing.serve import scrape

    proc, url = exported
    mine = engine(proc)
    stored = store(mine, keys(3))
    assert read_exact(mine, stored)
    twin, other = engine(proc), engine(proc, OTHER_IDENTITY)
    samples = scrape(url)
    namespace = 'namespace="test/model-f4a91f1b4ef09ca1"'
    # Attaches are answered before the engine goes on: each is counted by now.
    assert samples[f"kvtiers_service_namespace_engines{{{namespace}}}"] == 2
    assert samples["kvtiers_service_namespace_engines"] == 3
    assert samples['kvtiers_service_events_total{event="attaches"}'] == 3
    twin.shutdown()
    other.shutdown()
    assert samples[f"kvtiers_service_namespace_chunks{{{namespace}}}"] == 3
    assert samples[f"kvtiers_service_namespace_bytes{{{namespace}}}"] == 3 * SLOT
    assert samples[f"kvtiers_service_namespace_hits_total{{{namespace}}}"] == 3
    assert samples['kvtiers_service_pool_slots{state="ready"}'] == 3
    assert samples["kvtiers_service_engines"] == 3
    mine.shutdown()


def test_an_engine_of_another_wire_protocol_is_refused_with_the_reason(
    service: ServiceProcess, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kvtiers.errors import ConfigError
    from kvtiers.stack.builder import load_stack

    # An engine of the release before the protocol was versioned sends no protocol.
    old = _raw(service)
    old.sendall(_framed(["Attach", 0, IDENTITY, SLOT, "old"]))
    reply = _reply_then_closed(old)
    assert isinstance(reply, p.Error) and "wire protocol 1" in reply.message
    # A newer one: refused at start with the reason, not "no service answers".
    monkeypatch.setattr(p, "PROTOCOL", p.PROTOCOL + 1)
    with pytest.raises(ServiceDown, match="run the same kvtiers release"):
        ServiceClient(service.socket, IDENTITY, SLOT, timeout_s=5.0)
    assert any("run the same kvtiers release" in r.getMessage() for r in caplog.records)
    config = {"tiers": [{"kind": "service", "socket": str(service.socket)}], "model": MODEL}
    with pytest.raises(ConfigError, match="wire protocol") as info:
        load_stack(config)
    assert "start it with kvtiers serve" not in str(info.value)
    monkeypatch.undo()
    good = engine(service)
    assert store(good, keys(1)) == keys(1)
    good.shutdown()


def test_each_engine_reports_its_lookups_and_hits_to_the_service(
    exported: tuple[ServiceProcess, str],
) -> None:
    from kvtiers.testing.serve import scrape

    proc, url = exported
    writer = engine(proc)
    stored = store(writer, keys(3))
    # One engine per process here (both would have the same pid label).
    writer.shutdown()
    reader = engine(proc)
    ctx = ReqContext("r")
    # The reader's lookups read the mirror: the service hears of them only by report.
    answers = [reader.lookup(k, ctx) for k in [*stored, *keys(2, salt=9)]]
    assert answers == [HIT] * 3 + [MISS] * 2
    reader.flush(wait=True)
    engines = read_status(proc.socket)["engines"]
    assert [(e["lookups"], e["hits"]) for e in engines] == [(5, 3)]
    samples = scrape(url)
    looked = {k: v for k, v in samples.items()
              if k.startswith("kvtiers_service_engine_lookups_total{")}
    hits = {k: v for k, v in samples.items()
            if k.startswith("kvtiers_service_engine_hits_total{")}
    assert list(looked.values()) == [5.0] and list(hits.values()) == [3.0]
    stored_by = {k: v for k, v in samples.items()
                 if k.startswith("kvtiers_service_engine_stored_bytes_total{")}
    assert list(stored_by.values()) == [0.0]  # the reader stored nothing
    store(reader, keys(2, salt=5))
    assert [(e["stored"], e["stored_bytes"]) for e in
            read_status(proc.socket)["engines"]] == [(2, 2 * SLOT)]
    assert str(os.getpid()) in next(iter(looked))
    liar = ServiceClient(proc.socket, IDENTITY, SLOT, timeout_s=5.0)
    with pytest.raises(ServiceDown, match="refused a request"):
        liar.call([p.Report(1, liar.ns, 2, 3)])
    liar.close()
    assert read_exact(reader, stored)
    reader.shutdown()


def test_an_engines_service_tier_counters_are_on_its_stack_exporter(
    service: ServiceProcess,
) -> None:
    pytest.importorskip("prometheus_client")
    from kvtiers.engine.simulator import SimulatedEngine
    from kvtiers.engine.workload import WorkloadSpec, conversation_requests
    from kvtiers.stack.builder import load_stack
    from kvtiers.testing.serve import scrape

    config = {"tiers": [{"kind": "service", "name": "pool", "socket": str(service.socket)}],
              "model": MODEL, "metrics": {"port": 0, "refresh_s": 0}}
    spec = WorkloadSpec(conversations=2, system_prompts=1, turns=1, system_tokens=(128, 160))
    requests = list(conversation_requests(spec))
    with load_stack(config) as first_stack:  # stores the prefixes into the pool
        first = SimulatedEngine(first_stack, num_gpu_blocks=128)
        for r in requests:
            first.run_request(r.req_id, r.token_ids)
        first.glue.end_step()
        first_stack.tiers[0].manager.flush(wait=True)
        first.shutdown()
    with load_stack(config) as stack:
        assert stack.metrics is not None
        url = f"http://127.0.0.1:{stack.metrics.port}/metrics"
        stack.manager.refresh_stats_snapshot()
        before = scrape(url)
        sim = SimulatedEngine(stack, num_gpu_blocks=128)
        for r in requests:
            sim.run_request(r.req_id, r.token_ids)
        stack.manager.refresh_stats_snapshot()
        after = scrape(url)
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        stats = stack.manager.get_stats()
        sim.shutdown()
    hits = 'kvtiers_tier_lookups_total{result="hit",tier="pool"}'
    calls = 'kvtiers_tier_lookup_calls_total{tier="pool"}'
    assert before[hits] == before[calls] == 0
    assert after[hits] == stats["pool.hits"] > 0
    assert after[calls] == stats["pool.lookups"] >= after[hits]
    assert after['kvtiers_tier_service_up{tier="pool"}'] == 1
    assert after['kvtiers_tier_service_round_trips_total{tier="pool"}'] == (
        stats["pool.round_trips"])
    # Every counter the tier reports is a catalogued family (no generic HELP), with a unit.
    assert "not described in the catalogue" not in text
    for family in ("kvtiers_tier_service_down_lookups", "kvtiers_tier_lost_loads",
                   "kvtiers_tier_pins_missed", "kvtiers_tier_duplicate_stores",
                   "kvtiers_tier_probes_given_up", "kvtiers_tier_service_reattaches"):
        assert f"# TYPE {family}_total counter" in text
    assert "# TYPE kvtiers_tier_service_up gauge" in text


def test_an_engine_that_only_stores_reads_its_owed_replies(service: ServiceProcess) -> None:
    mine = engine(service)
    ctx = ReqContext("r")
    for step in range(300):
        key = OffloadKey(step.to_bytes(4, "big") * 9)
        accepted = mine.prepare_store([key], ctx)
        assert accepted == [key]
        mine.complete_store(accepted, ctx)
        mine.on_schedule_end(ScheduleEndContext())  # a write; arrived replies read
    mine.flush(wait=True)
    assert mine._inflight == []
    state = read_status(service.socket)
    assert state["counters"].get("slow_clients", 0) == 0
    assert sum(ns["stored"] for ns in state["namespaces"]) == 300
    assert mine.get_stats()["service_up"] == 1.0
    mine.shutdown()


def test_slots_being_written_at_a_stop_are_reused_last(tmp_path: Path, pool_name: str
                                                       ) -> None:
    from kvtiers.service.pool import Layout

    path = Path("/dev/shm", pool_name)
    pool = Pool(path, Layout(16, SLOT), fresh=True)
    pool.set_writing(3)  # a store in flight when the service died
    pool.close()
    pool = Pool(path, Layout(16, SLOT))
    svc = Service(pool, tmp_path / "again.sock")
    try:
        assert svc.adoption.unsettled == [3] and svc.adoption.torn == 1
        taken = [svc._take_slot(set()) for _ in range(16)]
        assert taken[-1] == 3 and sorted(taken) == list(range(16))
    finally:
        svc.stop()
        svc.serve()  # returns at once: closes the socket
        pool.close()


def test_freed_slots_are_reused_first_in_first_out(tmp_path: Path, pool_name: str) -> None:
    from kvtiers.service.pool import Layout

    pool = Pool(Path("/dev/shm", pool_name), Layout(4, SLOT), fresh=True)
    svc = Service(pool, tmp_path / "fifo.sock")
    try:
        first, second = svc._take_slot(set()), svc._take_slot(set())
        svc._release(first)
        # The slot freed last goes after the free slots freed before it.
        assert [svc._take_slot(set()) for _ in range(3)] == [2, 3, first]
        svc._release(second)
        assert svc._take_slot(set()) == second  # the only one free
    finally:
        svc.stop()
        svc.serve()
        pool.close()


# -- loads without a round trip: the worker checks each slot's header around its copy --------
def service_worker(manager: ServiceTierManager) -> tuple[ServiceWorker, torch.Tensor]:
    """A worker over the engine's mapped pool and its KV tensor of 4 one-slot blocks."""
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.worker import KVCacheTensors, KVTensorRef

    blocks = torch.zeros(4, SLOT, dtype=torch.uint8)
    kv = KVCacheTensors([blocks], [[KVTensorRef(0, SLOT)]])
    return ServiceWorker(kv, manager.region, ChunkGeometry(1, (SLOT,))), blocks


def run_job(worker: ServiceWorker, job_id: int, spec: CheckedSlots, *, store: bool = False
            ) -> bool:
    """Whether the one-block job between block 0 and ``spec`` succeeded."""
    from kvtiers.core.specs import GPULoadStoreSpec, GroupTransfer

    transfer = [GroupTransfer(GPULoadStoreSpec(np.array([0], dtype=np.int64)), spec)]
    submit = worker.submit_store if store else worker.submit_load
    assert submit(job_id, transfer)
    worker.wait({job_id})
    [result] = worker.get_finished()
    return result.success


def fill_until_refilled(service: ServiceProcess, manager: ServiceTierManager, slot: int,
                        tag: bytes, salt: int) -> None:
    """Another engine stores until the chunk tagged ``tag`` is gone and ``slot`` holds
    another ready chunk."""
    other = engine(service)
    for batch in range(40):
        store(other, keys(16, salt=salt + batch))
        if manager.region.find(tag) < 0 and manager.region.stamp(slot)[1] == SlotState.READY:
            break
    assert manager.region.find(tag) < 0
    assert manager.region.stamp(slot)[1] == SlotState.READY
    other.shutdown()


def test_a_slot_evicted_and_refilled_before_the_copy_fails_the_load(
    service: ServiceProcess,
) -> None:
    mine = engine(service)
    stored = store(mine, keys(1))
    ctx = ReqContext("load")
    assert mine.lookup(stored[0], ctx) is HIT
    mine.prepare_load(stored, ctx)  # its Pin waits for the step's end
    spec = mine.get_spec(stored)
    slot = int(spec.slot_ids[0])
    fill_until_refilled(service, mine, slot, tag_of(mine.client.digest, stored[0]), 100)
    worker, blocks = service_worker(mine)
    try:
        assert not run_job(worker, 1, spec)
        assert not blocks.any()  # nothing of the new chunk was copied
        # A load planned now finds the chunk that is there, byte-exact.
        current = keys(16, salt=100)[0]
        for k in keys(16, salt=100) + keys(16, salt=101):
            if mine.lookup(k, ctx) is HIT:
                current = k
                break
        mine.prepare_load([current], ctx)
        assert run_job(worker, 2, mine.get_spec([current]))
        assert bytes(blocks[0].numpy()) == chunk_bytes_of(current, SLOT)
        mine.complete_load([*stored, current], ctx)
    finally:
        worker.shutdown()
    mine.shutdown()


def test_a_job_planned_before_a_service_restart_fails_or_reads_exact_bytes(
    service: ServiceProcess,
) -> None:
    mine = engine(service)
    stored = store(mine, keys(2))
    ctx = ReqContext("r")
    mine.prepare_load(stored, ctx)
    first, second = mine.get_spec(stored[:1]), mine.get_spec(stored[1:])
    storing = keys(1, salt=50)
    assert mine.prepare_store(storing, ctx) == storing
    store_spec = mine.get_spec(storing)  # a leased slot, WRITING
    service.kill()
    assert "adopted 2" in service.start()
    worker, blocks = service_worker(mine)
    try:
        # Re-adopted after its checks, same generation: the load reads the chunk.
        assert run_job(worker, 1, first)
        assert bytes(blocks[0].numpy()) == chunk_bytes_of(stored[0], SLOT)
        # The leased slot was freed by the restart (a new generation): the store fails
        # without writing a byte into a slot the new service may hand to another engine.
        blocks[0] = 7
        assert not run_job(worker, 2, store_spec, store=True)
        assert not any(mine.region.view(int(store_spec.slot_ids[0])))
        # Once the restarted service has given the second chunk's slot to another chunk,
        # the load planned before the restart fails.
        slot = int(second.slot_ids[0])
        fill_until_refilled(service, mine, slot, tag_of(mine.client.digest, stored[1]), 150)
        blocks.zero_()
        assert not run_job(worker, 3, second)
        assert not blocks.any()
    finally:
        worker.shutdown()
    mine.complete_load(stored, ctx)
    mine.shutdown()


def test_a_step_with_loads_makes_no_round_trip(service: ServiceProcess) -> None:
    mine = engine(service)
    stored = store(mine, keys(4))
    before = mine.get_stats()["round_trips"]
    ctx = ReqContext("r")
    hits = [k for k in stored if mine.lookup(k, ctx) is HIT]
    mine.prepare_load(hits, ctx)
    spec = mine.get_spec(hits)
    mine.on_schedule_end(ScheduleEndContext())  # the Pins go in the step's end write
    assert mine.get_stats()["round_trips"] == before
    exact = all(bytes(mine.region.view(int(s))[:SLOT]) == chunk_bytes_of(k, SLOT)
                for k, s in zip(hits, spec.slot_ids, strict=True))
    assert exact and len(hits) == 4
    # Once the service has read that write, the slots are pinned; the loads' Unpins go
    # with the next step's end.
    mine.flush(wait=True)
    assert read_status(service.socket)["pinned_slots"] == 4
    mine.complete_load(hits, ctx)
    mine.on_schedule_end(ScheduleEndContext())
    mine.flush(wait=True)
    assert read_status(service.socket)["pinned_slots"] == 0
    assert mine.get_stats()["pins_missed"] == 0
    mine.shutdown()


def test_steps_wait_for_nothing_while_the_service_is_stopped(service: ServiceProcess) -> None:
    import signal

    mine = engine(service)
    stored = store(mine, keys(2))
    before = mine.get_stats()["round_trips"]
    ctx = ReqContext("r")
    assert service.proc is not None
    service.proc.send_signal(signal.SIGSTOP)  # the service reads and answers nothing
    try:
        for step in range(4):
            fresh = keys(1, salt=60 + step)
            assert mine.prepare_store(fresh, ctx) == fresh  # within the lease
            mine.complete_store(fresh, ctx)
            assert [mine.lookup(k, ctx) for k in stored] == [HIT, HIT]
            mine.prepare_load(stored, ctx)
            mine.complete_load(stored, ctx)
            # A write the socket takes; no reply is waited for (a wait would time out
            # and mark the service down).
            mine.on_schedule_end(ScheduleEndContext())
        assert mine.client.up and mine.get_stats()["round_trips"] == before
        assert len(mine._inflight) >= 4
    finally:
        service.proc.send_signal(signal.SIGCONT)
    mine.flush(wait=True)
    state = read_status(service.socket)
    assert sum(ns["stored"] for ns in state["namespaces"]) == 6
    assert state["pinned_slots"] == 0
    mine.shutdown()


def test_a_step_end_waits_for_the_oldest_replies_past_the_bound(
    service: ServiceProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtiers.service.tier as tier_module

    mine = engine(service)
    ctx = ReqContext("r")
    monkeypatch.setattr(tier_module, "MAX_OWED", 2)
    # As if no reply had arrived by any step's end: only the bound makes it read.
    monkeypatch.setattr(mine.client, "receive_ready", lambda requests: [])
    for step in range(6):
        fresh = keys(1, salt=70 + step)
        assert mine.prepare_store(fresh, ctx) == fresh
        mine.complete_store(fresh, ctx)
        mine.on_schedule_end(ScheduleEndContext())
        sent = 2  # this step's Commit and Lease top-up
        assert len(mine._inflight) <= tier_module.MAX_OWED + sent
    assert mine.get_stats()["owed_waits"] >= 4
    monkeypatch.undo()
    mine.flush(wait=True)
    assert sum(ns["stored"] for ns in read_status(service.socket)["namespaces"]) == 6
    mine.shutdown()
