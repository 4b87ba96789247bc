"""Retention in the persistent tiers (file, S3, fsspec): each evicts in the retention
order the cpu primary follows — expired chunks first, then lower priority first, the
chunks of live pins spared — for its own capacity and for a tenant's quota."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import ReqContext, ScheduleEndContext
from kvtiers.policies.retention import RetentionBook, RetentionHint
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.testing.s3 import BUCKET, MotoServer

# Chunks of 2 pages of 4 KiB (an 8 KiB chunk, a header's page more on the medium): the
# lower tier holds 4; the primary, 64, never evicts here.
MODEL = {"name": "m", "tokens_per_hash": 16, "blocks_per_chunk": 2,
         "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}]}
SLOT = 8192
LOWER_CHUNKS = 4


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
    return {"actions": [{"action_type": "retention", "action_version": "1",
                         "payload": payload}]}


@pytest.fixture(params=["file", "s3", "fsspec"])
def lower(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    capacity = LOWER_CHUNKS * (SLOT + HEADER_BYTES)
    if request.param == "file":
        return {"kind": "file", "root": str(tmp_path / "root"), "capacity": capacity}
    if request.param == "fsspec":
        return {"kind": "fsspec", "url": f"memory://kvtiers-{uuid.uuid4().hex}/kv",
                "capacity": capacity, "threads": 2}
    moto: MotoServer = request.getfixturevalue("s3_endpoint")
    return {"kind": "s3", "bucket": BUCKET, "prefix": "retention",
            "endpoint_url": moto.endpoint_url, "threads": 2, "capacity": capacity}


def build(lower: dict[str, Any], **more: Any) -> tuple[Stack, Clock]:
    stack = load_stack({
        "tiers": [{"kind": "cpu", "capacity": 64 * SLOT}, {"name": "lower", **lower}],
        "model": MODEL, "retention": {"max_pinned_bytes": 64 * SLOT}, **more})
    stack.wait_index()
    clock = Clock()
    book = stack.manager.retention
    assert book is not None
    book.clock = book.bad_hints.clock = book.refused_pins.clock = clock
    return stack, clock


@pytest.fixture
def stack_clock(lower: dict[str, Any]) -> Iterator[tuple[Stack, Clock]]:
    stack, clock = build(lower)
    with stack:
        yield stack, clock


def store(stack: Stack, i: int, envelope: Any = None, **params: Any) -> None:
    """Store key ``i`` in one request (hinted by ``envelope``); its cascade lands."""
    ctx = ReqContext(req_id=f"r{i}", kv_hints=envelope, kv_transfer_params=params or None)
    manager = stack.tenants or stack.manager
    manager.on_new_request(ctx)
    accepted = manager.prepare_store([key(i)], ctx)
    assert accepted == [key(i)]
    manager.complete_store(accepted, ctx)
    manager.on_request_finished(ctx)
    stack.manager.wait_idle()
    manager.on_schedule_end(ScheduleEndContext())


def in_lower(stack: Stack, ids: range) -> set[int]:
    index = stack.tiers[1].manager.index
    return {i for i in ids if key(i) in index}


def book_of(stack: Stack) -> RetentionBook:
    book = stack.manager.retention
    assert book is not None
    return book


def test_lower_priority_goes_first(stack_clock: tuple[Stack, Clock]) -> None:
    stack, _ = stack_clock
    store(stack, 0, hints(priority=5))
    for i in (1, 2, 3):
        store(stack, i)
    assert in_lower(stack, range(4)) == {0, 1, 2, 3}
    # Least recently used would take key 0; its priority keeps it, key 1 goes.
    store(stack, 4)
    assert in_lower(stack, range(5)) == {0, 2, 3, 4}
    # Negative priority goes first however recent: key 2 makes room for key 5, then
    # key 5 (the most recent) for key 6.
    store(stack, 5, hints(priority=-1))
    assert in_lower(stack, range(6)) == {0, 3, 4, 5}
    store(stack, 6)
    assert in_lower(stack, range(7)) == {0, 3, 4, 6}


def test_expired_chunks_go_first(stack_clock: tuple[Stack, Clock]) -> None:
    stack, clock = stack_clock
    for i in range(4):
        store(stack, i, hints(ttl_s=10) if i == 2 else None)
    clock.now += 11
    store(stack, 4)
    assert in_lower(stack, range(5)) == {0, 1, 3, 4}
    # An expiry the admin sets later orders evictions too.
    book_of(stack).expire_hashes([key(3)[:-4]])
    store(stack, 5)
    assert in_lower(stack, range(6)) == {0, 1, 4, 5}


def test_pins_are_spared_until_they_run_out(stack_clock: tuple[Stack, Clock]) -> None:
    stack, clock = stack_clock
    store(stack, 0, hints(pin_s=100))
    for i in (1, 2, 3, 4):
        store(stack, i)
    assert in_lower(stack, range(5)) == {0, 2, 3, 4}
    clock.now += 101  # the pin ran out: key 0 is the least recently used again
    store(stack, 5)
    assert in_lower(stack, range(6)) == {2, 3, 4, 5}


def test_a_pin_never_makes_a_lower_store_fail(stack_clock: tuple[Stack, Clock]) -> None:
    stack, _ = stack_clock
    for i in range(4):
        store(stack, i, hints(pin_s=100))
    before = stack.manager.get_stats()["retention_pins_overridden"]
    store(stack, 4)
    assert in_lower(stack, range(5)) == {1, 2, 3, 4}
    assert stack.manager.get_stats()["retention_pins_overridden"] == before + 1


def test_a_tenants_quota_takes_its_lowest_priority_first(lower: dict[str, Any]) -> None:
    """A tenant over its quota in the lower tier loses its own chunks in retention order
    (the tier itself has room: only the quota evicts)."""
    roomy = {**lower, "capacity": 16 * (SLOT + HEADER_BYTES)}
    tenants = {"members": [{"name": "t", "quota": {"lower": 3 * (SLOT + HEADER_BYTES)}}]}
    stack, _ = build(roomy, tenants=tenants)
    with stack:
        assert stack.tenants is not None
        scope = stack.tenants.keys.scope
        index = stack.tiers[1].manager.index
        store(stack, 0, hints(priority=5), kvtiers_tenant="t")
        store(stack, 1, kvtiers_tenant="t")
        store(stack, 2, hints(priority=-3), kvtiers_tenant="t")
        store(stack, 3, kvtiers_tenant="t")
        assert [scope(key(i), "t") in index for i in range(4)] == [True, True, False, True]
        store(stack, 4, kvtiers_tenant="t")
        assert [scope(key(i), "t") in index for i in range(5)] == [
            True, False, False, True, True]


def test_the_index_ranks_keys_not_slots_and_keeps_ranks_across_a_merge() -> None:
    """The index alone: a key stored into a freed slot has its own (default) priority,
    not the slot's last key's; a background rebuild's merge keeps the ranks of the keys
    indexed meanwhile."""
    from kvtiers.core.manager import Medium
    from kvtiers.tiers.compact import CompactChunkIndex, PackedChunks

    book = RetentionBook(hash_bytes=SLOT, max_pinned_bytes=0, clock=Clock())
    index = CompactChunkIndex(3, tier="t", medium=Medium.STORAGE)
    index.honour_retention(book, groups=1)

    def put(i: int) -> list[OffloadKey]:
        change = index.reserve([key(i)], 1)
        assert change is not None
        index.finish([key(i)], True)
        return change.victims

    book.record([key(0), key(1)], RetentionHint(priority=-1))
    put(0)
    put(1)
    put(2)
    assert put(3) == [key(0)]  # priority -1, least recently used of its level
    assert put(4) == [key(1)]
    # Key 5 takes key 0's old slot (freed first), with no hint: the default priority.
    assert put(5) == [key(2)]
    assert put(6) == [key(3)]
    # A rebuild found key 9 on the medium; key 7 (priority 2) is indexed meanwhile.
    book.record([key(7)], RetentionHint(priority=2))
    assert put(7) == [key(4)]
    index.merge_oldest(PackedChunks.pack([key(9)], [1]))
    # Over capacity by one: the found key is the least recently used, so it goes.
    assert key(9) not in index
    assert put(8) == [key(5)]
    assert put(10) == [key(6)]
    assert put(11) == [key(8)]  # key 7 outranks the rest


def test_the_default_level_walk_finds_keys_that_return_to_it() -> None:
    """The walk of the default priority starts past the ranked keys at the head of the
    recency log; a key given the default priority again, and the log's compaction, keep
    it exact."""
    from kvtiers.core.manager import Medium
    from kvtiers.tiers.compact import CompactChunkIndex

    book = RetentionBook(hash_bytes=SLOT, max_pinned_bytes=0, clock=Clock())
    index = CompactChunkIndex(4, tier="t", medium=Medium.STORAGE)
    index.honour_retention(book, groups=1)

    def put(i: int) -> list[OffloadKey]:
        change = index.reserve([key(i)], 1)
        assert change is not None
        index.finish([key(i)], True)
        return change.victims

    book.record([key(0), key(1)], RetentionHint(priority=5))
    for i in range(4):
        put(i)
    assert put(4) == [key(2)]
    # Key 0 returns to the default priority when next touched: the most recent default.
    book.record([key(0)], RetentionHint(priority=0))
    index.touch([key(0)])
    assert put(5) == [key(3)]
    assert put(6) == [key(4)]
    # Enough touches of key 1 to compact the recency log: the walk's place restarts.
    for _ in range(1100):
        index.touch([key(1)])
    assert put(7) == [key(0)]
    assert put(8) == [key(5)]
