"""The tier driver: stores and loads through a built lower tier the way the composite does.

:class:`TierDriver` runs a :class:`~kvtiers.core.tier.BuiltTier`'s manager and mover through
the one job driver (:class:`~kvtiers.tiers.jobs.JobDriver`) over a bytearray region the
caller owns, one job at a time, and waits for each. Tests and benchmarks of a single tier
use it; nothing in it reaches into a tier.
"""

from __future__ import annotations

from typing import Generic

from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import ReqContext
from kvtiers.core.mover import Mover, MoverResult
from kvtiers.core.tier import BuiltTier, M
from kvtiers.errors import UnknownKeyError
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold


class TierDriver(Generic[M]):
    """Drives a built lower tier over a bytearray region the test owns: ``store`` fills
    slots and copies them down, ``load`` copies them back. ``manager`` is the built
    tier's own manager (typed as the tier built it). The driver starts once the tier has
    indexed what its medium held (``wait_index``), so a reopened tier answers at once;
    ``wait_index=False`` drives it while its index is being built."""

    def __init__(
        self, built: BuiltTier[M], region: BytearrayRegion, geometry: ChunkGeometry,
        *, wait_index: bool = True,
    ) -> None:
        if built.mover is None:
            raise ValueError(
                f"tier {built.name!r} has no mover: the tier driver drives lower tiers only"
            )
        self.built = built
        self.manager: M = built.manager
        self.mover: Mover = built.mover
        self.region = region
        self.geometry = geometry
        self.ctx = ReqContext("driver")
        self._finished: list[FinishedJob[None]] = []
        self.jobs: JobDriver[None] = JobDriver(
            self.manager, self.mover, self._finished.append, ctx=self.ctx
        )
        self._job = 0
        if wait_index:
            self.manager.wait_index()

    def _result(self, copied: list[OffloadKey] | None) -> MoverResult:
        """The mover's result of the job just started (an empty one when nothing was
        copied)."""
        assert copied is not None, "the tier refused the store"
        if not copied:
            return MoverResult(self._job, succeeded_keys=())
        self.jobs.drain()
        (job,) = self._finished
        self._finished.clear()
        return job.result

    def store(self, payloads: dict[OffloadKey, bytes]) -> MoverResult:
        """Write each payload into a slot and copy the keys the tier accepts; the result."""
        self._job += 1
        slots = {}
        for slot, (key, payload) in enumerate(payloads.items()):
            self.region.view(slot)[: len(payload)] = payload
            slots[key] = slot
        return self._result(
            self.jobs.store(self._job, list(payloads), self.ctx, None, slots=slots)
        )

    def load(self, keys: list[OffloadKey]) -> tuple[MoverResult, dict[OffloadKey, bytes]]:
        """Copy ``keys`` into slots; the result and the bytes of each succeeded key. Raises
        :class:`~kvtiers.errors.UnknownKeyError` when the tier does not hold one of them."""
        self._job += 1
        self.region.buffer[:] = bytes(len(self.region.buffer))
        for slot, key in enumerate(keys):
            if self.jobs.hold_for_load(key, self.ctx, slot=slot) is not LoadHold.HELD:
                # Give back the keys already held before failing.
                self.jobs.load_held(self._job, None)
                self.jobs.drain()
                self._finished.clear()
                raise UnknownKeyError(f"load: {key.hex()} is not a HIT of this tier")
        result = self._result(self.jobs.load_held(self._job, None))
        data = {
            key: bytes(self.region.view(slot)[: self.geometry.key_chunk_bytes(key)])
            for slot, key in enumerate(keys)
            if key in result.succeeded_keys
        }
        return result, data
