"""A fused gather-scatter page copy for the CPU worker: page ``i`` goes from ``src[i]`` to
``dst[i]`` in one pass, with the GIL released, optionally over several threads.

torch has no copy indexed on both sides, so without this kernel a copy between scattered
GPU-side blocks and scattered slots gathers every byte into a staging buffer and scatters
it out again. The kernel is a few lines of C (``pagecopy.c`` beside this module) built
with the system C compiler on first use into a per-user cache directory and loaded with
:mod:`ctypes`, which releases the GIL for the call. No compiler, or a failed build, leaves
:func:`load_page_copier` returning ``None`` (once logged), and the worker keeps its
pure-torch path.

Invariants: the shared library's name carries a digest of the source, the compiler
command and the platform, so a changed kernel is never served from a stale build; a build
is published by an atomic rename, so concurrent processes building at once never load a
partial file. The caller checks bounds: the kernel copies whatever addresses it is given.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("pagecopy.c")
#: Overrides where built kernels are kept (default: ``$XDG_CACHE_HOME/kvtiers/kernels``).
CACHE_ENV = "KVTIERS_KERNEL_DIR"
#: Seconds a build may take before the pure-torch path is used instead.
BUILD_TIMEOUT_S = 120
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")

_lock = threading.Lock()
_loaded: dict[Path, PageCopier | None] = {}


class PageCopier:
    """The loaded kernel. :meth:`copy` moves ``nbytes[i]`` bytes from ``src[i]`` to
    ``dst[i]`` for every ``i``; the arrays are absolute addresses and lengths (int64)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.kvtiers_copy_pages
        function.argtypes = [
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        function.restype = ctypes.c_int
        self._function = function

    def copy(
        self,
        dst: npt.NDArray[np.int64],
        src: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        threads: int = 1,
        *,
        streaming: bool = False,
    ) -> int:
        """Copy every page; return the number of threads that copied. ``streaming``
        writes with non-temporal stores where the CPU has them (for copies far larger than
        the cache: the destination is not read into the cache first). The caller
        guarantees every range is inside memory it owns and no destination overlaps
        another range."""
        if not dst.shape == src.shape == nbytes.shape or dst.ndim != 1:
            raise ValueError(
                f"page copy needs three 1-D arrays of one length, got shapes {dst.shape}, "
                f"{src.shape}, {nbytes.shape}"
            )
        if threads < 1:
            raise ValueError(f"page copy needs at least one thread, got {threads}")
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (dst, src, nbytes)]
        if dst.size == 0:
            return 0
        return int(
            self._function(dst.size, *(a.ctypes.data for a in arrays), threads, int(streaming))
        )


def cache_dir() -> Path:
    """Where built kernels are kept: ``$KVTIERS_KERNEL_DIR``, else the user's cache."""
    if override := os.environ.get(CACHE_ENV):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvtiers" / "kernels"


def compiler() -> list[str]:
    """The C compiler command: ``$CC`` when set; else the one Python was built with, when
    it is on this machine's ``PATH`` (a relocated Python may name its build host's); else
    ``cc``."""
    if command := os.environ.get("CC"):
        return shlex.split(command)
    built_with = shlex.split(str(sysconfig.get_config_var("CC") or ""))
    if built_with and shutil.which(built_with[0]):
        return built_with
    return ["cc"]


def library_path(directory: Path) -> Path:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join((*compiler(), *FLAGS)).encode()):
        digest.update(part)
    digest.update(f"{sys.platform}-{platform.machine()}".encode())
    return directory / f"kvtiers_pagecopy_{digest.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [*compiler(), *FLAGS, str(SOURCE), "-o", temp],
            check=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def load_page_copier(directory: Path | None = None) -> PageCopier | None:
    """The kernel, built into ``directory`` (default :func:`cache_dir`) if it is not there
    yet; ``None`` when it cannot be built or loaded (logged once per directory)."""
    directory = directory or cache_dir()
    with _lock:
        if directory in _loaded:
            return _loaded[directory]
        copier: PageCopier | None = None
        try:
            target = library_path(directory)
            if not target.exists():
                _build(target)
            copier = PageCopier(ctypes.CDLL(str(target)))
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            logger.warning(
                "kvtiers: the CPU page-copy kernel could not be built in %s (%s%s); CPU "
                "copies between scattered blocks and slots take the slower two-pass torch "
                "path. Install a C compiler (or set CC) to enable it.",
                directory,
                exc,
                ": " + detail.decode(errors="replace").strip() if detail else "",
            )
        _loaded[directory] = copier
        return copier
