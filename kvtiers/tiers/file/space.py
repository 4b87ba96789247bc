"""Whether the file tier's filesystem takes new chunks: read-only roots and full disks.

One :class:`SpaceLatch` per file tier, shared by its factory, manager and mover:

- a root on a read-only filesystem is found once at start (:func:`filesystem_read_only`,
  from ``statvfs``): the latch is read-only for good, the factory turns the tier's
  admission off and logs one warning, loads keep working;
- a store that fails because the filesystem is full (``ENOSPC``, ``EDQUOT``) or turned
  read-only (``EROFS``) makes the mover call :meth:`SpaceLatch.mark_full`: one warning
  starts the episode, later failures are only counted, and :meth:`SpaceLatch.admits`
  answers False for ``retry_s`` so the manager refuses stores instead of failing one
  cascade per chunk. After ``retry_s`` one store is let through to try; the first store
  that succeeds ends the episode with one line saying how many chunks were refused. The
  manager may make room first: at the start of an episode it evicts least recently used
  chunks and, once their files are gone, calls :meth:`SpaceLatch.retry_now` so a store
  tries again at once (``episodes`` tells it a new episode began).

Thread-safe: the mover marks from I/O threads, the manager asks on the scheduler thread.
:meth:`SpaceLatch.admits` reads the clock and two fields, never the filesystem.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

logger = logging.getLogger(__name__)

#: Store errors that mean "this filesystem takes no more bytes for now".
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
#: How long admission stays off after a full-disk failure before one store tries again.
FULL_RETRY_S = 5.0


def filesystem_read_only(directory: Path) -> bool:
    """Whether ``directory`` is on a filesystem mounted read-only."""
    return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)


def is_no_space(exc: BaseException) -> TypeGuard[OSError]:
    """Whether a failed store says the filesystem takes no more bytes."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


class SpaceLatch:
    """See the module docstring. ``where`` names the tier's directory in log lines."""

    def __init__(
        self,
        where: str,
        *,
        retry_s: float = FULL_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.where = where
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self.read_only = False
        self._full = False
        self._retry_at = 0.0
        self._episode = 0
        #: Full-disk episodes begun over the tier's life.
        self.episodes = 0
        #: Whether the current episode began for want of room (``ENOSPC``, ``EDQUOT``;
        #: not ``EROFS``), so that evicting chunks may help.
        self.wants_room = False
        #: Chunks whose store failed for want of space, over the tier's life.
        self.refused_chunks = 0

    def admits(self) -> bool:
        """Whether a store may be tried now (the manager's one question)."""
        return not self.read_only and (not self._full or self._clock() >= self._retry_at)

    @property
    def full(self) -> bool:
        """Whether a full-disk episode is under way."""
        return self._full

    def mark_read_only(self) -> None:
        """The root is on a read-only filesystem: admission off for the tier's life."""
        self.read_only = True
        logger.warning(
            "file tier at %s: the filesystem is read-only; chunks already there are served "
            "but none are stored (admission off)", self.where,
        )

    def mark_full(self, exc: OSError) -> None:
        """A store failed with ``exc`` (see :data:`NO_SPACE_ERRNOS`): pause admission for
        ``retry_s``; only the first failure of an episode is logged."""
        with self._lock:
            self.refused_chunks += 1
            self._retry_at = self._clock() + self.retry_s
            if self._full:
                self._episode += 1
                return
            self._full = True
            self._episode = 1
            self.episodes += 1
            self.wants_room = exc.errno != errno.EROFS
        logger.warning(
            "file tier at %s: %s; no chunks are stored until space returns (tried again "
            "every %g s; further failures are counted, not logged)",
            self.where, exc.strerror or exc, self.retry_s,
        )

    def retry_now(self) -> None:
        """Room was made (chunks evicted): let one store try at once."""
        with self._lock:
            self._retry_at = self._clock()

    def mark_ok(self) -> None:
        """A store succeeded: a full-disk episode, if any, is over."""
        if not self._full:
            return
        with self._lock:
            if not self._full:
                return
            self._full = False
            refused = self._episode
        logger.warning("file tier at %s: storing again; %d chunk(s) were not stored while "
                       "the filesystem was full", self.where, refused)
