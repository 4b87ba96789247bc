"""``kvtiers inspect | verify | gc``: offline tools over a file root or an S3 prefix.

They read manifests and chunk headers directly (no tier, no identity needed) and print
plain text wrapped as :mod:`kvtiers.tools.text` says, or JSON (``--json``) for scripts.
Reports go to the output stream; a location that holds no kvtiers namespace, or a named
namespace that does not exist, is an error (:class:`~kvtiers.errors.LocationError`, exit status 1).

Reads are bounded (a manifest up to its size limit, a chunk's payload streamed in
:data:`VERIFY_BLOCK_BYTES` blocks), and a malformed manifest or chunk is one line of
output, never a traceback. ``verify`` checks every chunk exactly as a load would (header,
namespace, key, length, xxh3_128 of the stored bytes; a chunk stored with a codec is also
decoded and its decoded payload checked) and with ``--fix`` quarantines what fails; a
chunk whose codec this machine cannot decode is reported as not checked; ``gc``
removes whole namespaces (named, or stale), old chunks, chunks beyond a size, and
interrupted temp files — and nothing else.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import xxhash

from kvtiers.config.sizes import format_size
from kvtiers.core.bounded import load_json
from kvtiers.core.chunkformat import HEADER_BYTES, ChunkHeader, decode_header, finish_load
from kvtiers.core.codec import CODEC_NONE, CodecUnavailableError, Scratch
from kvtiers.core.keys import GROUP_INDEX_BYTES, get_offload_group_idx
from kvtiers.errors import CorruptChunkError, LocationError
from kvtiers.filemapper import key_from_chunk_name
from kvtiers.filemapper.manifest import MAX_MANIFEST_BYTES
from kvtiers.tiers.object.store import ObjectMissing
from kvtiers.tools.locations import Entry, Location, is_temp
from kvtiers.tools.summary import summary_report
from kvtiers.tools.text import DAY_S, age, say, say_parts

#: ``verify`` reads a chunk's payload in blocks of this size.
VERIFY_BLOCK_BYTES = 4 << 20
#: The largest decoded payload ``verify`` allocates for a chunk stored with a codec.
MAX_DECODED_BYTES = 1 << 32
_DIGEST_HEX = re.compile(r"[0-9a-f]{64}")


def _manifest(location: Location, namespace: str) -> dict[str, Any] | None:
    """The manifest as a mapping, or ``None`` when it cannot be read or parsed (bounded:
    see :func:`~kvtiers.core.bounded.load_json`)."""
    try:
        document = load_json(location.manifest(namespace), max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, ValueError, KeyError, ObjectMissing):
        return None
    return document if isinstance(document, dict) else None


def _group_report(manifest: dict[str, Any], chunks: list[Entry]) -> list[dict[str, Any]]:
    """Each KV-cache group of the identity: its attention kind (``full``,
    ``sliding_window:N`` ...; ``None`` where the manifest does not say), layer count and
    the chunks stored for it. :class:`_Malformed` names the first field that is not what
    kvtiers writes."""
    ident = _typed(manifest, "identity", dict)
    counts: dict[int, int] = {}
    for entry in chunks:
        key = key_from_chunk_name(entry.base)
        if key is not None:
            group = get_offload_group_idx(key)
            counts[group] = counts.get(group, 0) + 1
    groups = []
    for index, group in enumerate(_typed(ident, "groups", list, "identity")):
        if not isinstance(group, dict):
            raise _Malformed(f"identity.groups[{index}] is not a mapping")
        layers = _typed(group, "layer_names", list, f"identity.groups[{index}]")
        attention = group.get("attention")
        groups.append({"attention": attention if isinstance(attention, str) else None,
                       "layers": len(layers), "chunks": counts.get(index, 0)})
    return groups


def _manifest_lines(manifest: dict[str, Any], chunks: list[Entry]) -> list[list[str]]:
    """What :func:`inspect` prints of a manifest: lines of fields, each field kept whole
    when a line wraps (one line per KV-cache group, with the chunks stored for it);
    :class:`_Malformed` names the first field that is not what kvtiers writes."""
    # The report checks the groups' fields first (a malformed one is named, not a KeyError).
    reports = _group_report(manifest, chunks)
    ident = manifest["identity"]
    groups = []
    for index, (group, report) in enumerate(zip(ident["groups"], reports, strict=True)):
        size = _typed(group, "bytes_per_block", int, f"identity.groups[{index}]")
        kind = f" {report['attention']}" if report["attention"] else ""
        groups.append([f"group {index}{kind}",
                       f"{group.get('tokens_per_block')} tok/block x {report['layers']} "
                       f"layers ({format_size(size)}/block)",
                       f"{report['chunks']:,} chunks"])
    parallel = ident.get("parallel")
    layout = "parallelism-agnostic"
    if isinstance(parallel, dict):
        layout = " ".join(f"{str(k).removesuffix('_size')}={v}"
                          for k, v in sorted(parallel.items()))
    elif parallel is not None:
        raise _Malformed("identity.parallel is not a mapping")
    model = str(ident.get("model_name"))
    if ident.get("model_revision"):
        model += f"@{ident.get('model_revision')}"
    return [
        [f"model {model}", f"engine {ident.get('engine')}",
         f"kv {ident.get('kv_dtype')} {ident.get('kv_layout')}",
         f"hash {ident.get('hash_algorithm')}"],
        [f"tokens_per_hash {ident.get('tokens_per_hash')}",
         f"blocks_per_chunk {ident.get('blocks_per_chunk')}",
         f"groups {len(groups)}:"],
        *groups,
        [f"parallel: {layout}", f"created {manifest.get('created_at')}",
         f"format {manifest.get('format_version')}/{manifest.get('chunk_format_version')}"],
    ]


class _Malformed(Exception):
    """A manifest field is not of the kind kvtiers writes."""


def _typed(mapping: dict[str, Any], name: str, kind: type, where: str = "") -> Any:
    value = mapping.get(name)
    # bool is an int to Python, never a size or a count here.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        dotted = f"{where}.{name}" if where else name
        raise _Malformed(f"{dotted} is {_shorten(repr(value))}, not a {kind.__name__}")
    return value


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class _Census:
    chunks: list[Entry] = field(default_factory=list)
    temps: list[Entry] = field(default_factory=list)
    other: list[Entry] = field(default_factory=list)
    # Not regular files (FIFOs, directories, symlinks) under a chunk's name: never read.
    irregular: list[Entry] = field(default_factory=list)

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> _Census:
        census = cls()
        for entry in entries:
            if entry.irregular is not None and key_from_chunk_name(entry.base) is not None:
                census.irregular.append(entry)
            elif is_temp(entry):
                census.temps.append(entry)
            elif key_from_chunk_name(entry.base) is not None:
                census.chunks.append(entry)
            else:
                census.other.append(entry)
        return census


def require_namespaces(location: Location) -> list[str]:
    """The location's namespaces; :class:`LocationError` when it holds none, so a typo in a
    path or prefix is an error rather than an empty, successful report."""
    namespaces = location.namespaces()
    if not namespaces:
        raise LocationError(
            f"{location.describe()} holds no kvtiers namespace (a directory or prefix with a "
            "manifest.json): give a file tier's root or an S3 tier's bucket/prefix"
        )
    return namespaces


def tenant_usage(chunks: Iterable[Entry], tenants: Sequence[str]) -> dict[str, dict[str, int]]:
    """``{tenant: {"chunks": n, "bytes": b}}`` of ``chunks`` by the tag their keys carry
    (:mod:`kvtiers.stack.tenants`), for each of ``tenants`` and, under ``"(untagged)"``,
    the rest: the default tenant's, or chunks written without tenants."""
    from kvtiers.config.tenants import TAG_BYTES, tenant_tag

    by_tag = {tenant_tag(name): name for name in tenants}
    usage = {name: {"chunks": 0, "bytes": 0} for name in (*tenants, UNTAGGED)}
    for entry in chunks:
        key = key_from_chunk_name(entry.base)
        owner = UNTAGGED if key is None else by_tag.get(bytes(key[:TAG_BYTES]), UNTAGGED)
        usage[owner]["chunks"] += 1
        usage[owner]["bytes"] += entry.size
    return usage


#: :func:`tenant_usage`'s name for chunks no listed tenant's tag marks.
UNTAGGED = "(untagged)"


def inspect(location: Location, out: TextIO, *, as_json: bool = False,
            tenants: Sequence[str] = ()) -> int:
    """Namespaces with their manifest fields, chunk counts, bytes and ages; with
    ``tenants`` (names from a ``tenants:`` section), each one's chunks and bytes."""
    now = time.time()
    namespaces = require_namespaces(location)
    report: list[dict[str, Any]] = []
    for namespace in namespaces:
        census = _Census.of(location.entries(namespace))
        manifest = _manifest(location, namespace)
        chunks = census.chunks
        lines: list[list[str]]
        groups: list[dict[str, Any]] | None = None
        if manifest is None:
            lines = [["manifest: unreadable (every chunk here reads as a miss)"]]
        else:
            try:
                lines = _manifest_lines(manifest, chunks)
                groups = _group_report(manifest, chunks)
            except _Malformed as exc:
                lines = [[f"manifest: malformed ({exc}; every chunk here reads as a miss)"]]
        quarantined = list(location.quarantined(namespace))
        summary, summary_line = summary_report(location, namespace)
        if summary_line:
            lines.append([summary_line.strip()])
        report.append({
            "namespace": namespace,
            "manifest": manifest,
            "groups": groups,
            "chunks": len(chunks),
            "chunk_bytes": sum(e.size for e in chunks),
            "newest_mtime": max((e.mtime for e in chunks), default=None),
            "oldest_mtime": min((e.mtime for e in chunks), default=None),
            "temp_files": len(census.temps),
            "other_files": len(census.other),
            "not_regular_files": len(census.irregular),
            "quarantined": len(quarantined),
            "quarantined_bytes": sum(e.size for e in quarantined),
            "quarantined_oldest_mtime": min((e.mtime for e in quarantined), default=None),
            "summary": summary,
            "tenants": tenant_usage(chunks, tenants) if tenants else None,
            "lines": lines,
        })
    if as_json:
        json.dump({"location": location.describe(),
                   "namespaces": [{k: v for k, v in r.items() if k != "lines"}
                                  for r in report]},
                  out, indent=2, default=str)
        print(file=out)
        return 0
    say(out, f"{location.describe()}: {len(namespaces)} namespace(s)")
    for r in report:
        print(file=out)
        say(out, r["namespace"])
        for fields in r["lines"]:
            say_parts(out, fields, indent=2)
        ages = ""
        if r["chunks"]:
            ages = (f", newest {age(r['newest_mtime'], now)} old, oldest "
                    f"{age(r['oldest_mtime'], now)} old")
        parts = [f"chunks {r['chunks']:,} ({format_size(r['chunk_bytes'])}){ages}",
                 f"temp files {r['temp_files']}", f"other files {r['other_files']}"]
        if r["not_regular_files"]:
            parts.append(f"not regular files {r['not_regular_files']}")
        say_parts(out, parts, indent=2)
        if r["tenants"]:
            say_parts(out, [f"tenant {name} {use['chunks']:,} ({format_size(use['bytes'])})"
                            for name, use in r["tenants"].items()], indent=2)
        if r["quarantined"]:
            say_parts(out, [
                f"quarantined {r['quarantined']:,} ({format_size(r['quarantined_bytes'])}),",
                f"oldest {age(r['quarantined_oldest_mtime'], now)} old:",
                "corrupt chunks no tier reads;",
                "kvtiers gc --quarantine-older-than-days removes them",
            ], indent=2, separator=" ")
    return 0


def _progress(entries: list[Entry], show: bool) -> Iterator[Entry]:
    if not show:
        yield from entries
        return
    from tqdm import tqdm

    yield from tqdm(entries, unit="chunk", leave=False)


def verify(location: Location, out: TextIO, *, fix: bool = False,
           progress: bool = False, as_json: bool = False) -> int:
    """Check every chunk; 0 when all are good (or were quarantined with ``fix``), else 1.

    Entries under a chunk's name that are not regular files (FIFOs, directories,
    symlinks) and chunks that cannot be read are reported as unreadable, never opened in
    a way that could block, and make the answer 1 (``fix`` leaves them to the operator)."""
    bad_total = 0
    report: list[dict[str, Any]] = []
    for namespace in require_namespaces(location):
        census = _Census.of(location.entries(namespace))
        manifest = _manifest(location, namespace)
        digest_hex = manifest.get("digest") if manifest else None
        if not isinstance(digest_hex, str) or not _DIGEST_HEX.fullmatch(digest_hex):
            report.append({"namespace": namespace, "manifest_readable": False,
                           "chunks": len(census.chunks)})
            if not as_json:
                say(out, f"{namespace}: manifest unreadable; its {len(census.chunks)} chunks "
                          "cannot be verified (remove the namespace with kvtiers gc "
                          "--namespace)")
            bad_total += 1
            continue
        digest = bytes.fromhex(digest_hex)
        bad: list[tuple[Entry, str]] = []
        unreadable: list[tuple[Entry, str]] = []
        undecodable: list[tuple[Entry, str]] = []
        for entry in _progress(census.chunks, progress):
            key = key_from_chunk_name(entry.base)
            assert key is not None
            try:
                _verify_chunk(location, entry.name, digest, key)
            except CorruptChunkError as exc:
                bad.append((entry, exc.check))
            except CodecUnavailableError as exc:
                undecodable.append((entry, str(exc)))
            except (FileNotFoundError, ObjectMissing):
                continue  # evicted by a running engine since the listing
            except OSError as exc:
                unreadable.append((entry, exc.strerror or str(exc)))
        ok = len(census.chunks) - len(bad) - len(unreadable) - len(undecodable)
        unreadable += [(e, f"{e.irregular}, not a regular file") for e in census.irregular]
        # Corrupt chunks a running engine evicted or quarantined since their check: gone,
        # so nothing is left to set aside (and nothing wrong is left to report).
        vanished: set[str] = set()
        for entry, _check in bad:
            if fix:
                try:
                    location.quarantine(namespace, entry.name)
                except (FileNotFoundError, ObjectMissing):
                    vanished.add(entry.name)
        entry_report: dict[str, Any] = {
            "namespace": namespace, "manifest_readable": True, "ok": ok,
            "corrupt": [{"name": e.name, "check": check,
                         "quarantined": fix and e.name not in vanished}
                        | ({"vanished": True} if e.name in vanished else {})
                        for e, check in bad],
            "unreadable": [{"name": e.name, "why": why} for e, why in unreadable],
        }
        if undecodable:  # chunks whose codec this machine cannot decode
            entry_report["not_checked"] = [{"name": e.name, "why": why}
                                           for e, why in undecodable]
        report.append(entry_report)
        if not as_json:
            say(out, f"{namespace}: {ok:,} chunks ok, {len(bad)} corrupt, "
                     f"{len(unreadable)} unreadable"
                     + (f", {len(undecodable)} not checked" if undecodable else ""))
            # The reason first, the name last: a long name then wraps onto a line of its
            # own and stays whole (copyable).
            for entry, check in bad:
                done = ("; gone before its quarantine" if entry.name in vanished
                        else "; quarantined" if fix else "")
                say(out, f"  corrupt ({check} check failed{done}): {entry.name}")
            for entry, why in unreadable:
                say(out, f"  unreadable ({why}; not a chunk any tier loads, remove it): "
                          f"{entry.name}")
            for entry, why in undecodable:
                say(out, f"  not checked ({why}): {entry.name}")
        bad_total += len(unreadable) + len(undecodable)
        if not fix:
            bad_total += len(bad)
    if as_json:
        json.dump({"location": location.describe(), "ok": not bad_total,
                   "namespaces": report}, out, indent=2)
        print(file=out)
    return 1 if bad_total else 0


def _verify_chunk(location: Location, name: str, digest: bytes, key: bytes) -> None:
    """Check one chunk as a load would, holding at most about one
    :data:`VERIFY_BLOCK_BYTES` block of it at a time until its stored bytes are known to
    be the ones written: they are hashed block by block first. Only a chunk stored with
    a codec whose stored checksum matched is then read again whole (it is shorter than
    its chunk), decoded and checked again."""
    head = bytearray()
    header: ChunkHeader | None = None
    hasher = xxhash.xxh3_128()
    size = 0
    for block in location.stream(name, 0, VERIFY_BLOCK_BYTES):
        if header is None:
            head += block
            if len(head) < HEADER_BYTES:
                continue
            header = decode_header(head, namespace_digest=digest, key=key)
            block = bytes(head[HEADER_BYTES:])
        size += len(block)
        if size > header.stored_bytes:
            break
        hasher.update(block)
    if header is None:
        header = decode_header(head, namespace_digest=digest, key=key)  # raises: too short
    if size != header.stored_bytes:
        raise CorruptChunkError(
            "payload length",
            f"{'more than ' if size > header.stored_bytes else ''}{size} bytes, "
            f"header says {header.stored_bytes}",
        )
    if hasher.digest() != header.checksum:
        raise CorruptChunkError("payload checksum")
    if header.codec == CODEC_NONE:
        return
    if header.payload_bytes > MAX_DECODED_BYTES:
        raise CorruptChunkError(
            "payload length", f"{header.payload_bytes} decoded bytes is no chunk's size"
        )
    payload = memoryview(bytearray(header.payload_bytes))
    got = 0
    for block in location.stream(name, HEADER_BYTES, VERIFY_BLOCK_BYTES):
        if got + len(block) > header.stored_bytes:
            raise CorruptChunkError("payload length", "the chunk grew while it was read")
        payload[got:got + len(block)] = block
        got += len(block)
    finish_load(header, payload, got, Scratch())


@dataclass(frozen=True)
class GcRules:
    """What ``gc`` removes. Temp files older than ``temp_age_s`` always go."""

    namespaces: tuple[str, ...] = ()
    stale_days: float | None = None
    older_than_days: float | None = None
    max_bytes: int | None = None
    temp_age_s: float = 3600.0
    dry_run: bool = False
    #: Remove quarantined (corrupt) chunks older than this many days.
    quarantine_older_than_days: float | None = None
    #: Block hash → expiry (epoch seconds), from retention ledgers: remove the chunks of
    #: block hashes past their expiry.
    expired: Mapping[bytes, float] | None = None


def gc(location: Location, rules: GcRules, out: TextIO) -> int:
    """Remove what ``rules`` name; print one line per namespace touched and a closing
    total of what went (a whole namespace's bytes included, its quarantine too). A
    named namespace that does not exist is a :class:`LocationError` (nothing is
    removed then)."""
    now = time.time()
    verb = "would remove" if rules.dry_run else "removed"
    act: Callable[[str], None] = (lambda name: None) if rules.dry_run else location.delete
    existing = require_namespaces(location)
    unknown = [n for n in rules.namespaces if n not in existing]
    if unknown:
        raise LocationError(
            f"no namespace {', '.join(map(repr, unknown))} under {location.describe()}; "
            "`kvtiers inspect` lists the namespaces there"
        )
    files = namespaces_gone = 0
    freed = 0
    for namespace in existing:
        census = _Census.of(location.entries(namespace))
        newest = max((e.mtime for e in census.chunks), default=_created(location, namespace))
        stale = rules.stale_days is not None and now - newest > rules.stale_days * DAY_S
        if namespace in rules.namespaces or stale:
            why = "named" if namespace in rules.namespaces else (
                f"newest chunk {age(newest, now)} old")
            quarantined = list(location.quarantined(namespace))
            size = sum(e.size for e in (*census.chunks, *census.temps, *census.other,
                                        *quarantined))
            count = (len(census.chunks) + len(census.temps) + len(census.other)
                     + len(quarantined) + 1
                     if rules.dry_run else location.remove_namespace(namespace))
            say(out, f"{namespace}: {verb} the namespace ({why}; {count} entries, "
                     f"{format_size(size)})")
            namespaces_gone += 1
            freed += size
            continue
        doomed = [e for e in census.temps if now - e.mtime > rules.temp_age_s]
        if rules.quarantine_older_than_days is not None:
            cutoff = now - rules.quarantine_older_than_days * DAY_S
            doomed += [e for e in location.quarantined(namespace)
                       if e.mtime < cutoff and e.irregular is None]
        keep = sorted(census.chunks, key=lambda e: e.mtime, reverse=True)
        if rules.expired:
            past = [_expired(e, rules.expired, now) for e in keep]
            doomed += [e for e, gone in zip(keep, past, strict=True) if gone]
            keep = [e for e, gone in zip(keep, past, strict=True) if not gone]
        if rules.older_than_days is not None:
            cutoff = now - rules.older_than_days * DAY_S
            doomed += [e for e in keep if e.mtime < cutoff]
            keep = [e for e in keep if e.mtime >= cutoff]
        if rules.max_bytes is not None:
            total = 0
            for index, entry in enumerate(keep):
                total += entry.size
                if total > rules.max_bytes:
                    doomed += keep[index:]
                    break
        for entry in doomed:
            act(entry.name)
        if doomed:
            size = sum(e.size for e in doomed)
            say(out, f"{namespace}: {verb} {len(doomed)} files ({format_size(size)})")
            files += len(doomed)
            freed += size
    if namespaces_gone or files:
        say(out, f"gc: {verb} {namespaces_gone} namespace(s) and {files} file(s) "
                  f"({format_size(freed)}) of {len(existing)} namespace(s)")
    else:
        say(out, f"gc: nothing to remove in {len(existing)} namespace(s) (temp files older "
                  f"than {rules.temp_age_s:g} s always go; --namespace, --stale-days, "
                  "--older-than-days, --max-bytes and --quarantine-older-than-days "
                  "choose more)")
    return 0


def _expired(entry: Entry, expiries: Mapping[bytes, float], now: float) -> bool:
    """Whether ``entry``'s chunk is past the expiry its block hash has in ``expiries``."""
    key = key_from_chunk_name(entry.base)
    expires = None if key is None else expiries.get(key[:-GROUP_INDEX_BYTES])
    return expires is not None and expires <= now


def _created(location: Location, namespace: str) -> float:
    manifest = _manifest(location, namespace)
    created = manifest.get("created_at") if manifest else None
    if isinstance(created, str):
        try:
            return datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return datetime.now(timezone.utc).timestamp()


def gc_shm(out: TextIO, *, dry_run: bool = False, shm_dir: Path | None = None) -> int:
    """Remove the cpu regions vLLM engines of this user left in ``/dev/shm`` (named
    ``kvtiers-<uid>-…``) that no process maps: a killed engine's, which only the next
    engine's start would otherwise remove. A region some process maps is kept; so is any
    file that is not a private region file of this user. One line per region and a
    closing total; always 0."""
    from kvtiers.tiers.cpu.region import SHM_DIR, engine_region_prefix, region_files

    directory = SHM_DIR if shm_dir is None else shm_dir
    prefix = engine_region_prefix()
    found = region_files(prefix, shm_dir=directory, remove=not dry_run)
    verb = "would remove" if dry_run else "removed"
    unused = [f for f in found if not f.in_use]
    # The reason first, the path last, as verify does: a long path wraps whole.
    for region in found:
        size = format_size(region.size)
        what = f"in use, kept ({size})" if region.in_use else (
            f"{verb} (no process maps it; {size})")
        say(out, f"  {what}: {region.path}")
    freed = format_size(sum(f.size for f in unused))
    say(out, f"gc --shm: {verb} {len(unused)} region(s) ({freed}) and kept "
             f"{len(found) - len(unused)} in use of {prefix}* in {directory}")
    return 0
