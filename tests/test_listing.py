"""The background listing of a shared namespace (``list_interval_s``): other servers'
chunks become listed events within a bounded number of steps, vanished ones are withdrawn,
a chunk this tier comes to hold is handed over, and the summary it republishes answers for
every chunk listed. Time is an injected clock; the listing thread is waited for
explicitly (``listing.wait()``), never slept on."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    ScheduleEndContext,
)
from kvtiers.core.tier import BuiltTier
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.filemapper.summary import SUMMARY_NAME, NamespaceSummary
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers import listing as listing_module
from kvtiers.tiers.fsspec.store import FsspecStore
from kvtiers.tiers.listing import KEYS_PER_STEP, ListingSettings, SharedListing
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.manager import ObjectTierManager
from kvtiers.tiers.object.mover import ObjectMover
from kvtiers.tiers.object.store import ObjectStore
from tests.test_file_support import CTX, IDENTITY, open_tier

END = ScheduleEndContext()
INTERVAL_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def keys(ids: range | list[int]) -> list[OffloadKey]:
    return [conformance_key(i) for i in ids]


def listed(events: list[OffloadingEvent], *, removed: bool) -> list[OffloadKey]:
    """The keys of the listed events of one kind, in order."""
    return [k for e in events if e.listed and e.removed is removed for k in e.keys]


def own(events: list[OffloadingEvent], *, removed: bool) -> list[OffloadKey]:
    return [k for e in events if not e.listed and e.removed is removed for k in e.keys]


# -- the listing on its own --------------------------------------------------------------
class Namespace:
    """What a fake namespace holds; listing it records the thread that listed it."""

    def __init__(self) -> None:
        self.keys: list[OffloadKey] = []
        self.threads: list[str] = []
        self.gate: threading.Event | None = None
        self.fail: Exception | None = None

    def list(self) -> Iterator[OffloadKey]:
        self.threads.append(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait()
        if self.fail is not None:
            raise self.fail
        yield from list(self.keys)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def namespace() -> Namespace:
    return Namespace()


@pytest.fixture
def listing(namespace: Namespace, clock: Clock) -> Iterator[SharedListing]:
    shared = SharedListing(namespace.list, interval_s=INTERVAL_S, max_chunks=100,
                           medium=Medium.STORAGE, where="test", clock=clock)
    yield shared
    shared.close()


def list_once(listing: SharedListing, clock: Clock,
              held: frozenset[OffloadKey] = frozenset()) -> list[OffloadingEvent]:
    """One interval on: start a listing, wait for its thread, take it in; the events."""
    clock.now += INTERVAL_S
    listing.on_schedule_end((held,))
    assert listing.busy
    listing.wait()
    while listing.busy:
        listing.on_schedule_end((held,))
    return listing.observe([])


def test_a_listing_starts_once_per_interval_on_its_own_thread(
    listing: SharedListing, namespace: Namespace, clock: Clock
) -> None:
    listing.on_schedule_end(())
    clock.now += INTERVAL_S - 0.5
    listing.on_schedule_end(())
    assert not listing.busy and namespace.threads == []  # not before the interval
    list_once(listing, clock)
    assert namespace.threads == ["kvtiers-listing-0"]
    listing.on_schedule_end(())  # due again only one interval later
    assert not listing.busy and len(namespace.threads) == 1


def test_chunks_the_index_lacks_are_announced_remote_and_withdrawn_when_gone(
    listing: SharedListing, namespace: Namespace, clock: Clock
) -> None:
    namespace.keys = keys(range(5))
    events = list_once(listing, clock, held=frozenset({conformance_key(0)}))
    assert sorted(listed(events, removed=False)) == sorted(keys(range(1, 5)))
    assert all(e.locality is Locality.REMOTE and e.medium is Medium.STORAGE for e in events)
    assert listing.stats()["announced_chunks"] == 4
    # Listed again unchanged: nothing new. Two gone: withdrawn, once.
    assert list_once(listing, clock, held=frozenset({conformance_key(0)})) == []
    namespace.keys = keys([0, 1, 2])
    events = list_once(listing, clock, held=frozenset({conformance_key(0)}))
    assert sorted(listed(events, removed=True)) == sorted(keys([3, 4]))
    assert listed(events, removed=False) == []


def test_an_announced_chunk_the_index_comes_to_hold_is_handed_over(
    listing: SharedListing, namespace: Namespace, clock: Clock
) -> None:
    namespace.keys = keys(range(3))
    list_once(listing, clock)
    key = conformance_key(1)
    stored = OffloadingEvent([key], Medium.STORAGE, removed=False, locality=Locality.LOCAL)
    events = listing.observe([stored])
    # The listed announcement is withdrawn just before the tier's own.
    assert events == [
        OffloadingEvent([key], Medium.STORAGE, removed=True, locality=Locality.REMOTE,
                        listed=True),
        stored,
    ]
    assert listing.stats()["announced_chunks"] == 2
    # The tier evicts it later: its removal is the tier's alone; the listing that still
    # finds the file (the delete may be under way) does not announce it again.
    evicted = OffloadingEvent([key], Medium.STORAGE, removed=True, locality=Locality.LOCAL)
    assert listing.observe([evicted]) == [evicted]
    assert list_once(listing, clock) == []


def test_an_incomplete_listing_announces_but_withdraws_nothing(
    namespace: Namespace, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    shared = SharedListing(namespace.list, interval_s=INTERVAL_S, max_chunks=3,
                           medium=Medium.STORAGE, where="test ns", clock=clock)
    try:
        namespace.keys = keys(range(3))
        assert len(listed(list_once(shared, clock), removed=False)) == 3
        namespace.keys = keys(range(10, 20))  # the first three went; ten others came
        events = list_once(shared, clock)
        assert len(listed(events, removed=False)) == 3  # the bound
        assert listed(events, removed=True) == []  # it did not see the whole namespace
        assert shared.stats()["listings_incomplete"] == 1
        list_once(shared, clock)
        assert [r.message for r in caplog.records].count(
            "test ns: the namespace holds more than list_max_chunks (3) chunks; listings "
            "announce the first 3 found, withdraw nothing and write no summary") == 1
    finally:
        shared.close()


def test_a_complete_listing_withdraws_what_incomplete_ones_announced(
    namespace: Namespace, clock: Clock
) -> None:
    shared = SharedListing(namespace.list, interval_s=INTERVAL_S, max_chunks=3,
                           medium=Medium.STORAGE, where="test", clock=clock)
    try:
        namespace.keys = keys(range(3))
        list_once(shared, clock)
        namespace.keys = keys(range(10, 15))  # over the bound: incomplete
        assert len(listed(list_once(shared, clock), removed=False)) == 3
        before = set(shared.announced)  # chunks 0-2 and three of 10-14
        namespace.keys = keys([11])  # complete again
        events = list_once(shared, clock)
        assert set(listed(events, removed=True)) == before - {conformance_key(11)}
        assert shared.announced == {conformance_key(11)}
    finally:
        shared.close()


def test_a_failing_listing_is_incomplete_and_tried_again_later(
    listing: SharedListing, namespace: Namespace, clock: Clock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    namespace.keys = keys(range(2))
    list_once(listing, clock)
    namespace.fail = ConnectionError("the endpoint went away")
    namespace.keys = []
    assert list_once(listing, clock) == []  # nothing withdrawn on a failed listing
    assert "ConnectionError: the endpoint went away" in caplog.text
    namespace.fail = None
    assert sorted(listed(list_once(listing, clock), removed=True)) == sorted(keys(range(2)))


def test_each_step_compares_a_bounded_number_of_keys(
    listing: SharedListing, namespace: Namespace, clock: Clock
) -> None:
    shared = SharedListing(namespace.list, interval_s=INTERVAL_S, max_chunks=10 * KEYS_PER_STEP,
                           medium=Medium.STORAGE, where="test", clock=clock)
    try:
        namespace.keys = keys(range(2 * KEYS_PER_STEP + 5))
        clock.now += INTERVAL_S
        shared.on_schedule_end(())
        shared.wait()
        compared: list[int] = []
        announced = []
        calls: list[OffloadKey] = []

        class Held:
            """Holds nothing; counts the keys asked about."""

            def __contains__(self, key: object) -> bool:
                calls.append(key)  # type: ignore[arg-type]
                return False

        while shared.busy:
            calls.clear()
            shared.on_schedule_end((Held(),))
            compared.append(len(calls))
            announced.append(len(listed(shared.observe([]), removed=False)))
        assert compared == [KEYS_PER_STEP, KEYS_PER_STEP, 5]
        assert announced == [KEYS_PER_STEP, KEYS_PER_STEP, 5]
        # Then all gone, in one listing: the withdrawals are as bounded per step.
        namespace.keys = []
        clock.now += INTERVAL_S
        shared.on_schedule_end(())
        shared.wait()
        withdrawn: list[int] = []
        while shared.busy:
            shared.on_schedule_end(())
            withdrawn.append(len(listed(shared.observe([]), removed=True)))
        assert withdrawn == [KEYS_PER_STEP, KEYS_PER_STEP, 5]
    finally:
        shared.close()


def test_a_chunk_removed_here_during_a_listing_is_not_announced(
    listing: SharedListing, namespace: Namespace, clock: Clock
) -> None:
    namespace.keys = keys(range(3))
    namespace.gate = threading.Event()
    clock.now += INTERVAL_S
    listing.on_schedule_end(())  # the listing starts and waits at the gate
    evicted = OffloadingEvent([conformance_key(2)], Medium.STORAGE, removed=True)
    listing.observe([evicted])  # this tier deletes chunk 2 while the listing runs
    namespace.gate.set()
    listing.wait()
    while listing.busy:
        listing.on_schedule_end(())
    assert sorted(listed(listing.observe([]), removed=False)) == sorted(keys(range(2)))


def test_close_gives_up_on_a_listing_that_hangs(
    namespace: Namespace, clock: Clock, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(listing_module, "CLOSE_TIMEOUT_S", 0.05)
    namespace.gate = threading.Event()  # never set: a hung mount
    shared = SharedListing(namespace.list, interval_s=INTERVAL_S, max_chunks=10,
                           medium=Medium.STORAGE, where="hung ns", clock=clock)
    clock.now += INTERVAL_S
    shared.on_schedule_end(())
    shared.close()
    assert "hung ns: a namespace listing still runs at shutdown; it is abandoned" in caplog.text
    namespace.gate.set()


# -- a second stack's chunks, through the file tier ---------------------------------------
def test_another_servers_chunks_on_a_shared_root_become_events_and_a_summary(
    tmp_path: Path, clock: Clock
) -> None:
    reader = open_tier(tmp_path, shared=True, clock=clock,
                       listing=ListingSettings(INTERVAL_S, summary_interval_s=INTERVAL_S))
    writer = open_tier(tmp_path, shared=True)
    try:
        reader.manager.take_events()
        stored = writer.store(range(6))
        assert len(stored) == 6
        # Within one interval and two steps (the listing, then the comparison) the
        # reader announces every chunk the writer published.
        clock.now += INTERVAL_S
        reader.manager.on_schedule_end(END)
        assert reader.manager.listing is not None
        reader.manager.listing.wait()
        reader.manager.on_schedule_end(END)
        events = list(reader.manager.take_events())
        assert sorted(listed(events, removed=False)) == sorted(stored)
        assert {(e.medium, e.locality, e.listed) for e in events} == {
            (Medium.STORAGE, Locality.REMOTE, True)
        }
        # The summary beside the manifest holds every chunk that was there.
        data = (reader.manager.namespace_dir / SUMMARY_NAME).read_bytes()
        summary = NamespaceSummary.decode(data, namespace_digest=IDENTITY.digest)
        assert all(key in summary for key in stored)
        assert reader.manager.get_stats()["summaries"] == 1

        # The reader loads one (a probe finds it): its announcement is handed over.
        key = stored[0]
        assert reader.manager.lookup(key, CTX) is LookupResult.RETRY
        reader.manager.on_schedule_end(END)
        reader.manager.wait_probes()
        assert reader.manager.lookup(key, CTX) is LookupResult.HIT
        events = list(reader.manager.take_events())
        assert listed(events, removed=True) == [key]
        assert own(events, removed=False) == [key]
        assert events.index(next(e for e in events if e.listed)) < events.index(
            next(e for e in events if not e.listed))

        # Another server's gc removes two others: the next listing withdraws them.
        for gone in stored[4:]:
            reader.manager.mapper.path(gone).unlink()
        clock.now += INTERVAL_S
        reader.manager.on_schedule_end(END)
        reader.manager.listing.wait()
        reader.manager.on_schedule_end(END)
        events = list(reader.manager.take_events())
        assert sorted(listed(events, removed=True)) == sorted(stored[4:])
        stats = reader.manager.get_stats()
        assert (stats["listings"], stats["announced_chunks"], stats["listed_chunks"]) == (
            2, 3, 4)
    finally:
        writer.close()
        reader.close()


# -- and through an object tier (fsspec memory://, S3 on moto) -------------------------------
@pytest.fixture(params=["memory", "s3"])
def object_store(request: pytest.FixtureRequest) -> Callable[[], ObjectStore]:
    if request.param == "memory":
        url = f"memory://kvtiers-{uuid.uuid4().hex}/cache"
        return lambda: FsspecStore(url)
    from kvtiers.tiers.s3.store import S3Store

    endpoint: MotoServer = request.getfixturevalue("s3_endpoint")
    return lambda: S3Store(BUCKET, region="us-east-1", endpoint_url=endpoint.endpoint_url)


def test_another_servers_objects_become_events_and_a_summary(
    clock: Clock, object_store: Callable[[], ObjectStore]
) -> None:
    config = offloading_config()
    identity = NamespaceIdentity.from_config(config)
    geometry = ChunkGeometry.from_config(config)

    def manager(listing: ListingSettings | None = None) -> ObjectTierManager:
        backend = ObjectBackend(object_store(), identity, prefix="kv", threads=2)
        return ObjectTierManager(backend, max_chunk_bytes=geometry.max_chunk_bytes,
                                 shared=True, clock=clock, listing=listing)

    reader = manager(ListingSettings(INTERVAL_S, summary_interval_s=INTERVAL_S))
    writer_manager = manager()
    region = BytearrayRegion(8, geometry.slot_bytes)
    mover = ObjectMover(writer_manager.backend, region, geometry, reporter=writer_manager)
    writer = TierDriver(BuiltTier(name="w", manager=writer_manager, mover=mover), region,
                        geometry)
    try:
        payloads = {conformance_key(i): conformance_payload(i, 8192) for i in range(4)}
        assert writer.store(payloads).success
        clock.now += INTERVAL_S
        reader.on_schedule_end(END)
        assert reader.listing is not None
        reader.listing.wait()
        reader.on_schedule_end(END)
        events = list(reader.take_events())
        assert sorted(listed(events, removed=False)) == sorted(payloads)
        store = reader.backend.store
        data = store.read(f"{reader.backend.namespace_prefix}/{SUMMARY_NAME}", 1 << 20)
        summary = NamespaceSummary.decode(data, namespace_digest=identity.digest)
        assert all(key in summary for key in payloads)
    finally:
        mover.shutdown()
        writer_manager.shutdown()
        reader.shutdown()


# -- this tier's own evictions are never announced as another server's chunks -------------
def compare_listing(manager: object, clock: Clock) -> list[OffloadingEvent]:
    """One interval on: a listing starts, runs and is compared in full; the events."""
    clock.now += INTERVAL_S
    manager.on_schedule_end(END)  # type: ignore[attr-defined]
    listing: SharedListing = manager.listing  # type: ignore[attr-defined]
    listing.wait()
    while listing.busy:
        manager.on_schedule_end(END)  # type: ignore[attr-defined]
    return list(manager.take_events())  # type: ignore[attr-defined]


def test_a_file_chunk_evicted_in_the_step_its_listing_is_compared_is_not_announced(
    tmp_path: Path, clock: Clock
) -> None:
    tier = open_tier(tmp_path, capacity_chunks=2, shared=True, listing=ListingSettings(INTERVAL_S),
                     clock=clock)
    manager = tier.manager
    try:
        assert tier.store(range(2)) == keys(range(2))
        list(manager.take_events())
        clock.now += INTERVAL_S
        manager.on_schedule_end(END)  # a listing starts...
        assert manager.listing is not None
        manager.listing.wait()  # ...and finds chunks 0 and 1
        assert tier.store([2]) == keys([2])  # this step evicts chunk 0...
        manager.wait_deletions()  # ...and unlinks its file
        manager.on_schedule_end(END)  # the listing is compared
        events = list(manager.take_events())
        assert own(events, removed=True) == keys([0])
        assert listed(events, removed=False) == []
    finally:
        tier.close()


def test_a_file_chunk_whose_unlink_is_queued_or_just_ran_is_not_announced(
    tmp_path: Path, clock: Clock
) -> None:
    tier = open_tier(tmp_path, capacity_chunks=2, shared=True, listing=ListingSettings(INTERVAL_S),
                     clock=clock)
    manager = tier.manager
    try:
        assert tier.store(range(2)) == keys(range(2))
        manager.deletions_gate.clear()  # evicted files' unlinks wait
        assert tier.store([2]) == keys([2])  # evicts chunk 0; its file stays for now
        assert own(list(manager.take_events()), removed=True) == keys([0])
        announced = [key for _ in range(3) for key in
                     listed(compare_listing(manager, clock), removed=False)]
        assert announced == []
        # One more listing finds the file; the unlink runs before it is compared.
        clock.now += INTERVAL_S
        manager.on_schedule_end(END)
        assert manager.listing is not None
        manager.listing.wait()
        manager.deletions_gate.set()
        manager.wait_deletions()
        while manager.listing.busy:
            manager.on_schedule_end(END)
        assert listed(list(manager.take_events()), removed=False) == []
    finally:
        manager.deletions_gate.set()
        tier.close()


def test_an_object_evicted_in_the_step_its_listing_is_compared_is_not_announced(
    clock: Clock,
) -> None:
    config = offloading_config()
    identity = NamespaceIdentity.from_config(config)
    geometry = ChunkGeometry.from_config(config)
    backend = ObjectBackend(FsspecStore(f"memory://kvtiers-{uuid.uuid4().hex}/cache"),
                            identity, prefix="kv", threads=2)
    manager = ObjectTierManager(backend, max_chunk_bytes=geometry.max_chunk_bytes,
                                capacity_bytes=2 * (geometry.max_chunk_bytes + 4096),
                                shared=True, clock=clock, listing=ListingSettings(INTERVAL_S))
    region = BytearrayRegion(8, geometry.slot_bytes)
    mover = ObjectMover(backend, region, geometry, reporter=manager)
    driver = TierDriver(BuiltTier(name="o", manager=manager, mover=mover), region, geometry)
    try:
        payloads = {conformance_key(i): conformance_payload(i, 8192) for i in range(3)}
        first_two = dict(list(payloads.items())[:2])
        assert driver.store(first_two).success
        list(manager.take_events())
        clock.now += INTERVAL_S
        manager.on_schedule_end(END)  # a listing starts...
        assert manager.listing is not None
        manager.listing.wait()  # ...and finds chunks 0 and 1
        assert driver.store({conformance_key(2): payloads[conformance_key(2)]}).success
        manager.wait_background()  # chunk 0 was evicted and its object deleted
        manager.on_schedule_end(END)  # the listing is compared
        events = list(manager.take_events())
        assert own(events, removed=True) == keys([0])
        assert listed(events, removed=False) == []
    finally:
        mover.shutdown()
        manager.shutdown()
