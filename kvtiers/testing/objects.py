"""Test kit for object stores and object tiers.

- :func:`offloading_config`: a small cache identity (one block per chunk).
- :class:`ObjectStoreConformance`: the :class:`~kvtiers.tiers.object.store.ObjectStore`
  contract as tests. A store's test module subclasses it and supplies ``make_store``::

      class TestMyStore(ObjectStoreConformance):
          def make_store(self) -> ObjectStore: ...

  Every test gets a fresh store from ``make_store`` (closed afterwards) and uses names
  under one prefix, so stores that share a root between tests stay apart.
- :class:`ObjectTierConformance`: the backdoor helpers of the manager conformance suite
  (:class:`~kvtiers.testing.conformance.TierConformanceTests`) for an object tier over
  any store; a test class mixes it in before the suite and supplies ``make_store``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import xxhash

from kvtiers.core import chunkformat
from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.manager import OffloadingManager
from kvtiers.core.specs import LoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.manager import ObjectTierManager
from kvtiers.tiers.object.store import ObjectMissing, ObjectStore


def offloading_config(
    bytes_per_block: tuple[int, ...] = (8192,), *, model: str = "org/model", salt: str = ""
) -> OffloadingConfig:
    """An :class:`~kvtiers.core.config.OffloadingConfig` with one block per chunk."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(16, (f"layer.{g}",), size)
            for g, size in enumerate(bytes_per_block)
        ),
        model=OffloadingModelConfig(model),
        cache=OffloadingCacheConfig(tokens_per_hash=16),
        salt=salt,
    )


class ObjectStoreConformance:
    """The object-store contract as tests. See the module docstring for how to use it."""

    def make_store(self) -> ObjectStore:
        raise NotImplementedError

    @pytest.fixture
    def store(self) -> Iterator[ObjectStore]:
        store = self.make_store()
        try:
            yield store
        finally:
            store.close()

    @pytest.fixture
    def prefix(self) -> str:
        return f"conformance-{uuid.uuid4().hex[:12]}"

    # -- put, head, reads -------------------------------------------------------------
    def test_a_put_is_read_back_whole(self, store: ObjectStore, prefix: str) -> None:
        name = f"{prefix}/a/b/one.kvc"
        assert store.put_if_absent(name, [b"head", bytearray(b"-middle-"), memoryview(b"tail")])
        data = b"head-middle-tail"
        assert store.head(name) == len(data)
        assert store.read(name, len(data)) == data
        first, second = bytearray(4), bytearray(len(data) - 4)
        assert store.get_into(name, [memoryview(first), memoryview(second)]) == len(data)
        assert bytes(first + second) == data

    def test_a_second_put_changes_nothing(self, store: ObjectStore, prefix: str) -> None:
        name = f"{prefix}/once"
        assert store.put_if_absent(name, [b"first"])
        assert not store.put_if_absent(name, [b"second, longer"])
        assert store.read(name, 100) == b"first"

    def test_a_put_replaces_the_object_whole(self, store: ObjectStore, prefix: str) -> None:
        name = f"{prefix}/summary"
        store.put(name, [b"first, the longer one"])
        store.put(name, [b"sec", memoryview(b"ond")])
        assert store.read(name, 100) == b"second"
        assert [info.name for info in store.list(f"{prefix}/")] == [name]

    def test_racing_puts_store_exactly_one(self, store: ObjectStore, prefix: str) -> None:
        name = f"{prefix}/raced"
        writers = 4
        start = threading.Barrier(writers)
        won: list[bytes] = []
        lock = threading.Lock()

        def put(payload: bytes) -> None:
            start.wait()
            if store.put_if_absent(name, [payload]):
                with lock:
                    won.append(payload)

        threads = [
            threading.Thread(target=put, args=(b"writer %d" % i,)) for i in range(writers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1
        assert store.read(name, 100) == won[0]

    def test_a_larger_object_is_reported_a_shorter_one_read_whole(
        self, store: ObjectStore, prefix: str
    ) -> None:
        name = f"{prefix}/sized"
        store.put_if_absent(name, [b"12345678"])
        assert store.get_into(name, [memoryview(bytearray(3))]) == 8
        head, rest = bytearray(3), bytearray(b"*" * 17)
        assert store.get_into(name, [memoryview(head), memoryview(rest)]) == 8
        assert bytes(head) == b"123"
        assert bytes(rest) == b"45678" + b"*" * 12

    def test_a_hashed_read_feeds_every_byte_after_the_first_buffer(
        self, store: ObjectStore, prefix: str
    ) -> None:
        name = f"{prefix}/hashed"
        data = bytes(range(256)) * 3000
        store.put_if_absent(name, [data])
        hasher = xxhash.xxh3_128()
        head, rest = bytearray(100), bytearray(len(data))
        assert store.get_hashed(name, [memoryview(head), memoryview(rest)], hasher) == len(data)
        assert bytes(head) + bytes(rest[: len(data) - 100]) == data
        assert hasher.digest() == xxhash.xxh3_128_digest(data[100:])

    def test_a_read_past_its_limit_says_so(self, store: ObjectStore, prefix: str) -> None:
        name = f"{prefix}/large"
        store.put_if_absent(name, [bytes(range(256)) * 8])
        assert len(store.read(name, 100)) > 100

    def test_stream_yields_the_bytes_from_an_offset(
        self, store: ObjectStore, prefix: str
    ) -> None:
        name = f"{prefix}/streamed"
        data = bytes(range(256)) * 5
        store.put_if_absent(name, [data])
        blocks = list(store.stream(name, 100, 300))
        assert all(0 < len(block) <= 300 for block in blocks)
        assert b"".join(blocks) == data[100:]

    def test_a_missing_object(self, store: ObjectStore, prefix: str) -> None:
        name = f"{prefix}/absent"
        assert store.head(name) is None
        with pytest.raises(ObjectMissing):
            store.get_into(name, [memoryview(bytearray(4))])
        with pytest.raises(ObjectMissing):
            store.read(name, 10)
        store.delete(name)

    # -- listing and deleting ---------------------------------------------------------
    def test_list_names_every_object_under_a_prefix(
        self, store: ObjectStore, prefix: str
    ) -> None:
        sizes = {f"{prefix}/ns/manifest.json": 3, f"{prefix}/ns/ab/cd/x.kvc": 5,
                 f"{prefix}/ns/ab/ef/y.kvc": 7, f"{prefix}/other/z.kvc": 11}
        for name, size in sizes.items():
            assert store.put_if_absent(name, [bytes(size)])
        listed = {info.name: info for info in store.list(f"{prefix}/ns/")}
        assert {name: info.size for name, info in listed.items()} == {
            name: size for name, size in sizes.items() if name.startswith(f"{prefix}/ns/")
        }
        assert all(info.mtime >= 0 and info.irregular is None for info in listed.values())
        assert {info.name for info in store.list(prefix)} == set(sizes)
        assert list(store.list(f"{prefix}/nothing-here/")) == []

    def test_delete_removes_one_object(self, store: ObjectStore, prefix: str) -> None:
        keep, gone = f"{prefix}/keep", f"{prefix}/gone"
        store.put_if_absent(keep, [b"k"])
        store.put_if_absent(gone, [b"g"])
        store.delete(gone)
        assert store.head(gone) is None and store.head(keep) == 1
        assert [info.name for info in store.list(prefix)] == [keep]
        assert store.put_if_absent(gone, [b"again"])

    def test_delete_prefix_removes_everything_under_it(
        self, store: ObjectStore, prefix: str
    ) -> None:
        doomed = [f"{prefix}/ns/manifest.json", f"{prefix}/ns/ab/cd/x.kvc",
                  f"{prefix}/ns/quarantine/y.kvc"]
        for name in [*doomed, f"{prefix}/kept/manifest.json"]:
            store.put_if_absent(name, [b"data"])
        assert store.delete_prefix(f"{prefix}/ns/") == len(doomed)
        assert [info.name for info in store.list(prefix)] == [f"{prefix}/kept/manifest.json"]

    def test_nothing_ordinary_is_transient(self, store: ObjectStore) -> None:
        assert not store.is_transient(ValueError("a bad argument"))
        assert not store.is_transient(ObjectMissing("absent"))

    def test_describe_names_the_object(self, store: ObjectStore, prefix: str) -> None:
        assert f"{prefix}/x" in store.describe(f"{prefix}/x")


class ObjectTierConformance:
    """Backdoor helpers of the conformance suite for object tiers; a test class mixes
    this in before :class:`~kvtiers.testing.conformance.TierConformanceTests` and
    supplies :meth:`make_store`."""

    _capacity_chunks: int | None = None

    def make_store(self) -> ObjectStore:
        raise NotImplementedError

    def _manager(self, store: ObjectStore, capacity_chunks: int | None) -> ObjectTierManager:
        config = offloading_config()
        geometry = ChunkGeometry.from_config(config)
        backend = ObjectBackend(store, NamespaceIdentity.from_config(config), prefix="conf",
                                threads=2)
        capacity = None
        if capacity_chunks is not None:
            capacity = capacity_chunks * (HEADER_BYTES + geometry.max_chunk_bytes)
        return ObjectTierManager(backend, max_chunk_bytes=geometry.max_chunk_bytes,
                                 capacity_bytes=capacity)

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        self._capacity_chunks = capacity_chunks
        return self._manager(self.make_store(), capacity_chunks)

    def reopen(self, manager: OffloadingManager) -> OffloadingManager:
        manager.shutdown()
        return self._manager(self.make_store(), self._capacity_chunks)

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        backend, spec = _object_tier(manager, spec)
        blob = chunkformat.encode(backend.identity.digest, spec.keys[index], payload)
        backend.store.put_if_absent(spec.object_keys[index], [blob])

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        backend, spec = _object_tier(manager, spec)
        name = spec.object_keys[index]
        size = backend.store.head(name)
        assert size is not None, f"{name} is not in the store"
        buffer = bytearray(size)
        backend.store.get_into(name, [memoryview(buffer)])
        digest = backend.identity.digest
        return bytes(chunkformat.decode(buffer, namespace_digest=digest, key=spec.keys[index]))


def _object_tier(
    manager: OffloadingManager, spec: LoadStoreSpec
) -> tuple[ObjectBackend, ObjectLoadStoreSpec]:
    assert isinstance(manager, ObjectTierManager), f"not an object tier: {manager!r}"
    assert isinstance(spec, ObjectLoadStoreSpec), f"not an object spec: {spec!r}"
    return manager.backend, spec
