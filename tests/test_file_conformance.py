"""The shared manager conformance suite, run against the file tier with each I/O backend.

Chunks are written and read through the tier's own mover, so the suite also proves the
backend's bytes. The suite shuts down the managers it makes; each manager's mover is shut
down with it (at teardown, or when the manager is reopened). The kvikio run is skipped,
with the probe's reason, where kvikio cannot do I/O (no NVIDIA driver, or kvikio not
installed).
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.manager import OffloadingManager
from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec, LoadStoreSpec
from kvtiers.filemapper import FileMapper
from kvtiers.testing.conformance import TierConformanceTests
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.file.io import IOBackend, KvikioBackend, PosixBackend, kvikio_status
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import BadChunkHandler, FileMover
from tests.test_file_support import IDENTITY, MmapRegion

KVIKIO_UNUSABLE = kvikio_status(Path(tempfile.gettempdir()))


class TestFileTierConformance(TierConformanceTests):
    o_direct: ClassVar[bool] = False

    def make_backend(self) -> IOBackend:
        return PosixBackend(o_direct=self.o_direct)

    @pytest.fixture(autouse=True)
    def _movers(self) -> Iterator[None]:
        self._movers_by_manager: dict[int, tuple[FileMover, BytearrayRegion]] = {}
        self._jobs = itertools.count()
        yield
        for mover, _region in self._movers_by_manager.values():
            mover.shutdown()

    def make_manager(self, capacity_chunks: int) -> OffloadingManager:
        manager = FileTierManager(
            FileMapper(self.tmp_path / "root", IDENTITY),
            self.geometry,
            capacity_bytes=capacity_chunks * (HEADER_BYTES + self.chunk_size),
        )
        region = (MmapRegion if self.o_direct else BytearrayRegion)(1, self.geometry.slot_bytes)
        mover = FileMover(
            region,
            self.geometry,
            IDENTITY.digest,
            self.make_backend(),
            threads=2,
            bad_chunks=BadChunkHandler(manager, manager.quarantine_dir),
        )
        self._movers_by_manager[id(manager)] = (mover, region)
        return manager

    def reopen(self, manager: OffloadingManager) -> OffloadingManager:
        """Shut ``manager`` and its mover down, then open the namespace again: a restart,
        not two live managers over one directory."""
        assert isinstance(manager, FileTierManager) and manager.capacity_bytes is not None
        mover, _region = self._movers_by_manager.pop(id(manager))
        mover.shutdown()
        manager.shutdown()
        return self.make_manager(manager.capacity_bytes // (HEADER_BYTES + self.chunk_size))

    def _copy(self, manager: OffloadingManager, src: LoadStoreSpec, dst: LoadStoreSpec) -> None:
        mover, _region = self._movers_by_manager[id(manager)]
        assert mover.submit(next(self._jobs), src, dst)
        mover.drain()
        (result,) = mover.get_finished()
        assert result.success, result

    @staticmethod
    def _one(spec: LoadStoreSpec, index: int) -> FileLoadStoreSpec:
        assert isinstance(spec, FileLoadStoreSpec)
        return FileLoadStoreSpec([spec.paths[index]], [spec.keys[index]])

    def write_chunk(
        self, manager: OffloadingManager, spec: LoadStoreSpec, index: int, payload: bytes
    ) -> None:
        _mover, region = self._movers_by_manager[id(manager)]
        region.view(0)[: len(payload)] = payload
        self._copy(manager, CPULoadStoreSpec([0]), self._one(spec, index))

    def read_chunk(self, manager: OffloadingManager, spec: LoadStoreSpec, index: int) -> bytes:
        _mover, region = self._movers_by_manager[id(manager)]
        region.view(0)[:] = bytes(region.slot_bytes)
        self._copy(manager, self._one(spec, index), CPULoadStoreSpec([0]))
        return bytes(region.view(0)[: self.chunk_size])


class TestFileTierConformanceODirect(TestFileTierConformance):
    """The same suite with O_DIRECT over page-aligned slots (the CPU tier's mmap)."""

    o_direct = True


@pytest.mark.skipif(KVIKIO_UNUSABLE is not None, reason=f"kvikio unusable: {KVIKIO_UNUSABLE}")
class TestFileTierConformanceKvikio(TestFileTierConformance):
    def make_backend(self) -> IOBackend:
        return KvikioBackend()
