"""The file tier's index snapshot: a restart that reads one file instead of walking.

Two files in the namespace directory (neither is a chunk; scans and tools pass them by):

- ``index.generation``: every file tier that opens the namespace appends one byte, so
  its size counts the openings. A tier's *generation* is the size it saw before its
  own byte.
- ``index.snapshot``: written atomically (a temp file renamed over) at a clean shutdown,
  only when the tier's index is complete and no other tier opened the namespace since
  this one did (the generation file is one byte past this tier's generation). It holds
  the namespace digest, the generation of the next opening it is good for, the ``READY``
  chunks least recently used first (keys, sizes), and an xxh3-128 checksum of all that.

It also holds a *directory stamp*: a digest of the name and modification time of every
fan-out directory (one and two levels below the namespace directory; not the namespace
directory itself, which the snapshot's own publish touches). Creating, removing or
renaming an entry changes its directory's modification time, so a chunk added, removed or
replaced (or a temp file left beside chunks) behind the tier's back changes the stamp;
computing it lists 257 directories and takes one ``stat`` a directory (65,792 at most),
not one a chunk.

A snapshot is trusted only when its digest is the namespace's, its generation is the one
the opening tier sees before its own byte (no tier has opened the namespace since the
snapshot was written), its directory stamp is the namespace's now, and its checksum
holds; otherwise it is ignored and the tier walks. Only a tier that is its namespace's
one writer (not ``shared``) writes or reads snapshots. Temp files of interrupted
publishes are removed by walks only: after a clean shutdown none of this tier's are left
(its publishes ended), and the walk of the last start removed older ones. A change within
the filesystem's timestamp tick after the stamp was taken at shutdown could go unseen
(the tier's own writes have ended by then). Chunks removed behind the tier's back by
something that keeps directory times (none of kvtiers' tools) are reported vanished by
their first load and dropped, as after a walk.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from kvtiers.core.publish import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, publish_bytes
from kvtiers.filemapper import QUARANTINE_DIR
from kvtiers.filemapper.mapper import GENERATION_NAME, SNAPSHOT_NAME
from kvtiers.tiers.compact import PackedChunks, key_list

logger = logging.getLogger(__name__)

_MAGIC = b"KVTIDX01"
# magic, digest length, digest (up to 64 bytes), directory stamp, generation, chunk
# count, key width.
_HEADER = struct.Struct("<8sB64s16sQQH")
_CHECKSUM_BYTES = 16


def open_generation(namespace_dir: Path) -> tuple[int, float] | None:
    """Count this opening in ``index.generation``: the generation before it, and the
    file's modification time after it (the filesystem's clock: a file this process makes
    from now on is not older). ``None`` when the file cannot be written (a read-only root:
    no snapshot is trusted or written)."""
    try:
        fd = os.open(namespace_dir / GENERATION_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                     DEFAULT_FILE_MODE)
    except OSError:
        return None
    try:
        os.write(fd, b".")
        st = os.fstat(fd)
        return st.st_size - 1, st.st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)


def current_generation(namespace_dir: Path) -> int | None:
    """How many openings ``index.generation`` counts; ``None`` when it cannot be read."""
    try:
        return os.stat(namespace_dir / GENERATION_NAME).st_size
    except OSError:
        return None


def directory_stamp(namespace_dir: Path) -> bytes:
    """The digest of the name and modification time of every directory one and two levels
    below ``namespace_dir`` (the fan-out directories; the quarantine and links left out),
    in name order. Only the namespace directory and the first level are listed: a chunk
    lives in a second-level directory, whose own time changes with its entries. Each
    second-level directory costs one ``lstat`` relative to its parent's descriptor."""
    stamp = xxhash.xxh3_128()
    for name in _subdirectories(str(namespace_dir), stamp, ""):
        if name != QUARANTINE_DIR:
            _subdirectories(os.path.join(namespace_dir, name), stamp, f"{name}/")
    return stamp.digest()


def _subdirectories(path: str, stamp: xxhash.xxh3_128, relative: str) -> list[str]:
    """The names of the directories in ``path``, in order, each name and time fed to
    ``stamp``."""
    try:
        # Links followed as scandir(path) does: a namespace directory may be one.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        stamp.update(f"{relative}?\n".encode())
        return []
    try:
        try:
            with os.scandir(fd) as it:
                names = sorted(entry.name for entry in it if entry.is_dir(follow_symlinks=False))
        except OSError:
            stamp.update(f"{relative}?\n".encode())
            return []
        lines = []
        for name in names:
            try:
                mtime = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime_ns
            except OSError:
                mtime = -1
            lines.append(f"{relative}{name}\0{mtime}\n")
        stamp.update("".join(lines).encode())
        return names
    finally:
        os.close(fd)


def write_snapshot(
    namespace_dir: Path,
    digest: bytes,
    generation: int,
    width: int,
    key_bytes: bytes,
    lengths: bytes,
    sizes: bytes,
    count: int,
    *,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
    root: Path | None = None,
) -> None:
    """Publish the snapshot of ``count`` chunks (``key_bytes``: each key padded to
    ``width``; ``lengths``: uint16 each; ``sizes``: int64 each), good for the opening at
    ``generation``. Raises ``OSError`` when it cannot be written."""
    header = _HEADER.pack(
        _MAGIC, len(digest), digest, directory_stamp(namespace_dir), generation, count, width
    )
    checksum = xxhash.xxh3_128()
    for part in (header, lengths, sizes, key_bytes):
        checksum.update(part)
    publish_bytes(
        namespace_dir / SNAPSHOT_NAME, [header, lengths, sizes, key_bytes, checksum.digest()],
        file_mode=file_mode, dir_mode=dir_mode, root=root,
    )


def read_snapshot(namespace_dir: Path, digest: bytes, generation: int) -> PackedChunks | None:
    """The chunks of a trusted snapshot, least recently used first, packed; or ``None``
    — absent, or ignored for the reason logged (another namespace's, stale, damaged)."""
    path = namespace_dir / SNAPSHOT_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("file tier %s: index snapshot unreadable (%s); walking", namespace_dir,
                       exc)
        return None
    why = _check(data, digest, generation)
    if why is not None:
        logger.info("file tier %s: index snapshot ignored (%s); walking", namespace_dir, why)
        return None
    # The directory stamp (a stat a directory, outside the interpreter lock) is taken on
    # a thread of its own while the chunks are unpacked here; they are used only if it
    # matches.
    with ThreadPoolExecutor(1, thread_name_prefix="kvtiers-file-stamp") as pool:
        stamp = pool.submit(directory_stamp, namespace_dir)
        packed = _unpack(data)
        now = stamp.result()
    if now != _HEADER.unpack_from(data)[3]:
        logger.info("file tier %s: index snapshot ignored (a fan-out directory changed "
                    "since it was written); walking", namespace_dir)
        return None
    return packed


def _unpack(data: bytes) -> PackedChunks:
    """The chunks of a checked snapshot ``data``."""
    _, _, _, _, _, count, width = _HEADER.unpack_from(data)
    at = _HEADER.size
    view = memoryview(data)  # slices of it are not copies
    lengths = array("H")
    lengths.frombytes(view[at:at + 2 * count])
    at += 2 * count
    sizes = array("q")
    sizes.frombytes(view[at:at + 8 * count])
    at += 8 * count
    key_bytes = bytearray(view[at:at + count * width])
    keys = key_list(key_bytes, np.frombuffer(lengths, dtype=np.uint16), width)
    return PackedChunks.from_arrays(width, key_bytes, lengths, sizes, keys)


def _check(data: bytes, digest: bytes, generation: int) -> str | None:
    """Why ``data`` is not a snapshot to trust, or ``None``."""
    if len(data) < _HEADER.size + _CHECKSUM_BYTES:
        return "truncated"
    magic, digest_len, stored_digest, _, stored_generation, count, width = (
        _HEADER.unpack_from(data)
    )
    if magic != _MAGIC:
        return "not a snapshot of this format"
    if stored_digest[:digest_len] != digest:
        return "written for another namespace"
    if stored_generation != generation:
        return (f"the namespace was opened since it was written (generation "
                f"{stored_generation}, now {generation})")
    if len(data) != _HEADER.size + count * (2 + 8 + width) + _CHECKSUM_BYTES:
        return "truncated or padded"
    # One pass (xxh3: milliseconds for 100 MB, so the lock is not held long). Hashed in
    # slices instead, the process kept 13 B a chunk more after a 1M build (measured; the
    # C allocator's doing, not understood further).
    if xxhash.xxh3_128_digest(data[:-_CHECKSUM_BYTES]) != data[-_CHECKSUM_BYTES:]:
        return "checksum mismatch"
    return None
