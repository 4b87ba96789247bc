"""The seams kvtiers adapts in vLLM, recorded per release and compared with a baseline.

kvtiers plugs into vLLM's offloading interfaces, which vLLM marks experimental and changes
between minor releases. A *seam* is one thing kvtiers depends on there: a class it
subclasses or builds (its methods' signatures, which of them are abstract, its fields
and the attributes its ``__init__`` sets), a function it calls, or a config class of which
it reads a few fields (only those are recorded). :data:`SEAMS` lists them.

:func:`snapshot` describes each seam in the installed vLLM as plain strings (one per
member), :func:`compare` sets a snapshot against the baseline shipped next to this module
(``vllm_seams.json``, recorded on the newest supported release) and :func:`render` writes
the report: per seam, *unchanged*, *changed* (each member that moved, baseline → this
release), *added* (in this release, not in the baseline) or *gone* (in the baseline, not in
this release). A change is information for whoever adapts kvtiers to the release, not a
failure.

The module lives outside :mod:`kvtiers.integrations.vllm` on purpose: loading that package
checks the vLLM version and refuses an unsupported release, which is the release this
report is for. vLLM is imported inside functions only.

Command line (``make vllm-compat`` runs the first form)::

    python -m kvtiers.integrations.vllm_seams                 # report on the installed vLLM
    python -m kvtiers.integrations.vllm_seams --json          # its snapshot, as JSON
    python -m kvtiers.integrations.vllm_seams --current F     # report on a saved snapshot
    python -m kvtiers.integrations.vllm_seams --write-baseline

Exit status: 0 when the report was written (whatever it says), 1 when a seam could not be
read (an import inside vLLM failed for a reason other than the seam being absent: usually
a dependency the environment lacks), 2 when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The packaged baseline: the snapshot of the newest supported vLLM release.
BASELINE_PATH = Path(__file__).with_name("vllm_seams.json")
#: Version of the snapshot's JSON layout; a snapshot of another format is refused.
FORMAT = 1
#: Longest rendering of a default value or class attribute, in characters.
MAX_VALUE_CHARS = 80


@dataclass(frozen=True)
class Seam:
    """One vLLM class or function kvtiers depends on.

    ``members``: the only member names recorded (for configs, the fields kvtiers reads);
    ``None`` records every public member and ``__init__``.
    """

    module: str
    name: str
    members: tuple[str, ...] | None = None

    @property
    def path(self) -> str:
        """The seam's dotted path, its key in a snapshot."""
        return f"{self.module}.{self.name}"


_BASE = "vllm.v1.kv_offload.base"
_TIERING = "vllm.v1.kv_offload.tiering"
_OFFLOADING_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1"

#: What kvtiers adapts (route 1: the spec, manager and worker; route 2: the secondary
#: tier), the values it exchanges with vLLM, and the engine config fields it reads for the
#: cache identity.
SEAMS: tuple[Seam, ...] = (
    Seam(_BASE, "OffloadingSpec"),
    Seam(_BASE, "OffloadingManager"),
    Seam(_BASE, "OffloadingWorker"),
    Seam(_BASE, "LoadStoreSpec"),
    Seam(_BASE, "BlockIDsLoadStoreSpec"),
    Seam(_BASE, "GPULoadStoreSpec"),
    Seam(_BASE, "DevicePointers"),
    Seam(_BASE, "ReqContext"),
    Seam(_BASE, "RequestOffloadingContext"),
    Seam(_BASE, "OffloadPolicy"),
    Seam(_BASE, "LookupResult"),
    Seam(_BASE, "Medium"),
    Seam(_BASE, "Locality"),
    Seam(_BASE, "TierFilter"),
    Seam(_BASE, "OffloadingEvent"),
    Seam(_BASE, "OffloadingKVEventsConfig"),
    Seam(_BASE, "PrepareStoreOutput"),
    Seam(_BASE, "TransferResult"),
    Seam(_BASE, "CanonicalKVCaches"),
    Seam(_BASE, "CanonicalKVCacheTensor"),
    Seam(_BASE, "CanonicalKVCacheRef"),
    Seam("vllm.v1.kv_offload.pointer_utils", "resolve_device_pointers"),
    Seam("vllm.v1.kv_offload.config", "OffloadingConfig"),
    Seam("vllm.v1.kv_offload.config", "OffloadingGroupConfig"),
    Seam("vllm.v1.kv_offload.config", "OffloadingModelConfig"),
    Seam("vllm.v1.kv_offload.config", "OffloadingCacheConfig"),
    Seam("vllm.v1.kv_offload.config", "OffloadingParallelConfig"),
    Seam(f"{_TIERING}.base", "SecondaryTierManager"),
    Seam(f"{_TIERING}.base", "TransferJob"),
    Seam(f"{_TIERING}.base", "JobResult"),
    Seam(f"{_TIERING}.manager", "TieringOffloadingManager"),
    Seam("vllm.v1.metrics.cache_hit_source", "CacheHitSource"),
    Seam(f"{_OFFLOADING_CONNECTOR}.offloading_connector", "OffloadingConnector", ("__init__",)),
    Seam(f"{_OFFLOADING_CONNECTOR}.offloading.canonical_mapping", "canonical_format_id"),
    Seam("vllm.config", "ModelConfig",
         ("model", "revision", "dtype", "quantization", "hf_config", "hf_text_config",
          "hf_overrides")),
    Seam("vllm.config", "CacheConfig",
         ("block_size", "hash_block_size", "prefix_caching_hash_algo", "kv_cache_layout",
          "kv_cache_dtype_skip_layers")),
    Seam("vllm.config", "SpeculativeConfig",
         ("method", "model", "revision", "quantization", "num_speculative_tokens")),
    Seam("vllm.config", "LoadConfig", ("load_format", "model_loader_extra_config")),
    Seam("vllm.config", "ParallelConfig", ("nnodes_within_dp",)),
    Seam("vllm.config.cache", "_layout_from_name"),
    Seam("vllm.v1.kv_cache_layout", "KVCacheLayout"),
    Seam("vllm.v1.kv_cache_interface", "KVCacheConfig", ("kv_cache_groups", "kv_cache_layout")),
    Seam("vllm.v1.kv_cache_interface", "SlidingWindowSpec", ("sliding_window",)),
    Seam("vllm.v1.kv_cache_interface", "ChunkedLocalAttentionSpec", ("attention_chunk_size",)),
    Seam("vllm.v1.kv_cache_interface", "iter_layer_specs"),
)


class VllmMissingError(RuntimeError):
    """vLLM is not installed where a snapshot of it was asked for."""


# --- describing a seam -------------------------------------------------------------------

#: A run of dotted module names before a name (``typing.``, ``vllm.v1.kv_offload.base.``):
#: dropped, so an annotation reads the same whether a release writes it as a string or an
#: object.
_MODULE_PREFIX = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)+(?=[A-Za-z_])")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_FORWARD_REF = re.compile(r"ForwardRef\('([^']*)'\)")


def _annotation(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, type):
        return value.__qualname__
    return _FORWARD_REF.sub(r"\1", _MODULE_PREFIX.sub("", repr(value)))


def _value(value: Any) -> str:
    """A default or class attribute as text: no memory address, at most
    :data:`MAX_VALUE_CHARS` characters."""
    # pydantic's Field(default=...) stands in for the default on vLLM's config classes.
    if type(value).__name__ == "FieldInfo":
        factory = getattr(value, "default_factory", None)
        if factory is not None:
            return f"{getattr(factory, '__qualname__', '?')}()"
        value = getattr(value, "default", value)
    text = _ADDRESS.sub("", repr(value))
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def signature(func: Any) -> str:
    """``func``'s parameters and return annotation, with annotations and defaults written
    by :func:`_annotation` and :func:`_value`; ``(?)`` when Python cannot read them."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return "(?)"
    parts: list[str] = []
    kinds = inspect.Parameter
    previous: Any = None
    for param in sig.parameters.values():
        if previous is kinds.POSITIONAL_ONLY and param.kind is not kinds.POSITIONAL_ONLY:
            parts.append("/")
        if param.kind is kinds.KEYWORD_ONLY and previous not in (
            kinds.KEYWORD_ONLY, kinds.VAR_POSITIONAL
        ):
            parts.append("*")
        stars = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}
        text = stars.get(param.kind.name, "") + param.name
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            text += f" = {_value(param.default)}"
        parts.append(text)
        previous = param.kind
    if previous is kinds.POSITIONAL_ONLY:
        parts.append("/")
    result = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        result += f" -> {_annotation(sig.return_annotation)}"
    return result


def _vllm_classes(cls: type) -> list[type]:
    """``cls`` and its bases defined in vLLM, nearest first (members of ``object``, ABC,
    Enum or NamedTuple machinery are not vLLM's seams)."""
    return [klass for klass in cls.__mro__ if klass.__module__.split(".")[0] == "vllm"]


def _self_attributes(func: Any) -> Iterator[tuple[str, str | None]]:
    """``(name, annotation)`` of each ``self.name = …`` in ``func``'s source (nothing when
    the source is not available)."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError):
        return
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        note: str | None = None
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets, note = [node.target], ast.unparse(node.annotation)
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id == "self"):
                yield target.attr, note


def _generated(func: Any) -> bool:
    """Whether ``func`` was written by the dataclass machinery (its ``__init__``, which only
    repeats the fields), not by vLLM's source."""
    return str(func.__code__.co_filename).startswith("<")


def _field(field: dataclasses.Field[Any]) -> str:
    text = f"field: {_annotation(field.type)}"
    if field.default is not dataclasses.MISSING:
        text += f" = {_value(field.default)}"
    elif field.default_factory is not dataclasses.MISSING:
        factory = field.default_factory
        text += f" = {getattr(factory, '__qualname__', _value(factory))}()"
    if not field.init:
        text += " (init=False)"
    return text


def _describe_class(cls: type, wanted: tuple[str, ...] | None) -> dict[str, str]:
    def keep(name: str) -> bool:
        if wanted is not None:
            return name in wanted
        return not name.startswith("_") or name == "__init__"

    members: dict[str, str] = {}
    if wanted is None:
        bases = [base.__qualname__ for base in cls.__bases__]
        members["(bases)"] = ", ".join(bases)
    if isinstance(cls, enum.EnumMeta):
        member: enum.Enum
        for name, member in cls.__members__.items():
            if keep(name):
                members[name] = f"member = {_value(member.value)}"
    if dataclasses.is_dataclass(cls):
        for field in dataclasses.fields(cls):
            if keep(field.name):
                members[field.name] = _field(field)
    tuple_fields: Sequence[str] = getattr(cls, "_fields", ()) if issubclass(cls, tuple) else ()
    tuple_defaults: Mapping[str, Any] = getattr(cls, "_field_defaults", {})
    abstract: frozenset[str] = getattr(cls, "__abstractmethods__", frozenset())

    def mark(name: str) -> str:
        return "abstract " if name in abstract else ""

    for klass in _vllm_classes(cls):
        notes = inspect.get_annotations(klass)
        for name, raw in klass.__dict__.items():
            if name in members or not keep(name):
                continue
            if name in tuple_fields:
                text = f"field: {_annotation(notes.get(name, 'Any'))}"
                if name in tuple_defaults:
                    text += f" = {_value(tuple_defaults[name])}"
                members[name] = text
            elif isinstance(raw, (staticmethod, classmethod)):
                members[name] = (f"{mark(name)}{type(raw).__name__} "
                                 f"{signature(raw.__func__)}")
            elif isinstance(raw, property):
                members[name] = f"{mark(name)}property" + (
                    signature(raw.fget).partition(")")[2] if raw.fget else ""
                )
            elif inspect.isfunction(raw) and not _generated(raw):
                members[name] = f"{mark(name)}def {signature(raw)}"
            elif not callable(raw):
                note = notes.get(name)
                members[name] = "attribute" + (
                    f": {_annotation(note)}" if note is not None else ""
                ) + f" = {_value(raw)}"
        for name, note in notes.items():
            if name not in members and keep(name):
                members[name] = f"annotation: {_annotation(note)}"
        for method in ("__init__", "__post_init__"):
            if method in klass.__dict__:
                for name, annotation in _self_attributes(klass.__dict__[method]):
                    if name not in members and keep(name) and not name.startswith("_"):
                        members[name] = "instance attribute" + (
                            f": {annotation}" if annotation else ""
                        )
    return dict(sorted(members.items()))


def describe(obj: Any, wanted: tuple[str, ...] | None = None) -> dict[str, str]:
    """One seam's members as ``{name: description}``: for a class, its bases (when
    ``wanted`` is ``None``), enum members, fields, methods (``abstract def`` for an abstract
    one), properties, class attributes and the attributes ``__init__`` sets; for a function,
    its signature under ``def``."""
    if inspect.isclass(obj):
        return _describe_class(obj, wanted)
    return {"def": signature(obj)}


def _snapshot_seam(seam: Seam) -> dict[str, Any]:
    try:
        module = importlib.import_module(seam.module)
    except ModuleNotFoundError as error:
        # A module of vLLM's own that is not there is the seam gone; another name missing
        # is an environment without one of vLLM's dependencies.
        if error.name is not None and (
            seam.module == error.name or seam.module.startswith(error.name + ".")
        ):
            return {"absent": f"no module {seam.module}"}
        return {"unreadable": f"importing {seam.module}: {error}"}
    except Exception as error:
        # Any failure inside vLLM's import is reported for this seam, not raised.
        return {"unreadable": f"importing {seam.module}: {type(error).__name__}: {error}"}
    if not hasattr(module, seam.name):
        return {"absent": f"no {seam.name} in {seam.module}"}
    return {"members": describe(getattr(module, seam.name), seam.members)}


def snapshot(seams: Sequence[Seam] = SEAMS) -> dict[str, Any]:
    """The installed vLLM's seams, a JSON-ready mapping ``{"format", "vllm", "seams"}``.

    Raises :class:`VllmMissingError` when vLLM is not installed.
    """
    try:
        import vllm
    except ImportError as error:
        raise VllmMissingError(str(error)) from None
    return {
        "format": FORMAT,
        "vllm": str(getattr(vllm, "__version__", "unknown")),
        "seams": {seam.path: _snapshot_seam(seam) for seam in seams},
    }


# --- recording and comparing -------------------------------------------------------------


def dumps(snap: Mapping[str, Any]) -> str:
    """``snap`` as the JSON written to a baseline file: one member per line, seams in
    :data:`SEAMS` order and members sorted (as :func:`snapshot` made them), so the report
    reads in that order and a baseline's diff in review reads per member."""
    return json.dumps(snap, indent=1, ensure_ascii=False) + "\n"


def load(path: Path) -> dict[str, Any]:
    """A snapshot written by :func:`dumps`; raises ``ValueError`` (naming ``path``) for a
    file that is not one."""
    try:
        snap = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a seam snapshot ({error})") from None
    if not isinstance(snap, dict) or not isinstance(snap.get("seams"), dict):
        raise ValueError(f"{path}: not a seam snapshot (no 'seams' mapping)")
    if snap.get("format") != FORMAT:
        raise ValueError(
            f"{path}: seam snapshot format {snap.get('format')!r}, this kvtiers reads "
            f"format {FORMAT}; record it again with --write-baseline"
        )
    return snap


class Status(str, enum.Enum):
    """How a seam (or a member of one) in this release compares with the baseline."""

    UNCHANGED = "unchanged"
    CHANGED = "changed"
    ADDED = "added"
    GONE = "gone"
    #: The seam could not be read in this release (see the module docstring).
    UNREADABLE = "unreadable"
    #: The seam is not in the baseline at all (listed in :data:`SEAMS` after it was
    #: recorded): nothing to compare with.
    UNRECORDED = "unrecorded"


@dataclass(frozen=True)
class MemberChange:
    """One member that differs: ``old`` is the baseline's, ``new`` this release's."""

    name: str
    status: Status
    old: str | None
    new: str | None


@dataclass(frozen=True)
class SeamChange:
    """One seam's comparison; ``members`` lists what moved when ``status`` is CHANGED, and
    ``note`` says why a seam is absent or unreadable."""

    seam: str
    status: Status
    members: tuple[MemberChange, ...] = ()
    note: str = ""


def _compare_members(old: Mapping[str, str], new: Mapping[str, str]) -> tuple[MemberChange, ...]:
    changes: list[MemberChange] = []
    for name in sorted(set(old) | set(new)):
        before, after = old.get(name), new.get(name)
        if before == after:
            continue
        status = Status.ADDED if before is None else Status.GONE if after is None else (
            Status.CHANGED
        )
        changes.append(MemberChange(name, status, before, after))
    return tuple(changes)


def compare(baseline: Mapping[str, Any], current: Mapping[str, Any]) -> list[SeamChange]:
    """Each seam of ``current`` against ``baseline`` (both :func:`snapshot` mappings), in
    the baseline's order, then the seams only ``current`` lists."""
    old_seams: Mapping[str, Any] = baseline["seams"]
    new_seams: Mapping[str, Any] = current["seams"]
    result: list[SeamChange] = []
    for path in [*old_seams, *(p for p in new_seams if p not in old_seams)]:
        old, new = old_seams.get(path), new_seams.get(path)
        if new is None:
            # A seam dropped from SEAMS since the baseline was recorded: not inspected.
            continue
        if "unreadable" in new:
            result.append(SeamChange(path, Status.UNREADABLE, note=new["unreadable"]))
        elif old is None:
            result.append(SeamChange(path, Status.UNRECORDED))
        elif "absent" in new:
            status = Status.UNCHANGED if "absent" in old else Status.GONE
            result.append(SeamChange(path, status, note=new["absent"]))
        elif "members" not in old:
            result.append(SeamChange(path, Status.ADDED))
        else:
            members = _compare_members(old["members"], new["members"])
            result.append(SeamChange(path, Status.CHANGED if members else Status.UNCHANGED,
                                     members))
    return result


_MARK = {Status.ADDED: "+", Status.GONE: "-", Status.CHANGED: "~"}
#: A changed member whose description is longer than this many characters (a ``Literal``
#: of every quantization method, say) is reported by the words that moved.
LONG_CHARS = 160
_TOKEN = re.compile(r"'[^']*'|\"[^\"]*\"|\w+|\S")


def word_changes(old: str, new: str) -> str:
    """The words (names, quoted literals) only ``old`` has, as ``-word``, then those only
    ``new`` has, as ``+word``, each in its order of appearance; punctuation is left out."""
    before = [word for word in _TOKEN.findall(old) if not _PUNCTUATION.fullmatch(word)]
    after = [word for word in _TOKEN.findall(new) if not _PUNCTUATION.fullmatch(word)]
    removed, added = Counter(before) - Counter(after), Counter(after) - Counter(before)
    runs = [f"-{word}" for word in dict.fromkeys(before) if word in removed]
    runs += [f"+{word}" for word in dict.fromkeys(after) if word in added]
    return " ".join(runs) if runs else "(punctuation or order only)"


_PUNCTUATION = re.compile(r"[^\w'\"]")


def render(changes: Sequence[SeamChange], baseline_version: str, version: str) -> str:
    """The report: a header, one line per seam (the members that moved under a changed
    one) and a count per status."""
    lines = [
        f"vLLM seam report: vLLM {version} against the baseline recorded on vLLM "
        f"{baseline_version}",
        "  (per member: + only in this release, - only in the baseline, "
        "~ baseline -> this release)",
    ]
    width = max(len(status.value) for status in Status)
    for change in changes:
        line = f"  {change.status.value:<{width}}  {change.seam}"
        if change.note:
            line += f" ({change.note})"
        lines.append(line)
        for member in change.members:
            indent = " " * (width + 6)
            if member.status is Status.CHANGED and member.old and member.new and max(
                len(member.old), len(member.new)
            ) > LONG_CHARS:
                words = word_changes(member.old, member.new)
                lines.append(f"{indent}~ {member.name}: words {words}")
            elif member.status is Status.CHANGED:
                lines.append(f"{indent}~ {member.name}: {member.old}")
                lines.append(f"{indent}  {' ' * len(member.name)}  -> {member.new}")
            else:
                text = member.new if member.status is Status.ADDED else member.old
                lines.append(f"{indent}{_MARK[member.status]} {member.name}: {text}")
    counts = {status: 0 for status in Status}
    for change in changes:
        counts[change.status] += 1
    lines.append(
        f"{len(changes)} seams: "
        + ", ".join(f"{count} {status.value}" for status, count in counts.items() if count)
    )
    return "\n".join(lines) + "\n"


# --- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m kvtiers.integrations.vllm_seams",
        description="Compare the vLLM interfaces kvtiers adapts with the recorded baseline.",
    )
    parser.add_argument("--baseline", type=Path, default=BASELINE_PATH,
                        help="the snapshot to compare with (default: the packaged baseline)")
    parser.add_argument("--current", type=Path,
                        help="a snapshot saved with --json, instead of the installed vLLM")
    parser.add_argument("--json", action="store_true",
                        help="print the snapshot as JSON instead of the report")
    parser.add_argument("--write-baseline", action="store_true",
                        help="record the installed vLLM's snapshot as the baseline")
    args = parser.parse_args(argv)
    try:
        current = load(args.current) if args.current is not None else snapshot()
    except VllmMissingError as error:
        print(f"vllm_seams: vLLM is not installed in this environment ({error}); run this "
              "where it is, e.g. make vllm-compat VLLM=<version>", file=sys.stderr)
        return 2
    except (OSError, ValueError) as error:
        print(f"vllm_seams: {error}", file=sys.stderr)
        return 1
    unreadable = [path for path, seam in current["seams"].items() if "unreadable" in seam]
    if args.write_baseline:
        if unreadable:
            print(f"vllm_seams: not writing a baseline with unreadable seams: "
                  f"{', '.join(unreadable)}", file=sys.stderr)
            return 1
        args.baseline.write_text(dumps(current), encoding="utf-8")
        print(f"vllm_seams: wrote the baseline of vLLM {current['vllm']} to {args.baseline}")
        return 0
    if args.json:
        sys.stdout.write(dumps(current))
        return 0
    try:
        baseline = load(args.baseline)
    except (OSError, ValueError) as error:
        print(f"vllm_seams: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(render(compare(baseline, current), baseline["vllm"], current["vllm"]))
    return 1 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
