"""The ObjectStore contract (:class:`kvtiers.testing.objects.ObjectStoreConformance`) on
every store kvtiers ships: S3 on a moto server, fsspec on memory:// and file://, and the
local directory store the offline tools read file roots through; then what only the local
store promises (no link followed, nothing but regular files read)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from kvtiers.errors import SymlinkEscapeError
from kvtiers.testing.objects import ObjectStoreConformance
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers.object.local import LocalStore
from kvtiers.tiers.object.store import ObjectMissing, ObjectStore


class TestS3Store(ObjectStoreConformance):
    @pytest.fixture(autouse=True)
    def _endpoint(self, s3_endpoint: MotoServer) -> None:
        self.endpoint = s3_endpoint

    def make_store(self) -> ObjectStore:
        from kvtiers.tiers.s3.store import S3Store

        return S3Store(BUCKET, region="us-east-1", endpoint_url=self.endpoint.endpoint_url)


class TestFsspecMemoryStore(ObjectStoreConformance):
    def make_store(self) -> ObjectStore:
        from kvtiers.tiers.fsspec.store import FsspecStore

        # The memory filesystem is one process-wide dict: each store gets its own root.
        return FsspecStore(f"memory://kvtiers-{uuid.uuid4().hex}")


class TestFsspecFileStore(ObjectStoreConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "objects"

    def make_store(self) -> ObjectStore:
        from kvtiers.tiers.fsspec.store import FsspecStore

        return FsspecStore(f"file://{self.root}")


class TestLocalStore(ObjectStoreConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "root"
        self.root.mkdir()

    def make_store(self) -> ObjectStore:
        return LocalStore(self.root)


# -- what only the local store promises ------------------------------------------------------
def test_a_linked_directory_is_never_listed_through(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "ns").mkdir(parents=True)
    (outside / "ns" / "secret.kvc").write_bytes(b"secret")
    root.mkdir()
    (root / "ns").symlink_to(outside / "ns")
    store = LocalStore(root)
    assert [(i.name, i.irregular) for i in store.list("")] == [("ns", "a symbolic link")]
    assert list(store.list("ns/")) == []
    assert store.head("ns/secret.kvc") is None
    with pytest.raises(ObjectMissing):
        store.read("ns/secret.kvc", 100)
    store.delete("ns/secret.kvc")
    assert (outside / "ns" / "secret.kvc").exists()


def test_a_linked_file_is_listed_never_read(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_bytes(b"secret")
    (root / "x.kvc").symlink_to(tmp_path / "secret")
    store = LocalStore(root)
    assert [(i.name, i.irregular) for i in store.list("")] == [("x.kvc", "a symbolic link")]
    assert store.head("x.kvc") is None
    with pytest.raises(SymlinkEscapeError):
        store.read("x.kvc", 100)
    store.delete("x.kvc")
    assert (tmp_path / "secret").read_bytes() == b"secret"


def test_a_fifo_is_listed_and_a_read_of_it_fails_at_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / "stuck.kvc")
    store = LocalStore(root)
    assert [(i.name, i.irregular) for i in store.list("")] == [("stuck.kvc", "a FIFO")]
    with pytest.raises(OSError, match="a FIFO is where a regular file must be"):
        store.read("stuck.kvc", 100)


def test_a_put_never_writes_through_a_linked_directory(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "ns").symlink_to(outside)
    with pytest.raises(SymlinkEscapeError):
        LocalStore(root).put_if_absent("ns/x.kvc", [b"data"])
    assert list(outside.iterdir()) == []
