"""Sections of a stack file as frozen dataclasses, parsed generically from their type hints.

A section is a frozen, keyword-only dataclass deriving from :class:`Section`. Parsing
(:func:`parse_section`) is driven by the field types alone, never by per-key code:

=================================  ===================================================
field type                         accepted YAML value
=================================  ===================================================
``bool``                           ``true`` / ``false``
``int``                            an integer (not a boolean, not ``8.0``)
``float``                          a finite number
``str``                            a string (``2024`` must be quoted)
``Literal["a", "b"]``              one of the listed strings
``Size``                           a size (:func:`~kvtiers.config.sizes.parse_size`)
``OctalMode``                      permission bits: ``0640`` or ``"0o640"``
``tuple[X, ...]``                  a list of X
``Mapping[str, Any]``              a mapping with string keys, kept read-only
a ``Section`` subclass             a nested mapping
``X | None``                       X, or ``null``; a missing key takes the default
=================================  ===================================================

Conversion happens in the parser. Value rules are written into the type with
``Annotated[int, Range(1, 256)]`` and checked by :meth:`Section.__post_init__`, so a
section built in code is checked exactly like one read from YAML; rules that tie several
fields together go in :meth:`Section._check`. Every failure is a
:class:`~kvtiers.errors.ConfigError` whose path is relative to the section being built;
:func:`parse_section` prefixes the section's own path.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import (
    Annotated,
    Any,
    ClassVar,
    Literal,
    NewType,
    Protocol,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from kvtiers.config.paths import item_path, join_path, key_path
from kvtiers.config.sizes import Size, parse_size
from kvtiers.errors import ConfigError

#: Integers from a stack file must fit in 64 bits: they reach C code and fixed-width fields.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

OctalMode = NewType("OctalMode", int)
"""POSIX permission bits (``0o000`` to ``0o777``), written in YAML as ``0640`` or ``"0o640"``."""


class Constraint(Protocol):
    """A rule on a parsed value: ``check`` returns what is wrong with it, or ``None``."""

    def check(self, value: Any) -> str | None: ...


@dataclass(frozen=True)
class Range:
    """``low <= value <= high`` (either bound optional); ``above`` makes ``low`` exclusive."""

    low: float | None = None
    high: float | None = None
    above: bool = False

    def check(self, value: Any) -> str | None:
        too_low = self.low is not None and (value <= self.low if self.above else value < self.low)
        too_high = self.high is not None and value > self.high
        if not (too_low or too_high):
            return None
        if self.low is not None and self.high is not None:
            wanted = f"from {self.low:g} to {self.high:g}"
        elif self.low is not None:
            wanted = f"greater than {self.low:g}" if self.above else f"of at least {self.low:g}"
        else:
            wanted = f"of at most {self.high:g}"
        return f"expected a value {wanted}, got {value!r}"


@dataclass(frozen=True)
class Matches:
    """The string matches ``pattern`` entirely; ``described`` says in words what that is."""

    pattern: str
    described: str

    def check(self, value: Any) -> str | None:
        if re.fullmatch(self.pattern, value):
            return None
        return f"expected {self.described}, got {value!r}"


@dataclass(frozen=True)
class Check:
    """A rule given as a function returning what is wrong with the value, or ``None``."""

    rule: Callable[[Any], str | None]

    def check(self, value: Any) -> str | None:
        return self.rule(value)


def example(text: str) -> dict[str, str]:
    """Field metadata for a required field: ``text`` (``capacity: 8GiB``) is shown when it
    is missing. Use as ``capacity: Size = field(metadata=example("capacity: 8GiB"))``."""
    return {"example": text}


@dataclass(frozen=True)
class FieldSpec:
    """What parsing needs to know about one field of a section."""

    name: str
    type: Any
    optional: bool
    constraints: tuple[Constraint, ...]
    required: bool
    example: str


@dataclass(frozen=True, kw_only=True)
class Section:
    """Base of every section: checks its fields' constraints on construction."""

    what: ClassVar[str] = "this section"
    """How messages name the section: ``a cpu tier``, ``the model section``."""

    def __post_init__(self) -> None:
        for spec in field_specs(type(self)):
            value = getattr(self, spec.name)
            if value is None:
                continue
            for constraint in spec.constraints:
                problem = constraint.check(value)
                if problem is not None:
                    raise ConfigError(problem, path=spec.name)
        self._check()

    def _check(self) -> None:
        """Rules across fields; raise :class:`ConfigError` with the field's name as path."""


S = TypeVar("S", bound=Section)


def _unwrap(hint: Any) -> tuple[Any, bool, tuple[Constraint, ...]]:
    """``(type, optional, constraints)`` of a field hint such as ``Annotated[int, …] | None``."""
    constraints: list[Constraint] = []
    optional = False
    while True:
        origin = get_origin(hint)
        if origin is Annotated:
            hint, *extra = get_args(hint)
            constraints.extend(extra)
        elif origin in (Union, types.UnionType):
            members = [arg for arg in get_args(hint) if arg is not type(None)]
            assert len(members) == 1, f"only `X | None` unions are supported, got {hint}"
            optional = True
            hint = members[0]
        else:
            return hint, optional, tuple(constraints)


_FIELD_SPECS: dict[type[Section], tuple[FieldSpec, ...]] = {}


def field_specs(cls: type[Section]) -> tuple[FieldSpec, ...]:
    """The parsing view of ``cls``'s fields, in declaration order (computed once per class)."""
    cached = _FIELD_SPECS.get(cls)
    if cached is not None:
        return cached
    hints = get_type_hints(cls, include_extras=True)
    specs = []
    for field in dataclasses.fields(cls):
        tp, optional, constraints = _unwrap(hints[field.name])
        no_default = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        specs.append(
            FieldSpec(
                name=field.name,
                type=tp,
                optional=optional,
                constraints=constraints,
                required=no_default,
                example=field.metadata.get("example", ""),
            )
        )
    _FIELD_SPECS[cls] = result = tuple(specs)
    return result


def suggestion(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""`` if none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def shown(value: object) -> str:
    """``value`` as a message shows it: strings quoted, containers by kind, null by name."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def parse_section(
    cls: type[S], raw: object, path: str, *, defaults: Mapping[str, object] | None = None
) -> S:
    """Build ``cls`` from the mapping ``raw`` found at ``path``.

    ``defaults`` supplies values for keys the YAML may omit even though ``cls`` requires
    them (e.g. a tier's ``name``, which defaults to its position).
    """
    specs = field_specs(cls)
    known = [spec.name for spec in specs]
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"expected a mapping for {cls.what} with keys {', '.join(known)}; got {shown(raw)}",
            path=path,
        )
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r}", path=path)
        if key not in known:
            raise ConfigError(
                f"unknown key {key!r} for {cls.what}{suggestion(key, known)}; "
                f"known keys: {', '.join(known)}",
                path=key_path(path, key),
            )
    values: dict[str, object] = {}
    for spec in specs:
        where = key_path(path, spec.name)
        if spec.name in raw:
            values[spec.name] = parse_field(spec, raw[spec.name], where)
        elif defaults is not None and spec.name in defaults:
            values[spec.name] = defaults[spec.name]
        elif spec.required:
            example = f"; add it, e.g. `{spec.example}`" if spec.example else ""
            raise ConfigError(
                f"missing required key {spec.name!r} for {cls.what}{example}", path=where
            )
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(exc.message, path=join_path(path, exc.path)) from None


def parse_field(spec: FieldSpec, value: object, path: str) -> object:
    """``value`` converted to ``spec``'s type (``null`` allowed only for optional fields)."""
    if value is None and spec.optional:
        return None
    return parse_value(spec.type, value, path)


def parse_value(tp: Any, value: object, path: str) -> object:
    """``value`` converted to ``tp`` (see the table in the module docstring)."""
    if tp is Size:
        return parse_size(value, path=path)
    if tp is OctalMode:
        return parse_mode(value, path=path)
    origin = get_origin(tp)
    if origin is Literal:
        choices = [str(choice) for choice in get_args(tp)]
        if isinstance(value, str) and value in choices:
            return value
        hint = suggestion(value, choices) if isinstance(value, str) else ""
        raise ConfigError(
            f"expected one of {', '.join(choices)}, got {shown(value)}{hint}", path=path
        )
    if origin is tuple:
        item_type, ellipsis = get_args(tp)
        assert ellipsis is Ellipsis, f"only tuple[X, ...] is supported, got {tp}"
        if not isinstance(value, list):
            raise ConfigError(f"expected a list, got {shown(value)}", path=path)
        return tuple(
            parse_value(item_type, item, item_path(path, index)) for index, item in enumerate(value)
        )
    if origin is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {shown(value)}", path=path)
        for key in value:
            if not isinstance(key, str):
                raise ConfigError(f"keys must be strings, got {key!r}", path=path)
        return types.MappingProxyType(dict(value))
    if isinstance(tp, type) and issubclass(tp, Section):
        return parse_section(tp, value, path)
    return _parse_scalar(tp, value, path)


def _parse_scalar(tp: Any, value: object, path: str) -> object:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"expected true or false, got {shown(value)}", path=path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise ConfigError(
                    f"{value:.3g} does not fit in 64 bits (at most {INT64_MAX}); give a "
                    "smaller number",
                    path=path,
                )
            return value
        raise ConfigError(f"expected an integer, got {shown(value)}", path=path)
    if tp is float:
        number = value if isinstance(value, (int, float)) else None
        if number is not None and not isinstance(number, bool) and math.isfinite(number):
            return float(number)
        raise ConfigError(f"expected a number, got {shown(value)}", path=path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(
            f"expected a string, got {shown(value)}; quote it if it is meant as text",
            path=path,
        )
    raise AssertionError(f"no parser for field type {tp!r} at {path}")


def parse_mode(value: object, *, path: str) -> OctalMode:
    """Permission bits from a YAML octal integer (``0640``) or string (``"0640"``, ``"0o640"``).

    Values above ``0o777`` are rejected: they are almost always octal digits written
    without the leading ``0`` (``640`` is decimal 640, i.e. ``0o1200``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"(0o?)?[0-7]{1,4}", value.strip()):
        mode = int(value.strip().removeprefix("0o"), 8)
    else:
        raise ConfigError(
            f"expected permission bits like 0640 or '0o640', got {shown(value)}", path=path
        )
    if not 0 <= mode <= 0o777:
        raise ConfigError(
            f"permission bits must be between 0 and 0o777, got {value!r}; write octal "
            "with a leading 0 (0640) or as a string ('0o640')",
            path=path,
        )
    return OctalMode(mode)
