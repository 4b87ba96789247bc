"""A whole stack file: ordered tiers, an optional ``model:`` and ``metrics:`` section.

The rules a stack keeps (checked when a :class:`StackConfig` is constructed, so a stack
built in code is held to them too):

* at least one tier; the first is the primary and must be able to be one (``cpu``, or
  ``file`` with ``gds: true``);
* a ``cpu`` tier appears at most once, and only first; ``gds: true`` only on the first
  tier, and a GDS primary has no lower tiers (they copy through CPU memory it lacks);
* tier names are unique;
* a ``model:`` section must yield a valid :class:`~kvtiers.core.config.OffloadingConfig`;
* a ``tenants:`` section's quotas name tiers of the stack (:mod:`kvtiers.config.tenants`).

:func:`load_stack_config` reads a file (or takes an already-parsed mapping). Every error
is a :class:`~kvtiers.errors.ConfigError` whose ``path`` is the YAML location and, for a
file, whose ``source`` is ``<file>:<line>`` so the one-line message reads
``stack.yaml:7: tiers[1].capacity: expected a size like 8GiB, …``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar

from kvtiers.config.kinds import TIER_KINDS, get_kind, not_installed
from kvtiers.config.model import ModelSection
from kvtiers.config.paths import item_path, key_path
from kvtiers.config.retention import RetentionConfig
from kvtiers.config.schema import (
    Matches,
    Range,
    Section,
    parse_section,
    shown,
    suggestion,
)
from kvtiers.config.tenants import TENANTS_PATH, TenantsConfig, check_tier_names
from kvtiers.config.tiers import (
    LOCAL_PROTOCOLS,
    CPUTierConfig,
    FileTierConfig,
    FsspecTierConfig,
    LowerTierConfig,
    S3TierConfig,
    TierConfig,
    cpu_capacity_problem,
    missing_modules,
    redact_url,
)
from kvtiers.config.yamlfile import read_yaml
from kvtiers.core.config import OffloadingConfig
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.errors import ConfigError
from kvtiers.optional import hint_for

TOP_LEVEL_KEYS = ("tiers", "model", "metrics", "promotion", TENANTS_PATH, "retention")
_TIERS_EXAMPLE = "tiers: [{kind: cpu, capacity: 8GiB}]"


# The exporter's default port: outside 9100-9999 (the range Prometheus' exporter registry
# has allocated; 9400 is DCGM-exporter's) and clear of vLLM's own 8000.
DEFAULT_METRICS_PORT = 8471


@dataclass(frozen=True, kw_only=True)
class MetricsConfig(Section):
    """Where to serve Prometheus metrics (``metrics: {}`` takes every default)."""

    what: ClassVar[str] = "the metrics section"

    port: Annotated[int, Range(0, 65535)] = DEFAULT_METRICS_PORT
    """TCP port of ``http://addr:port/metrics``; 0 picks a free port."""
    addr: Annotated[str, Matches(r"\S+", "a listen address such as 127.0.0.1")] = "127.0.0.1"
    """Listen address: 127.0.0.1 serves this host only; 0.0.0.0 (all interfaces) lets a
    scraper on another host or pod reach it, as in Kubernetes."""
    refresh_s: Annotated[float, Range(0)] = 1.0
    """How often the scheduler refreshes the numbers a scrape reads (0: every step)."""

    def _check(self) -> None:
        if missing_modules(("prometheus_client",)):
            raise ConfigError(hint_for("prometheus_client", "the metrics: section"))


@dataclass(frozen=True, kw_only=True)
class PromotionConfig(Section):
    """Cost-aware promotion: a lower-tier chunk is promoted only when it arrives before
    recomputing it would finish (docs/architecture.md, "Cost-aware promotion")."""

    what: ClassVar[str] = "the promotion section"

    prefill_tokens_per_s: Annotated[float, Range(0, above=True)]
    """The engine's prefill rate, tokens per second: recomputing ``n`` prompt tokens is
    taken to cost ``n / prefill_tokens_per_s`` seconds."""
    estimate_weight: Annotated[float, Range(0, 1, above=True)] = 0.2
    """Weight of each completed promotion job in a lower tier's running estimate of its
    latency and bandwidth (the rest is the decayed history)."""


@dataclass(frozen=True)
class StackConfig:
    """An ordered stack of tiers (primary first) and its optional sections.

    ``source`` is the file the stack was read from, or ``<mapping>``.
    """

    tiers: tuple[TierConfig, ...]
    model: ModelSection | None = None
    metrics: MetricsConfig | None = None
    source: str = "<mapping>"
    promotion: PromotionConfig | None = None
    tenants: TenantsConfig | None = None
    retention: RetentionConfig | None = None

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError(
                f"at least one tier is required, e.g. `{_TIERS_EXAMPLE}`", path="tiers"
            )
        self._check_primary()
        _check_primary_writes(self.tiers[0])
        first_use: dict[str, int] = {}
        first_place: dict[tuple[str, ...], int] = {}
        for idx, tier in enumerate(self.tiers):
            where = item_path("tiers", idx)
            if idx > 0:
                self._check_lower(tier, where)
            elif isinstance(tier, LowerTierConfig) and (
                tier.load_latency_s is not None or tier.load_bytes_per_s is not None
            ):
                raise ConfigError(
                    "load_latency_s and load_bytes_per_s describe promotions from a lower "
                    "tier; the primary is never promoted from: remove them here",
                    path=key_path(where, "load_latency_s" if tier.load_latency_s is not None
                                  else "load_bytes_per_s"),
                )
            claim_tier_name(first_use, tier.name, idx, where)
            missing = missing_modules(get_kind(tier.kind).requires)
            if missing:
                raise ConfigError(not_installed(tier.kind, missing[0]),
                                  path=key_path(where, "kind"))
            # Two tiers over one place would evict each other's chunks.
            place, field_name = _place(tier)
            if place and place in first_place:
                raise ConfigError(
                    f"tiers[{first_place[place]}] already stores chunks at "
                    f"{' '.join(place[1:])} (after resolving '..', '//' and links); two "
                    "tiers over one place evict each other's chunks: give this tier its "
                    "own location",
                    path=key_path(where, field_name),
                )
            if place:
                first_place[place] = idx
        if self.model is not None:
            self._check_geometry(self.model.to_offloading_config())
        if self.tenants is not None:
            check_tier_names(self.tenants, tuple(tier.name for tier in self.tiers),
                             self.tiers[0].kind)
        if self.retention is not None and self.retention.admin_token_env is not None and (
                self.metrics is None):
            raise ConfigError("the admin endpoint is served by the metrics server: add a "
                              "metrics: section", path="retention.admin_token_env")

    def _check_geometry(self, identity: OffloadingConfig) -> None:
        """What the build checks of the tiers against the model's chunks: a cpu primary
        holds at least one chunk slot."""
        primary = self.tiers[0]
        if isinstance(primary, CPUTierConfig):
            problem = cpu_capacity_problem(primary.name, primary.capacity,
                                           ChunkGeometry.from_config(identity).slot_bytes)
            if problem is not None:
                raise ConfigError(problem, path=key_path(item_path("tiers", 0), "capacity"))

    def _check_primary(self) -> None:
        first = self.tiers[0]
        if first.can_be_primary:
            if isinstance(first, FileTierConfig) and len(self.tiers) > 1:
                raise ConfigError(
                    "a file tier with gds: true as primary cannot have lower tiers: they copy "
                    "chunks through the primary's CPU memory, which a GDS primary does not "
                    "have; put a cpu tier first or remove the lower tiers",
                    path=item_path("tiers", 1),
                )
            return
        if isinstance(first, FileTierConfig):
            message = (
                "a file tier can be the first tier (the primary) only with gds: true; "
                "add gds: true or put a cpu tier first"
            )
        else:
            primaries = ", ".join(name for name, kind in TIER_KINDS.items() if kind.may_be_primary)
            message = (
                f"the first tier is the primary and {first.what} cannot be one "
                f"(primaries: {primaries}); put a cpu tier first"
            )
        raise ConfigError(message, path=key_path(item_path("tiers", 0), "kind"))

    @staticmethod
    def _check_lower(tier: TierConfig, where: str) -> None:
        if tier.kind == "cpu":
            raise ConfigError(
                "a cpu tier can only be the first tier (the primary), and only one; "
                "move it first or remove it",
                path=key_path(where, "kind"),
            )
        if isinstance(tier, FileTierConfig) and tier.gds:
            raise ConfigError(
                "gds: true is only allowed on the first tier (the primary); remove it here",
                path=key_path(where, "gds"),
            )

    @property
    def primary(self) -> TierConfig:
        """The first tier."""
        return self.tiers[0]

    def summary(self) -> str:
        """One line: ``2 tiers: cpu(cpu 8.0 GiB, arc) -> file(file /data, io=auto)``."""
        count = len(self.tiers)
        line = f"{count} tier{'s' if count != 1 else ''}: " + " -> ".join(
            f"{tier.name}({tier.describe()})" for tier in self.tiers
        )
        if self.model is not None:
            groups = len(self.model.groups)
            line += f"; model {self.model.name} ({groups} group{'s' if groups != 1 else ''})"
        if self.metrics is not None:
            line += f"; metrics on {self.metrics.addr}:{self.metrics.port}"
        if self.promotion is not None:
            line += f"; cost-aware promotion at {self.promotion.prefill_tokens_per_s:g} tokens/s"
        if self.tenants is not None:
            line += f"; tenants {', '.join(self.tenants.names())}"
        return line


# The write rules say how chunks reach a lower tier from the primary: on the primary (a
# file tier with gds: true) it would have no meaning.
_WRITE_DEFAULTS = (("write", "through"), ("write_after_hits", 0), ("write_promoted", False))


def _check_primary_writes(primary: TierConfig) -> None:
    if not isinstance(primary, LowerTierConfig):
        return
    for key, default in _WRITE_DEFAULTS:
        if getattr(primary, key) != default:
            raise ConfigError(
                f"{key} is one of a lower tier's write rules (how chunks reach it from the "
                "primary); the first tier is the primary: remove it here, or set it on a "
                "lower tier",
                path=key_path(item_path("tiers", 0), key),
            )


def claim_tier_name(first_use: dict[str, int], name: str, idx: int, where: str) -> None:
    """Record that ``tiers[idx]`` (at ``where``) is named ``name`` in ``first_use`` (name →
    index of the tier that has it); :class:`ConfigError` if an earlier tier has it already.
    Every stack's tiers, kvtiers' own or SGLang's, follow this one rule."""
    if name in first_use:
        raise ConfigError(
            f"tier name {name!r} is already used by tiers[{first_use[name]}]; "
            "give each tier its own name",
            path=key_path(where, "name"),
        )
    first_use[name] = idx


def _place(tier: TierConfig) -> tuple[tuple[str, ...], str]:
    """Where a persistent tier keeps its chunks, and the key that says so (or nothing)."""
    if isinstance(tier, FileTierConfig):
        return ("file", _same_directory(str(tier.root_path))), "root"
    if isinstance(tier, S3TierConfig):
        location = f"s3://{tier.bucket}/{tier.prefix.strip('/')}"
        endpoint = redact_url(tier.endpoint_url) if tier.endpoint_url else "AWS"
        return ("s3", location, f"(endpoint {endpoint})"), "bucket"
    if isinstance(tier, FsspecTierConfig):
        protocol, _, rest = tier.url.partition("://")
        if protocol.lower() in LOCAL_PROTOCOLS:
            return ("file", _same_directory(rest)), "url"
        return ("fsspec", tier.url.rstrip("/")), "url"
    return (), ""


def _same_directory(path: str) -> str:
    """One spelling per local directory: ``..``, repeated slashes and links resolved."""
    return os.path.realpath(os.path.expanduser(path) or ".")


def load_stack_config(source: str | Path | Mapping[str, object]) -> StackConfig:
    """Read a stack from a YAML file, or from an already-parsed mapping."""
    if isinstance(source, Mapping):
        return parse_stack(source)
    document = read_yaml(source)
    try:
        return parse_stack(document.data, source=str(source))
    except ConfigError as exc:
        line = document.line_of(exc.path)
        where = f"{source}:{line}" if line is not None else str(source)
        raise ConfigError(exc.message, path=exc.path, source=where) from None


def parse_stack(data: object, *, source: str = "<mapping>") -> StackConfig:
    """Build a :class:`StackConfig` from plain values (errors carry paths, not sources)."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"the top level must be a mapping with a `tiers:` list, got {shown(data)}; "
            f"start the file with `{_TIERS_EXAMPLE}`"
        )
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise ConfigError(
                f"unknown top-level key {key!r}{suggestion(str(key), TOP_LEVEL_KEYS)}; "
                f"known keys: {', '.join(TOP_LEVEL_KEYS)}",
                path=str(key),
            )
    if "tiers" not in data:
        raise ConfigError(
            f"missing required key 'tiers'; list the tiers from fastest to slowest, "
            f"e.g. `{_TIERS_EXAMPLE}`",
            path="tiers",
        )
    model = data.get("model")
    metrics = data.get("metrics")
    promotion = data.get("promotion")
    tenants = data.get(TENANTS_PATH)
    retention = data.get("retention")
    return StackConfig(
        tiers=_parse_tiers(data["tiers"]),
        model=None if model is None else parse_section(ModelSection, model, "model"),
        metrics=None if metrics is None else parse_section(MetricsConfig, metrics, "metrics"),
        source=source,
        promotion=None if promotion is None else parse_section(
            PromotionConfig, promotion, "promotion"),
        tenants=None if tenants is None else parse_section(
            TenantsConfig, tenants, TENANTS_PATH),
        retention=None if retention is None else parse_section(
            RetentionConfig, retention, "retention"),
    )


def _parse_tiers(raw: object) -> tuple[TierConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError(
            f"expected a list of tiers, got {shown(raw)}; write each tier as `- kind: …`",
            path="tiers",
        )
    kinds = [t.get("kind") for t in raw if isinstance(t, Mapping)]
    tiers = []
    for idx, raw_tier in enumerate(raw):
        where = item_path("tiers", idx)
        if not isinstance(raw_tier, Mapping):
            raise ConfigError(
                f"expected a tier mapping such as {{kind: cpu, capacity: 8GiB}}, "
                f"got {shown(raw_tier)}",
                path=where,
            )
        if "kind" not in raw_tier:
            raise ConfigError(
                f"missing required key 'kind'; one of {', '.join(TIER_KINDS)}",
                path=key_path(where, "kind"),
            )
        kind = get_kind(raw_tier["kind"], path=key_path(where, "kind"))
        # A tier's name defaults to its kind; repeated kinds add their position.
        name = kind.name if kinds.count(kind.name) == 1 else f"{kind.name}{idx}"
        tiers.append(parse_section(kind.config_type, raw_tier, where, defaults={"name": name}))
    return tuple(tiers)
