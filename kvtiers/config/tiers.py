"""The configuration of each tier kind: ``cpu``, ``file``, ``s3``, ``fsspec``.

Every tier has a ``kind``, a ``name`` (unique within a stack; the stack parser defaults it
to its kind, or ``<kind><index>`` when the kind repeats) and an ``admission`` rule for
chunks written to it; the kinds that can be lower tiers add their write rules
(``write``, ``write_after_hits``, ``write_promoted``) and the cost model's seeds. The
classes here only describe and check values; building a tier from them is the job of the
kind's factory (see :mod:`kvtiers.config.kinds`). Sizes are bytes; ``*_s`` fields are
seconds.
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from kvtiers.config.schema import Check, Matches, OctalMode, Range, Section, example
from kvtiers.config.sizes import Size, format_size
from kvtiers.core.bounded import nesting_problem
from kvtiers.core.codec import codec_problem
from kvtiers.errors import ConfigError
from kvtiers.optional import hint_for
from kvtiers.policies.base import load_policy, policy_name_problem

#: Default ``op_deadline_s`` of object tiers, seconds (kept equal to
#: :data:`kvtiers.tiers.object.retry.DEFAULT_OP_DEADLINE_S`; config never imports tiers).
DEFAULT_OP_DEADLINE_S = 30.0

#: Default ``load_backoff_s`` / ``load_backoff_max_s`` of lower tiers, seconds (kept equal to
#: :mod:`kvtiers.tiers.backoff`'s defaults).
DEFAULT_LOAD_BACKOFF_S = 1.0
DEFAULT_LOAD_BACKOFF_MAX_S = 60.0
#: Default ``list_max_chunks`` (kept equal to
#: :data:`kvtiers.tiers.listing.DEFAULT_LIST_MAX_CHUNKS`).
DEFAULT_LIST_MAX_CHUNKS = 1_000_000

SIMPLE_NAME = Matches(r"[A-Za-z0-9._-]+", "a simple name of letters, digits, '.', '_' and '-'")
# A /dev/shm file name: no leading dot (the region's temp names start with one), short.
SHM_NAME = Matches(
    r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}",
    "a simple name of at most 200 letters, digits, '.', '_' and '-', not starting with '.'",
)
# fsspec storage options are a handful of settings, sometimes one nested client mapping.
STORAGE_OPTIONS_MAX_DEPTH = 6
STORAGE_OPTIONS_MAX_VALUES = 1000
Threads = Annotated[int, Range(1, 256)]
Seconds = Annotated[float, Range(0, above=True)]
_OWNER_READ_WRITE = OctalMode(0o600)
_OWNER_ALL = OctalMode(0o700)
#: The ``codec:`` settings (:data:`kvtiers.core.codec.CODEC_NAMES`).
CodecName = Literal["none", "blosc2-zstd", "blosc2-lz4"]


def _check_codec(codec: str) -> None:
    """A lower tier's codec must be one this machine can run (its package installed)."""
    problem = codec_problem(codec)
    if problem is not None:
        raise ConfigError(problem, path="codec")


def _check_listing(config: LowerTierConfig) -> None:
    """The background listing of a shared namespace (docs/sharing.md, "Announcing other
    servers' chunks"): only over a shared namespace, and the summary only after listings."""
    if config.list_interval_s is not None and not config.shared:
        raise ConfigError(
            "list_interval_s lists a namespace other servers write into, to announce their "
            "chunks; set shared: true as well, or remove list_interval_s",
            path="list_interval_s",
        )
    if config.summary_interval_s is not None and config.list_interval_s is None:
        raise ConfigError(
            "the namespace summary is rebuilt from the background listing; set "
            "list_interval_s as well (for example list_interval_s: 60), or remove "
            "summary_interval_s",
            path="summary_interval_s",
        )


def _check_load_backoff(base_s: float, max_s: float) -> None:
    """A lower tier's load back-off: a key whose load failed is a miss for ``base_s``,
    doubled per further failure up to ``max_s`` (docs/architecture.md, "Liveness")."""
    if max_s < base_s:
        raise ConfigError(
            f"load_backoff_max_s {max_s:g} is below load_backoff_s {base_s:g}; raise "
            "load_backoff_max_s or lower load_backoff_s",
            path="load_backoff_max_s",
        )


#: No tier can hold a chunk in less than one 4 KiB page: a smaller capacity is a size
#: written without its unit (``capacity: 8`` is 8 bytes).
MIN_CAPACITY_BYTES = 4096


def _capacity_problem(size: int) -> str | None:
    if size < MIN_CAPACITY_BYTES:
        return (
            f"{size} bytes cannot hold a single chunk (a chunk takes at least 4 KiB); a bare "
            f"number means bytes: write the unit, e.g. {size}GiB"
        )
    return None


def cpu_capacity_problem(name: str, capacity: int, slot_bytes: int) -> str | None:
    """Why the cpu tier ``name`` cannot hold one chunk slot of ``slot_bytes``, or ``None``
    (the build's check, which ``kvtiers validate`` makes when a ``model:`` section gives
    the chunks)."""
    if capacity >= slot_bytes:
        return None
    return (
        f"tier {name!r}: capacity {capacity} bytes holds no chunk of {slot_bytes} bytes; "
        f"give at least {slot_bytes} bytes"
    )


Capacity = Annotated[Size, Check(_capacity_problem)]
"""A tier's capacity: a :data:`~kvtiers.config.sizes.Size` of at least one 4 KiB page."""


@dataclass(frozen=True, kw_only=True)
class TierConfig(Section):
    """Fields every tier has. ``kind`` is fixed by each subclass."""

    kind: str
    """The tier kind: cpu, file, s3, fsspec or service."""
    name: Annotated[str, SIMPLE_NAME]
    """Unique within the stack; names the tier in stats, metrics and messages. Default:
    the kind, or ``<kind><index>`` when the kind repeats."""
    admission: Literal["always", "never"] = "always"
    """Whether chunks are written into this tier at all; ``never`` makes a lower tier
    read-only (it still serves promotions). On a file, s3 or fsspec tier, ``write``,
    ``write_after_hits`` and ``write_promoted`` say when and which."""
    event_medium: Annotated[str, Matches(r"[A-Za-z][A-Za-z0-9_.-]{0,63}",
                                         "a medium name such as DISK")] | None = None
    """The ``medium`` this tier's KV events announce to routers (with vLLM, through
    ``KVTiersConnector``); default vLLM's own: ``CPU`` for the cpu tier, ``STORAGE`` for
    the others. docs/retention.md ("Medium names for routers") lists what routers score."""

    @property
    def can_be_primary(self) -> bool:
        """Whether this tier, as configured, can be the first tier of a stack."""
        return False

    def describe(self) -> str:
        """A short description for one-line summaries: ``cpu 8.0 GiB, arc``."""
        return self.kind


@dataclass(frozen=True, kw_only=True)
class LowerTierConfig(TierConfig):
    """Fields of the kinds that can be a lower tier (promoted from), the persistent ones:
    file, s3, fsspec. Building one hands its load back-off and background listing on
    whole (:class:`kvtiers.tiers.backoff.BackoffSettings`,
    :class:`kvtiers.tiers.listing.ListingSettings`)."""

    write: Literal["through", "back"] = "through"
    """When a lower tier receives a chunk. through: as soon as it is stored in the
    primary (every stored chunk is written). back: when the tier above evicts it (a
    demotion). Directly below the primary (or below a tier that cannot hand its evictions
    over: s3, fsspec) the chunk is copied out of the primary's slot before the slot is
    reused; below a file tier it is written when the file tier evicts it, from the
    primary's slot if the primary still holds it, else read from the evicted file through
    a primary slot before the file is deleted. A chunk with no slot to copy through, or
    whose copy fails, is simply not written (counted); chunks only the primary holds are
    not written at shutdown."""
    write_after_hits: Annotated[int, Range(0)] = 0
    """Frequency admission: write only chunks referenced at least this many times — loaded
    from the primary, or stored again after the primary lost them (0: every chunk). Under
    write: through the chunk is written at the reference that reaches the count; under
    write: back it is admitted then and written when the tier above evicts it (at once,
    if that tier no longer holds it)."""
    write_promoted: bool = False
    """Also write chunks promoted from a tier below this one (an S3 hit lands in the
    primary and, with this, in this file tier too): under write: through when the
    promotion lands, under write: back when the primary evicts it."""
    load_latency_s: Annotated[float, Range(0)] | None = None
    """Expected fixed cost of one promotion job from this lower tier, seconds: seeds the
    cost model (``promotion:``) until the tier's own jobs are measured. Unset with
    ``load_bytes_per_s`` unset too: promotions from it are not held back until its first
    job runs (a request still waits at most its wait bound)."""
    load_bytes_per_s: Size | None = None
    """Expected promotion bandwidth of this lower tier, a size per second (``50MB``):
    seeds the cost model with ``load_latency_s``."""
    list_interval_s: Annotated[float, Range(1)] | None = None
    """With ``shared: true``: list the namespace in the background at most this often and
    announce the chunks other servers published there (and those that vanished) as KV
    events with locality REMOTE (docs/sharing.md, docs/vllm.md). Unset: no listing."""
    list_max_chunks: Annotated[int, Range(1)] = DEFAULT_LIST_MAX_CHUNKS
    """A listing stops after this many chunks (it then withdraws nothing and writes no
    summary): bounds its memory and time (docs/sharing.md gives the cost per chunk)."""
    summary_interval_s: Annotated[float, Range(1)] | None = None
    """With ``list_interval_s``: after a complete listing, republish the namespace summary
    (a Bloom filter of its chunk keys beside the manifest, docs/on-disk-format.md) at most
    this often. Unset: no summary."""
    threads: Threads = 8
    """I/O threads (file) or concurrent requests (s3, fsspec) of the tier's mover, for
    loads and for stores each."""
    capacity: Capacity | None = None
    """Bytes of chunks kept (files or objects); least recently used chunks are removed
    beyond it. Unset: bounded only by the medium (the filesystem; on a bucket, use a
    lifecycle rule instead)."""
    shared: bool = False
    """Other engines write this namespace too (a shared directory, bucket prefix or
    location): an index miss starts a batched background existence probe (the lookup
    answers RETRY until it resolves) instead of a miss."""
    load_backoff_s: Seconds = DEFAULT_LOAD_BACKOFF_S
    """Seconds a chunk whose load failed is a miss before it is tried again; doubled per
    further failure."""
    load_backoff_max_s: Seconds = DEFAULT_LOAD_BACKOFF_MAX_S
    """Cap of that back-off; also how long a chunk forgotten as unreadable stays a miss."""
    codec: CodecName = "none"
    """Lossless codec of stored payloads: none, blosc2-zstd (byte shuffle + zstd per byte
    stream: about 1.45x fewer bytes on bf16 KV, decoding at about 2 GB/s per core; on a
    remote object store it also means fewer bytes to send and fetch) or blosc2-lz4 (bit
    shuffle + LZ4: faster, about 1.2x). A chunk is stored encoded only when that makes it
    smaller; every reader decodes what a chunk's header says, so chunks with and without
    a codec share one namespace. Needs kvtiers[codec]."""

    def _check(self) -> None:
        _check_load_backoff(self.load_backoff_s, self.load_backoff_max_s)
        _check_listing(self)
        _check_codec(self.codec)


@dataclass(frozen=True, kw_only=True)
class ObjectTierConfig(LowerTierConfig):
    """Fields of the object store kinds: s3, fsspec."""

    threads: Threads = 16  # requests wait on the network: more than a disk's threads
    op_deadline_s: Seconds = DEFAULT_OP_DEADLINE_S
    """Overall bound of one operation: every attempt and backoff together end by it."""

    def _describe(self, parts: list[str]) -> str:
        """``parts`` (the kind and where) with the capacity, ``shared`` and the codec."""
        if self.capacity is not None:
            parts.append(format_size(self.capacity))
        if self.shared:
            parts.append("shared")
        if self.codec != "none":
            parts.append(f"codec={self.codec}")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class CPUTierConfig(TierConfig):
    """Host memory: the usual primary. ``shared_memory_name`` places it in ``/dev/shm``."""

    what: ClassVar[str] = "a cpu tier"

    kind: Literal["cpu"] = "cpu"
    capacity: Capacity = field(metadata=example("capacity: 8GiB"))
    """Host memory reserved for chunks, allocated at start-up in slots of the largest
    group's chunk."""
    policy: Annotated[str, Check(policy_name_problem)] = "lru"
    """Eviction policy: lru, arc, s3fifo, or a class named as ``package.module:Class``."""
    shared_memory_name: Annotated[str, SHM_NAME] | None = None
    """Place the region in ``/dev/shm/<name>`` so engine processes on this host share it;
    unset: private anonymous memory. The file is made 0600 by the tier itself; a file
    another user or program left at the name is refused."""

    @property
    def can_be_primary(self) -> bool:
        return True

    def _check(self) -> None:
        # As the build does: the module imports and the class is an EvictionPolicy.
        load_policy(self.policy)

    def describe(self) -> str:
        return f"cpu {format_size(self.capacity)}, {self.policy}"


@dataclass(frozen=True, kw_only=True)
class ServiceTierConfig(TierConfig):
    """The node's shared pool held by ``kvtiers serve`` (docs/service.md): first tier only."""

    what: ClassVar[str] = "a service tier"

    kind: Literal["service"] = "service"
    socket: Annotated[str, Matches(r"[^\x00]+", "a socket path")] = field(
        metadata=example("socket: /run/kvtiers/serve.sock")
    )
    """The Unix socket ``kvtiers serve`` listens on."""
    timeout_s: Annotated[float, Range(0.001)] = 0.5
    """The longest wait for one reply; past it the service counts as down (every lookup
    misses) until a reattach succeeds."""
    retry_s: Annotated[float, Range(0.001)] = 1.0
    """How often a down service is tried again (at calls; nothing sleeps)."""
    lease_slots: Annotated[int, Range(0, 4096)] = 64
    """Slots the engine keeps leased so that a store costs no round trip (its commits go
    in one round trip a step); more are leased when a step stores more. A key two engines
    store at once is then held once but may be written twice. 0: each store reserves its
    slots by a round trip, and such a key is written once."""
    probe_wait_s: Annotated[float, Range(0.0, 600.0)] = 10.0
    """With tiers below the service's pool: how long a lookup that missed the pool may
    answer ``RETRY`` while the service finds the chunk below and promotes it (and at
    least 16 scheduler steps); past both it is a miss, recomputed. An idle engine's steps
    take microseconds, so a bound in steps alone gave up on promotions that take seconds."""

    @property
    def can_be_primary(self) -> bool:
        return True

    def describe(self) -> str:
        return f"service {self.socket}"


@dataclass(frozen=True, kw_only=True)
class FileTierConfig(LowerTierConfig):
    """A directory on local or shared storage; with ``gds: true`` it is a GDS primary.

    ``root`` may be relative (to the current directory when the tier is built) and may
    start with ``~``. ``capacity`` ``None`` means bounded only by the filesystem.
    """

    what: ClassVar[str] = "a file tier"

    kind: Literal["file"] = "file"
    root: Annotated[str, Matches(r"[^\x00]+", "a directory path")] = field(
        metadata=example("root: /mnt/nvme/kvtiers")
    )
    """Directory holding one namespace per cache identity (a directory of its own, not
    the filesystem root); relative paths resolve against the current directory, ``~`` is
    expanded."""
    capacity_scope: Literal["namespace", "root"] = "namespace"
    """What ``capacity`` bounds: this namespace, or (``root``) every namespace under the
    root together, other namespaces' chunks going first, least recently used namespace
    first (one that cannot be unlinked keeps counting; a directory that cannot be read is
    named in a warning and counts against nothing)."""
    io: Literal["auto", "posix", "kvikio"] = "auto"
    """I/O path: posix (pread/pwrite), kvikio (GPUDirect Storage), or auto (kvikio only
    when a CUDA driver loads and a probe succeeds)."""
    gds: bool = False
    """Make this tier the primary, read and written by the GPU directly through kvikio
    (first tier only, no lower tiers)."""
    o_direct: bool = False
    """Bypass the page cache (O_DIRECT, aligned buffers) on the posix path."""
    file_mode: OctalMode = _OWNER_READ_WRITE
    """Permission bits of chunk files; must include 0600. Use 0640 or 0660 to share with a
    group."""
    dir_mode: OctalMode = _OWNER_ALL
    """Permission bits of directories the tier creates; must include 0700."""
    quarantine: bool = True
    """Move corrupt chunk files to ``<namespace>/quarantine/`` for inspection instead of
    deleting them."""
    durability: Literal["process", "power"] = "process"
    """What a stored chunk survives. process: the crash of any process (atomic publish, no
    fsync; a power cut may lose recent chunks, which then read as misses). power: a power
    cut too (a store job's chunks are flushed to disk before they count as stored: one
    syncfs per job on Linux); slower, most for small chunks."""

    @property
    def can_be_primary(self) -> bool:
        return self.gds

    @property
    def root_path(self) -> Path:
        """``root`` with ``~`` expanded, made absolute against the current directory."""
        return Path(self.root).expanduser().absolute()

    def _check(self) -> None:
        if self.gds and self.codec != "none":
            raise ConfigError(
                f"codec: {self.codec} cannot be used with gds: true (chunks go straight "
                "between files and GPU memory, with no host copy to decode); set codec: none",
                path="codec",
            )
        super()._check()
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
        if _is_filesystem_root(self.root_path):
            raise ConfigError(
                f"root {self.root!r} is the filesystem root: the tier would make its "
                "namespace directories straight under it, among the system's own; give it "
                "a directory of its own, e.g. root: /var/cache/kvtiers",
                path="root",
            )
        blocker = _non_directory_on(self.root_path)
        if blocker is not None:
            raise ConfigError(
                f"{blocker} exists and is not a directory, so the root {self.root} cannot be "
                "one; point root at a directory (it is created if missing)",
                path="root",
            )

    def describe(self) -> str:
        parts = [f"file {self.root}"]
        if self.capacity is not None:
            parts.append(format_size(self.capacity))
        parts.append(f"io={self.io}")
        parts.extend(flag for flag in ("gds", "shared", "o_direct") if getattr(self, flag))
        if self.durability != "process":
            parts.append(f"durability={self.durability}")
        if self.codec != "none":
            parts.append(f"codec={self.codec}")
        return ", ".join(parts)


#: What the embedded S3 server (``endpoint_url: embedded``) imports: moto's server.
EMBEDDED_SERVER_MODULES = ("moto", "flask", "flask_cors")


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    """Those of the top-level ``modules`` that cannot be imported here (none is imported)."""
    return [module for module in modules if importlib.util.find_spec(module) is None]


def _is_filesystem_root(path: str | Path) -> bool:
    """Whether ``path`` is ``/`` once ``..``, repeated slashes and links are resolved."""
    resolved = Path(os.path.realpath(path))
    return resolved == resolved.parent


#: fsspec protocols that are the local filesystem (such a tier shares places with file
#: tiers, and its url is a local path).
LOCAL_PROTOCOLS = frozenset({"file", "local"})


def _fsspec_root_problem(url: str) -> str | None:
    """Why ``url`` names no directory of its own below its filesystem's root (bare, or
    ``..`` back up to it; on the local filesystem also through links), or ``None``. At
    such a root namespaces would sit beside whatever else that filesystem holds, and a
    bare local one means the working directory."""
    protocol, _, path = url.partition("://")
    local = protocol.lower() in LOCAL_PROTOCOLS
    if local:
        bare = not path.strip("/") or _is_filesystem_root(path)
    else:
        bare = posixpath.normpath("/" + path.lstrip("/")) == "/"
    if not bare:
        return None
    example = "file:///var/cache/kvtiers" if local else f"{protocol}://kvtiers"
    return (
        f"{url!r} names no directory of its own (it is the root of its filesystem"
        f"{', or the working directory' if local else ''}), so namespaces would sit beside "
        f"everything else there; give a path below the root, e.g. {example}"
    )


def _non_directory_on(path: Path) -> Path | None:
    """The nearest existing ``path`` or ancestor of it, if that is not a directory."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return None if candidate.is_dir() else candidate
        except OSError:
            return None  # unreadable here: the build reports what it finds
    return None


def _fsspec_protocol_problem(url: str) -> str | None:
    """Why fsspec cannot open ``url`` on this machine (fsspec or the protocol's package
    is missing, or the protocol is unknown), or ``None``; nothing is contacted."""
    if importlib.util.find_spec("fsspec") is None:
        return "fsspec is not installed; install kvtiers[fsspec]"
    from fsspec.registry import known_implementations, registry

    protocol = url.split("://", 1)[0].lower()
    if protocol in registry:
        return None
    implementation = known_implementations.get(protocol)
    if implementation is None:
        return (
            f"fsspec knows no protocol {protocol!r}; use one it lists "
            "(fsspec.available_protocols()) such as gcs, az, memory, file"
        )
    package = implementation["class"].split(".", 1)[0]
    if importlib.util.find_spec(package) is None:
        hint = implementation.get("err") or f"install the {package!r} package"
        return f"the {protocol!r} protocol needs the {package!r} package: {hint}"
    return None


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
class S3TierConfig(ObjectTierConfig):
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
    """The bucket; it must exist (except on the embedded server)."""
    prefix: Annotated[str, Check(_prefix_problem)] = ""
    """Object key prefix under which namespaces live (no leading '/')."""
    region: Annotated[str, Matches(r"[a-z0-9-]+", "a region such as us-east-1")] | None = None
    """The bucket's region; unset: ``AWS_REGION``, then boto3's own resolution (profile,
    config files)."""
    profile: Annotated[str, SIMPLE_NAME] | None = None
    """A named profile of the AWS config and credentials files; unset: boto3's default."""
    endpoint_url: Annotated[str, Check(_endpoint_problem)] | None = None
    """An S3-compatible endpoint (MinIO, SeaweedFS, Ceph): ``http(s)://host:port``; unset:
    AWS; ``embedded``: a local moto server in this process (demos and tests)."""
    retry_mode: Literal["standard", "adaptive"] = "standard"
    """botocore's retry mode: ``standard`` (back-off from 1 s on throttling, honours
    Retry-After, a retry quota) or ``adaptive`` (adds client-side rate limiting)."""
    max_attempts: Annotated[int, Range(1)] = 5
    """Tries per request in all, on throttling, 5xx answers and timeouts."""
    backoff_base_s: Seconds = 0.05
    """Bound of the first backoff: each retry sleeps a random time below
    ``min(backoff_max_s, backoff_base_s * 2**attempt)`` (full jitter)."""
    backoff_max_s: Seconds = 20.0
    """Cap of the backoff bound; at least backoff_base_s."""
    timeout_s: Seconds = 30.0
    """Connect and read timeout of one request."""
    delete_corrupt: bool = True
    """Delete an object that fails verification twice (it is a miss either way)."""
    conditional_writes: bool = True
    """Puts carry ``If-None-Match: *`` so racing writers never clobber; the start-up probe
    refuses an endpoint that ignores it. ``false``: no condition, the last writer wins
    (checksums still keep reads safe)."""
    codec: CodecName = "blosc2-zstd"
    """Lossless codec of stored payloads (see the file tier's codec): the default,
    blosc2-zstd, stores bf16 KV in about 1.45x fewer bytes (fewer bytes to send, keep and
    fetch) at about 0.5 GB/s per core to encode and 2 GB/s to decode; none sends the
    chunks as they are. Needs kvtiers[codec] (kvtiers[s3] includes it)."""

    def _check(self) -> None:
        super()._check()
        if self.endpoint_url == "embedded":
            missing = missing_modules(EMBEDDED_SERVER_MODULES)
            if missing:
                raise ConfigError(
                    f"{hint_for(missing[0], 'endpoint_url: embedded')}, or point "
                    "endpoint_url at a real S3 endpoint",
                    path="endpoint_url",
                )
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
        return self._describe(parts)


@dataclass(frozen=True, kw_only=True)
class FsspecTierConfig(ObjectTierConfig):
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
    """Where namespaces live: any fsspec URL (``gcs://bucket/kv``, ``az://container/kv``,
    ``memory://kv``) naming a directory below its filesystem's root (not ``memory://`` or
    ``file:///`` itself); the protocol's fsspec package must be installed."""
    storage_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Keyword arguments for the fsspec filesystem (credentials, project, ...)."""

    def _check(self) -> None:
        super()._check()
        problem = _fsspec_root_problem(self.url) or _fsspec_protocol_problem(self.url)
        if problem is not None:
            raise ConfigError(problem, path="url")
        problem = nesting_problem(
            self.storage_options,
            max_depth=STORAGE_OPTIONS_MAX_DEPTH,
            max_values=STORAGE_OPTIONS_MAX_VALUES,
        )
        if problem is not None:
            raise ConfigError(
                f"{problem}; fsspec options are a few flat settings (credentials, "
                "endpoint), so write them out plainly",
                path="storage_options",
            )

    def describe(self) -> str:
        return self._describe([f"fsspec {self.url}"])
