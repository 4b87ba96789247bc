"""The registry of tier kinds: kind name → config class, factory, primary capability.

A factory is named by a dotted path (``"package.module:function"``) and imported only
when a stack is built, so reading or validating a stack file never imports a tier's
heavy dependencies (torch, boto3, kvikio, fsspec). A kind whose factory module cannot be
imported is reported as not installed, with the extra that provides it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, cast

from kvtiers.config.schema import suggestion
from kvtiers.config.tiers import (
    CPUTierConfig,
    FileTierConfig,
    FsspecTierConfig,
    S3TierConfig,
    ServiceTierConfig,
    TierConfig,
)
from kvtiers.errors import ConfigError

if TYPE_CHECKING:
    from kvtiers.core.tier import TierFactory


@dataclass(frozen=True)
class TierKind:
    """One kind of tier.

    ``may_be_primary`` says whether some configuration of the kind can be the first tier
    (a given configuration says so itself through ``TierConfig.can_be_primary``);
    ``persistent`` says whether its chunks outlive the process (and so must be named by
    an identity that is stable across restarts); ``extra`` is the package extra that
    installs the kind's dependencies, if any, and ``requires`` the top-level modules of
    those the factory imports (checked without importing them, so ``kvtiers validate``
    finds a missing one as the build would).
    """

    name: str
    config_type: type[TierConfig]
    factory: str
    may_be_primary: bool
    persistent: bool
    extra: str = ""
    requires: tuple[str, ...] = ()


TIER_KINDS: Mapping[str, TierKind] = MappingProxyType(
    {
        kind.name: kind
        for kind in (
            TierKind(
                "cpu", CPUTierConfig, "kvtiers.tiers.cpu.factory:build_tier",
                may_be_primary=True, persistent=False,
            ),
            TierKind(
                "file", FileTierConfig, "kvtiers.tiers.file.factory:build_tier",
                may_be_primary=True, persistent=True,
            ),
            TierKind(
                "s3", S3TierConfig, "kvtiers.tiers.s3.factory:build_tier",
                may_be_primary=False, persistent=True, extra="s3",
                requires=("boto3", "botocore"),
            ),
            TierKind(
                "fsspec", FsspecTierConfig, "kvtiers.tiers.fsspec.factory:build_tier",
                may_be_primary=False, persistent=True, extra="fsspec", requires=("fsspec",),
            ),
            TierKind(
                "service", ServiceTierConfig, "kvtiers.service.tier:build_tier",
                may_be_primary=True, persistent=False, extra="service",
                requires=("msgspec",),
            ),
        )
    }
)


def get_kind(kind: object, *, path: str = "kind") -> TierKind:
    """The registered kind named ``kind``; anything else is a :class:`ConfigError`."""
    known = ", ".join(TIER_KINDS)
    if not isinstance(kind, str):
        raise ConfigError(f"expected a tier kind (one of {known}), got {kind!r}", path=path)
    try:
        return TIER_KINDS[kind]
    except KeyError:
        raise ConfigError(
            f"unknown tier kind {kind!r}{suggestion(kind, TIER_KINDS)}; known kinds: {known}",
            path=path,
        ) from None


def not_installed(kind: str, module: str) -> str:
    """The message for a tier kind whose factory needs ``module``, which is missing."""
    extra = get_kind(kind).extra
    install = f"; install it with: pip install 'kvtiers[{extra}]'" if extra else ""
    return f"tier kind {kind!r} needs {module!r}, which is not installed{install}"


def resolve_factory(kind: str, *, path: str = "kind") -> TierFactory:
    """Import and return the factory of ``kind``.

    Raises :class:`ConfigError` (at ``path``) when the kind is unknown, when its factory
    module or one of its dependencies is not installed, or when the module lacks the
    factory.
    """
    entry = get_kind(kind, path=path)
    module_name, _, attribute = entry.factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            message = (
                f"tier kind {kind!r} is not installed: {module_name} cannot be imported; "
                "use a kvtiers release that provides it"
            )
        else:
            message = not_installed(kind, missing)
        raise ConfigError(message, path=path) from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(
            f"tier kind {kind!r} is broken: {module_name} has no factory {attribute!r}",
            path=path,
        )
    return cast("TierFactory", factory)
