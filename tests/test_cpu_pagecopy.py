"""The fused page-copy kernel on its own: byte-exact copies of pages of mixed sizes between
scattered addresses, on one and several threads, plus its build cache and argument checks.

Expected contents come from numpy slicing of the same buffers, never from the kernel.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvtiers.tiers.cpu.pagecopy import PageCopier, compiler, library_path, load_page_copier

pytestmark = pytest.mark.skipif(
    shutil.which(compiler()[0]) is None,
    reason=f"no C compiler ({compiler()[0]}) to build the page-copy kernel",
)


@pytest.fixture(scope="module")
def copier(tmp_path_factory: pytest.TempPathFactory) -> PageCopier:
    built = load_page_copier(tmp_path_factory.mktemp("kernels"))
    assert built is not None
    return built


def addresses(buffer: np.ndarray, offsets: list[int]) -> np.ndarray:
    return np.asarray(offsets, dtype=np.int64) + buffer.ctypes.data


@pytest.mark.parametrize("streaming", [False, True], ids=["memcpy", "streaming"])
@pytest.mark.parametrize("threads", [1, 2, 3, 16, 40])
@pytest.mark.parametrize("seed", range(8))
def test_pages_of_mixed_sizes_land_exactly_where_asked(
    copier: PageCopier, seed: int, threads: int, streaming: bool
) -> None:
    """Sizes and offsets are unaligned, so streaming copies exercise their unaligned head
    and tail as well as the 64-byte body."""
    rng = random.Random(seed)
    sizes = [
        rng.choice((1, 7, 15, 16, 64, 79, 100, 4096, 70_001)) for _ in range(rng.randint(1, 40))
    ]
    # Disjoint ranges in both buffers, in a random order on each side.
    src_offsets, dst_offsets, position = [], [], 0
    for size in sizes:
        src_offsets.append(position)
        position += size + rng.randint(0, 9)
    source = np.random.default_rng(seed).integers(0, 256, position, dtype=np.uint8)
    order = rng.sample(range(len(sizes)), len(sizes))
    dst_place, position = {}, 0
    for i in order:
        dst_place[i] = position
        position += sizes[i] + rng.randint(0, 9)
    dst_offsets = [dst_place[i] for i in range(len(sizes))]
    target = np.full(position, 7, dtype=np.uint8)
    expected = target.copy()
    for s, d, n in zip(src_offsets, dst_offsets, sizes, strict=True):
        expected[d : d + n] = source[s : s + n]

    used = copier.copy(
        addresses(target, dst_offsets),
        addresses(source, src_offsets),
        np.asarray(sizes, dtype=np.int64),
        threads,
        streaming=streaming,
    )
    np.testing.assert_array_equal(target, expected)
    assert 1 <= used <= min(threads, len(sizes))
    if threads == 1:
        assert used == 1


def test_several_threads_are_used_for_a_large_copy(copier: PageCopier) -> None:
    source = np.arange(1 << 20, dtype=np.uint8)
    target = np.zeros_like(source)
    offsets = list(range(0, 1 << 20, 1 << 16))
    sizes = np.full(len(offsets), 1 << 16, dtype=np.int64)
    reversed_offsets = offsets[::-1]
    used = copier.copy(
        addresses(target, reversed_offsets), addresses(source, offsets), sizes, threads=4
    )
    assert used == 4
    np.testing.assert_array_equal(
        target.reshape(16, -1), source.reshape(16, -1)[::-1]
    )


def test_no_pages_copy_nothing(copier: PageCopier) -> None:
    empty = np.zeros(0, dtype=np.int64)
    assert copier.copy(empty, empty, empty, threads=2) == 0


def test_bad_arguments_are_rejected(copier: PageCopier) -> None:
    one, two = np.zeros(1, dtype=np.int64), np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="one length"):
        copier.copy(one, two, two)
    with pytest.raises(ValueError, match="at least one thread"):
        copier.copy(one, one, one, threads=0)


def test_a_build_is_reused_and_named_by_its_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_page_copier(tmp_path)
    assert first is not None
    built = library_path(tmp_path)
    assert built.exists() and [p.name for p in tmp_path.iterdir()] == [built.name]
    assert load_page_copier(tmp_path) is first
    monkeypatch.setenv("CC", f"{compiler()[0]} -DKVTIERS_OTHER_FLAGS")
    assert library_path(tmp_path) != built


def test_a_failed_build_returns_none_and_leaves_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "false")
    assert load_page_copier(tmp_path) is None
    assert "could not be built" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_the_compiler_python_was_built_with_is_used_only_when_present(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sysconfig

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "no-such-cc-here -pthread")
    assert compiler() == ["cc"]
    present = shutil.which("cc") or shutil.which("gcc")
    assert present is not None
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: f"{present} -pthread")
    assert compiler() == [present, "-pthread"]
    monkeypatch.setenv("CC", "clang -O1")
    assert compiler() == ["clang", "-O1"]
