"""Reading a stack file: YAML text to plain values, remembering where each value was written.

PyYAML's ``safe_load`` forgets line numbers and silently keeps the last of two equal
mapping keys. Here the file is composed into nodes (which carry marks) and converted by
hand, so that:

* every mapping key and sequence item is recorded under its YAML path
  (``tiers[1].capacity``) with its 1-based line, for error messages;
* a key written twice in one mapping is an error (keys brought in through a ``<<`` merge
  may still be overridden, as YAML intends);
* every failure (missing file, bad syntax, empty file, recursive alias) is a one-line
  :class:`~kvtiers.errors.ConfigError`;
* hostile input is bounded before it costs anything: a file over
  :data:`MAX_STACK_FILE_BYTES` is refused unread, nesting deeper than :data:`MAX_DEPTH`
  is refused while the text is scanned (before PyYAML's recursive composer sees it), and
  a document whose aliases expand to more than :data:`MAX_VALUES` values (an "alias
  bomb") is refused while it is converted, each naming the file and line.

Scalars are constructed by PyYAML's safe constructor, so YAML 1.1 typing applies (``yes``
is a boolean, ``0640`` an octal integer).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvtiers.config.paths import item_path, key_path, parent_path
from kvtiers.errors import ConfigError

#: A stack file is a few KiB; anything over this is not one.
MAX_STACK_FILE_BYTES = 1 << 20
#: Deepest nesting of mappings and lists; real stacks stay under 10.
MAX_DEPTH = 64
#: Most values (scalars, lists, mappings) a document may expand to, aliases expanded.
MAX_VALUES = 10_000


@dataclass(frozen=True)
class YamlDocument:
    """Plain values of one YAML document plus the line of every key and item in it."""

    data: object
    lines: Mapping[str, int]

    def line_of(self, path: str) -> int | None:
        """Line of ``path``, or of its nearest written ancestor (a missing key has none)."""
        while True:
            line = self.lines.get(path)
            if line is not None or not path:
                return line
            path = parent_path(path)


def read_yaml(path: str | Path) -> YamlDocument:
    """Read and convert the YAML file at ``path``; errors name the file as their source."""
    source = str(path)
    try:
        raw = _read_bounded(Path(path))
        if len(raw) > MAX_STACK_FILE_BYTES:
            raise ConfigError(
                f"is larger than {MAX_STACK_FILE_BYTES} bytes, far more than any stack file; "
                "pass a YAML stack file",
                source=source,
            )
        text = raw.decode("utf-8")
    except FileNotFoundError:
        from kvtiers.config.examples import EXAMPLES_DIR

        raise ConfigError(
            f"no such file; pass the path of a YAML stack file (examples: {EXAMPLES_DIR})",
            source=source,
        ) from None
    except IsADirectoryError:
        raise ConfigError("is a directory; pass a YAML stack file", source=source) from None
    except _NotRegular:
        raise ConfigError(
            "is not a regular file (a pipe or device); pass a YAML stack file", source=source
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8",
            source=source,
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot be read: {exc.strerror}", source=source) from None
    return parse_yaml(text, source=source)


class _NotRegular(Exception):
    pass


def _read_bounded(path: Path) -> bytes:
    """At most :data:`MAX_STACK_FILE_BYTES` + 1 bytes of a regular file. Opened
    non-blocking so a FIFO at ``path`` is refused rather than waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(str(path))
        if not stat.S_ISREG(mode):
            raise _NotRegular(str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_STACK_FILE_BYTES + 1)
    finally:
        os.close(fd)


def parse_yaml(text: str, *, source: str = "") -> YamlDocument:
    """Convert one YAML document; an empty document is an error (a stack needs tiers)."""
    loader: yaml.SafeLoader | None = None
    try:
        # The reader rejects control characters as soon as it is made: inside the try.
        loader = yaml.SafeLoader(text)
        _check_depth(text, source)
        node = loader.get_single_node()
        if node is None:
            raise ConfigError(
                "the file is empty; a stack file needs a `tiers:` list", source=source
            )
        converter = _Converter(loader, source)
        data = converter.convert(node, "")
        return YamlDocument(data=data, lines=converter.lines)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None and source else source
        problem = ", ".join(part for part in (exc.context, exc.problem) if part) or "malformed"
        raise ConfigError(f"invalid YAML: {problem}; fix the syntax", source=where) from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"invalid YAML: {detail}", source=source) from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_depth(text: str, source: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH`, scanning events only (PyYAML's parser
    keeps its own stack; its composer and our converter recurse once per level)."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                where = f"{source}:{mark.line + 1}" if mark is not None and source else source
                raise ConfigError(
                    f"nesting deeper than {MAX_DEPTH} levels of mappings and lists; a stack "
                    "file is a few levels deep, so flatten it",
                    source=where,
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _brief(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


class _Converter:
    """Turns composed nodes into dicts, lists and scalars, recording lines by path."""

    def __init__(self, loader: yaml.SafeLoader, source: str) -> None:
        self._loader = loader
        self._source = source
        self._active: set[int] = set()
        self._flattened: set[int] = set()
        self._values = 0
        self.lines: dict[str, int] = {}

    def _error(self, message: str, path: str, node: yaml.Node) -> ConfigError:
        line = node.start_mark.line + 1
        return ConfigError(
            message, path=path, source=f"{self._source}:{line}" if self._source else ""
        )

    def convert(self, node: yaml.Node, path: str) -> object:
        self._values += 1
        if self._values > MAX_VALUES:
            raise self._error(
                f"the document expands to more than {MAX_VALUES} values (aliases repeat "
                "what they refer to); write the values out instead of nesting aliases",
                path,
                node,
            )
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, path)
        if id(node) in self._active:
            raise self._error(
                "an alias refers to a value that contains it; write the value out instead",
                path,
                node,
            )
        self._active.add(id(node))
        try:
            if isinstance(node, yaml.SequenceNode):
                return [
                    self.convert(item, item_path(path, index))
                    for index, item in enumerate(node.value)
                ]
            assert isinstance(node, yaml.MappingNode), node
            return self._mapping(node, path)
        finally:
            self._active.discard(id(node))

    def _scalar(self, node: yaml.ScalarNode, path: str) -> object:
        try:
            return self._loader.construct_object(node, deep=True)
        except (ValueError, OverflowError) as exc:
            # A value PyYAML's typing cannot build: an integer of thousands of digits, a
            # timestamp like 2024-13-45.
            detail = " ".join(str(exc).split())
            raise self._error(
                f"cannot read {_brief(node.value)!r} ({detail}); quote it if it is text",
                path,
                node,
            ) from None

    def _key(self, node: yaml.Node, path: str) -> str:
        if isinstance(node, yaml.ScalarNode):
            key = self._scalar(node, path)
            if isinstance(key, str):
                return key
            shown = repr(key)
        else:
            shown = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"
        raise self._error(f"mapping keys must be strings, got {shown}; quote the key", path, node)

    def _mapping(self, node: yaml.MappingNode, path: str) -> dict[str, object]:
        if id(node) not in self._flattened:
            self._check_duplicates(node, path)
            # Merges (``<<: *anchor``) are expanded in place, once per node (an alias
            # brings the same node back); explicit keys, placed after the merged ones,
            # win as YAML specifies.
            self._loader.flatten_mapping(node)
            self._flattened.add(id(node))
        result: dict[str, object] = {}
        for key_node, value_node in node.value:
            key = self._key(key_node, path)
            child = key_path(path, key)
            self.lines[child] = key_node.start_mark.line + 1
            result[key] = self.convert(value_node, child)
        return result

    def _check_duplicates(self, node: yaml.MappingNode, path: str) -> None:
        explicit: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self._key(key_node, path)
            line = key_node.start_mark.line + 1
            if key in explicit:
                raise self._error(
                    f"key {key!r} appears twice in this mapping (first on line "
                    f"{explicit[key]}); YAML would silently keep the last, so remove one",
                    key_path(path, key),
                    key_node,
                )
            explicit[key] = line
