"""Load back-off: what a lower tier answers for a chunk whose load failed.

A chunk that is indexed but cannot be read (a directory or a symlink loop where its file
should be, no permission, ``EIO``, an S3 server that is down) would otherwise be ``HIT``
on every lookup: each scheduler step would start a promotion that fails, and the request
would wait forever. The mover reports each failed load (``ChunkReporter.load_failed``,
from an I/O thread); the manager hands the reports to its :class:`LoadBackoff` on the
scheduler thread and asks it on every lookup of an indexed key.

Rules (see docs/architecture.md, "Liveness"):

- after its ``n``-th failure in a row a key is a ``MISS`` for ``base_s * 2**(n-1)``
  seconds, at most ``max_s``; then one lookup may try it again;
- a failure is *lasting* when the error says the stored chunk itself is unreadable
  (:func:`lasting_os_error`, or an object store's non-transient error): after
  ``forget_after`` lasting failures in a row the key is forgotten from the index (the
  manager drops it and counts it in ``unreadable_chunks``) and stays a ``MISS`` for
  ``max_s`` (a shared tier's probe would otherwise find it again at once). Other failures (``EIO``,
  ``ESTALE``, timeouts, a server that is down) only back off: when the fault ends, the
  chunk is served again;
- a record is dropped when its chunk is reported gone (vanished or corrupt), and once it
  has been quiet for ``max_s`` after its back-off ended; a new store of the key does not
  end its back-off (an object store keeps an existing object, so the same bytes may
  stay); quiet records are pruned whenever more than ``prune_at`` are held;
- warnings are aggregated: the first failure of an episode is logged with its error, the
  rest are counted and summarised at most once per ``summary_s``.

No threads, no I/O; the clock is injected.
"""

from __future__ import annotations

import errno
import logging
import queue
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtiers.core.keys import OffloadKey

if TYPE_CHECKING:
    from kvtiers.config.tiers import LowerTierConfig

logger = logging.getLogger(__name__)

#: Seconds a key is a miss after its first failed load (doubled per further failure).
DEFAULT_LOAD_BACKOFF_S = 1.0
#: The longest back-off, seconds.
DEFAULT_LOAD_BACKOFF_MAX_S = 60.0
#: Lasting failures in a row after which a key is forgotten from the index.
DEFAULT_FORGET_AFTER = 2
#: At most one summary warning per this many seconds.
SUMMARY_S = 60.0
DEFAULT_PRUNE_AT = 4096

#: ``errno`` values that describe the thing at a chunk's path, not the medium's health.
LASTING_ERRNOS = frozenset({
    errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO,
    errno.ENODEV, errno.ENAMETOOLONG,
})


def lasting_os_error(error: BaseException) -> bool:
    """Whether ``error`` says the chunk's path itself cannot be read (trying again fails
    the same way) rather than that the medium failed this time."""
    return isinstance(error, OSError) and error.errno in LASTING_ERRNOS


@dataclass(frozen=True)
class BackoffSettings:
    """A lower tier's ``load_backoff_s`` and ``load_backoff_max_s``: the first back-off
    of a key whose load failed, and the cap (see the module docstring)."""

    base_s: float = DEFAULT_LOAD_BACKOFF_S
    max_s: float = DEFAULT_LOAD_BACKOFF_MAX_S

    @classmethod
    def from_config(cls, config: LowerTierConfig) -> BackoffSettings:
        """The back-off a lower tier's section asks for."""
        return cls(config.load_backoff_s, config.load_backoff_max_s)


#: The back-off of a tier whose section leaves both keys at their defaults.
DEFAULT_BACKOFF = BackoffSettings()


@dataclass(slots=True)
class _Record:
    failures: int
    lasting: int
    retry_at: float


class LoadBackoff:
    """Failed loads per key; see the module docstring. ``tier`` names the tier in log
    lines. ``failures`` counts every failed load reported, ``forgotten`` the keys given
    up on."""

    def __init__(
        self,
        *,
        tier: str,
        base_s: float = DEFAULT_LOAD_BACKOFF_S,
        max_s: float = DEFAULT_LOAD_BACKOFF_MAX_S,
        forget_after: int = DEFAULT_FORGET_AFTER,
        summary_s: float = SUMMARY_S,
        prune_at: int = DEFAULT_PRUNE_AT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if base_s <= 0 or max_s < base_s:
            raise ValueError(
                f"{tier}: load back-off needs 0 < base_s <= max_s, got base_s={base_s}, "
                f"max_s={max_s}"
            )
        if forget_after < 1:
            raise ValueError(f"{tier}: forget_after must be >= 1, got {forget_after}")
        self.tier = tier
        self.base_s = base_s
        self.max_s = max_s
        self.forget_after = forget_after
        self.summary_s = summary_s
        self.prune_at = prune_at
        self.failures = 0
        self.forgotten = 0
        #: The clock every back-off is read on; tests may replace it.
        self.clock = clock
        self._records: dict[OffloadKey, _Record] = {}
        self._summary_at: float | None = None
        self._unlogged = 0
        self._last = ""

    def __len__(self) -> int:
        return len(self._records)

    def blocked(self, key: OffloadKey) -> bool:
        """Whether ``key`` is backing off now (answer ``MISS``). O(1)."""
        record = self._records.get(key)
        return record is not None and self.clock() < record.retry_at

    def failed(self, key: OffloadKey, where: str, error: BaseException, *, lasting: bool) -> bool:
        """Record a failed load of ``key`` (its chunk at ``where``); True when the key is
        to be forgotten now (it then stays blocked for ``max_s``)."""
        now = self.clock()
        self.failures += 1
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _Record(0, 0, now)
        record.failures += 1
        record.lasting = record.lasting + 1 if lasting else 0
        delay = min(self.max_s, self.base_s * 2 ** min(record.failures - 1, 62))
        forget = record.lasting >= self.forget_after
        if forget:
            delay = self.max_s
            record.lasting = 0
            self.forgotten += 1
        record.retry_at = now + delay
        self._warn(now, where, error, forget, delay)
        if len(self._records) > self.prune_at:
            self._prune(now)
        return forget

    def clear(self, key: OffloadKey) -> None:
        """``key``'s chunk is gone from the medium: forget its failures."""
        self._records.pop(key, None)

    def _prune(self, now: float) -> None:
        quiet = now - self.max_s
        self._records = {k: r for k, r in self._records.items() if r.retry_at > quiet}

    def _warn(
        self, now: float, where: str, error: BaseException, forget: bool, delay: float
    ) -> None:
        what = f"{type(error).__name__}: {error}"
        if self._summary_at is None or now >= self._summary_at + self.summary_s:
            if self._unlogged:
                logger.warning(
                    "%s: %d more chunk load(s) failed in the last %g s (the last: %s)",
                    self.tier, self._unlogged, self.summary_s, self._last,
                )
            self._summary_at = now
            self._unlogged = 0
            logger.warning(
                "%s: loading %s failed (%s); %s (further failures are summarised every %g s)",
                self.tier, where, what,
                "the chunk is unreadable and forgotten" if forget
                else f"it is a miss for {delay:g} s", self.summary_s,
            )
            return
        self._unlogged += 1
        self._last = f"{where}: {what}"


class MoverReports:
    """A persistent tier manager's inbox for what its mover reports from I/O threads:
    chunks found corrupt or gone (:meth:`forget`) and loads that failed
    (:meth:`load_failed`). Both are thread-safe; :meth:`drain`, on the scheduler thread,
    hands failures to ``backoff`` and answers the keys the index must drop."""

    def __init__(self, backoff: LoadBackoff) -> None:
        self.backoff = backoff
        self._forgotten: queue.SimpleQueue[OffloadKey] = queue.SimpleQueue()
        self._failed: queue.SimpleQueue[tuple[OffloadKey, str, BaseException, bool]] = (
            queue.SimpleQueue()
        )

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._forgotten.put(key)

    def load_failed(
        self, key: OffloadKey, where: str, error: BaseException, *, lasting: bool
    ) -> None:
        self._failed.put((key, where, error, lasting))

    def drain(self) -> list[OffloadKey]:
        """Keys to drop from the index: every forgotten one (its back-off record goes
        too), and those whose failures the back-off says to forget."""
        if self._forgotten.empty() and self._failed.empty():
            return []
        dropped = []
        while not self._forgotten.empty():
            key = self._forgotten.get()
            self.backoff.clear(key)
            dropped.append(key)
        while not self._failed.empty():
            key, where, error, lasting = self._failed.get()
            if self.backoff.failed(key, where, error, lasting=lasting):
                dropped.append(key)
        return dropped
