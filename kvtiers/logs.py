"""kvtiers' log records in the serving engine's log, and a stack's start and stop lines.

kvtiers logs under the ``kvtiers`` logger and configures no handler of its own: an
application decides where records go. Inside an engine, that is the engine's log:

* vLLM configures only its ``vllm`` logger (its own handler, ``propagate: false``), so
  records of any other logger never reach the server's output. :func:`join_engine_log`
  (``"vllm"``), called when vLLM loads kvtiers, hands kvtiers' records to that logger's
  handlers, with its level (``VLLM_LOGGING_LEVEL``): they appear, formatted as vLLM's
  own, exactly when a vLLM record of that level would.
* SGLang configures the root logger, which kvtiers' records already reach; the call
  changes nothing there.

An application that configured the ``kvtiers`` logger itself (a handler on it) keeps its
configuration. :func:`log_started` and :func:`log_stopped` write one INFO line per tier
when a stack is built (kind, where, capacity, namespace) and when it stops (chunks
stored, loaded, failed and found corrupt), and one line for the stack as a whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtiers.config.stack import StackConfig
    from kvtiers.core.config import OffloadingConfig

#: The logger every kvtiers module logs under (``logging.getLogger(__name__)``).
ROOT = "kvtiers"
logger = logging.getLogger(__name__)


class _ToEngineLog(logging.Handler):
    """Hands each record to the handlers of the engine's logger, looked up at each
    record (an engine that reconfigures its logging replaces its handlers)."""

    def __init__(self, engine: str) -> None:
        super().__init__()
        self.engine = engine

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(self.engine)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def join_engine_log(engine: str) -> bool:
    """Send kvtiers' records to the engine logger ``engine``'s handlers at its level
    (see the module docstring). Returns whether it did: not when the ``kvtiers`` logger
    has a handler already (configured by the application, or joined before), nor when
    the engine's logger has no handler of its own (its records go to the root logger,
    where kvtiers' go too). Idempotent."""
    ours = logging.getLogger(ROOT)
    target = logging.getLogger(engine)
    if ours.handlers or not target.handlers:
        return False
    ours.addHandler(_ToEngineLog(engine))
    # Records below the engine's level are not even made; at or above it they go to the
    # engine's handlers only, not a second time through the root logger.
    ours.setLevel(target.getEffectiveLevel())
    ours.propagate = False
    return True


def log_started(config: StackConfig, identity: OffloadingConfig) -> None:
    """One INFO line per tier of a stack just built: its name, kind, where it keeps
    chunks and its capacity (``describe()``), and the namespace of a persistent tier."""
    if not logger.isEnabledFor(logging.INFO):
        return
    from kvtiers.config.kinds import get_kind
    from kvtiers.filemapper import NamespaceIdentity

    namespace = NamespaceIdentity.from_config(identity).namespace
    for index, tier in enumerate(config.tiers):
        persistent = get_kind(tier.kind).persistent
        logger.info("kvtiers: tier %d %s started: %s%s", index, tier.name, tier.describe(),
                    f"; namespace {namespace}" if persistent else "")


#: (label, per-tier stat names summed) of a tier's stop line.
_TIER_COUNTS: Sequence[tuple[str, Sequence[str]]] = (
    ("stored", ("stores",)),
    ("loaded", ("loads",)),
    ("failed", ("store_failures", "load_failures")),
    ("corrupt", ("corrupt_chunks",)),
)
#: (label, stack stat names) of the stack's stop line.
_STACK_COUNTS: Sequence[tuple[str, str]] = (
    ("hits", "hits"), ("misses", "misses"),
    ("promoted", "promotions"), ("promotions refused", "promotions_refused"),
    ("cascaded", "cascades"), ("cascades refused", "cascades_refused"),
    ("corrupt", "corrupt_chunks"),
)


def log_stopped(tier_names: Sequence[str], stats: Mapping[str, float]) -> None:
    """One INFO line per tier of a stack that stopped (chunks stored, loaded, failed and
    corrupt, from ``stats``: a stack's ``get_stats()``), then the stack's own counts."""
    if not logger.isEnabledFor(logging.INFO):
        return
    for name in tier_names:
        counts = ", ".join(
            f"{label} {sum(int(stats.get(f'{name}.{stat}', 0)) for stat in names):,}"
            for label, names in _TIER_COUNTS)
        logger.info("kvtiers: tier %s stopped: chunks %s", name, counts)
    logger.info("kvtiers: stack stopped: %s",
                ", ".join(f"{label} {int(stats.get(stat, 0)):,}"
                          for label, stat in _STACK_COUNTS))
