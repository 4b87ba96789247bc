"""Bounds on untrusted nested data: JSON documents and nested mappings from users.

Files other programs can write (namespace manifests) and values from configuration
(``storage_options``) are parsed or walked only within fixed limits, so a hostile input
costs a bounded amount of time, memory and stack:

* :func:`nesting_problem` walks a value iteratively (no recursion, so no
  ``RecursionError``) and stops at the first limit passed; a value that refers to itself
  is caught by the value count;
* :func:`load_json` refuses oversized input before parsing and nesting deeper than its
  limit after (the C decoder stops itself at the interpreter's recursion limit, which is
  caught), and raises only :class:`ValueError` with a one-line message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

#: Default deepest nesting of a JSON document (a manifest is 4 levels deep).
MAX_JSON_DEPTH = 32


def nesting_problem(value: object, *, max_depth: int, max_values: int) -> str | None:
    """Why ``value`` (nested mappings and lists/tuples) is too big, or ``None``.

    Depth counts containers: a flat mapping is depth 1. Values count every container and
    leaf reached, repeats included."""
    stack: list[tuple[object, int]] = [(value, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > max_values:
            return f"holds more than {max_values} values"
        if isinstance(item, Mapping):
            children: list[object] = list(item.values())
        elif isinstance(item, list | tuple):
            children = list(item)
        else:
            continue
        if depth + 1 > max_depth:
            return f"nests deeper than {max_depth} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


def load_json(data: bytes, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> object:
    """Parse ``data`` as UTF-8 JSON within the limits; :class:`ValueError` otherwise."""
    if len(data) > max_bytes:
        raise ValueError(f"over {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        # The C decoder guards its recursion and unwinds cleanly at the interpreter's limit.
        raise ValueError(f"nests deeper than {max_depth} levels") from None
    problem = nesting_problem(document, max_depth=max_depth, max_values=max_bytes)
    if problem is not None:
        raise ValueError(problem)
    return document
