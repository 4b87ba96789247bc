"""What a tier kind's factory builds, and the signature every factory has.

A stack (see :mod:`kvtiers.config`) names tier kinds; each kind has a factory, imported
lazily by dotted path, that turns the kind's frozen config into a :class:`BuiltTier`. The
primary (first) tier provides the host region lower tiers' movers copy through and a
way to make the GPU worker; a lower tier provides a mover.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from kvtiers.core.config import OffloadingConfig
from kvtiers.core.manager import OffloadingManager
from kvtiers.core.mover import HostRegion, Mover
from kvtiers.core.worker import KVCacheTensors, OffloadingWorker

M = TypeVar("M", bound=OffloadingManager)


@dataclass(frozen=True)
class WriteRules:
    """When the composite writes a chunk into a lower tier (docs/architecture.md,
    "Placement").

    ``mode`` ``through``: as soon as the chunk is stored in the primary; ``back``: when
    the tier above evicts it (a *demotion*: the primary, copied out of its slot before
    the slot is reused; or a lower tier that hands its evictions over, such as the file
    tier). ``after_hits``: only chunks referenced at least that many times (loaded
    from the primary, or stored again after the primary lost them; 0: every chunk); under
    ``through`` a chunk is written at the reference that reaches the count. ``promoted``:
    chunks promoted from a tier below this one are written into it too (under ``through``
    when the promotion lands, under ``back`` at eviction).
    """

    mode: Literal["through", "back"] = "through"
    after_hits: int = 0
    promoted: bool = False

    def __post_init__(self) -> None:
        if self.after_hits < 0:
            raise ValueError(f"WriteRules.after_hits must be at least 0, got {self.after_hits}")


@dataclass
class BuiltTier(Generic[M]):
    """A ready tier: its manager (an ``M``), and its mover (lower tiers) or worker factory
    (primary).

    ``admission`` says whether the composite writes chunks into this tier at all (``never``:
    read-only); ``write`` says when and which (a lower tier's :class:`WriteRules`).
    """

    name: str
    manager: M
    mover: Mover | None = None
    region: HostRegion | None = None
    make_worker: Callable[[KVCacheTensors], OffloadingWorker] | None = None
    admission: Literal["always", "never"] = "always"
    write: WriteRules = field(default_factory=WriteRules)

    def shutdown(self) -> None:
        """Stop the mover (draining it), then the manager. Idempotent."""
        if self.mover is not None:
            self.mover.shutdown()
        self.manager.shutdown()


class TierFactory(Protocol):
    """``build(config, offloading, primary_region=..., name=..., staging=...) -> BuiltTier``.

    ``primary_region`` is ``None`` when building the primary itself; lower tiers get the
    primary's host region for their movers. ``staging`` is given to the primary's factory
    only: whether some lower tier is written through with every chunk, so the primary may
    evict for the head of a store that does not fit whole (what it evicts lives on below;
    :mod:`kvtiers.core.primary`, "Staging"). A kind that cannot be the primary takes no
    ``staging``.
    """

    def __call__(
        self,
        config: Any,
        offloading: OffloadingConfig,
        *,
        primary_region: HostRegion | None,
        name: str,
    ) -> BuiltTier: ...
