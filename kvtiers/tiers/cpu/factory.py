"""Builds the CPU tier from its YAML config: host region, manager and worker factory.

``capacity`` is in bytes; the tier holds ``capacity // slot_bytes`` chunks, where a slot
fits the largest group's chunk rounded up to 4096 bytes.
"""

from __future__ import annotations

from typing import Protocol

from kvtiers.config.tiers import cpu_capacity_problem
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.mover import HostRegion
from kvtiers.core.tier import BuiltTier
from kvtiers.core.worker import KVCacheTensors, OffloadingWorker
from kvtiers.errors import ConfigError
from kvtiers.policies.base import EvictionPolicy, load_policy
from kvtiers.policies.retention import RetainingPolicy, RetentionBook
from kvtiers.tiers.cpu.manager import CpuTierManager
from kvtiers.tiers.cpu.region import SlotRegion


class CpuTierSettings(Protocol):
    """The fields of the ``kind: cpu`` config this factory reads."""

    @property
    def capacity(self) -> int: ...

    @property
    def policy(self) -> str: ...

    @property
    def shared_memory_name(self) -> str | None: ...


def build_tier(
    config: CpuTierSettings,
    offloading: OffloadingConfig,
    *,
    primary_region: HostRegion | None,
    name: str,
    staging: bool = False,
    retention: RetentionBook | None = None,
) -> BuiltTier:
    """The CPU tier ``name``; it must be the primary (``primary_region`` is ``None``).
    ``staging``: the stack's decision (see :class:`~kvtiers.core.tier.TierFactory`).
    ``retention``: the stack's retention book, which the tier's policy then honours
    (:class:`~kvtiers.policies.retention.RetainingPolicy`)."""
    if primary_region is not None:
        raise ConfigError(
            f"tier {name!r}: a cpu tier can only be the first tier of a stack; "
            "move it to the top",
            path="kind",
        )
    geometry = ChunkGeometry.from_config(offloading)
    problem = cpu_capacity_problem(name, config.capacity, geometry.slot_bytes)
    if problem is not None:
        raise ConfigError(problem, path="capacity")
    num_slots = config.capacity // geometry.slot_bytes
    region = SlotRegion(num_slots, geometry.slot_bytes, config.shared_memory_name)
    policy: EvictionPolicy | type[EvictionPolicy] = load_policy(config.policy)
    if retention is not None:
        policy = RetainingPolicy(load_policy(config.policy), num_slots, retention)
    manager = CpuTierManager(
        num_slots, geometry.slot_bytes, policy, region=region, staging=staging,
    )

    def make_worker(kv: KVCacheTensors) -> OffloadingWorker:
        from kvtiers.tiers.cpu.worker import CpuWorker

        return CpuWorker(kv, region, geometry)

    return BuiltTier(name=name, manager=manager, region=region, make_worker=make_worker)
