"""Reading a namespace's summary: what ``kvtiers inspect`` shows of it and ``kvtiers has``.

The summary (:mod:`kvtiers.filemapper.summary`) lets a router ask whether a shared file
root or bucket holds a prefix's chunks without listing the namespace. In Python::

    from kvtiers.tools.summary import read_summary

    summary = read_summary("s3://kv-cache/prod", "org__model-0123456789abcdef")
    summary.leading(chunk_keys)  # how many of a prefix's chunks, from the first, it holds

The location is what ``kvtiers has`` takes (a file tier's root, ``s3://bucket/prefix``, an
fsspec URL) or a :class:`~kvtiers.tools.locations.Location` already open
(:func:`~kvtiers.tools.locations.open_location`), which a caller asking often keeps.

A chunk key is the chunk's block hash followed by its 4-byte big-endian KV-cache group,
the bytes a chunk's file name spells in hex (``<hash hex>_g<group>.kvc``).
"""

from __future__ import annotations

import json
import os
import time
from os import PathLike
from typing import Any, TextIO

from kvtiers.config.sizes import format_size
from kvtiers.core.keys import GROUP_INDEX_BYTES
from kvtiers.errors import ConfigError, LocationError, SummaryError
from kvtiers.filemapper import key_from_chunk_name
from kvtiers.filemapper.summary import MAX_SUMMARY_BYTES, SUMMARY_NAME, NamespaceSummary
from kvtiers.tiers.object.store import ObjectMissing
from kvtiers.tools.locations import Location, open_location
from kvtiers.tools.text import age, say


def read_summary(location: Location | str | PathLike[str], namespace: str) -> NamespaceSummary:
    """The summary of ``namespace`` at ``location``, checked. ``location`` is an open
    :class:`Location` or what :func:`~kvtiers.tools.locations.open_location` takes (a path,
    ``s3://bucket/prefix``, an fsspec URL), then opened and closed here. A namespace
    without a summary, or with one that cannot be read or fails a check, is a
    :class:`~kvtiers.errors.LocationError` saying so."""
    if not isinstance(location, Location):
        opened = open_location(os.fspath(location))
        try:
            return read_summary(opened, namespace)
        finally:
            opened.close()
    where = f"{location.describe()}/{namespace}"
    try:
        summary = _read(location, namespace)
    except SummaryError as exc:
        raise LocationError(f"{where}: {exc}; the next complete listing rewrites it") from None
    except OSError as exc:
        raise LocationError(f"{where}: cannot read its summary: {exc.strerror or exc}") from None
    if summary is None:
        raise LocationError(
            f"{where} has no summary ({SUMMARY_NAME}); a tier writes one with shared: true, "
            "list_interval_s and summary_interval_s (docs/sharing.md)"
        )
    return summary


def _read(location: Location, namespace: str) -> NamespaceSummary | None:
    """The checked summary, ``None`` when there is none; raises
    :class:`~kvtiers.errors.SummaryError` or :class:`OSError`."""
    try:
        data = location.read(f"{namespace}/{SUMMARY_NAME}", MAX_SUMMARY_BYTES)
    except (FileNotFoundError, ObjectMissing):
        return None
    return NamespaceSummary.decode(data)


def summary_report(location: Location, namespace: str) -> tuple[dict[str, Any] | None, str]:
    """What ``inspect`` says of ``namespace``'s summary: its fields for ``--json``
    (``None`` without a summary) and one line of text (empty without a summary)."""
    try:
        summary = _read(location, namespace)
    except (SummaryError, OSError) as exc:
        why = (f"{exc.check} check failed" if isinstance(exc, SummaryError)
               else exc.strerror or str(exc))
        return ({"readable": False, "error": why},
                f"  summary: unreadable ({why}); the next complete listing rewrites it")
    if summary is None:
        return None, ""
    fields = {
        "readable": True,
        "keys": summary.keys,
        "bits": summary.bits,
        "probes": summary.probes,
        "bytes": len(summary.bitmap),
        "false_positive_rate": summary.false_positive_rate,
        "listed_at": summary.listed_at_ns / 1e9,
    }
    line = (
        f"  summary: {summary.keys:,} chunk keys in {format_size(len(summary.bitmap))} "
        f"({summary.probes} probes, {summary.false_positive_rate:.2%} false positives), "
        f"listed {age(summary.listed_at_ns / 1e9, time.time())} ago"
    )
    return fields, line


def parse_key(text: str) -> bytes:
    """A chunk key from its file name (``<hash hex>_g<group>``, ``.kvc`` optional) or
    from its bytes in hex (hash then 4-byte group)."""
    name = text if text.endswith(".kvc") else f"{text}.kvc"
    key = key_from_chunk_name(name)
    if key is not None:
        return key
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) <= GROUP_INDEX_BYTES:
        raise ConfigError(
            f"{text!r} is not a chunk key: give a chunk's file name (<hash hex>_g<group>, "
            "as kvtiers inspect and the namespace's files show) or the key's bytes in hex",
            path="KEY",
        )
    return raw


#: ``kvtiers has``'s exit statuses: every key present, one absent, and no answer (no such
#: namespace, no summary, or one that cannot be read).
HAS_PRESENT = 0
HAS_ABSENT = 1
HAS_NO_SUMMARY = 3


def check_key_lengths(location: Location, namespace: str, keys: list[str],
                      parsed: list[bytes]) -> None:
    """Refuse (:class:`~kvtiers.errors.ConfigError`, exit status 2) a key whose length or
    group is not one of ``namespace``'s: its manifest names the hash (and so the key's
    length) and the number of groups. Nothing is refused when the manifest cannot say."""
    from kvtiers.core.bounded import load_json
    from kvtiers.core.keys import KeyFormat
    from kvtiers.errors import InvalidKeyError
    from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES

    try:
        document: Any = load_json(location.manifest(namespace), max_bytes=MAX_MANIFEST_BYTES)
        identity = document["identity"]
        algorithm, groups = identity["hash_algorithm"], identity["groups"]
    except (OSError, ValueError, KeyError, TypeError, ObjectMissing):
        return
    if not isinstance(algorithm, str) or not isinstance(groups, list) or not groups:
        return
    keyformat = KeyFormat.for_algorithm(len(groups), algorithm)
    for text, key in zip(keys, parsed, strict=True):
        try:
            keyformat.check(key, namespace)
        except InvalidKeyError:
            expected = ("" if keyformat.key_bytes is None
                        else f" of {keyformat.key_bytes} bytes (a {algorithm} hash and a "
                             "4-byte group)")
            raise ConfigError(
                f"{text!r} is not a chunk key of {namespace}: its keys are{expected} in "
                f"{len(groups)} group(s), this one is {len(key)} bytes"
                + ("" if keyformat.key_bytes != len(key) else " in another group"),
                path="KEY",
            ) from None


def has(location: Location, namespace: str, keys: list[str], out: TextIO, *,
        as_json: bool = False) -> int:
    """Say of each key whether the namespace's summary holds it, then how many of them
    lead (a prefix's chunks in token order). :data:`HAS_PRESENT` when every key is
    present, :data:`HAS_ABSENT` when one is not, :data:`HAS_NO_SUMMARY` when there is no
    summary to ask (said on stderr, or as JSON whose ``error`` says why). A key that cannot
    be one of the namespace's is refused (:class:`~kvtiers.errors.ConfigError`)."""
    import sys

    parsed = [parse_key(text) for text in keys]
    try:
        summary = read_summary(location, namespace)
    except LocationError as exc:
        if as_json:
            json.dump({"location": location.describe(), "namespace": namespace,
                       "listed_at": None, "false_positive_rate": None, "keys": None,
                       "leading": None, "error": str(exc)}, out, indent=2)
            print(file=out)
        else:
            from kvtiers.tools.text import visible

            print(f"kvtiers: {visible(str(exc))}", file=sys.stderr)
        return HAS_NO_SUMMARY
    check_key_lengths(location, namespace, keys, parsed)
    present = [key in summary for key in parsed]
    leading = summary.leading(parsed)
    ago = age(summary.listed_at_ns / 1e9, time.time())
    if as_json:
        json.dump({
            "location": location.describe(), "namespace": namespace,
            "listed_at": summary.listed_at_ns / 1e9,
            "false_positive_rate": summary.false_positive_rate,
            "keys": [{"key": text, "present": hit} for text, hit in zip(keys, present,
                                                                        strict=True)],
            "leading": leading, "error": None,
        }, out, indent=2)
        print(file=out)
    else:
        for text, hit in zip(keys, present, strict=True):
            say(out, f"{'present' if hit else 'absent '} {text}")
        say(out, f"{leading} of {len(keys)} leading chunk(s) present in {namespace} as "
                 f"listed {ago} ago (false positives "
                 f"{summary.false_positive_rate:.2%})")
    return HAS_PRESENT if all(present) else HAS_ABSENT
