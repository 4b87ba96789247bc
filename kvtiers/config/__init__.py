"""YAML tier stacks: parsing stack files into frozen, checked configuration values.

A stack file lists tiers from fastest to slowest (the first is the primary) and may carry
a ``model:`` section (cache identity for the demo, tests and tools), a ``metrics:``
section and a ``promotion:`` section (cost-aware promotion). Nothing here imports a
tier's heavy dependencies; tier factories are resolved lazily through
:func:`resolve_factory`.
"""

from kvtiers.config.kinds import TIER_KINDS, TierKind, get_kind, resolve_factory
from kvtiers.config.model import GroupSection, ModelSection, ParallelSection
from kvtiers.config.sizes import Size, format_size, parse_size
from kvtiers.config.stack import (
    MetricsConfig,
    PromotionConfig,
    StackConfig,
    load_stack_config,
    parse_stack,
)
from kvtiers.config.tiers import (
    CPUTierConfig,
    FileTierConfig,
    FsspecTierConfig,
    S3TierConfig,
    TierConfig,
)

__all__ = [
    "TIER_KINDS",
    "CPUTierConfig",
    "FileTierConfig",
    "FsspecTierConfig",
    "GroupSection",
    "MetricsConfig",
    "ModelSection",
    "ParallelSection",
    "PromotionConfig",
    "S3TierConfig",
    "Size",
    "StackConfig",
    "TierConfig",
    "TierKind",
    "format_size",
    "get_kind",
    "load_stack_config",
    "parse_size",
    "parse_stack",
    "resolve_factory",
]
