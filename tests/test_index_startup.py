"""A persistent tier serves while its index is built, and restarts from a snapshot.

The build is held partway by its ``before_*_part`` hook (an event, no sleeps): lookups of
chunks in parts already walked and in parts not yet walked, and of absent keys, answer
``RETRY`` until a probe answers, then ``HIT`` or ``MISS`` — never a wrong answer — and a
store, an eviction and the merge that follows keep usage, capacity and the files on disk
in step. The snapshot tests check when a snapshot is trusted and when the tier walks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtiers.core.keys import OffloadKey, get_offload_block_hash
from kvtiers.core.manager import LookupResult, ScheduleEndContext
from kvtiers.core.publish import TEMP_SUFFIX
from kvtiers.filemapper import FileMapper, NamespaceIdentity, scan_namespace
from kvtiers.stack.builder import load_stack
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.objects import offloading_config
from kvtiers.testing.s3 import BUCKET
from kvtiers.tiers.build import IndexBuild
from kvtiers.tiers.file import walk as walk_module
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.snapshot import SNAPSHOT_NAME, directory_stamp
from kvtiers.tiers.file.walk import Walked, walk_in_children, walk_namespace
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.local import LocalStore
from kvtiers.tiers.object.manager import ObjectTierManager
from kvtiers.tiers.persistent import PersistentTierManager

from .test_file_support import CTX, GEOMETRY, IDENTITY, Tier, chunk_files, open_tier

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
HIT_PENDING = LookupResult.HIT_PENDING
END = ScheduleEndContext()


class Gate:
    """Lets build parts below ``open_below`` through and holds the others until
    :meth:`release`; :attr:`held` is set once a part waits."""

    def __init__(self, open_below: int) -> None:
        self.open_below = open_below
        self.held = threading.Event()
        self._go = threading.Event()

    def __call__(self, part: int) -> None:
        if part >= self.open_below:
            self.held.set()
            self._go.wait()

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def gates() -> Iterator[list[Gate]]:
    made: list[Gate] = []
    yield made
    for gate in made:  # a failing test must not leave a build thread waiting
        gate.release()


def close(tier: Tier, gate: Gate) -> None:
    gate.release()  # a test that failed partway leaves no walk waiting
    tier.close()


def top_dir(key: OffloadKey) -> str:
    return get_offload_block_hash(key).hex()[:2]


def answer(manager: FileTierManager, key: OffloadKey) -> LookupResult:
    """Look ``key`` up as the scheduler does: on ``RETRY`` end the step (the probe batch
    goes out), wait for it, and ask again."""
    result = manager.lookup(key, CTX)
    if result is RETRY:
        manager.on_schedule_end(END)
        manager.wait_probes()
        result = manager.lookup(key, CTX)
    return result


def stored_tier(root: Path, ids: range, **kwargs: Any) -> None:
    tier = open_tier(root, **kwargs)
    try:
        tier.store(ids)
    finally:
        tier.close()


def test_a_restarted_file_tier_serves_while_its_walk_is_partway(
    tmp_path: Path, gates: list[Gate]
) -> None:
    stored_tier(tmp_path, range(40), slots=40)
    keys = [conformance_key(i) for i in range(40)]
    parts = sorted({top_dir(key) for key in keys})
    gate = Gate(open_below=len(parts) // 2)
    gates.append(gate)
    walked = {key for key in keys if parts.index(top_dir(key)) < gate.open_below}
    assert walked and len(walked) < len(keys)  # keys both before and after the position
    tier = open_tier(tmp_path, background_index=True, snapshot=False, walk_threads=1,
                     before_walk_part=gate)
    try:
        manager = tier.manager
        assert gate.held.wait(30), "the walk never reached the held part"
        assert not manager.index_complete
        for key in keys:
            assert answer(manager, key) is HIT, key in walked
        absent = conformance_key(100)
        assert answer(manager, absent) is MISS
        # A chunk found by a probe is loaded like any other.
        result, data = tier.load(7)
        assert result.success and data
        # A store during the build is the tier's at once.
        tier.store([50])
        assert manager.lookup(conformance_key(50), CTX) is HIT
        gate.release()
        manager.wait_index()
        assert manager.index_complete
        assert manager.get_stats()["chunks"] == 41
        assert [manager.lookup(key, CTX) for key in keys] == [HIT] * 40
        assert manager.lookup(absent, CTX) is MISS  # the index answers now, no probe
    finally:
        close(tier, gate)


def test_evictions_during_the_walk_stand_after_the_merge(
    tmp_path: Path, gates: list[Gate]
) -> None:
    stored_tier(tmp_path, range(4))
    gate = Gate(open_below=0)
    gates.append(gate)
    tier = open_tier(tmp_path, capacity_chunks=4, background_index=True, snapshot=False,
                     before_walk_part=gate)
    try:
        manager = tier.manager
        assert gate.held.wait(30)
        manager.deletions_gate.clear()  # the evicted file stays until the merge is done
        tier.store(range(10, 14))
        tier.store([14])  # evicts chunk 10, the oldest the index knows
        # A probe finds its file (the unlink waits) but never indexes it again.
        assert answer(manager, conformance_key(10)) is not HIT
        gate.release()
        manager.wait_index()  # the walk saw chunk 10's file too
        manager.deletions_gate.set()
        # Over capacity once the walk's chunks are in: the oldest on disk (0-3) go; the
        # chunk evicted meanwhile is not brought back.
        indexed = [conformance_key(i) for i in range(11, 15)]
        assert [manager.lookup(conformance_key(i), CTX) for i in (0, 1, 2, 3, 10)] == [MISS] * 5
        assert [manager.lookup(key, CTX) for key in indexed] == [HIT] * 4
        assert manager.usage_bytes <= 4 * manager.reserve_bytes
        manager.wait_deletions()
        mapper = FileMapper(tmp_path, IDENTITY)
        assert chunk_files(manager.namespace_dir) == sorted(mapper.path(k) for k in indexed)
    finally:
        close(tier, gate)


def test_chunks_cleared_during_the_walk_stay_gone(tmp_path: Path, gates: list[Gate]) -> None:
    stored_tier(tmp_path, range(4))
    gate = Gate(open_below=0)
    gates.append(gate)
    tier = open_tier(tmp_path, background_index=True, snapshot=False, before_walk_part=gate)
    try:
        manager = tier.manager
        assert gate.held.wait(30)
        assert answer(manager, conformance_key(0)) is HIT  # found by a probe
        tier.store([10, 11])
        manager.deletions_gate.clear()  # the files stay while the walk runs
        assert manager.clear() == 3  # what the index holds: 0, 10, 11
        tier.store([12])
        gate.release()
        manager.wait_index()  # the walk saw every file, the cleared ones too
        manager.deletions_gate.set()
        manager.wait_deletions()
        assert [manager.lookup(conformance_key(i), CTX) for i in (0, 1, 2, 3, 10, 11)] == [
            MISS] * 6
        assert manager.lookup(conformance_key(12), CTX) is HIT
        mapper = FileMapper(tmp_path, IDENTITY)
        assert chunk_files(manager.namespace_dir) == [mapper.path(conformance_key(12))]
    finally:
        close(tier, gate)


def test_an_object_tier_serves_while_its_listings_are_partway(
    tmp_path: Path, gates: list[Gate]
) -> None:
    identity = NamespaceIdentity.from_config(offloading_config())
    store = LocalStore(tmp_path)

    def open_manager(**kwargs: Any) -> ObjectTierManager:
        backend = ObjectBackend(store, identity, threads=2)
        return ObjectTierManager(backend, max_chunk_bytes=4096, **kwargs)

    open_manager().shutdown()
    namer = ObjectBackend(store, identity, threads=1)
    keys = [conformance_key(i) for i in range(20)]
    for key in keys:
        store.put(namer.object_key(key), [b"chunk"])
    namer.close()
    prefixes = {int(top_dir(key), 16) for key in keys}
    gate = Gate(open_below=sorted(prefixes)[len(prefixes) // 2])
    gates.append(gate)
    manager = open_manager(background_index=True, list_threads=1, before_list_part=gate)
    try:
        assert gate.held.wait(30)

        def ask(key: OffloadKey) -> LookupResult:
            result = manager.lookup(key, CTX)
            if result is RETRY:
                manager.on_schedule_end(END)
                manager.wait_background()
                result = manager.lookup(key, CTX)
            return result

        assert [ask(key) for key in keys] == [HIT] * 20
        assert ask(conformance_key(100)) is MISS
        gate.release()
        manager.wait_index()
        assert manager.index_complete and manager.get_stats()["chunks"] == 20
    finally:
        gate.release()
        manager.shutdown()


def _unreadable_part(part: int) -> None:
    raise OSError(5, "Input/output error")


def test_a_failed_build_leaves_both_tiers_probing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The file and object tiers take a build in through one piece of code: a build that
    # fails is logged, the index stays incomplete, and misses are probed, not trusted.
    stored_tier(tmp_path / "file", range(3))
    tier = open_tier(tmp_path / "file", background_index=True, snapshot=False,
                     walk_threads=1, before_walk_part=_unreadable_part)
    identity = NamespaceIdentity.from_config(offloading_config())
    store = LocalStore(tmp_path / "objects")
    writer = ObjectBackend(store, identity, threads=1)
    store.put(writer.object_key(conformance_key(0)), [b"chunk"])
    writer.close()
    objects = ObjectTierManager(ObjectBackend(store, identity, threads=1),
                                max_chunk_bytes=4096, background_index=True,
                                before_list_part=_unreadable_part)
    try:
        tier.manager.wait_index()
        objects.wait_index()
        assert not tier.manager.index_complete and not objects.index_complete
        assert caplog.text.count("the index could not be built") == 2
        assert answer(tier.manager, conformance_key(1)) is HIT  # found by a probe
        assert objects.lookup(conformance_key(0), CTX) is RETRY
    finally:
        tier.close()
        objects.shutdown()


# -- tiers built from a stack file ------------------------------------------------------
@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_stack_file_tier_serves_a_warm_restart_before_its_index_is_built(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kind == "file":
        lower: dict[str, Any] = {"kind": "file", "root": str(tmp_path), "io": "posix",
                                 "threads": 2}
    else:
        endpoint = request.getfixturevalue("s3_endpoint").endpoint_url
        lower = {"kind": "s3", "bucket": BUCKET, "prefix": "start", "endpoint_url": endpoint,
                 "threads": 2}
    description = {"tiers": [{"kind": "cpu", "capacity": 4 * 8192}, lower]}
    keys = [conformance_key(i) for i in range(3)]
    with load_stack(description, offloading_config()) as first:
        assert first.manager.prepare_store(keys, CTX) == keys
        first.manager.complete_store(keys, CTX)
        first.manager.wait_idle()  # cascaded into the lower tier
    go = request.getfixturevalue("held_builds")
    # The stack is built while its lower tier's index build is held: nothing waits for it.
    with load_stack(description, offloading_config()) as stack:
        manager, tier = stack.manager, stack.tiers[1].manager
        assert not tier.index_complete
        absent = conformance_key(100)
        asked = [*keys, absent]
        assert [manager.lookup(key, CTX) for key in asked] == [RETRY] * 4
        manager.on_schedule_end(END)  # the existence probe goes out
        if kind == "file":
            tier.wait_probes()
        else:
            tier.wait_background()
        assert [manager.lookup(key, CTX) for key in asked] == [HIT_PENDING] * 3 + [MISS]
        go.set()
        stack.wait_index()
        assert tier.index_complete and tier.get_stats()["chunks"] == 3


# -- the snapshot -----------------------------------------------------------------------
def reopened(root: Path, **kwargs: Any) -> Tier:
    tier = open_tier(root, **kwargs)
    tier.manager.wait_index()
    return tier


def test_a_clean_restart_reads_the_snapshot_and_keeps_recency(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity_chunks=3)
    tier.store(range(3))
    tier.manager.touch([conformance_key(0)], CTX)  # 0 is now the most recently used
    tier.close()
    assert (tier.manager.namespace_dir / SNAPSHOT_NAME).is_file()
    tier = reopened(tmp_path, capacity_chunks=3)
    try:
        manager = tier.manager
        assert manager.index_source == "snapshot"
        assert manager.get_stats()["chunks"] == 3
        tier.store([10])  # evicts the least recently used: 1, not 0
        assert [manager.lookup(conformance_key(i), CTX) for i in (0, 1, 2, 10)] == [
            HIT, MISS, HIT, HIT
        ]
    finally:
        tier.close()


def _add_stray_chunk(root: Path) -> None:
    """Another writer's chunk, published behind the tier's back."""
    path = FileMapper(root, IDENTITY).path(conformance_key(99))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")


def _open_and_crash(root: Path) -> None:
    """Another engine opens the namespace and never shuts down cleanly."""
    FileTierManager(FileMapper(root, IDENTITY), GEOMETRY)


def _damage(root: Path) -> None:
    path = FileMapper(root, IDENTITY).namespace_dir / SNAPSHOT_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _foreign(root: Path) -> None:
    """A snapshot copied in from another namespace."""
    other = NamespaceIdentity.from_config(offloading_config(model="other/model"))
    other_tier = open_tier(root, identity=other)
    other_tier.store([5])
    other_tier.close()
    mine = FileMapper(root, IDENTITY).namespace_dir / SNAPSHOT_NAME
    mine.write_bytes((FileMapper(root, other).namespace_dir / SNAPSHOT_NAME).read_bytes())


@pytest.mark.parametrize("change", [_add_stray_chunk, _open_and_crash, _damage, _foreign],
                         ids=["chunk added", "opened since", "damaged", "another namespace"])
def test_a_snapshot_is_ignored_when_the_namespace_may_have_changed(
    tmp_path: Path, change: Callable[[Path], None]
) -> None:
    stored_tier(tmp_path, range(3))
    change(tmp_path)
    tier = reopened(tmp_path)
    try:
        manager = tier.manager
        assert manager.index_source == "walk"
        expected = 4 if change is _add_stray_chunk else 3
        assert manager.get_stats()["chunks"] == expected
        assert [manager.lookup(conformance_key(i), CTX) for i in range(3)] == [HIT] * 3
    finally:
        tier.close()


def test_the_directory_stamp_of_a_linked_namespace_sees_a_new_chunk(tmp_path: Path) -> None:
    """A namespace directory reached through a symbolic link is stamped through it (a
    stamp that could not list it would match after any change)."""
    stored_tier(tmp_path / "real", range(3), slots=3)
    real = FileMapper(tmp_path / "real", IDENTITY).namespace_dir
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    leaf = FileMapper(tmp_path / "real", IDENTITY).path(conformance_key(0)).parent
    os.utime(leaf, ns=(10**9, 10**9))  # long before the entry made next: its time moves
    before = directory_stamp(link)
    assert before == directory_stamp(real)
    (leaf / "new").write_bytes(b"x")
    assert directory_stamp(link) != before


def test_no_snapshot_while_a_store_is_in_flight(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.store([0])
    assert tier.manager.prepare_store([conformance_key(1)], CTX) == [conformance_key(1)]
    tier.close()
    assert not (tier.manager.namespace_dir / SNAPSHOT_NAME).exists()


# -- the walk in child processes --------------------------------------------------------
def messy_namespace(root: Path) -> Path:
    """A namespace of 30 chunks with distinct mtimes, a stale temp file, a FIFO under a
    chunk's name, a chunk name in the wrong place and a stray file."""
    stored_tier(root, range(30), slots=30)
    namespace_dir = FileMapper(root, IDENTITY).namespace_dir
    mapper = FileMapper(root, IDENTITY)
    for i in range(30):
        os.utime(mapper.path(conformance_key(i)), ns=(10**18 + i, 10**18 + (i * 7) % 30))
    leaf = mapper.path(conformance_key(0)).parent
    (leaf / STALE).write_bytes(b"x")
    os.utime(leaf / STALE, (0, 0))
    fifo = mapper.path(conformance_key(40))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    misplaced = mapper.path(conformance_key(41))
    (leaf / misplaced.name).write_bytes(b"y")
    (namespace_dir / "stray.txt").write_bytes(b"z")
    return namespace_dir


STALE = f".stale.kvc.abcdef{TEMP_SUFFIX}"


class _Build:
    """The part of :class:`IndexBuild` a walk uses."""

    stopping = False
    parts = 0

    def part_done(self) -> None:
        self.parts += 1

    def on_stop(self, action: Callable[[], None]) -> None:
        pass


@pytest.mark.parametrize("processes", [1, 3])
def test_a_walk_in_child_processes_finds_what_the_walk_in_process_finds(
    tmp_path: Path, processes: int
) -> None:
    namespace_dir = messy_namespace(tmp_path / "a")
    twin = messy_namespace(tmp_path / "b")
    build, twin_build = _Build(), _Build()
    inside = walk_namespace(twin, twin_build, temp_cutoff=1.0)  # type: ignore[arg-type]
    children = walk_in_children(namespace_dir, build, temp_cutoff=1.0,  # type: ignore[arg-type]
                                processes=processes)
    assert children is not None
    assert children.packed.keys == inside.packed.keys  # the same chunks, oldest first
    assert len(children.packed) == 30
    assert bytes(children.packed.key_bytes) == bytes(inside.packed.key_bytes)
    assert list(children.packed.sizes) == list(inside.packed.sizes)
    assert list(children.packed.table) == list(inside.packed.table)
    assert (children.removed_temps, children.unindexed) == (1, 1)
    assert (inside.removed_temps, inside.unindexed) == (1, 1)
    assert build.parts == twin_build.parts > 0
    assert not list(namespace_dir.rglob(STALE))


def messier_namespace(root: Path) -> Path:
    """:func:`messy_namespace` with what the walk's short way must leave to the slow
    way: a directory and a link under chunks' names, a name in upper-case hex, a group
    past 32 bits, a deeper directory in a chunk's place (holding a chunk's name and a
    stale temp file) and a young temp file."""
    namespace_dir = messy_namespace(root)
    mapper = FileMapper(root, IDENTITY)
    leaf = mapper.path(conformance_key(0)).parent
    name = mapper.path(conformance_key(0)).name
    os.mkdir(leaf / name.replace("_g", "0000_g"))
    os.symlink(mapper.path(conformance_key(1)), leaf / name.replace("_g", "1111_g"))
    (leaf / name.upper()).write_bytes(b"u")
    (leaf / f"{name.split('_g')[0]}_g4294967296.kvc").write_bytes(b"g")
    deeper = leaf / "deeper"
    deeper.mkdir()
    (deeper / name).write_bytes(b"d")
    (deeper / STALE).write_bytes(b"x")
    os.utime(deeper / STALE, (0, 0))
    (leaf / f".young.kvc.abcdef{TEMP_SUFFIX}").write_bytes(b"x")
    return namespace_dir


def test_the_walks_short_way_finds_what_the_scan_finds(tmp_path: Path) -> None:
    """Each part walked (chunk names parsed and stat'ed by the directory's descriptor)
    finds the same chunks, sizes, times, unindexed entries and stale temp files as
    :func:`scan_namespace`'s entries taken one by one."""
    namespace_dir = messier_namespace(tmp_path / "a")
    twin = messier_namespace(tmp_path / "b")
    found, expected = walk_module._Part(), walk_module._Part()
    for part in sorted(namespace_dir.iterdir()):
        if part.is_dir() and part.name != "quarantine":
            walk_module._walk_part(str(part), f"{part.name}/", found, 1.0)
            for item in scan_namespace(twin / part.name, prefix=f"{part.name}/"):
                expected.take(item, 1.0)

    def chunks(part: walk_module._Part) -> list[tuple[bytes, int, int]]:
        return sorted(zip(part.keys, part.sizes, part.mtimes, strict=True))

    assert len(found.keys) == 30
    assert chunks(found) == chunks(expected)
    assert (found.unindexed, found.removed_temps) == (expected.unindexed,
                                                      expected.removed_temps) == (3, 2)
    assert sorted(p.name for p in namespace_dir.rglob(f"*{TEMP_SUFFIX}")) == [
        f".young.kvc.abcdef{TEMP_SUFFIX}"]


def test_a_failed_walk_process_falls_back_to_the_walk_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stored_tier(tmp_path, range(5))
    monkeypatch.setattr(walk_module.sys, "executable", str(tmp_path / "no-python"))
    tier = reopened(tmp_path, snapshot=False)
    try:
        assert tier.manager.get_stats()["chunks"] == 5
        assert "could not start the walk's process" in caplog.text
        assert "walking in this process instead" in caplog.text
    finally:
        tier.close()


def test_stopping_a_build_kills_its_walk_process(tmp_path: Path) -> None:
    namespace_dir = messy_namespace(tmp_path)
    started: list[subprocess.Popen[bytes]] = []
    running = threading.Event()
    real = subprocess.Popen

    def stuck(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        # A child that never answers stands in for a walk stuck on a dead filesystem.
        child = real([sys.executable, "-c", "import sys; sys.stdin.read()"],
                     **{**kwargs, "stdin": subprocess.PIPE})
        started.append(child)
        running.set()
        return child

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(walk_module.subprocess, "Popen", stuck)
        build: IndexBuild[Walked | None] = IndexBuild(
            lambda b: walk_in_children(namespace_dir, b, temp_cutoff=0.0, processes=1),
            name="test-walk",
        )
        assert running.wait(30), "the build never started its child"
        build.stop()
    assert build.done.is_set() and build.result is None
    assert started[0].poll() is not None  # killed, and reaped
    assert started[0].stdin is not None
    started[0].stdin.close()


# -- the names-only walk and its stat pass ------------------------------------------
def names_first_tier(root: Path, gate: Gate | None = None, **kwargs: Any) -> Tier:
    """A restarted tier walking names first; its stat pass waits for ``gate``."""
    return open_tier(
        root, background_index=True, snapshot=False, walk_processes=0,
        before_stat_pass=None if gate is None else (lambda: gate(0)), **kwargs,
    )


def test_a_names_only_index_answers_lookups_before_its_stat_pass(
    tmp_path: Path, gates: list[Gate]
) -> None:
    stored_tier(tmp_path, range(12), slots=12)
    sizes = sum(path.stat().st_size for path in chunk_files(
        FileMapper(tmp_path, IDENTITY).namespace_dir))
    gate = Gate(open_below=0)
    gates.append(gate)
    tier = names_first_tier(tmp_path, gate)
    try:
        manager = tier.manager
        PersistentTierManager.wait_index(manager)  # the names-only pass, not the stat
        assert gate.held.wait(30), "the stat pass never began"
        assert manager.index_complete and not manager.index_stat_done
        # Answered by the index at once: no probe, no RETRY.
        keys = [conformance_key(i) for i in range(12)]
        assert [manager.lookup(key, CTX) for key in keys] == [HIT] * 12
        assert manager.lookup(conformance_key(100), CTX) is MISS
        # Counted at the largest blob's size until the stat pass (never below the truth).
        assert manager.usage_bytes == 12 * manager.reserve_bytes >= sizes
        result, data = tier.load(3)
        assert result.success and data
        gate.release()
        manager.wait_index()
        assert manager.index_stat_done
        assert manager.usage_bytes == sizes
        assert manager.stat_dropped == 0
    finally:
        close(tier, gate)


def test_the_stat_pass_drops_what_is_no_chunk_file(tmp_path: Path) -> None:
    stored_tier(tmp_path, range(6), slots=6)
    mapper = FileMapper(tmp_path, IDENTITY)
    not_regular = mapper.path(conformance_key(1))
    not_regular.unlink()
    not_regular.mkdir()  # a directory under a chunk's name
    with open(mapper.path(conformance_key(2)), "ab") as grown:
        grown.write(b"\0" * 7)  # larger than any chunk of this geometry
    tier = names_first_tier(tmp_path)
    try:
        manager = tier.manager
        manager.wait_index()
        assert manager.stat_dropped == 2
        answers = [manager.lookup(conformance_key(i), CTX) for i in range(6)]
        assert answers == [HIT, MISS, MISS, HIT, HIT, HIT]
        assert manager.get_stats()["chunks"] == 4
        assert not_regular.is_dir()  # dropped from the index, left on disk
    finally:
        tier.close()


def test_eviction_order_after_the_stat_pass_is_by_mtime(tmp_path: Path) -> None:
    stored_tier(tmp_path, range(6), slots=6)
    mapper = FileMapper(tmp_path, IDENTITY)
    by_name = sorted(range(6), key=lambda i: mapper.path(conformance_key(i)).name)
    # Oldest by mtime is last by name: name order would evict the other end.
    for age, i in enumerate(reversed(by_name)):
        os.utime(mapper.path(conformance_key(i)), ns=(10**18, 10**18 + age * 10**9))
    tier = names_first_tier(tmp_path, capacity_chunks=6)
    try:
        manager = tier.manager
        manager.wait_index()
        assert manager.index_stat_done
        tier.store([20, 21])  # two chunks evicted: the two oldest by mtime
        evicted = {i for i in range(6) if manager.lookup(conformance_key(i), CTX) is MISS}
        assert evicted == set(by_name[-2:])
    finally:
        tier.close()


@pytest.mark.parametrize("processes", [0, 2])
def test_names_then_stat_find_what_the_stat_walk_finds(tmp_path: Path, processes: int) -> None:
    """A names-only walk (in this process or in children) and its stat pass: the chunks
    that stat as regular files in their places are the stat walk's, with its sizes and
    mtimes; what is no regular file there (a directory, a link, a FIFO under a chunk's
    name), which names alone cannot tell, stats as not regular."""
    namespace_dir = messier_namespace(tmp_path / "a")
    twin = messier_namespace(tmp_path / "b")
    full = walk_namespace(twin, _Build(), temp_cutoff=1.0)  # type: ignore[arg-type]
    if processes:
        names = walk_in_children(namespace_dir, _Build(),  # type: ignore[arg-type]
                                 temp_cutoff=1.0, processes=processes, assume_size=7)
    else:
        names = walk_namespace(namespace_dir, _Build(),  # type: ignore[arg-type]
                               temp_cutoff=1.0, assume_size=7)
    assert names is not None and names.names_only
    keys = names.packed.keys
    stat = walk_module.stat_chunks(namespace_dir, keys, lambda: False)
    assert stat is not None
    if processes:
        # The children's own stat pass, in the packed order, says the same.
        assert names.stats is not None
        children = names.stats.collect()
        assert not isinstance(children, str), children
        assert children[0].tolist() == stat[0].tolist()
        assert children[1].tolist() == stat[1].tolist()
    else:
        assert names.stats is None
    sizes, mtimes = stat
    kept = {(key, int(size), int(mtime))
            for key, size, mtime in zip(keys, sizes, mtimes, strict=True) if size >= 0}
    twin_mapper = FileMapper(tmp_path / "b", IDENTITY)
    expected = {(key, size, os.lstat(twin_mapper.path(key)).st_mtime_ns)
                for key, size in zip(full.packed.keys, full.packed.sizes, strict=True)}
    assert kept == expected and len(kept) == 30
    assert full.unindexed == 3 and names.unindexed == 0
    assert list(sizes).count(walk_module.STAT_NOT_REGULAR) == len(keys) - 30 == 3
    assert set(names.packed.sizes) == {7}


def test_nothing_is_evicted_on_the_assumed_sizes_before_the_stat_pass(
    tmp_path: Path, gates: list[Gate]
) -> None:
    """Reopened over its capacity (6 chunks, room for 3): the names-only merge deletes
    nothing; the stat pass's merge gives the capacity back, evicting the oldest by mtime."""
    stored_tier(tmp_path, range(6), slots=6)
    mapper = FileMapper(tmp_path, IDENTITY)
    by_name = sorted(range(6), key=lambda i: mapper.path(conformance_key(i)).name)
    for age, i in enumerate(reversed(by_name)):
        os.utime(mapper.path(conformance_key(i)), ns=(10**18, 10**18 + age * 10**9))
    gate = Gate(open_below=0)
    gates.append(gate)
    tier = names_first_tier(tmp_path, gate, capacity_chunks=3)
    try:
        manager = tier.manager
        PersistentTierManager.wait_index(manager)
        assert gate.held.wait(30), "the stat pass never began"
        assert [manager.lookup(conformance_key(i), CTX) for i in range(6)] == [HIT] * 6
        assert len(chunk_files(mapper.namespace_dir)) == 6
        gate.release()
        manager.wait_index()
        kept = {i for i in range(6) if manager.lookup(conformance_key(i), CTX) is HIT}
        assert kept == set(by_name[:3])  # the three newest by mtime
        assert manager.usage_bytes <= 3 * manager.reserve_bytes
    finally:
        close(tier, gate)


def test_a_childs_stat_pass_marks_gone_files_and_places(tmp_path: Path) -> None:
    """A walking child's stat pass over a part: true sizes and mtimes; a chunk whose
    file went since its place was listed, and every chunk of a place that went, are
    missing; the slow way's chunk keeps the stat it had."""
    stored_tier(tmp_path, range(8), slots=8)
    mapper = FileMapper(tmp_path, IDENTITY)
    paths = [mapper.path(conformance_key(i)) for i in range(8)]
    part = walk_module._Part(places=[])
    by_place: dict[Path, list[str]] = {}
    for path in paths:
        by_place.setdefault(path.parent, []).append(path.name)
    for place, names in by_place.items():
        part.places.append((str(place), len(part.keys), names))  # type: ignore[union-attr]
        for name in names:
            part.keys.append(OffloadKey(name.encode()))
            part.sizes.append(999)
            part.mtimes.append(0)
    slow = len(part.keys)
    part.keys.append(OffloadKey(b"slow"))
    part.sizes.append(5)
    part.mtimes.append(6)
    order = [place / name for place, names in by_place.items() for name in names]
    order[0].unlink()  # gone since its place was listed
    gone_place = order[-1].parent  # a place that went, with its chunks
    assert gone_place != order[0].parent  # (these keys' places differ)
    for name in by_place[gone_place]:
        (gone_place / name).unlink()
    gone_place.rmdir()
    sizes, mtimes = walk_module._stat_part(part)
    assert len(sizes) == len(mtimes) == slow + 1
    assert (sizes[slow], mtimes[slow]) == (5, 6)
    for i, path in enumerate(order):
        if i == 0 or path.parent == gone_place:
            assert sizes[i] == walk_module.STAT_MISSING
        else:
            st = os.lstat(path)
            assert (sizes[i], mtimes[i]) == (st.st_size, st.st_mtime_ns)


def test_the_walks_processes_stat_what_is_no_chunk_file_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A names-only walk in child processes, and their stat pass: true sizes, and what
    is no chunk file (a directory under a chunk's name, a file larger than any chunk)
    dropped and counted in ``stat_dropped``; nothing stat-ed in this process."""
    stored_tier(tmp_path, range(6), slots=6)
    mapper = FileMapper(tmp_path, IDENTITY)
    not_regular = mapper.path(conformance_key(1))
    not_regular.unlink()
    not_regular.mkdir()
    with open(mapper.path(conformance_key(2)), "ab") as grown:
        grown.write(b"\0" * 7)
    sizes = sum(mapper.path(conformance_key(i)).stat().st_size for i in (0, 3, 4, 5))
    called: list[int] = []
    real = walk_module.stat_chunks

    def in_process(*args: Any, **kwargs: Any) -> Any:
        called.append(1)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("kvtiers.tiers.file.manager.stat_chunks", in_process)
        tier = open_tier(tmp_path, background_index=True, snapshot=False, walk_processes=2)
        try:
            manager = tier.manager
            manager.wait_index()
            assert manager.index_stat_done
            stats = manager.get_stats()
            assert stats["stat_dropped"] == manager.stat_dropped == 2
            assert stats["chunks"] == 4
            assert manager.usage_bytes == sizes
            answers = [manager.lookup(conformance_key(i), CTX) for i in range(6)]
            assert answers == [HIT, MISS, MISS, HIT, HIT, HIT]
        finally:
            tier.close()
    assert not called
    assert "stat-ing in this process instead" not in caplog.text


def test_a_failed_stat_pass_in_the_walks_processes_stats_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    stored_tier(tmp_path, range(6), slots=6)
    sizes = sum(path.stat().st_size for path in chunk_files(
        FileMapper(tmp_path, IDENTITY).namespace_dir))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(walk_module.ChildStats, "collect",
                      lambda self: (self.close(), "a stand-in failure")[1])
        tier = open_tier(tmp_path, background_index=True, snapshot=False, walk_processes=2)
        try:
            manager = tier.manager
            manager.wait_index()
            assert manager.index_stat_done
            assert manager.usage_bytes == sizes
            assert manager.get_stats()["stat_dropped"] == 0
        finally:
            tier.close()
    assert "a stand-in failure" in caplog.text
    assert "stat-ing in this process instead" in caplog.text


@pytest.mark.parametrize("word", [b"", b"s"])
def test_a_walking_child_stats_only_when_told(tmp_path: Path, word: bytes) -> None:
    """A names-only child sends its names, then waits: its stat pass runs only on the
    parent's word (``s``, once every child's names are merged); a closed stdin without
    it (the build stopped, the parent gone) ends the child with no stat pass."""
    stored_tier(tmp_path, range(5))
    namespace_dir = FileMapper(tmp_path, IDENTITY).namespace_dir
    parts = [str(p) for p in sorted(namespace_dir.iterdir())
             if p.is_dir() and p.name != "quarantine"]
    child = subprocess.Popen(
        [sys.executable, "-m", walk_module.__name__, "0.0", "2", "7", *parts],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
    )
    try:
        block = walk_module._read_child(child, _Build())  # type: ignore[arg-type]
        assert not isinstance(block, str), block
        assert len(block.lengths) == 5 and set(block.sizes.tolist()) == {7}
        assert child.stdin is not None
        child.stdin.write(word)
        child.stdin.close()
        sizes, mtimes = np.zeros(5, dtype="<i8"), np.zeros(5, dtype="<i8")
        failure = walk_module._read_stats(child, sizes, mtimes)
    finally:
        child.kill()
        assert child.stdout is not None
        child.stdout.close()
        child.wait()
    if word:
        assert failure is None, failure
        assert sorted(sizes.tolist()) == sorted(
            path.stat().st_size for path in chunk_files(namespace_dir))
        assert sorted(mtimes.tolist()) == sorted(
            path.stat().st_mtime_ns for path in chunk_files(namespace_dir))
    else:
        assert failure == "it ended without its stat pass"


def _cpu_work(i: int) -> int:
    """A few milliseconds on a core, never blocked."""
    return i + sum(range(400_000)) * 0


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"),
                    reason="no per-thread scheduler account: waits for a core read as blocked")
def test_walk_parts_on_a_medium_answering_from_memory_keep_one_thread() -> None:
    threads: set[int] = set()

    def work(i: int) -> int:
        threads.add(threading.get_ident())
        return _cpu_work(i)

    assert walk_module.map_parts(work, 40, 4) == list(range(40))
    # One stall outside the walk (the virtual machine's host taking the core) may add a
    # thread; a pool that does not wait for the medium's answers to grow uses all four.
    assert len(threads) <= 2


def test_walk_parts_that_wait_on_the_medium_get_more_threads() -> None:
    # Part 0 stands for a slow medium: blocked 50 ms, nearly nothing on a core. Parts 1
    # and 2 pass the barrier only if two threads walk at once.
    barrier = threading.Barrier(2, timeout=30)
    slow = threading.Event()

    def work(i: int) -> int:
        if i == 0:
            slow.wait(0.05)
        else:
            barrier.wait()
        return i

    assert walk_module.map_parts(work, 3, 4) == [0, 1, 2]


def test_walk_parts_stop_at_the_first_error_and_raise_it() -> None:
    done: list[int] = []

    def work(i: int) -> int:
        if i == 2:
            raise PermissionError(f"part {i}")
        done.append(i)
        return i

    with pytest.raises(PermissionError, match="part 2"):
        walk_module.map_parts(work, 10, 1)
    assert done == [0, 1]


def test_an_object_tiers_listing_indexes_oldest_first_ties_by_name(tmp_path: Path) -> None:
    identity = NamespaceIdentity.from_config(offloading_config())
    store = LocalStore(tmp_path)
    namer = ObjectBackend(store, identity, threads=1)
    namer.open_namespace()
    keys = [conformance_key(i) for i in range(12)]
    for key in keys:
        store.put(namer.object_key(key), [b"chunk" * (1 + keys.index(key))])
    by_name = sorted(keys, key=namer.object_key)
    # The last six by name are the oldest; the first six share one mtime (name order).
    ages = {key: 10**18 + (0 if n < 6 else -n) * 10**9 for n, key in enumerate(by_name)}
    for key, mtime in ages.items():
        os.utime(tmp_path / namer.object_key(key), ns=(mtime, mtime))
    namer.close()
    backend = ObjectBackend(store, identity, threads=2)
    manager = ObjectTierManager(backend, max_chunk_bytes=4096, background_index=True,
                                list_threads=3)
    try:
        manager.wait_index()
        assert list(manager.index.keys()) == [*reversed(by_name[6:]), *by_name[:6]]
        sizes = {key: entry.size for key, entry in manager.index.items()}
        assert sizes == {key: 5 * (1 + keys.index(key)) for key in keys}
    finally:
        manager.shutdown()
        backend.close()


def test_memory_goes_back_once_each_merges_announcement_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    released: list[str] = []
    monkeypatch.setattr("kvtiers.tiers.persistent.release_free_memory",
                        lambda: released.append(threading.current_thread().name))

    def step() -> int:
        manager.on_schedule_end(END)
        for thread in threading.enumerate():
            if thread.name == "kvtiers-release-memory":
                thread.join()
        return len(released)

    stored_tier(tmp_path, range(6), slots=6)
    tier = open_tier(tmp_path, background_index=True, snapshot=False)
    try:
        manager = tier.manager
        manager.wait_index()  # the names merged, then the stat pass
        assert manager.index_stat_done
        assert step() == 0  # the announcement is not taken yet
        events = list(manager.take_events())
        assert sum(len(event.keys) for event in events) == 6
        assert step() == 1
        assert step() == 1  # once a merge
        assert released == ["kvtiers-release-memory"]
    finally:
        tier.close()
