"""The namespace manifest: written once without clobbering, re-read and compared field by
field on every open, failing closed on any difference or on an unreadable manifest."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core import chunkformat
from kvtiers.core.publish import TEMP_SUFFIX
from kvtiers.errors import NamespaceMismatchError
from kvtiers.filemapper import (
    MANIFEST_FORMAT_VERSION,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    GroupIdentity,
    NamespaceIdentity,
    ParallelIdentity,
    check_manifest,
    manifest_bytes,
    open_namespace,
)
from kvtiers.filemapper import manifest as manifest_module


def make_identity(**changes: Any) -> NamespaceIdentity:
    identity = NamespaceIdentity(
        engine="vllm",
        model_name="Qwen/Qwen3-8B",
        model_revision="main",
        kv_dtype="bfloat16",
        kv_layout="NHD",
        tokens_per_hash=16,
        blocks_per_chunk=4,
        groups=(GroupIdentity(16, ("layers.0", "layers.1"), 65536),),
        parallel=ParallelIdentity(world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1),
        hash_algorithm="xxh3_128",
    )
    return dataclasses.replace(identity, **changes)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def manifest_of(root: Path, identity: NamespaceIdentity) -> Path:
    return root / identity.namespace / MANIFEST_NAME


def mismatch(data: bytes, identity: NamespaceIdentity) -> NamespaceMismatchError:
    with pytest.raises(NamespaceMismatchError) as info:
        check_manifest(data, identity, where="here")
    return info.value


# --- create and reopen ------------------------------------------------------------------


def test_create_then_reopen(tmp_path: Path) -> None:
    identity = make_identity()
    namespace_dir = open_namespace(tmp_path, identity)
    assert namespace_dir == tmp_path / identity.namespace
    document = json.loads(manifest_of(tmp_path, identity).read_bytes())
    assert document["identity"] == identity.to_dict()
    assert document["digest"] == identity.hexdigest
    assert document["namespace"] == identity.namespace
    assert document["format_version"] == MANIFEST_FORMAT_VERSION
    assert document["chunk_format_version"] == chunkformat.FORMAT_VERSION

    before = manifest_of(tmp_path, identity).read_bytes()
    assert open_namespace(tmp_path, make_identity()) == namespace_dir
    assert open_namespace(tmp_path, make_identity(), create=False) == namespace_dir
    assert manifest_of(tmp_path, identity).read_bytes() == before
    assert sorted(os.listdir(namespace_dir)) == [MANIFEST_NAME]


def test_manifest_and_namespace_modes(tmp_path: Path, umask_022: None) -> None:
    identity = make_identity()
    namespace_dir = open_namespace(tmp_path / "root", identity)
    assert stat.S_IMODE(os.stat(namespace_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "root").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(namespace_dir / MANIFEST_NAME).st_mode) == 0o600

    shared = open_namespace(tmp_path / "shared", identity, file_mode=0o644, dir_mode=0o755)
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(shared / MANIFEST_NAME).st_mode) == 0o644


def test_open_without_create_on_a_missing_namespace(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="create=True"):
        open_namespace(tmp_path, make_identity(), create=False)
    assert os.listdir(tmp_path) == []


def test_manifest_records_creation_time_in_utc() -> None:
    document = json.loads(manifest_bytes(make_identity(), created_at=86400.5))
    assert document["created_at"] == "1970-01-02T00:00:00.500000+00:00"


# --- mismatches name every differing field ----------------------------------------------


def test_mismatch_names_each_differing_field(tmp_path: Path) -> None:
    stored = make_identity()
    expected = make_identity(
        salt="tenant-b",
        groups=(GroupIdentity(32, ("layers.0", "layers.1"), 65536),),
        parallel=ParallelIdentity(world_size=4, tp_size=4, pp_size=1, pcp_size=1, dcp_size=1),
    )
    open_namespace(tmp_path, stored)
    # Another identity finds this manifest where it expects its own (a copied or renamed
    # namespace directory, or a digest-prefix collision).
    os.rename(tmp_path / stored.namespace, tmp_path / expected.namespace)
    with pytest.raises(NamespaceMismatchError) as info:
        open_namespace(tmp_path, expected)
    differences = info.value.differences
    assert differences == {
        "salt": ("", "tenant-b"),
        "groups[0].tokens_per_block": (16, 32),
        "parallel.world_size": (2, 4),
        "parallel.tp_size": (2, 4),
        "digest": (stored.hexdigest, expected.hexdigest),
        "namespace": (stored.namespace, expected.namespace),
    }
    message = str(info.value)
    for name in differences:
        assert name in message
    assert str(tmp_path / expected.namespace / MANIFEST_NAME) in message
    assert "stored 16, expected 32" in message


@pytest.mark.parametrize(
    ("stored", "expected", "field", "values"),
    [
        (
            make_identity(),
            make_identity(groups=make_identity().groups * 2),
            "len(groups)",
            (1, 2),
        ),
        (make_identity(), make_identity(parallel=None), "parallel", None),
        (
            make_identity(),
            make_identity(groups=(GroupIdentity(16, ("layers.0",), 65536),)),
            "groups[0].layer_names",
            (["layers.0", "layers.1"], ["layers.0"]),
        ),
        (
            make_identity(),
            make_identity(schema_version=SCHEMA_VERSION + 1),
            "schema_version",
            (SCHEMA_VERSION, SCHEMA_VERSION + 1),
        ),
        (make_identity(), make_identity(kv_dtype="float16"), "kv_dtype", ("bfloat16", "float16")),
    ],
)
def test_structural_differences(
    stored: NamespaceIdentity,
    expected: NamespaceIdentity,
    field: str,
    values: tuple[object, object] | None,
) -> None:
    error = mismatch(manifest_bytes(stored), expected)
    assert field in error.differences
    if values is not None:
        assert error.differences[field] == values
    assert field in str(error)


def edit_document(edit: Callable[[dict[str, Any]], None]) -> bytes:
    document = json.loads(manifest_bytes(make_identity()))
    edit(document)
    return json.dumps(document).encode()


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(format_version=2), "format_version"),
        (lambda d: d.update(chunk_format_version=2), "chunk_format_version"),
        (lambda d: d.pop("digest"), "digest"),
        (lambda d: d.update(digest="00" * 32), "digest"),
        (lambda d: d["identity"].update(kv_dtype="float16"), "kv_dtype"),
        # Equal in Python, different in type: caught only by the strict comparison.
        (lambda d: d["identity"].update(blocks_per_chunk=4.0), "blocks_per_chunk"),
        (lambda d: d["identity"]["parallel"].update(pp_size=True), "parallel.pp_size"),
        (lambda d: d["identity"].pop("salt"), "salt"),
        (lambda d: d["identity"].update(colour="blue"), "colour"),
        (
            lambda d: d["identity"]["groups"][0].update(bytes_per_block=1),
            "groups[0].bytes_per_block",
        ),
    ],
)
def test_tampered_manifest_on_disk_fails_closed(
    edit: Callable[[dict[str, Any]], None], field: str, tmp_path: Path
) -> None:
    identity = make_identity()
    open_namespace(tmp_path, identity)
    path = manifest_of(tmp_path, identity)
    path.write_bytes(edit_document(edit))
    with pytest.raises(NamespaceMismatchError) as info:
        open_namespace(tmp_path, identity)
    assert field in info.value.differences
    assert field in str(info.value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\xff\xfe garbage",
        b'{"format_version": 1,',
        b"[]",
        b"null",
        b"{}",
        b'{"identity": 3}',
        b'{"identity": {}}' + b" " * manifest_module.MAX_MANIFEST_BYTES,
    ],
)
def test_garbage_manifest_fails_closed(data: bytes, tmp_path: Path) -> None:
    identity = make_identity()
    (tmp_path / identity.namespace).mkdir()
    manifest_of(tmp_path, identity).write_bytes(data)
    with pytest.raises(NamespaceMismatchError) as info:
        open_namespace(tmp_path, identity)
    assert list(info.value.differences) == ["manifest"]
    assert "unreadable" in str(info.value)
    assert manifest_of(tmp_path, identity).read_bytes() == data


# --- racing creators --------------------------------------------------------------------


def test_concurrent_create_publishes_exactly_one_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = 8
    # Every creator has seen "no manifest" before any of them publishes, so all of them
    # race on the no-clobber publish and seven must take the loser's path.
    all_missed = threading.Barrier(threads, timeout=30)
    lost: list[bool] = []
    real_publish = manifest_module.publish_bytes

    def racing_publish(*args: Any, **kwargs: Any) -> None:
        all_missed.wait()
        try:
            real_publish(*args, **kwargs)
        except FileExistsError:
            lost.append(True)
            raise

    monkeypatch.setattr(manifest_module, "publish_bytes", racing_publish)
    identity = make_identity()
    results: list[Path] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            results.append(open_namespace(tmp_path, identity))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=create) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    assert errors == []
    assert results == [tmp_path / identity.namespace] * threads
    assert len(lost) == threads - 1
    assert os.listdir(tmp_path / identity.namespace) == [MANIFEST_NAME]
    check_manifest(manifest_of(tmp_path, identity).read_bytes(), identity, where="winner")


def test_losing_creator_checks_the_winners_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    identity = make_identity()
    other = make_identity(salt="other")
    real_publish = manifest_module.publish_bytes

    def another_process_wins(path: Path, *args: Any, **kwargs: Any) -> None:
        # A racing process with a different identity publishes at this very name first.
        real_publish(path, [manifest_bytes(other)], replace=False)
        real_publish(path, *args, **kwargs)

    monkeypatch.setattr(manifest_module, "publish_bytes", another_process_wins)
    with pytest.raises(NamespaceMismatchError) as info:
        open_namespace(tmp_path, identity)
    assert info.value.differences["salt"] == ("other", "")
    names = os.listdir(tmp_path / identity.namespace)
    assert names == [MANIFEST_NAME]
    assert not any(name.endswith(TEMP_SUFFIX) for name in names)


def test_a_chunk_format_bump_opens_a_new_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/on-disk-format.md: old chunks read as misses after a format bump; the tier
    must not stop with NamespaceMismatchError on the old namespace."""
    from tests.test_filemapper import base_config

    old = open_namespace(tmp_path, NamespaceIdentity.from_config(base_config()))
    monkeypatch.setattr(chunkformat, "FORMAT_VERSION", chunkformat.FORMAT_VERSION + 1)
    new = open_namespace(tmp_path, NamespaceIdentity.from_config(base_config()))
    assert new != old
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([old.name, new.name])
