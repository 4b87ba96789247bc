"""Byte sizes as people write them in a stack file: ``512MiB``, ``8 GiB``, ``1.5GiB``, ``4096``.

Binary units (``KiB``, ``MiB``, ``GiB``, ``TiB``, ``PiB``) are powers of 1024; decimal units
(``KB``, ``MB``, ``GB``, ``TB``, ``PB``) powers of 1000; ``B`` or no unit means bytes. Units
are matched case-insensitively. A size is always a positive whole number of bytes: a
fraction must come to whole bytes (``1.5KiB`` is 1536, ``1.5B`` is rejected), and bare
letters such as ``8G`` are rejected because they do not say binary or decimal.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import NewType

from kvtiers.errors import ConfigError

#: The largest size accepted: sizes become 64-bit offsets and counts further down.
MAX_SIZE_BYTES = 2**63 - 1

Size = NewType("Size", int)
"""A positive number of bytes parsed from a stack file."""

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}

_BINARY_NAMES = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

_SIZE_RE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")


def _expected(value: object) -> str:
    return f"expected a size like 8GiB, 512MiB or a number of bytes, got {value!r}"


def parse_size(value: object, *, path: str) -> Size:
    """Bytes denoted by ``value`` (an int of bytes or a string with an optional unit).

    Raises :class:`ConfigError` located at ``path`` for anything that is not a positive
    whole number of bytes.
    """
    if isinstance(value, bool):
        raise ConfigError(_expected(value), path=path)
    if isinstance(value, int):
        number = Decimal(value)
        multiplier = 1
    elif isinstance(value, float):
        if not value.is_integer():
            raise ConfigError(
                f"{value!r} is not a whole number of bytes; write a size like 1.5GiB",
                path=path,
            )
        number = Decimal(int(value))
        multiplier = 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ConfigError(_expected(value), path=path)
        unit = match["unit"]
        if unit and unit.lower() not in _UNITS:
            raise ConfigError(
                f"unknown size unit {unit!r} in {value!r}; use B, KiB, MiB, GiB, TiB "
                "(powers of 1024) or KB, MB, GB, TB (powers of 1000)",
                path=path,
            )
        multiplier = _UNITS[unit.lower()] if unit else 1
        number = Decimal(match["number"])
    else:
        raise ConfigError(_expected(value), path=path)
    total = number * multiplier
    if total != total.to_integral_value():
        raise ConfigError(f"{value!r} is not a whole number of bytes", path=path)
    if total <= 0:
        raise ConfigError(f"a size must be positive, got {value!r}", path=path)
    if total > MAX_SIZE_BYTES:
        raise ConfigError(
            f"{shown_briefly(value)} is more than {MAX_SIZE_BYTES} bytes (8 EiB), beyond "
            "what any medium or 64-bit offset holds; give a smaller size",
            path=path,
        )
    return Size(int(total))


def shown_briefly(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def format_size(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit it reaches: ``8.0 GiB``, ``1.5 KiB``, ``512 B``."""
    value = float(num_bytes)
    unit = 0
    while abs(value) >= 1024 and unit < len(_BINARY_NAMES) - 1:
        value /= 1024
        unit += 1
    return f"{num_bytes} B" if unit == 0 else f"{value:.1f} {_BINARY_NAMES[unit]}"
