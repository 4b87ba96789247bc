"""Atomic publish: a failure at any step leaves the old file or the new one, never a torn
one, and no temp file that start-up cleanup would not remove — with anonymous files
(``O_TMPFILE`` + link) and with named temp files (the fallback) alike; the fallback is taken
where anonymous files are refused; an existing name is replaced, or kept in no-clobber
mode; short writes are retried; modes; stale temp cleanup."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvtiers.core import publish as publish_module
from kvtiers.core.publish import (
    TEMP_SUFFIX,
    FileOps,
    KnownDirs,
    is_temp_name,
    publish,
    publish_bytes,
    temp_path_for,
    write_all,
)
from kvtiers.errors import SymlinkEscapeError
from kvtiers.filemapper import remove_stale_temps

OLD = b"old content " * 100
NEW = b"NEW CONTENT " * 300


class InjectedFault(OSError):
    def __init__(self, step: str) -> None:
        super().__init__(errno.EIO, f"injected failure at {step}")
        self.step = step


class FaultyOps(FileOps):
    """Real system calls, except that the named steps raise :class:`InjectedFault`
    (after doing their work for ``close``, which releases the descriptor either way)."""

    def __init__(self, *steps: str) -> None:
        self.steps = set(steps)
        self.calls: list[str] = []

    def _maybe_fail(self, step: str) -> None:
        self.calls.append(step)
        if step in self.steps:
            raise InjectedFault(step)

    def open_exclusive(self, path: Path, mode: int, extra_flags: int) -> int:
        self._maybe_fail("open")
        return super().open_exclusive(path, mode, extra_flags)

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        self._maybe_fail("open")
        return super().open_anonymous(directory, mode, extra_flags)

    def link_anonymous(self, fd: int, dst: Path) -> None:
        self._maybe_fail("link")
        super().link_anonymous(fd, dst)

    def fsync(self, fd: int) -> None:
        self._maybe_fail("fsync")
        super().fsync(fd)

    def close(self, fd: int) -> None:
        super().close(fd)
        self._maybe_fail("close")

    def replace(self, src: Path, dst: Path) -> None:
        self._maybe_fail("replace")
        super().replace(src, dst)

    def link(self, src: Path, dst: Path) -> None:
        self._maybe_fail("link")
        super().link(src, dst)

    def fsync_dir(self, path: Path) -> None:
        self._maybe_fail("fsync_dir")
        super().fsync_dir(path)

    def unlink(self, path: Path) -> None:
        self._maybe_fail("unlink")
        super().unlink(path)


class WriterFault(RuntimeError):
    pass


def half_then_fail(fd: int, _temp: Path) -> None:
    """A writer that dies midway, after a partial write."""
    write_all(fd, [NEW[: len(NEW) // 2]])
    raise WriterFault("writer died midway")


def write_new(fd: int, _temp: Path) -> None:
    write_all(fd, [NEW])


def temps_in(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if is_temp_name(name)]


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# --- fault injection --------------------------------------------------------------------

# step -> does the new content end up published when that step fails? Named temp files:
REPLACE_STEPS = {
    "open": False,
    "writer": False,
    "fsync": False,
    "close": False,
    "replace": False,
    "fsync_dir": True,
}
LINK_STEPS = {**{k: v for k, v in REPLACE_STEPS.items() if k != "replace"}, "link": False}
# Anonymous files: linked first, closed after; "replace" runs only over an existing name.
ANONYMOUS_STEPS = LINK_STEPS

needs_anonymous = pytest.mark.skipif(
    not FileOps().has_anonymous(), reason="no O_TMPFILE or no /proc/self/fd here"
)
MECHANISMS = [
    pytest.param(True, id="anonymous", marks=needs_anonymous),
    pytest.param(False, id="named"),
]


def run_faulty(final: Path, step: str, *, replace: bool, anonymous: bool) -> FaultyOps:
    ops = FaultyOps(step)
    writer = half_then_fail if step == "writer" else write_new
    expected_error: type[Exception] = WriterFault if step == "writer" else InjectedFault
    with pytest.raises(expected_error):
        publish(final, writer, replace=replace, ops=ops, anonymous=anonymous)
    if step != "writer":
        assert step in ops.calls
    return ops


def steps(anonymous: bool, existing: bool) -> dict[str, bool]:
    if not anonymous:
        return REPLACE_STEPS
    return {**ANONYMOUS_STEPS, "replace": False} if existing else ANONYMOUS_STEPS


FAULT_CASES = [
    pytest.param(anonymous.values[0], existing, step,
                 id=f"{anonymous.id}-{'overwrite' if existing else 'first'}-{step}",
                 marks=anonymous.marks)
    for anonymous in MECHANISMS
    for existing in (False, True)
    for step in sorted(steps(bool(anonymous.values[0]), existing))
]


@pytest.mark.parametrize(("anonymous", "existing", "step"), FAULT_CASES)
def test_failure_at_each_step_never_tears_the_file(
    step: str, existing: bool, anonymous: bool, tmp_path: Path
) -> None:
    final = tmp_path / "chunk.kvc"
    if existing:
        final.write_bytes(OLD)
    run_faulty(final, step, replace=True, anonymous=anonymous)
    if steps(anonymous, existing)[step]:
        assert final.read_bytes() == NEW
    elif existing:
        assert final.read_bytes() == OLD
    else:
        assert not final.exists()
    assert temps_in(tmp_path) == []


@pytest.mark.parametrize("anonymous", MECHANISMS)
@pytest.mark.parametrize("step", sorted(LINK_STEPS))
def test_no_clobber_failure_at_each_step_never_tears_the_file(
    step: str, anonymous: bool, tmp_path: Path
) -> None:
    final = tmp_path / "manifest.json"
    run_faulty(final, step, replace=False, anonymous=anonymous)
    if LINK_STEPS[step]:
        assert final.read_bytes() == NEW
    else:
        assert not final.exists()
    assert temps_in(tmp_path) == []


def test_no_clobber_unlink_failure_after_link_leaves_a_temp_cleanup_removes(
    tmp_path: Path,
) -> None:
    final = tmp_path / "manifest.json"
    run_faulty(final, "unlink", replace=False, anonymous=False)
    assert final.read_bytes() == NEW
    assert len(temps_in(tmp_path)) == 1
    assert remove_stale_temps(tmp_path) == 1
    assert temps_in(tmp_path) == []
    assert final.read_bytes() == NEW


@needs_anonymous
def test_anonymous_failed_temp_removal_after_a_failed_replace_leaves_a_temp_cleanup_removes(
    tmp_path: Path,
) -> None:
    final = tmp_path / "chunk.kvc"
    final.write_bytes(OLD)
    with pytest.raises(InjectedFault):
        publish(final, write_new, ops=FaultyOps("replace", "unlink"))
    assert final.read_bytes() == OLD
    assert len(temps_in(tmp_path)) == 1
    assert remove_stale_temps(tmp_path) == 1
    assert final.read_bytes() == OLD


@needs_anonymous
def test_an_anonymous_file_that_fails_before_its_link_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(InjectedFault):
        publish(tmp_path / "chunk.kvc", write_new, ops=FaultyOps("fsync", "unlink"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_failed_temp_removal_leaves_a_temp_cleanup_removes(step: str, tmp_path: Path) -> None:
    final = tmp_path / "chunk.kvc"
    final.write_bytes(OLD)
    ops = FaultyOps(step, "unlink")
    with pytest.raises(InjectedFault):
        publish(final, write_new, ops=ops, anonymous=False)
    assert final.read_bytes() == OLD
    assert len(temps_in(tmp_path)) == 1
    assert remove_stale_temps(tmp_path) == 1
    assert temps_in(tmp_path) == []
    assert final.read_bytes() == OLD


def test_failed_fsync_of_a_new_directory_publishes_nothing_and_a_retry_succeeds(
    tmp_path: Path,
) -> None:
    final = tmp_path / "ab" / "cd" / "chunk.kvc"
    with pytest.raises(InjectedFault):
        publish(final, write_new, ops=FaultyOps("fsync_dir"))
    assert not final.exists()
    publish(final, write_new)
    assert final.read_bytes() == NEW
    assert temps_in(final.parent) == []


REPLACE_CALLS = {
    # The first link finds the name taken (EEXIST): the file is linked under a temp name
    # and renamed over it.
    True: ["open", "fsync", "link", "link", "close", "replace", "fsync_dir"],
    False: ["open", "fsync", "close", "replace", "fsync_dir"],
}


@pytest.mark.parametrize("anonymous", MECHANISMS)
def test_publish_replaces_and_leaves_no_temp(anonymous: bool, tmp_path: Path) -> None:
    final = tmp_path / "chunk.kvc"
    final.write_bytes(OLD)
    ops = FaultyOps()
    publish_bytes(final, [NEW[:5], b"", NEW[5:]], ops=ops, anonymous=anonymous)
    assert final.read_bytes() == NEW
    assert os.listdir(tmp_path) == ["chunk.kvc"]
    assert ops.calls == REPLACE_CALLS[anonymous]


@needs_anonymous
def test_an_anonymous_publish_names_its_file_once(tmp_path: Path) -> None:
    final = tmp_path / "chunk.kvc"
    ops = FaultyOps()
    publish_bytes(final, [NEW], ops=ops)
    assert final.read_bytes() == NEW
    assert os.listdir(tmp_path) == ["chunk.kvc"]
    assert ops.calls == ["open", "fsync", "link", "close", "fsync_dir"]


@pytest.mark.parametrize("anonymous", MECHANISMS)
def test_without_sync_nothing_is_fsynced_and_the_publish_is_still_atomic(
    anonymous: bool, tmp_path: Path
) -> None:
    final = tmp_path / "ab" / "cd" / "chunk.kvc"
    ops = FaultyOps()
    publish(final, write_new, ops=ops, root=tmp_path, sync=False, anonymous=anonymous)
    assert final.read_bytes() == NEW
    assert ops.calls == (["open", "link", "close"] if anonymous else ["open", "close", "replace"])
    ops = FaultyOps("replace")
    with pytest.raises(InjectedFault):
        publish(final, lambda fd, _p: write_all(fd, [OLD]), ops=ops, sync=False,
                anonymous=anonymous)
    assert final.read_bytes() == NEW
    assert temps_in(final.parent) == []


class RefusingOps(FaultyOps):
    """A filesystem without anonymous files: ``open_anonymous`` fails with ``error``."""

    def __init__(self, error: int) -> None:
        super().__init__()
        self.error = error

    def open_anonymous(self, directory: Path, mode: int, extra_flags: int) -> int:
        self.calls.append("open_anonymous")
        raise OSError(self.error, os.strerror(self.error))


@pytest.mark.parametrize("error", [errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL])
def test_a_filesystem_refusing_anonymous_files_gets_named_temps_and_is_asked_once(
    error: int, tmp_path: Path
) -> None:
    known = KnownDirs()
    ops = RefusingOps(error)
    publish(tmp_path / "one.kvc", write_new, ops=ops, known=known, sync=False)
    assert ops.calls == ["open_anonymous", "open", "close", "replace"]
    assert not known.anonymous
    ops.calls.clear()
    publish(tmp_path / "two.kvc", write_new, ops=ops, known=known, sync=False)
    assert ops.calls == ["open", "close", "replace"]
    assert (tmp_path / "one.kvc").read_bytes() == (tmp_path / "two.kvc").read_bytes() == NEW
    assert temps_in(tmp_path) == []


def test_other_errors_of_an_anonymous_open_propagate(tmp_path: Path) -> None:
    known = KnownDirs()
    with pytest.raises(OSError) as caught:
        publish(tmp_path / "one.kvc", write_new, ops=RefusingOps(errno.EIO), known=known)
    assert caught.value.errno == errno.EIO
    assert known.anonymous
    assert os.listdir(tmp_path) == []


def test_without_o_tmpfile_or_proc_named_temps_are_used(tmp_path: Path) -> None:
    class Without(FaultyOps):
        def has_anonymous(self) -> bool:
            return False

    ops = Without()
    publish(tmp_path / "one.kvc", write_new, ops=ops, sync=False)
    assert ops.calls == ["open", "close", "replace"]
    assert (tmp_path / "one.kvc").read_bytes() == NEW


class CountingLstat:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[Path] = []
        real = os.lstat

        def lstat(path: os.PathLike[str]) -> os.stat_result:
            self.paths.append(Path(path))
            return real(path)

        monkeypatch.setattr(publish_module.os, "lstat", lstat)


def test_known_dirs_are_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    known = KnownDirs()
    counter = CountingLstat(monkeypatch)
    publish(tmp_path / "ab" / "cd" / "one.kvc", write_new, root=tmp_path, known=known)
    assert counter.paths, "the first publish checks the path from the root"
    assert tmp_path / "ab" / "cd" in known and tmp_path / "ab" in known
    counter.paths.clear()
    publish(tmp_path / "ab" / "cd" / "two.kvc", write_new, root=tmp_path, known=known)
    publish(tmp_path / "ab" / "ef" / "three.kvc", write_new, root=tmp_path, known=known)
    assert set(counter.paths) == {tmp_path / "ab" / "ef"}  # missing, then made


def test_a_known_dir_removed_behind_the_cache_is_made_again(tmp_path: Path) -> None:
    known = KnownDirs()
    publish(tmp_path / "ns" / "ab" / "one.kvc", write_new, root=tmp_path, known=known)
    shutil.rmtree(tmp_path / "ns")
    final = tmp_path / "ns" / "ab" / "two.kvc"
    publish(final, write_new, root=tmp_path, known=known)
    assert final.read_bytes() == NEW


def test_a_link_is_refused_even_after_other_dirs_were_cached(tmp_path: Path) -> None:
    known = KnownDirs()
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    publish(root / "ab" / "one.kvc", write_new, root=root, known=known)
    (root / "cd").symlink_to(outside)
    with pytest.raises(SymlinkEscapeError):
        publish(root / "cd" / "two.kvc", write_new, root=root, known=known)
    assert list(outside.iterdir()) == []


# --- no-clobber -------------------------------------------------------------------------


@pytest.mark.parametrize("anonymous", MECHANISMS)
def test_no_clobber_publishes_a_new_file(anonymous: bool, tmp_path: Path) -> None:
    final = tmp_path / "sub" / "manifest.json"
    ops = FaultyOps()
    publish_bytes(final, [NEW], replace=False, ops=ops, anonymous=anonymous)
    assert final.read_bytes() == NEW
    assert temps_in(final.parent) == []
    expected = ["link", "close", "fsync_dir"] if anonymous else ["close", "link", "unlink",
                                                                 "fsync_dir"]
    assert ops.calls[-len(expected):] == expected


@pytest.mark.parametrize("anonymous", MECHANISMS)
def test_no_clobber_keeps_the_existing_file(anonymous: bool, tmp_path: Path) -> None:
    final = tmp_path / "manifest.json"
    final.write_bytes(OLD)
    with pytest.raises(FileExistsError):
        publish_bytes(final, [NEW], replace=False, anonymous=anonymous)
    assert final.read_bytes() == OLD
    assert os.listdir(tmp_path) == ["manifest.json"]


# --- short writes -----------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 7, 4096])
def test_short_writes_are_retried(
    limit: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pwritev = os.pwritev
    calls: list[int] = []

    def short_pwritev(fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Writes at most ``limit`` bytes, as a signal or a full disk may cause."""
        budget, clipped = limit, []
        for buf in buffers:
            if budget == 0:
                break
            clipped.append(buf[:budget])
            budget -= len(clipped[-1])
        calls.append(offset)
        return real_pwritev(fd, clipped, offset)

    monkeypatch.setattr(publish_module.os, "pwritev", short_pwritev)
    parts: list[bytes | bytearray | memoryview] = [
        b"head", b"", bytearray(NEW[:1000]), memoryview(NEW)[1000:], b"z"
    ]
    final = tmp_path / "chunk.kvc"
    publish_bytes(final, parts)
    expected = b"head" + NEW + b"z"
    assert final.read_bytes() == expected
    assert len(calls) == -(-len(expected) // limit)


def test_write_all_at_an_offset_returns_the_byte_count(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x" * 10)
        assert write_all(fd, [b"abc", b"def"], offset=4) == 6
    finally:
        os.close(fd)
    assert path.read_bytes() == b"xxxxabcdef"


def test_a_write_that_makes_no_progress_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publish_module.os, "pwritev", lambda fd, buffers, offset: 0)
    final = tmp_path / "chunk.kvc"
    with pytest.raises(OSError, match="pwritev wrote 0 bytes"):
        publish_bytes(final, [NEW])
    assert not final.exists()
    assert temps_in(tmp_path) == []


# --- modes ------------------------------------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_default_modes_are_private(tmp_path: Path, umask_022: None) -> None:
    final = tmp_path / "a" / "b" / "chunk.kvc"
    publish_bytes(final, [NEW])
    assert mode_of(final) == 0o600
    assert mode_of(tmp_path / "a") == 0o700
    assert mode_of(tmp_path / "a" / "b") == 0o700


def test_configured_modes_are_honoured(tmp_path: Path, umask_022: None) -> None:
    final = tmp_path / "a" / "b" / "chunk.kvc"
    publish_bytes(final, [NEW], file_mode=0o644, dir_mode=0o755)
    assert mode_of(final) == 0o644
    assert mode_of(tmp_path / "a") == 0o755
    assert mode_of(tmp_path / "a" / "b") == 0o755


# --- stale temp cleanup -----------------------------------------------------------------


def make_temp(final: Path, *, age_s: float = 0.0) -> Path:
    temp = temp_path_for(final)
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"partial")
    if age_s:
        then = time.time() - age_s
        os.utime(temp, (then, then))
    return temp


def test_cleanup_removes_only_temp_names(tmp_path: Path) -> None:
    keep = [
        tmp_path / "manifest.json",
        tmp_path / "ns" / "00" / "01" / "0001_g0.kvc",
        tmp_path / "ns" / ".hidden",
        tmp_path / "ns" / f"visible{TEMP_SUFFIX}",
        tmp_path / "ns" / ".almost.kvtmp.bak",
    ]
    for path in keep:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"keep")
    temps = [make_temp(keep[0]), make_temp(keep[1]), make_temp(keep[1]), make_temp(keep[2])]
    assert all(is_temp_name(t.name) for t in temps)

    assert remove_stale_temps(tmp_path) == len(temps)
    assert not any(t.exists() for t in temps)
    assert all(path.read_bytes() == b"keep" for path in keep)


def test_cleanup_respects_older_than(tmp_path: Path) -> None:
    final = tmp_path / "00" / "01" / "0001_g0.kvc"
    old = [make_temp(final, age_s=3600), make_temp(final, age_s=120)]
    fresh = [make_temp(final), make_temp(final, age_s=30)]
    assert remove_stale_temps(tmp_path, older_than_s=60) == len(old)
    assert not any(t.exists() for t in old)
    assert all(t.exists() for t in fresh)
    assert remove_stale_temps(tmp_path) == len(fresh)


def test_cleanup_of_a_missing_root(tmp_path: Path) -> None:
    assert remove_stale_temps(tmp_path / "absent") == 0
