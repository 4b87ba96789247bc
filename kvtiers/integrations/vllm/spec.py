"""``KVTiersOffloadingSpec``: a kvtiers stack as vLLM's offloading spec (route 1).

vLLM (0.32 to 0.34) loads it through ``OffloadingSpecFactory`` from ``spec_name`` +
``spec_module_path`` in ``kv_connector_extra_config``, once in the scheduler process
(:meth:`KVTiersOffloadingSpec.get_manager`) and once per worker
(:meth:`KVTiersOffloadingSpec.get_worker`). The rooms:

* :mod:`~kvtiers.integrations.vllm.manager` — the scheduler's manager through the
  stack's composite; :mod:`~kvtiers.integrations.vllm.direct` — the manager of a stack of
  one cpu tier, which calls that tier itself (``get_manager`` picks the class);
* :mod:`~kvtiers.integrations.vllm.worker` — the worker over the primary tier's kvtiers
  worker, and the shared memory both processes map;
* :mod:`~kvtiers.integrations.vllm.compat` — what differs between vLLM releases.

Stores are self-describing (vLLM's ``self_describing_kv_events``) unless the extra config
turns that off (docs/vllm.md, "What a router sees").

Tensor and pipeline parallelism on one node (``world_size`` > 1, a ``cpu`` or ``service``
primary): every rank's worker maps the same primary region (a service's pool: each rank
attaches with the engine's identity) and copies its own pages into the same slots,
rank innermost (:mod:`kvtiers.tiers.cpu.worker`), so one slot holds the whole chunk and
the scheduler's one stack (its manager, movers, cascade and promotion) handles every
rank's shard at once: a file or object holds one blob per chunk with every shard. The
cache identity counts a block's bytes over all ranks. vLLM completes a job once every
rank reported it; before the manager publishes a stored chunk it checks the shard ledger
(:mod:`kvtiers.tiers.cpu.shards`), where each rank stamped the slots it wrote for that
job (beside a cpu primary's region, or per engine beside a service's pool). A rank's
failed store is therefore reported to vLLM as finished and refused by the scheduler
instead. Ranks on other nodes cannot map the region: such an engine is refused
at start-up.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import OffloadingConfig as VllmOffloadingConfig

from kvtiers.config import (
    CPUTierConfig,
    StackConfig,
    get_kind,
    load_stack_config,
    resolve_factory,
)
from kvtiers.config.tiers import ServiceTierConfig
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.tier import BuiltTier
from kvtiers.core.worker import KVCacheTensors
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.direct import KVTiersDirectManager, direct_eligible
from kvtiers.integrations.vllm.engine import find_engine_configs, handed_over
from kvtiers.integrations.vllm.manager import KVTiersManager, reset_grace_steps
from kvtiers.integrations.vllm.media import medium_names
from kvtiers.integrations.vllm.translate import (
    EXTRA_CONFIG,
    KeyMap,
    block_hash_algorithm,
    derived_group_bytes,
    translate_config,
    warn_unstable_hashes,
)
from kvtiers.integrations.vllm.worker import (
    KVTiersWorker,
    check_one_node,
    engine_ledger_name,
    kv_cache_tensors,
    share_primary,
    slot_region,
)
from kvtiers.stack.builder import build_primary_worker, load_stack
from kvtiers.tiers.cpu.shards import ShardLedger, ledger_name
from kvtiers.tiers.cpu.worker import CpuWorker

logger = logging.getLogger(__name__)


def _num_slots(tier: BuiltTier) -> int:
    """The slots of a sharded engine's primary ``tier``: a cpu tier's region or the
    service's pool."""
    from kvtiers.service.pool import PoolView

    if isinstance(tier.region, PoolView):
        return tier.region.num_slots
    return slot_region(tier).num_slots

_CONFIG_INFO_KEYS = (
    "cpu_num_chunks", "cpu_blocks_per_chunk", "cpu_kv_cache_size_bytes", "kvtiers_tiers"
)


def _events_config(config: VllmOffloadingConfig, extra_config: Any) -> Any:
    """vLLM's event settings for this spec: as vLLM's own, except that stores are
    self-describing (block hashes, tokens, block size) unless ``self_describing_kv_events``
    in the extra config is ``false``."""
    described = extra_config.get("self_describing_kv_events", True)
    if not isinstance(described, bool):
        raise ConfigError(
            f"expected true or false, got {described!r}",
            path=f"{EXTRA_CONFIG}.self_describing_kv_events",
        )
    return vbase.OffloadingKVEventsConfig(
        enable_kv_cache_events=config.enable_kv_cache_events,
        self_describing_kv_events=described,
    )


def _read_stack(extra_config: Any) -> StackConfig:
    path = extra_config.get("kvtiers_config")
    inline = extra_config.get("kvtiers")
    if (path is None) == (inline is None):
        raise ConfigError(
            "give exactly one of kvtiers_config (the path of a stack YAML file) or kvtiers "
            "(the stack as an inline mapping)",
            path=EXTRA_CONFIG,
        )
    return load_stack_config(path if path is not None else inline)


def replicated_kv(extra_config: dict[str, Any], engine: Any, parallel: Any) -> bool:
    """Whether every rank of a sharded engine holds the same KV, so a chunk holds it once
    (written by rank 0, loaded by every rank) instead of once per rank: an MLA model's
    latent, which tensor-parallel ranks replicate. ``kvtiers_replicated_kv`` (a bool)
    decides when given, else whether the engine's model uses MLA. Never with pipeline
    stages (they hold different layers) or context parallelism (it shards tokens)."""
    where = f"{EXTRA_CONFIG}.kvtiers_replicated_kv"
    given = extra_config.get("kvtiers_replicated_kv")
    if given is not None and not isinstance(given, bool):
        raise ConfigError(f"expected true or false, got {given!r}", path=where)
    sharded_otherwise = parallel.pp_size > 1 or parallel.dcp_size > 1 or parallel.pcp_size > 1
    if parallel.world_size == 1 or given is False:
        return False
    if given and sharded_otherwise:
        raise ConfigError(
            "kvtiers_replicated_kv needs tensor parallelism alone: pipeline stages hold "
            "different layers and context parallelism shards tokens",
            path=where,
        )
    if given:
        return True
    model = getattr(engine.vllm, "model_config", None) if engine is not None else None
    return bool(getattr(model, "use_mla", False)) and not sharded_otherwise


class KVTiersOffloadingSpec(vbase.OffloadingSpec):
    """vLLM's offloading spec for a kvtiers stack.

    ``kv_connector_extra_config`` keys: ``kvtiers_config`` (a stack YAML path) or
    ``kvtiers`` (the stack inline); optional ``model_revision``, ``kvtiers_salt``,
    ``kvtiers_parallel_agnostic``, ``prefix_caching_hash_algo`` (when the engine's config
    cannot be read; it must agree when it can), ``kvtiers_identity`` (see
    :func:`~kvtiers.integrations.vllm.translate.identity_source`),
    ``kvtiers_group_bytes_per_block`` (see
    :func:`~kvtiers.integrations.vllm.translate.derived_group_bytes`),
    ``kvtiers_replicated_kv`` (see :func:`replicated_kv`) and
    ``self_describing_kv_events`` (default true here). Every other identity
    input is read from the configs of the vLLM connector building the spec (see
    :mod:`kvtiers.integrations.vllm.engine`).
    """

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels :meth:`KVTiersManager.config_info` fills (vLLM's info metric)."""
        return _CONFIG_INFO_KEYS

    def __init__(self, config: VllmOffloadingConfig) -> None:
        super().__init__(config)
        self.kv_events_config = _events_config(config, self.extra_config)
        if config.canonical_layout:
            raise ConfigError(
                "canonical_layout is not supported by kvtiers' vLLM spec; remove it",
                path=f"{EXTRA_CONFIG}.canonical_layout",
            )
        # Read here, while vLLM's connector is building this spec (never stored: the spec
        # is pickled to workers).
        engine = find_engine_configs()
        par = config.parallel
        #: Ranks whose workers share the primary's slots (1: one worker per engine).
        self.ranks = par.world_size
        if self.ranks > 1:
            check_one_node(engine, self.ranks)
        self.hash_algorithm = block_hash_algorithm(self.extra_config, engine)
        #: One rank's bytes per block of each group (what its KV tensors hold).
        self.rank_group_bytes = derived_group_bytes(config)
        #: Every rank holds the same KV (MLA): a chunk holds one rank's copy.
        self.replicated = replicated_kv(self.extra_config, engine, par)
        copies = 1 if self.replicated else self.ranks
        stack_config = _read_stack(self.extra_config)
        persistent = any(get_kind(tier.kind).persistent for tier in stack_config.tiers)
        self.offloading: OffloadingConfig = translate_config(
            config,
            engine=engine,
            # A chunk holds every rank's pages (one copy when they are the same); pipeline
            # stages hold different layers, so their chunks are never those of another
            # layout.
            group_bytes_per_block=[n * copies for n in self.rank_group_bytes],
            hash_algorithm=self.hash_algorithm,
            layout_agnostic=par.is_parallelism_agnostic and par.pp_size == 1,
            persistent=persistent,
        )
        self.stack_config = share_primary(stack_config, config.engine_id)
        primary = self.stack_config.tiers[0]
        if self.ranks > 1 and not isinstance(primary, CPUTierConfig | ServiceTierConfig):
            raise ConfigError(
                f"with {self.ranks} ranks (tensor / pipeline parallel) the first tier must be "
                f"a cpu or service tier, which every rank shares; got kind {primary.kind!r}",
                path="tiers[0].kind",
            )
        #: The shard ledger's /dev/shm name (a sharded engine): beside a cpu primary's
        #: region, or per engine beside the service's pool (the pool is the service's).
        self.ledger_name = ""
        if self.ranks > 1:
            self.ledger_name = (
                ledger_name(primary.shared_memory_name)
                if isinstance(primary, CPUTierConfig) and primary.shared_memory_name
                else engine_ledger_name(config.engine_id)
            )
        if persistent:
            warn_unstable_hashes(self.hash_algorithm)
        self.keys = KeyMap([group.group_id for group in config.groups])
        #: What a reset's fence waits for on vLLM 0.32 (see :func:`reset_grace_steps`).
        self.reset_grace_steps = reset_grace_steps(engine, par.pp_size)
        self._manager: KVTiersManager | None = None

    def get_manager(self) -> KVTiersManager:
        """The scheduler's manager; builds the whole stack on first call."""
        if self._manager is None:
            if medium_names(self.stack_config) and not handed_over():
                logger.warning(
                    "event_medium is set on a tier, but the KV events are published by a "
                    "connector other than KVTiersConnector, which alone renames them: "
                    "routers will see CPU / STORAGE; use \"kv_connector\": "
                    "\"KVTiersConnector\" (kvtiers vllm-config prints it)")
            stack = load_stack(self.stack_config, self.offloading)
            ledger = None
            if self.ranks > 1:
                try:
                    ledger = self._ledger(_num_slots(stack.tiers[0]))
                except BaseException:
                    stack.shutdown()
                    raise
            manager = (
                KVTiersDirectManager if direct_eligible(stack, self.keys) else KVTiersManager
            )
            self._manager = manager(
                stack,
                self.keys,
                events_enabled=self.config.enable_kv_cache_events,
                ledger=ledger,
                reset_grace_steps=self.reset_grace_steps,
            )
        return self._manager

    def get_worker(self, kv_caches: Any) -> KVTiersWorker:
        """A worker over ``kv_caches``; in a process without the manager it builds only
        the primary tier (attached to the shared primary memory)."""
        kv = kv_cache_tensors(kv_caches)
        self._check_geometry(kv)
        if self.ranks > 1:
            return self._rank_worker(kv)
        if self._manager is not None:
            return KVTiersWorker(self._manager.stack.make_worker(kv), kv)
        worker, primary = build_primary_worker(self.stack_config, self.offloading, kv)
        return KVTiersWorker(worker, kv, primary.shutdown)

    def _ledger(self, num_slots: int) -> ShardLedger:
        """The shard ledger over the shared primary's ``num_slots`` slots (see the module
        docstring)."""
        return ShardLedger(num_slots, self.ranks, self.ledger_name)

    def _rank_worker(self, kv: KVCacheTensors) -> KVTiersWorker:
        """This rank's worker: its pages go to its place in the shared primary's slots
        (see the module docstring)."""
        rank = self.config.parallel.rank
        geometry = ChunkGeometry(self.offloading.cache.blocks_per_chunk, self.rank_group_bytes)
        tier_config = self.stack_config.tiers[0]
        if isinstance(tier_config, ServiceTierConfig):
            return self._service_rank_worker(tier_config, kv, geometry)
        owned: BuiltTier | None = None
        if self._manager is not None:
            region = slot_region(self._manager.stack.tiers[0])
        else:
            tier_config = self.stack_config.tiers[0]
            factory = resolve_factory(tier_config.kind, path="tiers[0].kind")
            owned = factory(tier_config, self.offloading, primary_region=None,
                            name=tier_config.name)
            region = slot_region(owned)
        ledger: ShardLedger | None = None
        try:
            ledger = self._ledger(region.num_slots)
            if self.replicated:  # one copy in each slot, written by rank 0
                worker = CpuWorker(kv, region, geometry, writes=rank == 0)
            else:
                worker = CpuWorker(kv, region, geometry, shard=(rank, self.ranks))
        except BaseException:
            if ledger is not None:
                ledger.close()
            if owned is not None:
                owned.shutdown()
            raise
        closing = ledger

        def close() -> None:
            closing.close()
            if owned is not None:
                owned.shutdown()

        return KVTiersWorker(worker, kv, close, shard=(rank, ledger))

    def _service_rank_worker(self, tier_config: ServiceTierConfig, kv: KVCacheTensors,
                             geometry: ChunkGeometry) -> KVTiersWorker:
        """This rank's worker over the service's pool, attached from the rank's process
        with the engine's identity; the ledger is the engine's own, beside the pool."""
        from kvtiers.service.tier import attach_rank

        rank = self.config.parallel.rank
        worker, client = attach_rank(
            tier_config, self.offloading, kv, geometry,
            shard=(0, 1) if self.replicated else (rank, self.ranks),
            writes=rank == 0 or not self.replicated,
        )
        ledger: ShardLedger | None = None
        try:
            assert client.pool is not None
            ledger = self._ledger(client.pool.num_slots)
        except BaseException:
            worker.shutdown()
            client.close()
            raise
        closing = ledger

        def close() -> None:
            closing.close()
            client.close()

        return KVTiersWorker(worker, kv, close, shard=(rank, ledger))

    def _check_geometry(self, kv: KVCacheTensors) -> None:
        expected = list(self.rank_group_bytes)
        actual = [kv.group_bytes_per_block(g) for g in range(len(kv.groups))]
        if actual != expected:
            raise ConfigError(
                f"the engine's KV tensors hold {actual} bytes per block per group but the "
                f"scheduler derived {expected}; set kvtiers_group_bytes_per_block: {actual}",
                path=f"{EXTRA_CONFIG}.kvtiers_group_bytes_per_block",
            )
