"""Liveness at the I/O level (docs/architecture.md, "Liveness"): non-regular files never
block a read and are never indexed as chunks, and a failed read of any kind reaches the
mover's result as a failed key, never a hang or an exception.

A test that checks "never blocks" runs the call on a helper thread and waits for it with
a generous bound: the bound only turns a hang into a failure, it measures nothing. A FIFO
left blocking by a broken build is unblocked afterwards by opening its write end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult
from kvtiers.core.regular import NotRegularFileError, open_regular, read_regular
from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec
from kvtiers.errors import ConfigError, NamespaceMismatchError
from kvtiers.filemapper import FileMapper, open_namespace
from kvtiers.testing.conformance import conformance_key, conformance_payload
from tests.test_file_support import CHUNK, CTX, IDENTITY, open_tier

HANG_GUARD_S = 60.0


def _unblock(fifo: Path) -> None:
    """Give a reader stuck in ``open`` of ``fifo`` its writer (then EOF)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def run_bounded(call: Callable[[], Any], fifo: Path | None = None) -> Any:
    """``call()`` on a helper thread; fails the test if it does not return in time."""
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc
        done.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    finished = done.wait(HANG_GUARD_S)
    if not finished and fifo is not None:
        _unblock(fifo)
        done.wait(HANG_GUARD_S)
    assert finished, f"{call} blocked"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


# -- the helper -----------------------------------------------------------------------
def test_open_regular_refuses_everything_but_regular_files(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_bytes(b"abc")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    link = tmp_path / "link"
    link.symlink_to(regular)
    assert read_regular(regular, 10) == b"abc"
    assert read_regular(link, 10, follow_symlinks=True) == b"abc"
    with pytest.raises(NotRegularFileError, match="a FIFO"):
        run_bounded(lambda: open_regular(fifo), fifo)
    with pytest.raises(NotRegularFileError, match="a directory"):
        open_regular(tmp_path)
    with pytest.raises(OSError) as loop_error:
        open_regular(loop, follow_symlinks=True)
    assert loop_error.value.errno == 40  # ELOOP
    with pytest.raises(OSError):
        open_regular(link)


# -- the file tier --------------------------------------------------------------------
def _replace_with(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "symlink loop":
        path.symlink_to(path)
    else:
        path.symlink_to(path.parent)


KINDS = ["fifo", "directory", "symlink loop", "symlink to a directory"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_load_of_a_non_regular_chunk_fails_its_key_without_blocking(
    tmp_path: Path, kind: str
) -> None:
    tier = open_tier(tmp_path)
    try:
        assert set(tier.store([0, 1])) == {conformance_key(0), conformance_key(1)}
        path = tier.manager.mapper.path(conformance_key(0))
        _replace_with(path, kind)
        keys: list[OffloadKey] = [conformance_key(0), conformance_key(1)]
        tier.manager.prepare_load(keys, CTX)
        spec = tier.manager.get_spec(keys)
        result = run_bounded(lambda: tier.run(spec, CPULoadStoreSpec([0, 1])), path)
        tier.manager.complete_load(keys, CTX)
        assert result.failed_keys == (conformance_key(0),)
        assert result.succeeded_keys == (conformance_key(1),)
        assert bytes(tier.region.view(1)[:CHUNK]) == conformance_payload(1, CHUNK)
    finally:
        tier.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_rebuild_indexes_regular_files_only(tmp_path: Path, kind: str) -> None:
    tier = open_tier(tmp_path)
    tier.store([0, 1])
    tier.close()
    _replace_with(FileMapper(tmp_path, IDENTITY).path(conformance_key(0)), kind)
    reopened = open_tier(tmp_path)
    try:
        assert reopened.manager.lookup(conformance_key(0), CTX) is LookupResult.MISS
        assert reopened.manager.lookup(conformance_key(1), CTX) is LookupResult.HIT
        assert reopened.manager.unindexed_entries == 1
        assert reopened.load(1)[1] == conformance_payload(1, CHUNK)
    finally:
        reopened.close()


def test_a_store_over_a_non_regular_chunk_path_fails_its_key(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    try:
        key = conformance_key(0)
        path = tier.manager.mapper.path(key)
        path.parent.mkdir(parents=True)
        path.mkdir()
        accepted = tier.manager.prepare_store([key], CTX)
        assert accepted == [key]
        spec = tier.manager.get_spec(accepted)
        result = run_bounded(lambda: tier.run(CPULoadStoreSpec([0]), spec))
        assert result.failed_keys == (key,)
        tier.manager.complete_store([key], CTX, success=False)
    finally:
        tier.close()


# -- the manifest ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink loop"])
def test_a_non_regular_manifest_is_a_clear_error_not_a_hang(tmp_path: Path, kind: str) -> None:
    manifest = FileMapper(tmp_path, IDENTITY).manifest_path
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    _replace_with(manifest, kind)
    with pytest.raises(NamespaceMismatchError, match="manifest: stored 'unreadable") as error:
        run_bounded(lambda: open_namespace(tmp_path, IDENTITY), manifest)
    assert "\n" not in str(error.value)


# -- fsspec on a local directory ------------------------------------------------------
def test_fsspec_local_read_of_a_fifo_fails_without_blocking(tmp_path: Path) -> None:
    from kvtiers.tiers.fsspec.store import FsspecStore

    store = FsspecStore(f"file://{tmp_path}/objects")
    os.makedirs(tmp_path / "objects" / "ns")
    fifo = tmp_path / "objects" / "ns" / "chunk"
    os.mkfifo(fifo)
    buffer = bytearray(16)
    with pytest.raises(OSError, match="FIFO") as error:
        run_bounded(lambda: store.get_into("ns/chunk", [memoryview(buffer)]), fifo)
    assert not store.is_transient(error.value)


# -- kvtiers verify -------------------------------------------------------------------
def test_verify_reports_non_regular_chunks_instead_of_hanging(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    tier.store([0, 1, 2])
    namespace_dir = tier.manager.namespace_dir
    tier.close()
    mapper = FileMapper(tmp_path, IDENTITY)
    fifo = mapper.path(conformance_key(0))
    _replace_with(fifo, "fifo")
    _replace_with(mapper.path(conformance_key(1)), "symlink loop")
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from kvtiers.cli import main; raise SystemExit(main())",
             "verify", str(tmp_path)],
            capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
        )
    except subprocess.TimeoutExpired:
        _unblock(fifo)
        raise
    assert done.returncode == 1, done.stderr
    assert f"{namespace_dir.name}: 1 chunks ok, 0 corrupt, 2 unreadable" in done.stdout
    flat = " ".join(done.stdout.split())  # reports wrap at 80 columns
    assert (f"unreadable (a FIFO, not a regular file; not a chunk any tier loads, remove it): "
            f"{fifo.relative_to(tmp_path).as_posix()}") in flat
    assert "a symbolic link, not a regular file" in done.stdout


def test_file_load_spec_paths_are_the_chunk_paths(tmp_path: Path) -> None:
    """The tests above replace the file a spec names: pin that the spec names it."""
    tier = open_tier(tmp_path)
    try:
        tier.store([0])
        key = conformance_key(0)
        tier.manager.prepare_load([key], CTX)
        spec = tier.manager.get_spec([key])
        tier.manager.complete_load([key], CTX)
        assert isinstance(spec, FileLoadStoreSpec)
        assert list(spec.paths) == [str(tier.manager.mapper.path(key))]
    finally:
        tier.close()


def test_load_stack_over_a_fifo_manifest_fails_at_once(tmp_path: Path) -> None:
    from kvtiers.stack.builder import load_stack

    stack_file = {
        "tiers": [{"kind": "cpu", "capacity": "1MiB"}, {"kind": "file", "root": str(tmp_path)}],
        "model": {"name": "team/model", "tokens_per_hash": 16, "blocks_per_chunk": 1,
                  "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}]},
    }
    load_stack(stack_file).shutdown()
    (manifest,) = tmp_path.glob("*/manifest.json")
    _replace_with(manifest, "fifo")
    # The start-time checks read it first (as the tier would: never blocking) and refuse.
    with pytest.raises(ConfigError, match="a FIFO is where a regular file must be"):
        run_bounded(lambda: load_stack(stack_file), manifest)
