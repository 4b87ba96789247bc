"""``kvtiers identity`` and ``kvtiers diff``: the answer to "my cache missed; why?".

``identity`` prints, field by field, the cache identity (and so the namespace) that a stack
file's ``model:`` section gives; ``diff`` reads the manifests of two namespaces under a
file root or an S3 prefix and names every identity field that differs between them. Field
names are dotted the way ``docs/on-disk-format.md`` and ``NamespaceMismatchError`` spell
them (``groups[0].tokens_per_block``, ``parallel.tp_size``, ``len(groups)``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TextIO

from kvtiers.core.bounded import load_json
from kvtiers.errors import KVTiersError, LocationError
from kvtiers.filemapper.identity import NamespaceIdentity
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES, differences
from kvtiers.tiers.object.store import ObjectMissing
from kvtiers.tools.commands import require_namespaces
from kvtiers.tools.locations import Location
from kvtiers.tools.text import say


def _leaves(value: object, path: str) -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        for name in sorted(value):
            yield from _leaves(value[name], f"{path}.{name}" if path else str(name))
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        for idx, item in enumerate(value):
            yield from _leaves(item, f"{path}[{idx}]")
    else:
        yield path, value


def identity_fields(identity: NamespaceIdentity) -> list[tuple[str, object]]:
    """Every field of ``identity`` as (dotted name, value), groups and parallel expanded."""
    return list(_leaves(identity.to_dict(), ""))


def _show(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def print_identity(identity: NamespaceIdentity, out: TextIO) -> None:
    """The namespace, digest and every identity field, one per line (a long value wraps
    onto indented continuation lines, as every report does: see :mod:`kvtiers.tools.text`)."""
    fields = identity_fields(identity)
    width = max(len(name) for name, _ in fields)
    say(out, f"namespace  {identity.namespace}")
    say(out, f"digest     {identity.hexdigest}")
    for name, value in fields:
        say(out, f"  {name:<{width}}  {_show(value)}", hang=width + 4)


def stored_identity(location: Location, namespace: str) -> dict[str, Any]:
    """The identity recorded in ``namespace``'s manifest, as stored (not re-validated: an
    older schema's identity is compared as it is).

    A location that holds no namespace, or not this one, is a :class:`LocationError`
    (exit status 1, as for ``inspect`` and ``gc``); a manifest that cannot be read is a
    :class:`KVTiersError` (exit status 1 too).
    """
    if namespace not in require_namespaces(location):
        raise LocationError(
            f"no namespace {namespace!r} under {location.describe()}; `kvtiers inspect` "
            "lists the namespaces there"
        )
    try:
        document = load_json(location.manifest(namespace), max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, ValueError, KeyError, ObjectMissing) as exc:
        raise KVTiersError(f"{namespace}: manifest unreadable ({exc})") from None
    identity = document.get("identity") if isinstance(document, dict) else None
    if not isinstance(identity, dict):
        raise KVTiersError(f"{namespace}: manifest holds no identity")
    return identity


def differ_heading(count: int) -> str:
    """The line ``diff`` opens its list of ``count`` (>= 1) differing fields with."""
    return "1 field differs:" if count == 1 else f"{count} fields differ:"


def diff(location: Location, first: str, second: str, out: TextIO, *,
         as_json: bool = False) -> int:
    """Name every identity field that differs between two namespaces: 0 when the
    identities are identical, 1 when they differ (as ``diff`` and ``cmp`` answer)."""
    a, b = stored_identity(location, first), stored_identity(location, second)
    found = differences(a, b)
    if as_json:
        json.dump({"location": location.describe(), "a": first, "b": second,
                   "identical": not found,
                   "differences": [{"field": name, "a": found[name][0], "b": found[name][1]}
                                   for name in sorted(found)]},
                  out, indent=2, ensure_ascii=False, default=str)
        print(file=out)
        return 1 if found else 0
    say(out, f"A: {first}")
    say(out, f"B: {second}")
    if not found:
        say(out, "the identities are identical")
        return 0
    say(out, differ_heading(len(found)))
    for name in sorted(found):
        value_a, value_b = found[name]
        say(out, f"  {name}: {_show(value_a)} -> {_show(value_b)}")
    return 1
