"""Helpers shared by the file tier's test modules (no tests here): a small cache identity,
a manager with a mover over a host region, store/load round trips through them (driven by
the :class:`~kvtiers.tiers.jobs.JobDriver`, as the composite drives its lower tiers)."""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import ReqContext
from kvtiers.core.mover import MoverResult
from kvtiers.errors import UnknownKeyError
from kvtiers.filemapper import FileMapper, NamespaceIdentity
from kvtiers.testing.conformance import conformance_key, conformance_payload
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.file.io import IOBackend, PosixBackend, PublishSettings
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import BadChunkHandler, FileMover
from kvtiers.tiers.jobs import FinishedJob, JobDriver, LoadHold

CTX = ReqContext(req_id="file-tests")
CHUNK = 8192
BLOB = HEADER_BYTES + CHUNK


def offloading_config(**changes: object) -> OffloadingConfig:
    """A one-group config with 8 KiB chunks; keyword arguments replace single fields."""
    group = OffloadingGroupConfig(
        tokens_per_block=int(changes.get("tokens_per_block", 16)),  # type: ignore[call-overload]
        layer_names=tuple(changes.get("layer_names", ("layer.0",))),  # type: ignore[arg-type]
        bytes_per_block=int(changes.get("bytes_per_block", CHUNK)),  # type: ignore[call-overload]
    )
    return OffloadingConfig(
        groups=(group,),
        model=OffloadingModelConfig(
            name=str(changes.get("model", "org/model")),
            revision=str(changes.get("revision", "main")),
            dtype=str(changes.get("dtype", "bfloat16")),
            kv_layout=str(changes.get("kv_layout", "NHD")),
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=int(changes.get("tokens_per_hash", 16)),  # type: ignore[call-overload]
            blocks_per_chunk=1,
            hash_algorithm=str(changes.get("hash_algorithm", "xxh3_128")),
        ),
        engine=str(changes.get("engine", "kvtiers")),
        salt=str(changes.get("salt", "")),
    )


IDENTITY = NamespaceIdentity.from_config(offloading_config())
GEOMETRY = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(CHUNK,))


class MmapRegion(BytearrayRegion):
    """A host region over an anonymous mmap: page-aligned slots, as the CPU tier has."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        super().__init__(0, slot_bytes)
        self._num_slots = num_slots
        self.map = mmap.mmap(-1, num_slots * slot_bytes)

    def view(self, slot_id: int) -> memoryview:
        start = slot_id * self.slot_bytes
        return memoryview(self.map)[start : start + self.slot_bytes]


@dataclass
class Tier:
    """A file tier manager with a mover over a one-slot-per-chunk bytearray region."""

    manager: FileTierManager
    mover: FileMover
    region: BytearrayRegion
    jobs: itertools.count[int] = field(default_factory=itertools.count)

    def close(self) -> None:
        self.mover.shutdown()
        self.manager.shutdown()

    def __post_init__(self) -> None:
        self._finished: list[FinishedJob[None]] = []
        self.driver: JobDriver[None] = JobDriver(
            self.manager, self.mover, self._finished.append, ctx=CTX
        )

    def run(self, src: object, dst: object) -> MoverResult:
        """Submit one job straight to the mover (no manager bookkeeping) and wait for it."""
        job = next(self.jobs)
        assert self.mover.submit(job, src, dst)  # type: ignore[arg-type]
        self.mover.drain()
        (result,) = self.mover.get_finished()
        assert result.job_id == job
        return result

    def _result(self) -> MoverResult:
        """The mover's result of the job just submitted."""
        self.driver.drain()
        (job,) = self._finished
        self._finished.clear()
        return job.result

    def store(self, ids: Iterable[int], *, payload_of: int | None = None) -> list[OffloadKey]:
        """Store chunks ``ids`` (payload of ``payload_of`` if given); returns stored keys."""
        ids = list(ids)
        keys = [conformance_key(i) for i in ids]
        slots: dict[OffloadKey, int] = {}
        for slot, (key, i) in enumerate(zip(keys, ids, strict=True)):
            source = i if payload_of is None else payload_of
            self.region.view(slot)[:CHUNK] = conformance_payload(source, CHUNK)
            slots[key] = slot
        accepted = self.driver.store(next(self.jobs), keys, CTX, None, slots=slots)
        assert accepted is not None
        if not accepted:
            return []
        return list(self._result().succeeded_keys)

    def load(self, i: int) -> tuple[MoverResult, bytes]:
        """Pin, read chunk ``i`` into slot 0, unpin; returns the result and slot bytes.
        Raises :class:`~kvtiers.errors.UnknownKeyError` when the tier does not hold it."""
        key = conformance_key(i)
        if self.driver.hold_for_load(key, CTX, slot=0) is not LoadHold.HELD:
            raise UnknownKeyError(f"chunk {i} is not a HIT of this tier")
        self.region.view(0)[:CHUNK] = bytes(CHUNK)
        self.driver.load_held(next(self.jobs), None)
        return self._result(), bytes(self.region.view(0)[:CHUNK])


def open_tier(
    root: Path,
    *,
    capacity_chunks: int | None = None,
    slots: int = 8,
    identity: NamespaceIdentity = IDENTITY,
    backend: IOBackend | None = None,
    settings: PublishSettings | None = None,
    quarantine: bool = True,
    shared: bool = False,
    aligned: bool = False,
    **manager_args: object,
) -> Tier:
    manager = FileTierManager(
        FileMapper(root, identity),
        GEOMETRY,
        capacity_bytes=None if capacity_chunks is None else capacity_chunks * BLOB,
        shared=shared,
        **manager_args,  # type: ignore[arg-type]
    )
    region = (MmapRegion if aligned else BytearrayRegion)(slots, GEOMETRY.slot_bytes)
    mover = FileMover(
        region,
        GEOMETRY,
        identity.digest,
        backend or PosixBackend(),
        threads=2,
        settings=settings,
        bad_chunks=BadChunkHandler(
            manager, manager.quarantine_dir if quarantine else None
        ),
    )
    return Tier(manager, mover, region)


def chunk_files(namespace_dir: Path) -> list[Path]:
    """Every chunk file under the fan-out directories (not the quarantine)."""
    return sorted(p for p in namespace_dir.glob("??/??/*.kvc"))


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.name.endswith(".kvtmp"))
