"""The ``tenants:`` section: which tenant a request belongs to, and its byte quotas per tier.

A request's tenant is, in this order: the tenant whose ``salts`` list the request's
``cache_salt``; the tenant its ``kv_transfer_params`` names under ``param``; else the
``default`` tenant. A tenant's ``quota`` caps the bytes its chunks take in each tier it
names (a tier it does not name is uncapped for it); its ``protected`` share, per tier, is
what other tenants' stores never evict. How the stack keeps tenants apart and enforces the
quotas is :mod:`kvtiers.stack.tenants` (docs/tenants.md).

Rules checked here: tenant names are unique and plain (letters, digits, ``._-``); a salt
belongs to one tenant; every size is positive and a protected share is at most the quota
it sits under. That every tier named exists is checked by the stack
(:func:`check_tier_names`), which knows the tiers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from kvtiers.config.paths import item_path, key_path
from kvtiers.config.schema import Matches, Section, example, suggestion
from kvtiers.config.sizes import Size, parse_size
from kvtiers.errors import ConfigError

TENANTS_PATH = "tenants"
#: The ``kv_transfer_params`` field that names a request's tenant unless ``param`` says
#: otherwise.
DEFAULT_TENANT_PARAM = "kvtiers_tenant"
_NAME = Matches(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}",
                "a tenant name: letters, digits, '.', '_', '-' (at most 63)")


#: Bytes at the head of a tenant's scoped hash that name the tenant
#: (:mod:`kvtiers.stack.tenants`); a chunk's file or object name shows them first.
TAG_BYTES = 8


def tenant_tag(name: str) -> bytes:
    """The first :data:`TAG_BYTES` of every scoped hash of tenant ``name``."""
    return hashlib.blake2b(b"kvtiers-tenant\0" + name.encode(), digest_size=TAG_BYTES).digest()


def _sizes(raw: Mapping[str, Any], key: str) -> dict[str, int]:
    """``{tier name: bytes}`` from a mapping of sizes; errors name ``key.<tier>``."""
    sizes: dict[str, int] = {}
    for tier, value in raw.items():
        size = parse_size(value, path=key_path(key, tier))
        if size <= 0:
            raise ConfigError(f"expected a positive size such as 2GiB, got {value!r}",
                              path=key_path(key, tier))
        sizes[tier] = size
    return sizes


@dataclass(frozen=True, kw_only=True)
class TenantSection(Section):
    """One tenant: the salts that select it and its byte quotas per tier."""

    what: ClassVar[str] = "a tenant"

    name: Annotated[str, _NAME] = field(metadata=example("name: team-a"))
    """The tenant's name, as metrics (``tenant`` label), ``kvtiers inspect`` and
    ``kv_transfer_params`` show it."""
    salts: tuple[str, ...] = ()
    """Requests whose ``cache_salt`` is one of these belong to this tenant (not under
    vLLM, which hands its offloading manager no ``cache_salt``: docs/tenants.md)."""
    quota: Mapping[str, Any] = field(default_factory=dict)
    """Most bytes this tenant's chunks take in each tier named (``{cpu: 2GiB, file:
    100GiB}``); past it the tenant's own least recently used chunks go first. A tier not
    named is not capped for this tenant."""
    protected: Mapping[str, Any] = field(default_factory=dict)
    """Bytes of this tenant's chunks, per tier named, that other tenants' stores never
    evict (at most its quota there)."""
    max_pinned_bytes: Size | None = None
    """The most bytes this tenant's retention pins hold at once, with a ``retention:``
    section (docs/retention.md); a pin past it is refused whole. Default: the retention
    section's ``max_pinned_bytes``; never more than this tenant's quota on the primary."""

    def _check(self) -> None:
        quota = _sizes(self.quota, "quota")
        for tier, size in _sizes(self.protected, "protected").items():
            cap = quota.get(tier)
            if cap is not None and size > cap:
                raise ConfigError(
                    f"the protected share ({self.protected[tier]}) is larger than the "
                    f"quota ({self.quota[tier]}) in tier {tier!r}: "
                    "lower it to at most the quota",
                    path=key_path("protected", tier),
                )

    def quota_bytes(self) -> dict[str, int]:
        """``{tier name: quota in bytes}``."""
        return _sizes(self.quota, "quota")

    def protected_bytes(self) -> dict[str, int]:
        """``{tier name: protected share in bytes}``."""
        return _sizes(self.protected, "protected")


@dataclass(frozen=True, kw_only=True)
class TenantsConfig(Section):
    """Tenants sharing one stack: how requests map to them and what each may hold."""

    what: ClassVar[str] = "the tenants section"

    default: Annotated[str, _NAME] = "default"
    """The tenant of a request that no salt and no ``kv_transfer_params`` field names.
    Its keys are the engine's own, unchanged (docs/tenants.md)."""
    param: Annotated[str, Matches(r"\S+", "a kv_transfer_params field name")] = (
        DEFAULT_TENANT_PARAM)
    """The ``kv_transfer_params`` field that names a request's tenant."""
    members: tuple[TenantSection, ...] = ()
    """The tenants, each ``{name, salts, quota, protected}``; the default tenant may be
    one of them (to give it quotas)."""

    def _check(self) -> None:
        seen: dict[str, int] = {}
        salts: dict[str, int] = {}
        for idx, tenant in enumerate(self.members):
            where = item_path("members", idx)
            if tenant.name in seen:
                raise ConfigError(
                    f"tenant name {tenant.name!r} is already used by members[{seen[tenant.name]}]; "
                    "give each tenant its own name",
                    path=key_path(where, "name"),
                )
            seen[tenant.name] = idx
            for pos, salt in enumerate(tenant.salts):
                if salt in salts:
                    raise ConfigError(
                        f"cache_salt {salt!r} already selects tenant "
                        f"{self.members[salts[salt]].name!r}: a salt belongs to one tenant",
                        path=item_path(key_path(where, "salts"), pos),
                    )
                salts[salt] = idx

    def tenant(self, name: str) -> TenantSection | None:
        """The section of tenant ``name``, if listed."""
        for tenant in self.members:
            if tenant.name == name:
                return tenant
        return None

    def names(self) -> tuple[str, ...]:
        """Every tenant's name: the default first, then the listed ones."""
        return (self.default, *(t.name for t in self.members if t.name != self.default))


def check_tier_names(tenants: TenantsConfig, tier_names: tuple[str, ...],
                     primary_kind: str) -> None:
    """:class:`ConfigError` (path ``tenants.members[i].quota.<tier>``) for a quota or
    protected share naming a tier the stack does not have, or a primary other than a
    ``cpu`` tier (the only primary whose chunks a quota can count and evict by owner)."""
    for idx, tenant in enumerate(tenants.members):
        where = item_path(key_path(TENANTS_PATH, "members"), idx)
        for key, sizes in (("quota", tenant.quota), ("protected", tenant.protected)):
            for tier in sizes:
                path = key_path(key_path(where, key), tier)
                if tier not in tier_names:
                    raise ConfigError(
                        f"no tier is named {tier!r}{suggestion(tier, tier_names)}; the "
                        f"stack's tiers: {', '.join(tier_names)}",
                        path=path,
                    )
                if tier == tier_names[0] and primary_kind != "cpu":
                    raise ConfigError(
                        f"quotas on the primary need a cpu tier, and {tier!r} is a "
                        f"{primary_kind} tier: cap this tenant in the lower tiers only",
                        path=path,
                    )
