"""The kvtiers keys of SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands a ``dynamic`` storage backend its extra config as a dict: its own keys
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``) and the backend's.
kvtiers reads:

* ``kvtiers_config``: the stack, as the path of a YAML file or an inline mapping, with a
  ``tiers:`` list of *lower* tiers only (``file``, ``s3``, ``fsspec``; fastest first): SGLang's
  host pool is the primary, so a ``cpu`` tier, ``gds: true`` and the keys that describe
  how chunks leave a kvtiers primary (``write``, ``write_after_hits``, ``write_promoted``,
  ``load_latency_s``, ``load_bytes_per_s``) are refused. Every tier key of
  ``docs/configuration.md`` is checked as in any stack file, with the same one-line errors
  (file, line, YAML path).
* ``kvtiers_salt``: a string that separates otherwise identical caches (the identity's
  salt).
* ``model_revision``: the model revision, when SGLang's ``--revision`` does not pin one (the
  two must agree when both are given).

Any other key is refused by name: a misspelt key never silently changes nothing, and
nothing in the extra config escapes the cache identity without being named here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtiers.config.kinds import get_kind
from kvtiers.config.paths import item_path, join_path, key_path
from kvtiers.config.schema import parse_section, suggestion
from kvtiers.config.stack import _place, claim_tier_name
from kvtiers.config.tiers import FileTierConfig, LowerTierConfig
from kvtiers.config.yamlfile import YamlDocument, read_yaml
from kvtiers.errors import ConfigError

#: Where SGLang's flag puts these keys, for error messages.
EXTRA_CONFIG = "hicache_storage_backend_extra_config"
#: SGLang's own keys in a dynamic backend's extra config.
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")
#: kvtiers' keys.
KVTIERS_KEYS = ("kvtiers_config", "kvtiers_salt", "model_revision")
#: Lower-tier keys that describe how chunks leave a kvtiers primary: there is none here.
_PRIMARY_ONLY = (
    ("write", "through"), ("write_after_hits", 0), ("write_promoted", False),
    ("load_latency_s", None), ("load_bytes_per_s", None),
)
_EXAMPLE = '{"kvtiers_config": {"tiers": [{"kind": "file", "root": "/mnt/nvme/kv"}]}}'


@dataclass(frozen=True)
class BackendOptions:
    """What the extra config says: the tiers (fastest first), where they were written
    (``source``), the salt, and the revision it pins (``None``: none)."""

    tiers: tuple[LowerTierConfig, ...]
    source: str
    salt: str
    revision: str | None
    zero_copy_calls: bool


def parse_options(extra: Mapping[str, Any] | None) -> BackendOptions:
    """Read the extra config (see the module docstring); a bad one raises one
    :class:`~kvtiers.errors.ConfigError` naming the key and what to write."""
    extra = dict(extra or {})
    for key in extra:
        if key not in SGLANG_KEYS and key not in KVTIERS_KEYS:
            raise ConfigError(
                f"unknown key {key!r}{suggestion(str(key), KVTIERS_KEYS)}; kvtiers reads "
                f"{', '.join(KVTIERS_KEYS)} (SGLang itself {', '.join(SGLANG_KEYS)})",
                path=key_path(EXTRA_CONFIG, str(key)),
            )
    salt = extra.get("kvtiers_salt", "")
    if not isinstance(salt, str):
        raise ConfigError(
            f"expected a string, got {salt!r}", path=key_path(EXTRA_CONFIG, "kvtiers_salt")
        )
    revision = extra.get("model_revision")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ConfigError(
            f"expected a non-empty string, got {revision!r}",
            path=key_path(EXTRA_CONFIG, "model_revision"),
        )
    if "kvtiers_config" not in extra:
        raise ConfigError(
            f"missing key 'kvtiers_config': the stack of tiers to store pages in, e.g. "
            f"{_EXAMPLE}",
            path=key_path(EXTRA_CONFIG, "kvtiers_config"),
        )
    tiers, source = load_tiers(extra["kvtiers_config"])
    return BackendOptions(
        tiers=tiers,
        source=source,
        salt=salt,
        revision=revision,
        zero_copy_calls=bool(extra.get("interface_v1", 0)),
    )


def load_tiers(spec: object) -> tuple[tuple[LowerTierConfig, ...], str]:
    """The lower tiers of a stack file (a path) or of an inline mapping, and where they
    were written."""
    where = key_path(EXTRA_CONFIG, "kvtiers_config")
    if isinstance(spec, (str, Path)):
        document: YamlDocument = read_yaml(spec)
        try:
            return parse_tiers(document.data), str(spec)
        except ConfigError as exc:
            line = document.line_of(exc.path)
            raise exc.with_source(f"{spec}:{line}" if line is not None else str(spec)) from None
    if isinstance(spec, Mapping):
        try:
            return parse_tiers(spec), where
        except ConfigError as exc:
            raise ConfigError(exc.message, path=join_path(where, exc.path)) from None
    raise ConfigError(
        f"expected the path of a YAML stack file or a mapping with a `tiers:` list, got "
        f"{spec!r}",
        path=where,
    )


def parse_tiers(data: object) -> tuple[LowerTierConfig, ...]:
    """The ``tiers:`` list of a stack without a primary (errors carry YAML paths)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping with a `tiers:` list, e.g. {_EXAMPLE}")
    for key in data:
        if key != "tiers":
            raise ConfigError(
                f"unknown top-level key {key!r}; under SGLang a stack has a `tiers:` list "
                "only (the model's identity comes from SGLang)",
                path=str(key),
            )
    raw = data.get("tiers")
    if not isinstance(raw, list) or not raw:
        raise ConfigError(
            "expected a non-empty list of file, s3 or fsspec tiers, fastest first",
            path="tiers",
        )
    kinds = [t.get("kind") for t in raw if isinstance(t, Mapping)]
    tiers: list[LowerTierConfig] = []
    names: dict[str, int] = {}
    places: dict[tuple[str, ...], int] = {}
    for idx, raw_tier in enumerate(raw):
        where = item_path("tiers", idx)
        if not isinstance(raw_tier, Mapping) or "kind" not in raw_tier:
            raise ConfigError(
                "expected a tier mapping with a kind: file, s3 or fsspec", path=where
            )
        kind = get_kind(raw_tier["kind"], path=key_path(where, "kind"))
        if kind.name == "cpu":
            raise ConfigError(
                "SGLang's host memory pool is the primary: list only lower tiers (file, "
                "s3, fsspec) here and size the host pool with --hicache-size",
                path=key_path(where, "kind"),
            )
        name = kind.name if kinds.count(kind.name) == 1 else f"{kind.name}{idx}"
        tier = parse_section(kind.config_type, raw_tier, where, defaults={"name": name})
        assert isinstance(tier, LowerTierConfig)
        if isinstance(tier, FileTierConfig) and tier.gds:
            raise ConfigError(
                "gds: true makes a file tier a primary; under SGLang the host pool is the "
                "primary: remove it",
                path=key_path(where, "gds"),
            )
        for key, default in _PRIMARY_ONLY:
            if getattr(tier, key) != default:
                raise ConfigError(
                    f"{key} describes how chunks reach a tier from a kvtiers primary; under "
                    "SGLang every tier is written when SGLang stores a page: remove it",
                    path=key_path(where, key),
                )
        claim_tier_name(names, tier.name, idx, where)
        place, field_name = _place(tier)
        if place and place in places:
            raise ConfigError(
                f"tiers[{places[place]}] already stores chunks at {' '.join(place[1:])}; two "
                "tiers over one place evict each other's chunks: give this tier its own "
                "location",
                path=key_path(where, field_name),
            )
        if place:
            places[place] = idx
        tiers.append(tier)
    return tuple(tiers)
