"""Builds the file tier from its YAML config: manager, plus a mover or a GDS worker.

As a lower tier (``primary_region`` given) the tier gets a :class:`FileMover` copying
through the primary's host slots. As the primary (``gds: true``, no ``primary_region``)
it gets no mover and no region; ``make_worker`` builds a :class:`FileWorker` that moves
GPU blocks straight to and from chunk files, and the manager needs no mover because the
worker writes the files between ``prepare_store`` and ``complete_store``.

The namespace is opened (manifest checked or created) before anything else, and the I/O
backend is chosen and probed inside it, once. A root on a read-only filesystem opens
read-only: admission ``never``, one warning, loads served. One
:class:`~kvtiers.tiers.file.space.SpaceLatch` shared by the manager and the mover stops
stores while the disk is full.
"""

from __future__ import annotations

from kvtiers.config.tiers import FileTierConfig
from kvtiers.core.codec import make_codec
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.core.worker import KVCacheTensors, OffloadingWorker
from kvtiers.errors import ConfigError
from kvtiers.filemapper import FileMapper, NamespaceIdentity, open_namespace
from kvtiers.tiers.backoff import BackoffSettings
from kvtiers.tiers.file import space as space_module
from kvtiers.tiers.file.io import PublishSettings, select_backend
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.mover import BadChunkHandler, FileMover
from kvtiers.tiers.file.space import SpaceLatch
from kvtiers.tiers.listing import ListingSettings


def build_tier(
    config: FileTierConfig,
    offloading: OffloadingConfig,
    *,
    primary_region: HostRegion | None,
    name: str,
    staging: bool = False,
) -> BuiltTier:
    """The file tier ``name``: a lower tier when ``primary_region`` is given, else a GDS
    primary (which needs ``gds: true``). A GDS primary has no host memory for lower tiers
    to copy through, so it cannot stage for them (``staging``: see
    :class:`~kvtiers.core.tier.TierFactory`)."""
    if staging:
        raise ConfigError(
            f"tier {name!r}: a gds file tier as the primary has no host memory for lower "
            "tiers to copy through; put a cpu tier first",
            path="kind",
        )
    if primary_region is None and not config.gds:
        raise ConfigError(
            f"tier {name!r}: a file tier can be the first tier of a stack only with "
            "gds: true; put a cpu tier first or set gds: true",
            path="gds",
        )
    identity = NamespaceIdentity.from_config(offloading)
    geometry = ChunkGeometry.from_config(offloading)
    mapper = FileMapper(config.root_path, identity)
    namespace_dir = open_namespace(
        mapper.root, identity, file_mode=config.file_mode, dir_mode=config.dir_mode
    )
    space = SpaceLatch(str(namespace_dir))
    admission = config.admission
    if space_module.filesystem_read_only(namespace_dir):
        space.mark_read_only()
        admission = "never"
    backend = select_backend(config.io, o_direct=config.o_direct, directory=namespace_dir)
    manager = FileTierManager(
        mapper,
        geometry,
        capacity_bytes=config.capacity,
        shared=config.shared,
        file_mode=config.file_mode,
        dir_mode=config.dir_mode,
        io_backend=backend.code,
        io_backend_name=backend.name,
        space=space,
        load_backoff=BackoffSettings.from_config(config),
        capacity_scope=config.capacity_scope,
        listing=ListingSettings.from_config(config),
        background_index=True,
    )
    settings = PublishSettings(
        file_mode=config.file_mode,
        dir_mode=config.dir_mode,
        root=mapper.root,
        durability=config.durability,
    )
    bad_chunks = BadChunkHandler(
        manager, manager.quarantine_dir if config.quarantine else None, config.dir_mode
    )
    if primary_region is not None:
        mover = FileMover(
            primary_region,
            geometry,
            identity.digest,
            backend,
            threads=config.threads,
            settings=settings,
            bad_chunks=bad_chunks,
            space=space,
            codec=make_codec(config.codec, kv_dtype=offloading.model.dtype),
        )
        return BuiltTier(name=name, manager=manager, mover=mover, admission=admission)

    def make_worker(kv: KVCacheTensors) -> OffloadingWorker:
        from kvtiers.tiers.file.gds_worker import FileWorker

        return FileWorker(
            kv, geometry, identity.digest, backend, settings=settings, bad_chunks=bad_chunks
        )

    return BuiltTier(name=name, manager=manager, make_worker=make_worker, admission=admission)
