"""One walk over a namespace directory, shared by the file tier's rebuild, temp-file
cleanup and the offline tools.

:func:`scan_namespace` yields every entry below a directory that is not itself a
directory (or is a directory standing under a chunk's name), with its name relative to
that directory. Invariants: it never follows a
symbolic link (a link is yielded as an entry, never descended into), so no walk leaves
the directory; it never descends into the namespace's quarantine; a directory that
vanishes while it is walked is skipped. An entry is a chunk only when both its name and
its place are a chunk's (``<hh>/<hh>/<hash hex>_g<group>.kvc``, see
:mod:`kvtiers.filemapper.mapper`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtiers.core.keys import OffloadKey, get_offload_block_hash
from kvtiers.core.publish import is_temp_name
from kvtiers.filemapper.mapper import QUARANTINE_DIR, key_from_chunk_name


@dataclass(frozen=True)
class ScannedEntry:
    """One entry found by :func:`scan_namespace`."""

    #: ``/``-separated, relative to the scanned directory.
    name: str
    entry: os.DirEntry[str]

    @property
    def is_temp(self) -> bool:
        """Whether this is the temp file of a publish (never read as data)."""
        return is_temp_name(self.entry.name)

    def chunk_key(self) -> OffloadKey | None:
        """The key of the chunk this entry's name and place stand for; ``None`` for
        anything else (a chunk name in the wrong fan-out directory included)."""
        key = key_from_chunk_name(self.entry.name)
        if key is None:
            return None
        hex_hash = get_offload_block_hash(key).hex()
        if self.name != f"{hex_hash[0:2]}/{hex_hash[2:4]}/{self.entry.name}":
            return None
        return key


def scan_namespace(
    directory: Path, *, skip_quarantine: bool = True, prefix: str = ""
) -> Iterator[ScannedEntry]:
    """Every entry below ``directory`` that is not a directory, or is a directory under a
    chunk's name (nothing if ``directory`` does not exist), without following links;
    ``skip_quarantine`` leaves out ``<directory>/quarantine``. ``prefix`` (``"ab/"``) is
    put before every name: a walk of one fan-out directory names entries as a walk of the
    whole namespace would."""
    stack = [(str(directory), prefix)]
    while stack:
        path, relative = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except FileNotFoundError:
            continue
        for entry in entries:
            name = f"{relative}{entry.name}"
            # A directory under a chunk's name is yielded (it stands where a chunk would),
            # never descended into.
            if entry.is_dir(follow_symlinks=False) and key_from_chunk_name(entry.name) is None:
                if not (skip_quarantine and name == QUARANTINE_DIR):
                    stack.append((entry.path, f"{name}/"))
                continue
            yield ScannedEntry(name, entry)


def remove_temp(item: ScannedEntry, cutoff: float | None) -> bool:
    """Unlink a stale temp file (modified before ``cutoff``, seconds since the epoch,
    when given); whether it was removed. One that cannot be removed (gone already, a
    read-only filesystem) stays: a temp name is never read as data."""
    try:
        if cutoff is not None and item.entry.stat(follow_symlinks=False).st_mtime >= cutoff:
            return False
        os.unlink(item.entry.path)
    except OSError:
        return False
    return True


def remove_stale_temps(directory: Path, *, older_than_s: float = 0.0) -> int:
    """Remove the temp files interrupted publishes left anywhere below ``directory``;
    returns how many. On a shared directory pass ``older_than_s`` so another live
    writer's temp files are left alone."""
    cutoff = time.time() - older_than_s if older_than_s > 0 else None
    return sum(
        remove_temp(item, cutoff)
        for item in scan_namespace(directory, skip_quarantine=False)
        if item.is_temp
    )
