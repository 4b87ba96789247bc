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

BUILTIN_POLICIES = ("lru", "arc", "s3fifo")

SIMPLE_NAME = Matches(r"[A-Za-z0-9._-]+", "a simple name of letters, digits, '.', '_' and '-'")
Threads = Annotated[int, Range(1, 256)]
Seconds = Annotated[float, Range(0, above=True)]
_OWNER_READ_WRITE = OctalMode(0o600)
_OWNER_ALL = OctalMode(0o700)

_DOTTED_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


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
    """

    what: ClassVar[str] = "a file tier"

    kind: Literal["file"] = "file"
    root: Annotated[str, Matches(r"[^\x00]+", "a directory path")] = field(
        metadata=example("root: /mnt/nvme/kvtiers")
    )
    capacity: Size | None = None
    io: Literal["auto", "posix", "kvikio"] = "auto"
    threads: Threads = 8
    gds: bool = False
    shared: bool = False
    o_direct: bool = False
    file_mode: OctalMode = _OWNER_READ_WRITE
    dir_mode: OctalMode = _OWNER_ALL
    # Corrupt chunk files are moved aside for inspection rather than deleted.
    quarantine: bool = True

    @property
    def can_be_primary(self) -> bool:
        return self.gds

    @property
    def root_path(self) -> Path:
        """``root`` with ``~`` expanded, made absolute against the current directory."""
        return Path(self.root).expanduser().absolute()

    def _check(self) -> None:
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


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``, for messages and logs."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"***@{host}").geturl()


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
        f"'embedded', got {redact_url(url)!r}"
    )


def _prefix_problem(prefix: str) -> str | None:
    if prefix.startswith("/"):
        return f"an object prefix must not start with '/', got {prefix!r}; drop the '/'"
    return None


@dataclass(frozen=True, kw_only=True)
class S3TierConfig(TierConfig):
    """An S3-compatible bucket. ``endpoint_url: embedded`` starts a local test server.

    Requests go through botocore's ``retry_mode`` (``standard``, or ``adaptive`` which
    also limits the client's request rate when throttled), ``max_attempts`` attempts in
    all; botocore's back-off is capped at ``backoff_max_s``. A GET body cut in transit
    (which botocore never retries) is read again up to ``max_attempts`` times with back-off
    from ``backoff_base_s``. Every socket wait is capped at ``timeout_s``.
    ``op_deadline_s`` bounds one operation (a chunk's get or put, a probe, a delete) as a
    whole: attempts, back-off and socket waits together end by then and the key fails
    (docs/architecture.md, "Liveness").

    ``region`` unset: ``AWS_REGION``, else boto3's own resolution (``AWS_DEFAULT_REGION``,
    the profile's region); ``profile`` names a profile of the AWS config files. At start-up
    the endpoint must refuse a second put-if-absent of a probe object;
    ``conditional_writes: false`` accepts an endpoint that ignores ``If-None-Match``: racing
    writers of one chunk then overwrite each other (last writer wins; both wrote the same
    key's chunk and every read is checked against its checksum, so reads stay safe).
    """

    what: ClassVar[str] = "an s3 tier"

    kind: Literal["s3"] = "s3"
    bucket: Annotated[str, Check(_bucket_problem)] = field(metadata=example("bucket: kv-cache"))
    prefix: Annotated[str, Check(_prefix_problem)] = ""
    region: Annotated[str, Matches(r"[a-z0-9-]+", "a region such as us-east-1")] | None = None
    profile: Annotated[str, SIMPLE_NAME] | None = None
    endpoint_url: Annotated[str, Check(_endpoint_problem)] | None = None
    threads: Threads = 16
    capacity: Size | None = None
    shared: bool = False
    retry_mode: Literal["standard", "adaptive"] = "standard"
    max_attempts: Annotated[int, Range(1)] = 5
    backoff_base_s: Seconds = 0.05
    backoff_max_s: Seconds = 20.0
    timeout_s: Seconds = 30.0
    op_deadline_s: Seconds = DEFAULT_OP_DEADLINE_S
    delete_corrupt: bool = True
    conditional_writes: bool = True

    def _check(self) -> None:
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
            parts.append(f"endpoint={redact_url(self.endpoint_url)}")
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

    def describe(self) -> str:
        parts = [f"fsspec {self.url}"]
        if self.capacity is not None:
            parts.append(format_size(self.capacity))
        if self.shared:
            parts.append("shared")
        return ", ".join(parts)
