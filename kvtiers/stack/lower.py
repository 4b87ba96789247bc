"""The composite's view of a lower tier, and the tag its tier-to-tier jobs carry.

Owns: :class:`Lower` (a built lower tier with its job driver, its position in the stack
and the keys held for its next promotion job), :class:`Hop` (a second-hop demotion's pair
of tiers), :class:`DemotionTag` (what a demotion job carries; promotions and cascades
carry ``None``) and :data:`INTERNAL`, the request context of the composite's own jobs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import OffloadingManager, ReqContext
from kvtiers.core.primary import HandingTier
from kvtiers.core.tier import BuiltTier, WriteRules
from kvtiers.tiers.jobs import JobDriver

#: The context of the jobs the composite starts itself (cascades, demotions).
INTERNAL = ReqContext(req_id="kvtiers-internal")


@dataclass(frozen=True)
class DemotionTag:
    """A demotion job's tag.

    ``slots``: the primary slot of each key, held by the composite (``None``: the chunks'
    own slots in the primary, pinned by the job driver). ``hop``: for a second hop, the
    handing tier above and the ``back`` tier below; a load job with a hop is the staging
    read of chunks that tier evicted, a store job the copy into the tier below."""

    slots: Mapping[OffloadKey, int] | None
    hop: Hop | None = None


#: A job's tag: a demotion's, or ``None`` (a promotion or a cascade).
JobTag = DemotionTag | None


@dataclass
class Lower:
    """A lower tier as the composite drives it."""

    tier: BuiltTier
    jobs: JobDriver[JobTag]
    #: Position in the stack (1 for the first lower tier).
    index: int
    #: Keys held for this tier's next promotion job, in hold order.
    holding: list[OffloadKey] = field(default_factory=list)

    @property
    def manager(self) -> OffloadingManager:
        return self.tier.manager

    @property
    def write(self) -> WriteRules:
        return self.tier.write


@dataclass(frozen=True)
class Hop:
    """A second hop: ``target`` (a ``back`` tier) receives what ``above``, the nearest
    writing tier above it, evicts; ``source`` is ``above``'s manager handing them over."""

    above: Lower
    target: Lower
    source: HandingTier
