"""Start-time checks of a stack, before anything is built: ``kvtiers check`` and every start.

:func:`preflight` asks what a start would need of the machine and the services a stack
file names, and changes nothing it finds: S3 credentials and buckets (HeadBucket) and
write permission under the prefix (a probe object, deleted again); write permission on
each file root (a probe file in it, or a probe directory in the nearest existing parent
when the root is still to be made; both removed at once); free space there; room in
``/dev/shm`` for a cpu tier placed there; the metrics port; and, with the engine's
identity, an existing namespace's manifest (it must match, as opening it would require).
Each problem is one :class:`Finding` naming the YAML key; a warning is one a start survives.

:func:`check_before_build` runs them first when a stack is built (``load_stack``), so a
start that would fail stops before any namespace directory, manifest, region or listening
socket exists, with one :class:`~kvtiers.errors.ConfigError` line naming every problem.
``endpoint_url: embedded`` names a server the engine starts itself: it has nothing to
check beforehand.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtiers.config import StackConfig
from kvtiers.config.sizes import format_size
from kvtiers.config.tiers import (
    CPUTierConfig,
    FileTierConfig,
    S3TierConfig,
    ServiceTierConfig,
)
from kvtiers.core.config import OffloadingConfig
from kvtiers.errors import ConfigError, NamespaceMismatchError

#: Where a cpu tier with a ``shared_memory_name`` keeps its region.
SHM_DIR = Path("/dev/shm")
#: Below this much free space a file root is reported as full (a problem): no chunk fits.
MIN_FREE_BYTES = 64 << 20
#: The name of the probe file or object (a random suffix follows); a dot first, so
#: listings of a namespace never take it for a chunk.
PROBE_PREFIX = ".kvtiers-check-"

Severity = Literal["problem", "warning"]


@dataclass(frozen=True)
class Finding:
    """One thing a start would trip on (``problem``) or should know (``warning``);
    ``path`` is the YAML key it concerns (``tiers[1].root``)."""

    path: str
    message: str
    severity: Severity = "problem"

    def line(self, source: str = "") -> str:
        """The one-line report: ``<source>: <path>: <message>``."""
        where = ": ".join(part for part in (source, self.path) if part)
        prefix = "warning: " if self.severity == "warning" else ""
        return f"{prefix}{where}: {self.message}" if where else prefix + self.message


def preflight(
    config: StackConfig,
    identity: OffloadingConfig | None = None,
    *,
    check_port: bool = True,
) -> list[Finding]:
    """Every start-time check of ``config`` (see the module docstring), in tier order.

    ``identity`` (the engine's, or the ``model:`` section's) lets an existing namespace's
    manifest be compared; without it manifests are not read. ``check_port=False`` leaves
    the metrics port out (a caller about to bind it reports its own error)."""
    findings: list[Finding] = []
    for index, tier in enumerate(config.tiers):
        where = f"tiers[{index}]"
        if isinstance(tier, CPUTierConfig):
            findings.extend(_cpu_findings(tier, where))
        elif isinstance(tier, FileTierConfig):
            findings.extend(_file_findings(tier, where, identity))
        elif isinstance(tier, S3TierConfig):
            findings.extend(_s3_findings(tier, where))
        elif isinstance(tier, ServiceTierConfig):
            findings.extend(_service_findings(tier, where))
    if check_port and config.metrics is not None and config.metrics.port != 0:
        problem = _port_problem(config.metrics.addr, config.metrics.port)
        if problem is not None:
            findings.append(Finding("metrics.port", problem))
    return findings


def check_before_build(config: StackConfig, identity: OffloadingConfig | None) -> None:
    """Raise one :class:`~kvtiers.errors.ConfigError` naming every problem
    :func:`preflight` finds (warnings are not errors); its source is the stack file."""
    problems = [f for f in preflight(config, identity, check_port=True)
                if f.severity == "problem"]
    if not problems:
        return
    source = "" if config.source == "<mapping>" else config.source
    if len(problems) == 1:
        raise ConfigError(problems[0].message, path=problems[0].path, source=source)
    raise ConfigError(
        f"{len(problems)} problems before start: "
        + "; ".join(f"{p.path}: {p.message}" for p in problems),
        source=source,
    )


def _service_findings(tier: ServiceTierConfig, where: str) -> Iterator[Finding]:
    """Something listens on the service's socket (a connect, closed at once; whether it
    is ``kvtiers serve`` the attach tells)."""
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(tier.timeout_s)
    try:
        probe.connect(tier.socket)
    except OSError as exc:
        yield Finding(f"{where}.socket", f"no kvtiers service answers on {tier.socket} "
                      f"({exc.strerror or exc}); start it with kvtiers serve")
    finally:
        probe.close()


def _cpu_findings(tier: CPUTierConfig, where: str) -> Iterator[Finding]:
    """Room for the region: in ``/dev/shm`` when it is placed there."""
    if tier.shared_memory_name is None:
        return
    free = _free_bytes(SHM_DIR)
    if free is None:
        yield Finding(f"{where}.shared_memory_name",
                      f"{SHM_DIR} cannot be read; a shared cpu tier needs it")
        return
    existing = SHM_DIR / tier.shared_memory_name
    with contextlib.suppress(OSError):
        free += existing.stat().st_size  # an attached region is already counted as used
    if free < tier.capacity:
        yield Finding(
            f"{where}.capacity",
            f"capacity {format_size(tier.capacity)} does not fit in {SHM_DIR}: "
            f"{format_size(free)} free; lower capacity or enlarge {SHM_DIR} "
            "(in a container: --shm-size, or an emptyDir with medium: Memory)",
        )


def _file_findings(
    tier: FileTierConfig, where: str, identity: OffloadingConfig | None
) -> Iterator[Finding]:
    root = tier.root_path
    existing = _nearest_existing(root)
    problem = _write_problem(root, existing)
    if problem is not None:
        yield Finding(f"{where}.root", problem)
        return
    free = _free_bytes(existing)
    if free is not None and free < MIN_FREE_BYTES:
        yield Finding(f"{where}.root",
                      f"{existing} has {format_size(free)} free: the disk is full; free "
                      "space or point root at another filesystem")
    elif free is not None and tier.capacity is not None and free < tier.capacity:
        yield Finding(
            f"{where}.capacity",
            f"capacity {format_size(tier.capacity)} is more than the {format_size(free)} "
            f"free on {existing}: stores stop when the disk fills",
            severity="warning",
        )
    if identity is not None and existing == root:
        yield from _manifest_findings(root, where, identity)


def _manifest_findings(
    root: Path, where: str, identity: OffloadingConfig
) -> Iterator[Finding]:
    """An existing namespace for ``identity`` under ``root`` must match it, as opening
    it would require (read only; a missing one is what a first start creates)."""
    from kvtiers.filemapper import MANIFEST_NAME, NamespaceIdentity
    from kvtiers.filemapper.manifest import check_manifest, read_manifest

    ident = NamespaceIdentity.from_config(identity)
    path = root / ident.namespace / MANIFEST_NAME
    try:
        # As the tier reads it: never blocking on a FIFO or a device in its place.
        data = read_manifest(path)
    except FileNotFoundError:
        return
    except NamespaceMismatchError as exc:
        yield Finding(f"{where}.root", str(exc))
        return
    try:
        check_manifest(data, ident, where=str(path))
    except NamespaceMismatchError as exc:
        yield Finding(f"{where}.root", str(exc))


def _s3_findings(tier: S3TierConfig, where: str) -> Iterator[Finding]:
    """Credentials and bucket (HeadBucket), then a probe object put and deleted under
    the prefix (what list, get, put and delete need is then known to work)."""
    if tier.endpoint_url == "embedded":
        return
    try:
        from kvtiers.tiers.s3.store import S3Store
    except ModuleNotFoundError as exc:
        from kvtiers.optional import hint_for

        yield Finding(f"{where}.kind", hint_for(exc.name or str(exc)))
        return
    try:
        store = S3Store(
            tier.bucket, region=tier.region, endpoint_url=tier.endpoint_url,
            profile=tier.profile, timeout_s=tier.timeout_s, max_connections=1,
            retry_mode=tier.retry_mode, max_attempts=tier.max_attempts,
            backoff_max_s=tier.backoff_max_s, conditional_writes=False,
        )
    except ConfigError as exc:
        yield Finding(f"{where}.{exc.path or 'bucket'}", exc.message)
        return
    try:
        store.check_bucket(where="bucket")
    except ConfigError as exc:
        store.close()
        yield Finding(f"{where}.{exc.path or 'bucket'}", exc.message)
        return
    probe = (f"{tier.prefix.rstrip('/')}/" if tier.prefix else "") + PROBE_PREFIX
    probe += secrets.token_hex(8)
    try:
        store.put(probe, [b"kvtiers check\n"])
        store.delete(probe)
    except Exception as exc:  # botocore's errors as well as kvtiers' own: one line
        yield Finding(f"{where}.prefix", f"cannot write {store.describe(probe)}: "
                      f"{_short(exc)}; the credentials need put and delete there")
    finally:
        store.close()


def _nearest_existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor)


def _write_problem(root: Path, existing: Path) -> str | None:
    """Why nothing can be written at ``root`` (``existing`` its nearest existing part),
    or ``None``. A probe is made and removed: a file in an existing root, a directory in
    the nearest existing parent of one still to be made (which the tier would create)."""
    if not existing.is_dir():
        return f"{existing} is not a directory, so the root {root} cannot be one"
    probe = existing / (PROBE_PREFIX + secrets.token_hex(8))
    try:
        if existing == root:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             0o600))
        else:
            os.mkdir(probe, 0o700)
    except OSError as exc:
        if exc.errno == errno.EROFS and existing == root:
            return None  # a read-only root opens read-only: loads are still served
        if existing == root:
            return (f"cannot write in the root {root}: {exc.strerror or exc}; give this "
                    "user write permission there or choose another root")
        return (f"the root {root} does not exist and cannot be created in {existing}: "
                f"{exc.strerror or exc}; create it with write permission for this user or "
                "choose another root")
    with contextlib.suppress(OSError):
        if existing == root:
            probe.unlink()
        else:
            probe.rmdir()
    return None


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _port_problem(addr: str, port: int) -> str | None:
    """Why ``addr:port`` cannot be listened on, or ``None`` (the probe socket is closed
    at once, reusable as the exporter's would be)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"metrics.addr {addr!r} cannot be resolved: {exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return (f"the metrics exporter cannot listen on {addr}:{port}: "
                    f"{exc.strerror or exc}; choose another metrics.port (0 picks a free "
                    "one) or metrics.addr")
    return None


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
