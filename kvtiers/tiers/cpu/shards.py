"""Which ranks wrote a CPU slot's chunk: the shard ledger of a primary that several ranks
of one engine (tensor / pipeline parallel, one node) fill together.

Each rank's worker copies its own pages into the same slots
(:class:`~kvtiers.tiers.cpu.worker.CpuWorker` with ``shard``), so a chunk is whole only
when every rank wrote its part *for the same store*. The ledger is a ``num_slots x
ranks`` table of 64-bit stamps in shared memory, beside the region:

* the scheduler gives every store job a stamp that never repeats while the ledger lives
  (:meth:`ShardLedger.next_stamp`);
* a rank whose copy of the job completed writes the job's stamp into its own column for
  every slot of the job (:meth:`ShardLedger.stamp`); a rank whose copy failed writes
  nothing;
* once every rank reported the job (the engine counts the reports) the scheduler keeps
  a slot's chunk only if every column holds the job's stamp (:meth:`ShardLedger.whole`).
  A rank that failed, never ran, or last wrote the slot for an older job leaves another
  value there: the chunk has a shard missing or stale and is refused.

Invariants: a stamp is written only after the copy it vouches for completed; stamps are
never 0 (a fresh ledger is all zeros, "never written"); a column is written by its rank
only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtiers.core.geometry import round_up
from kvtiers.tiers.cpu.region import SHM_DIR, SlotRegion

_STAMP_BYTES = 8


def ledger_name(region_name: str) -> str:
    """The ``/dev/shm`` name of the ledger beside the region named ``region_name``."""
    return f"{region_name}-shards"


class ShardLedger:
    """Stamps of ``ranks`` ranks over ``num_slots`` slots, in shared memory named
    ``shared_memory_name`` (made by whichever process comes first, with the region's
    rules: private to this user, removed by the last process to close it)."""

    def __init__(
        self,
        num_slots: int,
        ranks: int,
        shared_memory_name: str,
        *,
        shm_dir: Path = SHM_DIR,
    ) -> None:
        if num_slots <= 0 or ranks <= 0:
            raise ValueError(f"a shard ledger needs slots and ranks, got {num_slots} x {ranks}")
        self.num_slots = num_slots
        self.ranks = ranks
        nbytes = round_up(num_slots * ranks * _STAMP_BYTES)
        self._region = SlotRegion(1, nbytes, shared_memory_name, shm_dir=shm_dir)
        self._table: npt.NDArray[np.uint64] | None = np.frombuffer(
            self._region.view(0), dtype=np.uint64, count=num_slots * ranks
        ).reshape(num_slots, ranks)
        # Past every stamp already there: a scheduler attaching to a ledger its ranks made
        # (or still use) never hands out a stamp a slot already holds.
        self._last_stamp = int(self._table.max(initial=0))

    def _rows(self) -> npt.NDArray[np.uint64]:
        if self._table is None:
            raise ValueError("the shard ledger is closed")
        return self._table

    def next_stamp(self) -> int:
        """A stamp no earlier call of this ledger's scheduler returned (never 0)."""
        self._last_stamp += 1
        return self._last_stamp

    def stamp(self, rank: int, slots: Sequence[int] | npt.NDArray[np.int64], stamp: int) -> None:
        """Rank ``rank`` completed its copy of the job ``stamp`` into ``slots``."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is outside [0, {self.ranks})")
        if stamp <= 0:
            raise ValueError(f"stamps are positive, got {stamp}")
        self._rows()[np.asarray(slots, dtype=np.int64), rank] = stamp

    def whole(
        self, slots: Sequence[int] | npt.NDArray[np.int64], stamps: int | Sequence[int]
    ) -> npt.NDArray[np.bool_]:
        """For each of ``slots``: whether every rank stamped it with its stamp
        (``stamps``: one for all slots, or one per slot)."""
        rows = self._rows()[np.asarray(slots, dtype=np.int64)]
        wanted = np.asarray(stamps, dtype=np.uint64).reshape(-1, 1)
        return np.asarray((rows == wanted).all(axis=1), dtype=np.bool_)

    def close(self) -> None:
        """Unmap the ledger (removed with the last process out). Idempotent."""
        self._table = None
        self._region.close()
