"""The chunk index's contract: key → (size, state, pins) in LRU order, its rules, and the
values it answers with (:class:`ChunkState`, :class:`ChunkEntry`, :class:`IndexChange`).

The one implementation is :class:`~kvtiers.tiers.compact.CompactChunkIndex`: a plain
object — no threads, no I/O — that managers hold by composition; the file, object and
in-memory tiers keep all their bookkeeping in one (see docs/architecture.md). Sizes are
in the owner's unit of capacity: bytes for persistent tiers (which reserve a key at the
largest blob size and account rebuilt entries at their real size), 1 per chunk for a tier
that counts chunks.

Invariants, kept in step on every operation so that ``stats`` is O(1):

- ``usage`` is the sum of the entries' sizes and ``ready_count`` the number of ``READY``
  entries; with a ``capacity``, ``reserve`` never takes ``usage`` above it and
  ``add_ready`` evicts back under it;
- entries are in least recently used order: a finished store and a pin move a key to the
  most recent end, ``touch`` moves ``READY`` keys only (a ``WRITING`` key has no
  recency yet);
- a victim is ``READY``, unpinned and not named by the batch that needs the room; every
  victim picker answers the same way (:class:`IndexChange`), and a reservation that cannot
  free enough changes nothing;
- releasing more pins than a key holds raises :class:`~kvtiers.errors.UnknownKeyError`
  and changes nothing;
- a chunk reported bad goes through ``discard``: dropped at once when unpinned, at its
  last unpin otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvtiers.core.keys import OffloadKey


class ChunkState(Enum):
    """Where a key's chunk stands: bytes in flight, or stored."""

    WRITING = 1
    READY = 2


@dataclass(slots=True)
class ChunkEntry:
    """One indexed chunk. ``size`` is in the index's capacity unit."""

    size: int
    state: ChunkState
    pins: int = 0


@dataclass(frozen=True, slots=True)
class IndexChange:
    """What an operation added and what it evicted to make room (oldest first).

    The evicted keys are already gone from the index; the owner deletes their bytes."""

    keys: list[OffloadKey]
    victims: list[OffloadKey] = field(default_factory=list)
