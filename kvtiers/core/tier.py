"""What a tier kind's factory builds, and the signature every factory has.

A stack (see :mod:`kvtiers.config`) names tier kinds; each kind has a factory, imported
lazily by dotted path, that turns the kind's frozen config into a :class:`BuiltTier`. The
primary (first) tier provides the host region lower tiers' movers copy through and a
way to make the GPU worker; a lower tier provides a mover.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from kvtiers.core.config import OffloadingConfig
from kvtiers.core.manager import OffloadingManager
from kvtiers.core.mover import HostRegion, Mover
from kvtiers.core.worker import KVCacheTensors, OffloadingWorker

M = TypeVar("M", bound=OffloadingManager)


@dataclass
class BuiltTier(Generic[M]):
    """A ready tier: its manager (an ``M``), and its mover (lower tiers) or worker factory
    (primary).

    ``admission`` says whether the composite cascades newly stored chunks into this tier.
    """

    name: str
    manager: M
    mover: Mover | None = None
    region: HostRegion | None = None
    make_worker: Callable[[KVCacheTensors], OffloadingWorker] | None = None
    admission: Literal["always", "never"] = "always"

    def shutdown(self) -> None:
        """Stop the mover (draining it), then the manager. Idempotent."""
        if self.mover is not None:
            self.mover.shutdown()
        self.manager.shutdown()


class TierFactory(Protocol):
    """``build(config, offloading, primary_region=..., name=...) -> BuiltTier``.

    ``primary_region`` is ``None`` when building the primary itself; lower tiers get the
    primary's host region for their movers.
    """

    def __call__(
        self,
        config: Any,
        offloading: OffloadingConfig,
        *,
        primary_region: HostRegion | None,
        name: str,
    ) -> BuiltTier: ...
