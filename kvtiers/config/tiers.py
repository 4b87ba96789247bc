"""The configuration of each tier kind: ``cpu``, ``file``, ``s3``, ``fsspec``.

Every tier has a ``kind``, a ``name`` (unique within a stack; the stack parser defaults it
to its kind, or ``<kind><index>`` when the kind repeats) and an ``admission`` rule for
chunks cascaded to it. The classes here only describe and check values; building a tier
from them is the job of the kind's factory (see :mod:`kvtiers.config.kinds`). Sizes are
bytes; ``*_s`` fields are seconds.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from kvtiers.config.schema import Check, Matches, OctalMode, Range, Section, example
from kvtiers.config.sizes import Size, format_size
from kvtiers.errors import ConfigError

#: Default ``op_deadline_s`` of object tiers, seconds (kept equal to
#: :data:`kvtiers.tiers.object.retry.DEFAULT_OP_DEADLINE_S`; config never imports tiers).
DEFAULT_OP_DEADLINE_S = 30.0

#: Default ``load_backoff_s`` / ``load_backoff_max_s`` of lower tiers, seconds (kept equal to
#: :mod:`kvtiers.tiers.backoff`'s defaults).
DEFAULT_LOAD_BACKOFF_S = 1.0
DEFAULT_LOAD_BACKOFF_MAX_S = 60.0

BUILTIN_POLICIES = ("lru", "arc", "s3fifo")

SIMPLE_NAME = Matches(r"[A-Za-z0-9._-]+", "a simple name of letters, digits, '.', '_' and '-'")
Threads = Annotated[int, Range(1, 256)]
Seconds = Annotated[float, Range(0, above=True)]
_OWNER_READ_WRITE = OctalMode(0o600)
_OWNER_ALL = OctalMode(0o700)

_DOTTED_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def _check_load_backoff(base_s: float, max_s: float) -> None:
    """A lower tier's load back-off: a key whose load failed is a miss for ``base_s``,
    doubled per further failure up to ``max_s`` (docs/architecture.md, "Liveness")."""
    if max_s < base_s:
        raise ConfigError(
            f"load_backoff_max_s {max_s:g} is below load_backoff_s {base_s:g}; raise "
            "load_backoff_max_s or lower load_backoff_s",
            path="load_backoff_max_s",
        )


def _policy_problem(policy: str) -> str | None:
    if policy in BUILTIN_POLICIES or _DOTTED_CLASS.fullmatch(policy):
        return None
    return (
        f"unknown eviction policy {policy!r}; use one of {', '.join(BUILTIN_POLICIES)} "
        "or name a policy class as 'package.module:ClassName'"
    )


@dataclass(frozen=True, kw_only=True)
class TierConfig(Section):
    """Fields every tier has. ``kind`` is fixed by each subclass."""

    kind: str
    name: Annotated[str, SIMPLE_NAME]
    admission: Literal["always", "never"] = "always"

    @property
    def can_be_primary(self) -> bool:
        """Whether this tier, as configured, can be the first tier of a stack."""
        return False

    def describe(self) -> str:
        """A short description for one-line summaries: ``cpu 8.0 GiB, arc``."""
        return self.kind


@dataclass(frozen=True, kw_only=True)
class CPUTierConfig(TierConfig):
    """Host memory: the usual primary. ``shared_memory_name`` places it in ``/dev/shm``."""

    what: ClassVar[str] = "a cpu tier"

    kind: Literal["cpu"] = "cpu"
    capacity: Size = field(metadata=example("capacity: 8GiB"))
    policy: Annotated[str, Check(_policy_problem)] = "lru"
    shared_memory_name: Annotated[str, SIMPLE_NAME] | None = None

    @property
    def can_be_primary(self) -> bool:
        return True

    def describe(self) -> str:
        return f"cpu {format_size(self.capacity)}, {self.policy}"


@dataclass(frozen=True, kw_only=True)
class FileTierConfig(TierConfig):
    """A directory on local or shared storage; with ``gds: true`` it is a GDS primary.

    ``root`` may be relative (to the current directory when the tier is built) and may
    start with ``~``. ``capacity`` ``None`` means bounded only by the filesystem.
    ``capacity_scope: root`` makes ``capacity`` one budget for every namespace under the
    root (other identities' chunks go first, least recently used namespace first).
    """

    what: ClassVar[str] = "a file tier"

    kind: Literal["file"] = "file"
    root: Annotated[str, Matches(r"[^\x00]+", "a directory path")] = field(
        metadata=example("root: /mnt/nvme/kvtiers")
    )
    capacity: Size | None = None
    capacity_scope: Literal["namespace", "root"] = "namespace"
    io: Literal["auto", "posix", "kvikio"] = "auto"
    threads: Threads = 8
    gds: bool = False
    shared: bool = False
    o_direct: bool = False
    file_mode: OctalMode = _OWNER_READ_WRITE
    dir_mode: OctalMode = _OWNER_ALL
    # Corrupt chunk files are moved aside for inspection rather than deleted.
    quarantine: bool = True
    load_backoff_s: Seconds = DEFAULT_LOAD_BACKOFF_S
    load_backoff_max_s: Seconds = DEFAULT_LOAD_BACKOFF_MAX_S

    @property
    def can_be_primary(self) -> bool:
        return self.gds

    @property
    def root_path(self) -> Path:
        """``root`` with ``~`` expanded, made absolute against the current directory."""
        return Path(self.root).expanduser().absolute()

    def _check(self) -> None:
        _check_load_backoff(self.load_backoff_s, self.load_backoff_max_s)
        if self.capacity_scope == "root" and self.capacity is None:
            raise ConfigError(
                "capacity_scope: root shares the tier's capacity among the root's "
                "namespaces; set a capacity (for example capacity: 100GiB)",
                path="capacity_scope",
            )
        if self.file_mode & 0o600 != 0o600:
            raise ConfigError(
                f"file_mode {self.file_mode:#o} must let the owner read and write (include 0o600)",
                path="file_mode",
            )
        if self.dir_mode & 0o700 != 0o700:
            raise ConfigError(
                f"dir_mode {self.dir_mode:#o} must give the owner full access (include 0o700)",
                path="dir_mode",
            )
        if self.gds and self.io == "posix":
            raise ConfigError(
                "gds: true needs the kvikio I/O backend; set io: auto or io: kvikio",
                path="io",
            )

    def describe(self) -> str:
        parts = [f"file {self.root}"]
        if self.capacity is not None:
            parts.append(format_size(self.capacity))
        parts.append(f"io={self.io}")
        parts.extend(flag for flag in ("gds", "shared", "o_direct") if getattr(self, flag))
        return ", ".join(parts)


def _bucket_problem(bucket: str) -> str | None:
    rules = "S3 bucket names are 3-63 characters of a-z, 0-9, '.' and '-'"
    if not 3 <= len(bucket) <= 63 or not re.fullmatch(r"[a-z0-9.-]+", bucket):
        return f"invalid bucket name {bucket!r}: {rules}"
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return f"invalid bucket name {bucket!r}: it must begin and end with a letter or digit"
    if ".." in bucket:
        return f"invalid bucket name {bucket!r}: it must not contain '..'"
    try:
        ipaddress.IPv4Address(bucket)
    except ValueError:
        return None
    return f"invalid bucket name {bucket!r}: it must not look like an IP address"


def _endpoint_problem(url: str) -> str | None:
    if url == "embedded":
        return None
    parts = urlsplit(url)
    if parts.scheme in ("http", "https") and parts.hostname:
        try:
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError:
            pass
        else:
            return None
    return (
        f"expected an http:// or https:// URL (such as http://127.0.0.1:9000) or the word "
        f"'embedded', got {url!r}"
    )


def _prefix_problem(prefix: str) -> str | None:
    if prefix.startswith("/"):
        return f"an object prefix must not start with '/', got {prefix!r}; drop the '/'"
    return None


@dataclass(frozen=True, kw_only=True)
class S3TierConfig(TierConfig):
    """An S3-compatible bucket. ``endpoint_url: embedded`` starts a local test server.

    A request is tried ``max_attempts`` times in all, sleeping between attempts with
    exponential backoff from ``backoff_base_s`` up to ``backoff_max_s``, and every socket
    wait is capped at ``timeout_s``. ``op_deadline_s`` bounds one operation (a chunk's
    get or put, a probe, a delete) as a whole: attempts, back-off and socket waits
    together end by then and the key fails (docs/architecture.md, "Liveness").
    """

    what: ClassVar[str] = "an s3 tier"

    kind: Literal["s3"] = "s3"
    bucket: Annotated[str, Check(_bucket_problem)] = field(metadata=example("bucket: kv-cache"))
    prefix: Annotated[str, Check(_prefix_problem)] = ""
    region: Annotated[str, Matches(r"[a-z0-9-]+", "a region such as us-east-1")] | None = None
    endpoint_url: Annotated[str, Check(_endpoint_problem)] | None = None
    threads: Threads = 16
    capacity: Size | None = None
    shared: bool = False
    max_attempts: Annotated[int, Range(1)] = 5
    backoff_base_s: Seconds = 0.05
    backoff_max_s: Seconds = 2.0
    timeout_s: Seconds = 30.0
    op_deadline_s: Seconds = DEFAULT_OP_DEADLINE_S
    delete_corrupt: bool = True
    load_backoff_s: Seconds = DEFAULT_LOAD_BACKOFF_S
    load_backoff_max_s: Seconds = DEFAULT_LOAD_BACKOFF_MAX_S

    def _check(self) -> None:
        _check_load_backoff(self.load_backoff_s, self.load_backoff_max_s)
        if self.backoff_max_s < self.backoff_base_s:
            raise ConfigError(
                f"backoff_max_s {self.backoff_max_s:g} is below backoff_base_s "
                f"{self.backoff_base_s:g}; raise backoff_max_s or lower backoff_base_s",
                path="backoff_max_s",
            )

    def describe(self) -> str:
        location = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        parts = [f"s3 {location}"]
        if self.endpoint_url is not None:
            parts.append(f"endpoint={self.endpoint_url}")
        if self.capacity is not None:
            parts.append(format_size(self.capacity))
        if self.shared:
            parts.append("shared")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class FsspecTierConfig(TierConfig):
    """Any fsspec URL (``gcs://``, ``az://``, ``memory://`` …) as an object tier.

    ``op_deadline_s`` bounds one operation (attempts and back-off together; on
    asynchronous filesystems the request itself too), see docs/architecture.md,
    "Liveness".
    """

    what: ClassVar[str] = "an fsspec tier"

    kind: Literal["fsspec"] = "fsspec"
    url: Annotated[str, Matches(r"[A-Za-z][A-Za-z0-9+.-]*://.*", "a URL like gcs://bucket/kv")] = (
        field(metadata=example("url: gcs://bucket/kv"))
    )
    threads: Threads = 16
    capacity: Size | None = None
    shared: bool = False
    op_deadline_s: Seconds = DEFAULT_OP_DEADLINE_S
    storage_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    load_backoff_s: Seconds = DEFAULT_LOAD_BACKOFF_S
    load_backoff_max_s: Seconds = DEFAULT_LOAD_BACKOFF_MAX_S

    def _check(self) -> None:
        _check_load_backoff(self.load_backoff_s, self.load_backoff_max_s)

    def describe(self) -> str:
        parts = [f"fsspec {self.url}"]
        if self.capacity is not None:
            parts.append(format_size(self.capacity))
        if self.shared:
            parts.append("shared")
        return ", ".join(parts)
