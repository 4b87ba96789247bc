"""What each tier announces for a router, below vLLM's event tracker: what a persistent
tier holds at start and what a probe finds, stores that vLLM may expect a removal of,
listed chunks that keep locality REMOTE, self-describing payloads by default, and the
route 1 adapter spreading a large announcement over steps (the real publisher and
subscriber: ``tests/e2e/test_kv_events.py``)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.manager import Locality, LookupResult, Medium, OffloadingEvent
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.integrations.vllm import compat
from kvtiers.integrations.vllm import manager as manager_module
from kvtiers.integrations.vllm.translate import KeyMap, vllm_event
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.objects import offloading_config
from kvtiers.tiers.fsspec.store import FsspecStore
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.manager import ObjectTierManager
from tests.test_file_support import CTX, open_tier
from tests.test_vllm_spec import canonical_kv, make_kv, make_request, store, vllm_config

END = vbase.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def stored_keys(events: Any) -> list[Any]:
    return [k for e in events if not e.removed for k in e.keys]


# -- what a persistent tier holds is announced, however it came to hold it -------------------
def test_a_reopened_file_tier_announces_the_chunks_it_found(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    stored = tier.store(range(4))
    tier.close()
    reopened = open_tier(tmp_path)
    try:
        [event] = reopened.manager.take_events()
        assert sorted(event.keys) == sorted(stored)
        assert (event.removed, event.medium, event.locality) == (
            False, Medium.STORAGE, Locality.LOCAL)
    finally:
        reopened.close()


def test_a_tier_reopened_over_capacity_announces_only_what_it_keeps(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.store(range(5))
    tier.close()
    reopened = open_tier(tmp_path, capacity_chunks=3)
    try:
        [event] = reopened.manager.take_events()  # no store then removal of the other two
        held = [k for k in (conformance_key(i) for i in range(5))
                if reopened.manager.lookup(k, CTX) is LookupResult.HIT]
        assert not event.removed and sorted(event.keys) == sorted(held) and len(held) == 3
    finally:
        reopened.close()


def test_a_reopened_object_tier_announces_the_chunks_it_listed() -> None:
    url = f"memory://kvtiers-{uuid.uuid4().hex}/cache"
    config = offloading_config()
    identity = NamespaceIdentity.from_config(config)
    geometry = ChunkGeometry.from_config(config)
    store = FsspecStore(url)
    names = [ObjectBackend(store, identity).object_key(conformance_key(i)) for i in range(3)]
    backend = ObjectBackend(store, identity)
    backend.open_namespace()
    for name in names:
        store.put_if_absent(name, [b"listed, never read here"])
    manager = ObjectTierManager(ObjectBackend(FsspecStore(url), identity),
                                max_chunk_bytes=geometry.max_chunk_bytes)
    try:
        assert sorted(stored_keys(manager.take_events())) == sorted(
            conformance_key(i) for i in range(3))
    finally:
        manager.shutdown()


def test_a_chunk_a_probe_finds_is_announced(tmp_path: Path) -> None:
    reader = open_tier(tmp_path, shared=True)
    writer = open_tier(tmp_path, shared=True)
    try:
        reader.manager.take_events()
        [key] = writer.store([7])
        assert reader.manager.lookup(key, CTX) is LookupResult.RETRY
        reader.manager.on_schedule_end(END)
        reader.manager.wait_probes()
        assert reader.manager.lookup(key, CTX) is LookupResult.HIT
        assert stored_keys(reader.manager.take_events()) == [key]
    finally:
        writer.close()
        reader.close()


# -- the form vLLM gets ---------------------------------------------------------------------
def test_stores_reach_vllm_expecting_their_removal() -> None:
    keys = KeyMap([0])
    key = conformance_key(1)
    stored = vllm_event(OffloadingEvent([key], Medium.STORAGE, removed=False,
                                        locality=Locality.LOCAL, ownership="file"), keys)
    removed = vllm_event(OffloadingEvent([key], Medium.STORAGE, removed=True,
                                         locality=Locality.LOCAL, ownership="file"), keys)
    assert stored is not None and removed is not None
    # vLLM's tracker keeps a chunk's self-describing payload while a tier that will
    # announce its removal holds it, so the removal names the hashes the store did.
    assert stored.removal_expected and not removed.removal_expected
    assert (stored.medium, stored.locality, stored.ownership) == (
        vbase.Medium.STORAGE, vbase.Locality.LOCAL, "file")


def test_a_configured_locality_leaves_listed_chunks_remote() -> None:
    keys = KeyMap([0])
    own = OffloadingEvent([conformance_key(1)], Medium.STORAGE, removed=False,
                          locality=Locality.LOCAL)
    listed = OffloadingEvent([conformance_key(2)], Medium.STORAGE, removed=False,
                             locality=Locality.REMOTE, listed=True)
    local = vbase.Locality.LOCAL
    assert vllm_event(own, keys, "t", local).locality is vbase.Locality.LOCAL  # type: ignore[union-attr]
    assert vllm_event(listed, keys, "t", local).locality is vbase.Locality.REMOTE  # type: ignore[union-attr]


def test_route1_asks_vllm_for_self_describing_events_unless_told_not_to(tmp_path: Path) -> None:
    spec = OffloadingSpecFactory.create_spec(vllm_config(tmp_path))
    assert spec.kv_events_config.self_describing_kv_events
    assert spec.kv_events_config.enable_kv_cache_events
    spec = OffloadingSpecFactory.create_spec(
        vllm_config(tmp_path, self_describing_kv_events=False))
    assert not spec.kv_events_config.self_describing_kv_events
    with pytest.raises(ConfigError, match="self_describing_kv_events: expected true or false"):
        OffloadingSpecFactory.create_spec(vllm_config(tmp_path, self_describing_kv_events="no"))


def test_route1_spreads_a_large_announcement_over_steps_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "kv"
    kv = make_kv()
    req = make_request(5, first_block=0)
    config = vllm_config(root)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    worker = OffloadingSpecFactory.create_spec(config).get_worker(canonical_kv(kv))
    store(manager, worker, req, [range(0, 3), range(0, 1)], job_id=1)
    manager.stack.manager.wait_idle()
    worker.shutdown()
    manager.shutdown()

    monkeypatch.setattr(manager_module, "MAX_EVENT_KEYS_PER_CALL", 3)
    manager = OffloadingSpecFactory.create_spec(vllm_config(root)).get_manager()
    manager.stack.wait_index()  # the restart's chunks are found, to be announced
    try:
        batches = [list(manager.take_events()) for _ in range(3)]
        assert [sum(len(e.keys) for e in batch) for batch in batches] == [3, 1, 0]
        announced = [k for batch in batches for e in batch for k in e.keys]
        assert sorted(announced) == sorted(req.keys[0][:3] + req.keys[1][:1])
        assert {(e.medium, e.ownership) for batch in batches for e in batch} == {
            (vbase.Medium.STORAGE, "file")}
    finally:
        manager.shutdown()


def test_route2_announces_other_servers_chunks_remote_whatever_its_locality(
    tmp_path: Path,
) -> None:
    from tests.test_vllm_tiers import Primary, build, finished, job, keys, make_spec

    spec = make_spec()
    config = {"type": "KVTiersFileTier", "module_path": "kvtiers.integrations.vllm",
              "root": str(tmp_path / "kv"), "io": "posix", "threads": 2, "shared": True}
    reader = build({**config, "list_interval_s": 60, "locality": "LOCAL"}, Primary(), spec,
                   enable_kv_events=True)
    primary = Primary()
    writer = build(config, primary, spec, enable_kv_events=True)
    try:
        ks = keys(3, 4)
        for chunk in range(4):
            primary.fill(chunk, seed=chunk)
        writer.submit_store(job(1, ks, [0, 1, 2, 3], promotion=False))
        assert [r.success for r in finished(writer)] == [True]
        [own] = writer.take_events()
        assert own.removal_expected and own.locality is vbase.Locality.LOCAL

        assert list(reader.take_events()) == []
        reader.manager.listing.list_soon()
        reader.on_schedule_end(END)
        reader.manager.listing.wait()
        reader.on_schedule_end(END)
        [event] = reader.take_events()
        assert sorted(event.keys) == sorted(ks)  # vLLM's keys (group ids 0 and 3)
        assert (event.removed, event.medium, event.locality, event.ownership) == (
            False, vbase.Medium.STORAGE, vbase.Locality.REMOTE, "KVTiersFileTier")
        assert event.removal_expected
    finally:
        writer.shutdown()
        reader.shutdown()


@pytest.mark.parametrize("tiers", ["cpu", "cpu+file"])
def test_route1_stored_events_carry_the_storing_request_context(
    tiers: str, tmp_path: Path
) -> None:
    """vLLM 0.34's tracker reads a self-describing store's tokens and block hashes from
    the event's request context (an event without one goes out as a placeholder): each
    stored event names the context of the request whose store completed it, for the
    composite's manager over one and over two tiers."""
    extra: dict[str, Any] = {}
    if tiers == "cpu":
        extra["kvtiers"] = {"tiers": [{"kind": "cpu", "capacity": "16KiB"}]}
    config = vllm_config(tmp_path / "kv", **extra)
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    try:
        first, second = make_request(1, first_block=0), make_request(2, first_block=12)
        contexts = [vbase.ReqContext(req_id="a"), vbase.ReqContext(req_id="b")]
        batches = [[req.keys[0][0], req.keys[1][0]] for req in (first, second)]
        for keys, context in zip(batches, contexts, strict=True):
            assert manager.prepare_store(keys, context) is not None
        for keys, context in zip(batches, contexts, strict=True):
            manager.complete_store(keys, context)
        stored = [e for e in manager.take_events() if not e.removed and e.ownership is None]
        assert sorted(stored_keys(stored)) == sorted(batches[0] + batches[1])
        if not compat.EVENT_CARRIES_REQ_CONTEXT:
            return  # vLLM before 0.34: the tracker keeps the payload itself
        for event in stored:
            for key in event.keys:
                assert event.req_context is contexts[0 if key in batches[0] else 1]
    finally:
        manager.shutdown()
