"""The ``retention:`` section of a stack file: what retention hints may ask and who may
change retention through the admin endpoint (docs/retention.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from kvtiers.config.schema import Matches, Range, Section
from kvtiers.config.sizes import Size


@dataclass(frozen=True, kw_only=True)
class RetentionConfig(Section):
    """Retention hints (priority, pin, TTL) from requests' ``kv_hints`` and the admin
    endpoint (``retention: {}`` takes every default)."""

    what: ClassVar[str] = "the retention section"

    hints: bool = True
    """Whether requests' ``kv_hints`` retention actions are read (false: only the admin
    endpoint sets retention)."""
    max_pinned_bytes: Size | None = None
    """The most bytes pinned at once (a block hash counts one primary slot per KV-cache
    group); a pin past it is refused whole, counted and warned about. With a ``tenants:``
    section it caps each tenant's pins (unless the member sets its own). Default: half
    the primary's capacity, so pins never fill it (with ``kvtiers serve``, half its pool;
    an engine whose primary is ``kind: service`` leaves the cap to the service)."""
    max_pin_s: Annotated[float, Range(0, above=True)] = 86400.0
    """The longest pin a hint or the admin endpoint may ask for, seconds."""
    max_ttl_s: Annotated[float, Range(0, above=True)] = 30 * 86400.0
    """The longest TTL a hint may ask for, seconds."""
    ledger: Annotated[str, Matches(r"[^\x00]+", "a file path")] | None = None
    """A JSON file the engine writes its TTLs to (replaced atomically), for ``kvtiers gc
    LOCATION --expired LEDGER`` to remove the chunks of persistent tiers past their TTL;
    unset: none written."""
    ledger_interval_s: Annotated[float, Range(1)] = 60.0
    """How often the ledger is written, seconds (and once at shutdown)."""
    admin_token_env: Annotated[str, Matches(r"[A-Za-z_][A-Za-z0-9_]*",
                                            "an environment variable name")] | None = None
    """The environment variable holding the bearer token of the admin endpoint
    (``/admin/pin``, ``/admin/unpin``, ``/admin/expire`` on the metrics server, which needs
    a ``metrics:`` section; with ``kvtiers serve``, on its ``--metrics-port``); unset: no
    admin endpoint. An empty or unset variable at start is an error."""
