"""``kvtiers serve`` with tiers below its pool (docs/service.md, "Lower tiers").

The service runs in its own process (but for the priority check, which blocks the file
tier's store path inside the service and so runs the service on a thread here), over a
real file root or moto S3. Each wait is on the service's own state (its status, an
engine's lookup answered), bounded by a deadline that only a defect reaches; no sleeps.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("msgspec")

from kvtiers.config import load_stack_config
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext, ScheduleEndContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.service.client import ServiceClient, read_status
from kvtiers.service.lower import identity_config
from kvtiers.service.main import print_status
from kvtiers.service.pool import IdentityRecords, Layout, Pool, RecordDamaged
from kvtiers.service.server import Service
from kvtiers.service.tier import ServiceTierManager
from kvtiers.stack.builder import load_stack
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.testing.service import ServiceProcess, remove_pool

CHUNK = 4096
SLOTS = 32
OFFLOADING = offloading_config((CHUNK,))
IDENTITY = NamespaceIdentity.from_config(OFFLOADING).canonical_json()
HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
#: A bound on waits that only a defect reaches (the machine may be loaded).
DEADLINE_S = 60.0


def key(i: int) -> OffloadKey:
    return conformance_key(i)


def payload(k: OffloadKey) -> bytes:
    return conformance_payload(int.from_bytes(k[:4], "little"), CHUNK)


def stack_yaml(pool_name: str, lower: str) -> str:
    return (f"tiers:\n  - kind: cpu\n    capacity: {SLOTS * CHUNK}\n"
            f"    shared_memory_name: {pool_name}\n{lower}")


def file_tier(root: Path) -> str:
    return f"  - kind: file\n    root: {root}\n"


def s3_tier(endpoint: str) -> str:
    return (f"  - kind: s3\n    bucket: {BUCKET}\n    prefix: served\n"
            f"    endpoint_url: {endpoint}\n")


@pytest.fixture
def pool_name(tmp_path: Path) -> Iterator[str]:
    name = f"kvtiers-test-{os.getpid()}-{tmp_path.name}"
    yield name
    remove_pool(name)
    shutil.rmtree(Path("/dev/shm", f"{name}.identities"), ignore_errors=True)


def start(tmp_path: Path, pool_name: str, lower: str, *,
          metrics_port: int | None = None) -> ServiceProcess:
    config = tmp_path / "serve.yaml"
    config.write_text(stack_yaml(pool_name, lower))
    proc = ServiceProcess(config, tmp_path / "serve.sock", slot_bytes=CHUNK,
                          metrics_port=metrics_port)
    proc.start(fresh=True)
    return proc


def engine(socket: Path, *, probe_steps: int = 10**6, probe_wait_s: float = 0.0
           ) -> ServiceTierManager:
    """An engine's tier reserving by round trip; ``probe_steps`` as large as a test that
    waits for the service's own answer needs (no bound in time unless asked)."""
    client = ServiceClient(socket, IDENTITY, CHUNK, timeout_s=5.0, retry_s=0.0)
    return ServiceTierManager(client, liveness_s=0.0, lease_slots=0, probe_steps=probe_steps,
                              probe_wait_s=probe_wait_s)


def store(manager: ServiceTierManager, wanted: list[OffloadKey], *,
          settle: Path | None = None) -> None:
    """Store ``wanted`` (a connection holds an eighth of the pool at once: batches); with
    ``settle`` (the socket), each batch's cascades end before the next batch, whose
    slots may only be evicted then (a slot a cascade reads is pinned)."""
    ctx = ReqContext("store")
    for at in range(0, len(wanted), SLOTS // 8):
        batch = wanted[at : at + SLOTS // 8]
        done = 0.0 if settle is None else lower_counter(read_status(settle), "cascades")
        accepted = manager.prepare_store(batch, ctx)
        assert accepted == batch
        for k, slot in zip(batch, manager.get_spec(batch).block_ids, strict=True):
            manager.region.view(int(slot))[:CHUNK] = payload(k)
        manager.complete_store(batch, ctx)
        manager.flush(wait=True)
        if settle is not None:
            wait_status(settle, functools.partial(cascaded, done + len(batch)))


def read_exact(manager: ServiceTierManager, k: OffloadKey) -> bool:
    ctx = ReqContext("load")
    manager.prepare_load([k], ctx)
    slot = int(manager.get_spec([k]).block_ids[0])
    exact = bytes(manager.region.view(slot)[:CHUNK]) == payload(k)
    manager.complete_load([k], ctx)
    manager.flush(wait=True)
    return exact


def step(manager: ServiceTierManager) -> None:
    """An engine step's end: the queued probes go out, their answers are read."""
    manager.on_schedule_end(ScheduleEndContext())
    manager.flush(wait=True)


def resolve(manager: ServiceTierManager, k: OffloadKey) -> tuple[LookupResult, int]:
    """Look ``k`` up step after step until it is no longer ``RETRY``: the answer and the
    steps it took."""
    ctx = ReqContext("lookup")
    steps = 0
    end = time.monotonic() + DEADLINE_S
    while (result := manager.lookup(k, ctx)) is RETRY:
        assert time.monotonic() < end, f"lookup still RETRY after {steps} steps"
        step(manager)
        steps += 1
    return result, steps


def wait_status(socket: Path, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    end = time.monotonic() + DEADLINE_S
    while not done(state := read_status(socket)):
        assert time.monotonic() < end, f"the service never reached the state: {state}"
    return state


def lower_counter(state: dict[str, Any], name: str) -> float:
    return sum(entry[name] for entry in state["lower_tiers"])


def cascaded(count: float, state: dict[str, Any]) -> bool:
    return lower_counter(state, "cascades") >= count


def test_identity_round_trips_to_the_config_the_tiers_take() -> None:
    config = identity_config(IDENTITY)
    assert NamespaceIdentity.from_config(config).canonical_json() == IDENTITY
    with pytest.raises(Exception, match="JSON"):
        identity_config(b"{")


@pytest.fixture(params=["file", "s3"])
def lower(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return file_tier(tmp_path / "root")
    moto: MotoServer = request.getfixturevalue("s3_endpoint")
    return s3_tier(moto.endpoint_url)


def test_stored_cascaded_evicted_promoted_and_found_again_after_kill_9(
    tmp_path: Path, pool_name: str, lower: str, capsys: pytest.CaptureFixture[str]
) -> None:
    service = start(tmp_path, pool_name, lower)
    try:
        a = engine(service.socket)
        wanted = [key(i) for i in range(8)]
        store(a, wanted, settle=service.socket)
        # In the pool at once; below it after write-behind.
        assert all(a.lookup(k, ReqContext("a")) is HIT for k in wanted)
        wait_status(service.socket, lambda s: lower_counter(s, "cascades") >= 8)
        if "kind: file" in lower:
            # On the file root, under this identity's namespace: an in-process stack
            # over the same root finds every chunk, byte-exact.
            root = tmp_path / "root"
            with load_stack({"tiers": [{"kind": "cpu", "capacity": 4 * CHUNK},
                                       {"kind": "file", "root": str(root)}]},
                            OFFLOADING) as check:
                check.wait_index()
                assert all(k in check.tiers[1].manager.index for k in wanted)
        # Evict them from the pool: fillers (cascaded too) take every slot.
        store(a, [key(100 + i) for i in range(SLOTS)], settle=service.socket)
        assert all(a.lookup(k, ReqContext("a")) is not HIT for k in wanted[:4])
        wait_status(service.socket, lambda s: lower_counter(s, "cascades") >= 8 + SLOTS)

        # Another engine's lookup misses the pool, the service promotes from below.
        b = engine(service.socket)
        result, _ = resolve(b, wanted[0])
        assert result is HIT
        assert read_exact(b, wanted[0])
        state = read_status(service.socket)
        assert state["counters"]["promoted"] >= 1
        assert lower_counter(state, "promotions") >= 1
        print_status(state, as_json=False)
        shown = capsys.readouterr().out
        assert f"lower tier {state['lower_tiers'][0]['tiers'][0]['name']}:" in shown
        assert re.search(r"lower tier \S+: \d+ chunks \((indexed|indexing)\)", shown)

        # kill -9: the restarted service re-adopts its pool and rebuilds the lower
        # tiers' indexes; the chunks evicted before are promoted again, byte-exact.
        service.kill()
        service.start()
        c = engine(service.socket)
        # Asked first: the promotions below evict the least recently used chunks, and
        # after a restart that order is the slots' own.
        assert resolve(c, wanted[0]) == (HIT, 0)  # re-adopted from the pool itself
        for k in wanted[1:4]:
            result, _ = resolve(c, k)
            assert result is HIT
            assert read_exact(c, k)
        assert resolve(c, key(999))[0] is MISS  # held nowhere
        for manager in (a, b, c):
            manager.shutdown()
    finally:
        service.stop()


def test_a_failing_lower_tier_resolves_to_a_miss(tmp_path: Path, pool_name: str,
                                                  lower: str) -> None:
    service = start(tmp_path, pool_name, lower)
    try:
        a = engine(service.socket)
        wanted = [key(i) for i in range(4)]
        store(a, wanted, settle=service.socket)
        store(a, [key(100 + i) for i in range(SLOTS)], settle=service.socket)
        wait_status(service.socket, lambda s: lower_counter(s, "cascades") >= 4 + SLOTS)
        if "kind: file" in lower:
            # Each chunk file of ``wanted`` becomes unreadable: a directory in its place.
            names = {k[:16].hex() for k in wanted}
            chunks = [path for path in (tmp_path / "root").rglob("*.kvc")
                      if path.name.split("_")[0] in names]
            assert len(chunks) == len(wanted)
            for path in chunks:
                path.unlink()
                path.mkdir()
        else:
            MotoServer(lower.split("endpoint_url: ")[1].strip()).reset()
        # The service's answer makes it a MISS (the engine's own bound is far away).
        for k in wanted:
            result, steps = resolve(a, k)
            assert result is MISS
            assert steps < 1000
        state = read_status(service.socket)
        assert state["counters"].get("promoted", 0) == 0
        # The pool keeps serving.
        store(a, [key(200)])
        assert a.lookup(key(200), ReqContext("a")) is HIT
        a.shutdown()
    finally:
        service.stop()


def test_a_dead_service_and_an_unanswered_probe_are_misses_within_the_bound(
    tmp_path: Path, pool_name: str
) -> None:
    service = start(tmp_path, pool_name, file_tier(tmp_path / "root"))
    a = engine(service.socket, probe_steps=3)
    ctx = ReqContext("a")
    try:
        # Held nowhere: the service's answer, within the bound.
        assert resolve(a, key(1))[0] is MISS
        service.kill()
        assert a.lookup(key(2), ctx) is MISS  # dead: a miss at once, never RETRY
    finally:
        if service.proc is not None and service.proc.poll() is None:
            service.stop()
    a.shutdown()


@contextlib.contextmanager
def serving_here(tmp_path: Path, pool_name: str, lower: str, gate: threading.Event
                 ) -> Iterator[Path]:
    """The service in this process (so a test can block its movers) over a fresh pool
    with ``lower`` below it; its socket. ``gate`` is set before the service stops, so a
    mover the test blocked lets go."""
    config = tmp_path / "serve.yaml"
    config.write_text(stack_yaml(pool_name, lower))
    pool = Pool(Path("/dev/shm", pool_name), Layout(SLOTS, CHUNK), fresh=True)
    socket = tmp_path / "local.sock"
    svc = Service(pool, socket, lower=load_stack_config(config))
    thread = threading.Thread(target=svc.serve)
    thread.start()
    try:
        yield socket
    finally:
        gate.set()
        svc.stop()
        thread.join()
        pool.close()


def stored_then_evicted(manager: ServiceTierManager, socket: Path, target: OffloadKey
                        ) -> None:
    """``target`` stored, cascaded below, then evicted from the pool by other stores."""
    store(manager, [target], settle=socket)
    store(manager, [key(100 + i) for i in range(SLOTS)], settle=socket)
    wait_status(socket, lambda s: lower_counter(s, "cascades") >= 1 + SLOTS)


# -- priority: a promotion is served while the cascades ahead of it are blocked --------
@pytest.fixture
def blocked_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The file tier's store path blocked until the event is set (it starts set)."""
    from kvtiers.tiers.file.mover import FileMover

    gate = threading.Event()
    gate.set()
    store_one = FileMover._store_one

    def gated(self: FileMover, job: Any, chunk: Any) -> int:
        assert gate.wait(DEADLINE_S), "the store path stayed blocked"
        return store_one(self, job, chunk)

    monkeypatch.setattr(FileMover, "_store_one", gated)
    yield gate
    gate.set()


def test_a_promotion_is_served_ahead_of_the_cascades_queued_before_it(
    tmp_path: Path, pool_name: str, blocked_stores: threading.Event
) -> None:
    # One store thread: the first cascade blocks it, the others queue behind.
    lower = file_tier(tmp_path / "root") + "    threads: 1\n"
    with serving_here(tmp_path, pool_name, lower, blocked_stores) as socket:
        a = engine(socket)
        target = key(1)
        stored_then_evicted(a, socket, target)
        assert a.lookup(target, ReqContext("a")) is not HIT

        blocked_stores.clear()
        queued = [key(300 + i) for i in range(SLOTS // 2)]
        store(a, queued)  # their cascades queue on the blocked store path
        before = lower_counter(read_status(socket), "cascades")

        b = engine(socket)
        result, _ = resolve(b, target)
        assert result is HIT
        assert read_exact(b, target)
        state = read_status(socket)
        # Served while every cascade queued before it is still waiting.
        assert lower_counter(state, "cascades") == before
        assert not blocked_stores.is_set()
        blocked_stores.set()
        wait_status(socket, lambda s: lower_counter(s, "cascades") >= before + len(queued))
        a.shutdown()
        b.shutdown()


def test_a_probe_waits_out_a_slow_promotion_in_time_not_only_in_steps(
    tmp_path: Path, pool_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtiers.tiers.file.mover import FileMover

    gate = threading.Event()
    gate.set()
    load_one = FileMover._load_one

    def gated(self: FileMover, chunk: Any) -> int:
        assert gate.wait(DEADLINE_S), "the load path stayed blocked"
        return load_one(self, chunk)

    monkeypatch.setattr(FileMover, "_load_one", gated)
    with serving_here(tmp_path, pool_name, file_tier(tmp_path / "root"), gate) as socket:
        a = engine(socket)
        target = key(1)
        stored_then_evicted(a, socket, target)
        gate.clear()  # the promotion it starts cannot land
        b = engine(socket, probe_steps=2, probe_wait_s=5.0)
        now = [1000.0]
        b._clock = lambda: now[0]
        ctx = ReqContext("b")
        assert b.lookup(target, ctx) is RETRY
        for _ in range(4):  # past the steps, not the time: still waiting for it
            step(b)
            assert b.lookup(target, ctx) is RETRY
        now[0] += 5.0
        assert b.lookup(target, ctx) is MISS
        assert b.stats["probes_given_up"] == 1
        gate.set()
        a.shutdown()
        b.shutdown()


@pytest.mark.usefixtures("aws_env")
def test_a_dead_s3_resolves_to_a_miss_and_the_pool_keeps_serving(
    tmp_path: Path, pool_name: str
) -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    running = True
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    service = start(tmp_path, pool_name, s3_tier(endpoint) + (
        "    max_attempts: 1\n    timeout_s: 1\n    op_deadline_s: 2\n"))
    try:
        a = engine(service.socket)
        wanted = [key(i) for i in range(4)]
        store(a, wanted, settle=service.socket)
        store(a, [key(100 + i) for i in range(SLOTS)], settle=service.socket)
        moto.stop()  # S3 dead: every request is refused
        running = False
        for k in wanted:
            result, _ = resolve(a, k)
            assert result is MISS
        assert read_status(service.socket)["counters"]["promotions_failed"] >= 1
        store(a, [key(200)])
        assert a.lookup(key(200), ReqContext("a")) is HIT
        a.shutdown()
    finally:
        service.kill()
        if running:
            moto.stop()


def test_a_probe_or_commit_of_a_key_not_this_caches_is_refused(tmp_path: Path,
                                                                 pool_name: str) -> None:
    from kvtiers.service import protocol as p
    from kvtiers.service.client import ServiceDown

    service = start(tmp_path, pool_name, file_tier(tmp_path / "root"))
    try:
        a = engine(service.socket)
        wait_status(service.socket, lambda s: bool(s["lower_tiers"]))
        for bad in (p.Probe(1, a.client.ns, [b"short"]),
                    p.Commit(1, a.client.ns, [b"short"], [0], [CHUNK])):
            hostile = ServiceClient(service.socket, IDENTITY, CHUNK, timeout_s=5.0)
            bad.ns = hostile.ns
            with pytest.raises(ServiceDown, match="refused a request"):
                hostile.call([bad])
            hostile.close()
        # The engine beside them is served.
        store(a, [key(1)])
        assert a.lookup(key(1), ReqContext("a")) is HIT
        assert read_status(service.socket)["counters"]["bad_messages"] == 2
        a.shutdown()
    finally:
        service.stop()


# -- lower tiers built at the service's start (identity records beside the pool) -------
def root_holds(root: Path, wanted: list[OffloadKey]) -> bool:
    """Whether an in-process stack over the file ``root`` finds every key, byte-exact."""
    return tier_holds({"kind": "file", "root": str(root)}, wanted)


def tier_holds(tier: dict[str, Any], wanted: list[OffloadKey]) -> bool:
    """Whether an in-process stack over ``tier`` (a lower tier's stack entry) finds every
    key, byte-exact."""
    with load_stack({"tiers": [{"kind": "cpu", "capacity": 4 * CHUNK}, tier]},
                    OFFLOADING) as check:
        check.wait_index()
        lower = check.tiers[1].manager
        if not all(k in lower.index for k in wanted):
            return False
        manager = check.manager
        for k in wanted:
            ctx = ReqContext("check")
            assert manager.lookup(k, ctx) is LookupResult.HIT_PENDING  # promoted
            manager.on_schedule_end(ScheduleEndContext())
            manager.wait_idle()
            assert manager.lookup(k, ctx) is HIT
            manager.prepare_load([k], ctx)
            spec = manager.get_spec([k])
            region = check.tiers[0].region
            assert isinstance(spec, CPULoadStoreSpec) and region is not None
            same = bytes(region.view(int(spec.block_ids[0]))[:CHUNK]) == payload(k)
            manager.complete_load([k], ctx)
            manager.on_request_finished(ctx)
            if not same:
                return False
        return True


def test_identity_records_read_back_whole_or_refused(tmp_path: Path) -> None:
    import hashlib

    records = IdentityRecords(tmp_path / "pool")
    digest = hashlib.sha256(IDENTITY).digest()
    assert records.read(digest) is None
    records.write(IDENTITY)
    assert records.read(digest) == IDENTITY
    assert [p.name for p in records.directory.iterdir()] == [f"{digest.hex()}.json"]
    # Filed under another digest, cut short, or a link: refused, never parsed.
    (records.directory / f"{digest.hex()}.json").write_bytes(IDENTITY[:-1])
    with pytest.raises(RecordDamaged, match="identity of its digest"):
        records.read(digest)
    (records.directory / f"{digest.hex()}.json").unlink()
    (records.directory / f"{digest.hex()}.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RecordDamaged):
        records.read(digest)
    records.write(IDENTITY)  # replaces the link
    assert records.read(digest) == IDENTITY
    records.prune([])
    assert records.read(digest) is None


def test_lower_tiers_come_up_at_the_start_and_take_the_readopted_chunks(
    tmp_path: Path, pool_name: str
) -> None:
    service = start(tmp_path, pool_name, file_tier(tmp_path / "first"))
    try:
        a = engine(service.socket)
        wanted = [key(i) for i in range(8)]
        store(a, wanted, settle=service.socket)
        a.shutdown()
        assert service.stop() == 0
        # Restarted over an empty root: no engine attaches, yet the namespace's lower
        # tiers are built from the record and the re-adopted chunks cascade into it.
        second = tmp_path / "second"
        service.config.write_text(stack_yaml(pool_name, file_tier(second)))
        service.start()
        state = wait_status(service.socket, functools.partial(cascaded, len(wanted)))
        assert state["engines"] == []
        assert state["counters"].get("attaches", 0) == 0
        assert state["counters"]["adopted"] == len(wanted)
        assert [entry["tiers"][0]["name"] for entry in state["lower_tiers"]] == ["file"]
        assert root_holds(second, wanted)

        # The first engine's probe is answered from them: evicted, promoted, byte-exact.
        b = engine(service.socket)
        store(b, [key(100 + i) for i in range(SLOTS)], settle=service.socket)
        assert b.lookup(wanted[0], ReqContext("b")) is not HIT
        result, _ = resolve(b, wanted[0])
        assert result is HIT
        assert read_exact(b, wanted[0])
        assert read_status(service.socket)["counters"]["promoted"] >= 1
        b.shutdown()
    finally:
        service.stop()


def test_a_damaged_identity_record_waits_for_the_first_attach(tmp_path: Path,
                                                               pool_name: str) -> None:
    service = start(tmp_path, pool_name, file_tier(tmp_path / "root"))
    try:
        a = engine(service.socket)
        store(a, [key(1)], settle=service.socket)
        a.shutdown()
        service.stop()
        records = IdentityRecords(Path("/dev/shm", pool_name))
        (record,) = records.directory.iterdir()
        record.write_bytes(b'{"model_name": "another"}')
        service.start()
        state = read_status(service.socket)
        assert state["counters"]["identity_records_damaged"] == 1
        assert state["lower_tiers"] == [] and not state["lower_tiers_refused"]
        assert state["counters"]["adopted"] == 1
        # The first attach builds them as for a new namespace and writes the record anew.
        b = engine(service.socket)
        wait_status(service.socket, lambda s: bool(s["lower_tiers"]))
        assert record.read_bytes() == IDENTITY
        assert resolve(b, key(1)) == (HIT, 0)
        b.shutdown()
    finally:
        service.stop()


# -- write: back below the pool: demotions from held slots --------------------------------
#: The slots the service keeps free by demoting (an eighth of the pool).
HEADROOM = SLOTS // 8


def back_tier(root: Path) -> str:
    return file_tier(root) + "    write: back\n    threads: 1\n"


def settled(state: dict[str, Any]) -> bool:
    """No demotion in flight and the headroom free again."""
    return state["held_slots"] == 0 and state["num_slots"] - state["used_slots"] >= HEADROOM


def store_settled(manager: ServiceTierManager, socket: Path, wanted: list[OffloadKey]) -> None:
    """Store ``wanted`` batch by batch, each after the demotions the one before caused."""
    for at in range(0, len(wanted), HEADROOM):
        store(manager, wanted[at : at + HEADROOM])
        wait_status(socket, settled)


def test_write_back_demotes_the_pools_evictions_byte_exact(tmp_path: Path,
                                                           pool_name: str) -> None:
    pytest.importorskip("prometheus_client")
    from kvtiers.testing.serve import free_port, scrape

    root = tmp_path / "root"
    service = start(tmp_path, pool_name, back_tier(root), metrics_port=free_port())
    try:
        a = engine(service.socket)
        wanted = [key(i) for i in range(8)]
        store_settled(a, service.socket, wanted)
        assert lower_counter(read_status(service.socket), "demotions") == 0  # not at store
        store_settled(a, service.socket, [key(100 + i) for i in range(SLOTS)])
        state = read_status(service.socket)
        assert all(a.lookup(k, ReqContext("a")) is not HIT for k in wanted)
        # Every chunk evicted went down first: none dropped, none failed.
        assert lower_counter(state, "demotions") >= len(wanted)
        assert state["counters"].get("demotions_dropped", 0) == 0
        assert lower_counter(state, "demotion_failures") == 0
        assert lower_counter(state, "cascades") == 0  # write: back writes at eviction only
        assert root_holds(root, wanted)
        # Another engine's lookup is promoted from the back tier, byte-exact.
        b = engine(service.socket)
        for k in wanted[:2]:
            result, _ = resolve(b, k)
            assert result is HIT
            assert read_exact(b, k)

        # The lower tier's own families on the service's exporter, per namespace (the
        # promotions' demotions ended first: nothing moves while it is scraped).
        state = wait_status(service.socket, settled)
        samples = scrape(f"http://127.0.0.1:{service.metrics_port}/metrics")
        ns = f'namespace="{state["namespaces"][0]["name"]}"'
        tier = f'{ns},tier="file"'
        demoted = lower_counter(state, "demotions")
        assert samples[f"kvtiers_service_lower_demoted_chunks_total{{{tier}}}"] == demoted
        assert samples[f"kvtiers_service_lower_demoted_bytes_total{{{tier}}}"] >= (
            demoted * CHUNK)
        assert samples[f'kvtiers_service_lower_demotions_total{{{ns},outcome="done"}}'] == (
            demoted)
        assert samples[f'kvtiers_service_lower_demotions_total{{{ns},outcome="dropped"}}'] == 0
        assert samples[f'kvtiers_service_lower_promotions_total{{{ns},outcome="done"}}'] >= 2
        assert samples[f"kvtiers_service_lower_promoted_chunks_total{{{tier}}}"] >= 2
        assert samples[f"kvtiers_service_lower_cascaded_chunks_total{{{tier}}}"] == 0
        assert samples[f"kvtiers_service_lower_chunks{{{tier}}}"] >= len(wanted)
        assert samples[f"kvtiers_service_lower_index_complete{{{tier}}}"] == 1
        assert samples[f"kvtiers_service_lower_corrupt_chunks_total{{{ns}}}"] == 0
        assert samples['kvtiers_service_pool_slots{state="held"}'] == 0
        a.shutdown()
        b.shutdown()
    finally:
        service.stop()


_GATED_SERVE = """
import sys, threading
from pathlib import Path

from kvtiers.tiers.file.mover import FileMover

marker = Path(sys.argv.pop(1))


def gated(self, job, chunk):
    marker.touch()
    threading.Event().wait()  # this store thread stops here until the process is killed
    raise AssertionError("unreachable")


FileMover._store_one = gated
from kvtiers.cli import main

raise SystemExit(main(sys.argv[1:]))
"""


def test_a_demotion_killed_mid_copy_loses_nothing_and_serves_nothing_torn(
    tmp_path: Path, pool_name: str
) -> None:
    root = tmp_path / "root"
    config = tmp_path / "serve.yaml"
    config.write_text(stack_yaml(pool_name, back_tier(root)))
    socket, marker, script = tmp_path / "serve.sock", tmp_path / "demoting", tmp_path / "g.py"
    script.write_text(_GATED_SERVE)
    # The service's file tier cannot finish a store: the first demotion's copy stops.
    gated = subprocess.Popen(
        [sys.executable, str(script), str(marker), "serve", "--config", str(config),
         "--socket", str(socket), "--slot-bytes", str(CHUNK), "--fresh"],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert gated.stdout is not None
        assert gated.stdout.readline().startswith("kvtiers serve: ready")
        a = engine(socket)
        wanted = [key(i) for i in range(HEADROOM)]
        store(a, wanted)
        store(a, [key(100 + i) for i in range(SLOTS - HEADROOM)])
        # The pool full: its oldest chunks, ``wanted``, are evicted with their slots held
        # while their copy down is stuck.
        wait_status(socket, lambda s: s["held_slots"] == HEADROOM and marker.exists())
        # Stores go on meanwhile: they take other slots, never a held one.
        store(a, [key(200 + i) for i in range(HEADROOM)])
        state = read_status(socket)
        assert state["held_slots"] == HEADROOM
        assert state["counters"]["demotions_dropped"] >= HEADROOM  # fillers, not wanted
        a.shutdown()
        gated.send_signal(signal.SIGKILL)
        gated.wait(timeout=30)
    finally:
        if gated.poll() is None:
            gated.kill()
            gated.wait(timeout=30)
        if gated.stdout is not None:
            gated.stdout.close()
    # Restarted (stores unblocked): the chunks whose demotion was cut short are still
    # whole in the pool, re-adopted and served byte-exact; the back tier holds nothing of
    # them, so nothing torn is ever served from it.
    service = ServiceProcess(config, socket, slot_bytes=CHUNK)
    service.start()
    try:
        b = engine(socket)
        for k in wanted:
            assert resolve(b, k) == (HIT, 0)
            assert read_exact(b, k)
        b.shutdown()
    finally:
        service.stop()
    with load_stack({"tiers": [{"kind": "cpu", "capacity": 4 * CHUNK},
                               {"kind": "file", "root": str(root)}]}, OFFLOADING) as check:
        check.wait_index()
        assert not any(k in check.tiers[1].manager.index for k in wanted)


def test_a_failed_demotion_loses_the_chunk_cleanly(tmp_path: Path, pool_name: str) -> None:
    root = tmp_path / "root"
    service = start(tmp_path, pool_name, back_tier(root))
    try:
        a = engine(service.socket)
        wait_status(service.socket, lambda s: bool(s["lower_tiers"]))
        # The namespace's directory becomes a plain file: every copy down fails.
        (namespace_dir,) = root.iterdir()
        shutil.rmtree(namespace_dir)
        namespace_dir.write_bytes(b"not a directory")
        wanted = [key(i) for i in range(HEADROOM)]
        store(a, wanted)
        store(a, [key(100 + i) for i in range(SLOTS - HEADROOM)])
        state = wait_status(service.socket, lambda s: lower_counter(s, "demotion_failures")
                            >= HEADROOM and s["held_slots"] == 0)
        assert lower_counter(state, "demotions") == 0
        # Gone from the pool, held nowhere: a miss (recomputed), never wrong bytes; the
        # held slots are free again and the pool keeps serving.
        for k in wanted:
            assert resolve(a, k)[0] is MISS
        assert state["num_slots"] - state["used_slots"] >= HEADROOM
        store(a, [key(300)])
        assert read_exact(a, key(300))
        a.shutdown()
    finally:
        service.stop()


def test_a_second_hop_demotes_the_file_tiers_evictions_to_s3(
    tmp_path: Path, pool_name: str, s3_endpoint: MotoServer
) -> None:
    # A file tier (write: through) of 40 chunks over S3 (write: back): what the file tier
    # evicts is handed down to S3. The pool (32 slots) evicted those chunks before, so
    # each is read from its file into a held free slot of the pool and stored from there.
    lower = (file_tier(tmp_path / "root") + f"    capacity: {40 * 2 * CHUNK}\n"
             + s3_tier(s3_endpoint.endpoint_url) + "    write: back\n")
    service = start(tmp_path, pool_name, lower)
    try:
        a = engine(service.socket)
        wanted = [key(i) for i in range(48)]
        store(a, wanted, settle=service.socket)
        state = wait_status(service.socket, lambda s: lower_counter(s, "demotions") >= 8
                            and s["held_slots"] == 0)
        assert lower_counter(state, "demotion_failures") == 0
        assert all(a.lookup(k, ReqContext("a")) is not HIT for k in wanted[:8])
        assert tier_holds({"kind": "s3", "bucket": BUCKET, "prefix": "served",
                           "endpoint_url": s3_endpoint.endpoint_url}, wanted[:8])
        a.shutdown()
    finally:
        service.stop()
