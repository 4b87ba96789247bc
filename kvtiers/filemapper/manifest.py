"""The namespace manifest: the identity a namespace was created under, written once.

``<root>/<namespace>/manifest.json`` holds the full :class:`NamespaceIdentity`, its digest,
the manifest and chunk format versions and the creation time. It is published atomically
and without clobbering, so of several processes creating one namespace exactly one
manifest wins and every process then checks that one.

Opening a namespace always re-reads its manifest and compares it field by field with the
identity of the opener. Any difference, or a manifest that cannot be parsed or read (a
FIFO, a directory or a symlink loop in its place: refused at once, never waited on),
raises :class:`~kvtiers.errors.NamespaceMismatchError`: kvtiers fails closed rather than
serve KV computed under another identity.

Creating a namespace on a filesystem that refuses the manifest (full, read-only, no
permission) raises a one-line :class:`~kvtiers.errors.ConfigError` and leaves no empty
namespace directory behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvtiers.core import chunkformat
from kvtiers.core.bounded import load_json
from kvtiers.core.publish import DEFAULT_DIR_MODE, DEFAULT_FILE_MODE, publish_bytes
from kvtiers.core.regular import read_regular
from kvtiers.errors import ConfigError, NamespaceMismatchError, SymlinkEscapeError
from kvtiers.filemapper.identity import NamespaceIdentity

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT_VERSION = 1
#: A manifest is a few KiB; anything larger than this is not one.
MAX_MANIFEST_BYTES = 1 << 20

_EXPECTED_MANIFEST = "a kvtiers manifest"
_ABSENT = "<absent>"


def manifest_bytes(identity: NamespaceIdentity, *, created_at: float | None = None) -> bytes:
    """The manifest of ``identity``; ``created_at`` is seconds since the epoch (now if
    ``None``)."""
    stamp = time.time() if created_at is None else created_at
    document = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "chunk_format_version": chunkformat.FORMAT_VERSION,
        "namespace": identity.namespace,
        "digest": identity.hexdigest,
        "created_at": datetime.fromtimestamp(stamp, tz=timezone.utc).isoformat(),
        "identity": identity.to_dict(),
    }
    return (json.dumps(document, sort_keys=True, indent=2, ensure_ascii=True) + "\n").encode()


def check_manifest(data: bytes, identity: NamespaceIdentity, *, where: str) -> None:
    """Raise :class:`~kvtiers.errors.NamespaceMismatchError` unless ``data`` is the
    manifest of exactly ``identity``; ``where`` locates it in the message.

    Every differing field is named with its stored and expected value: the manifest's own
    fields (``format_version``, ``digest``, ...) and the identity's, dotted
    (``groups[0].tokens_per_block``, ``len(groups)``, ``parallel.tp_size``).
    """
    try:
        document = load_json(data, max_bytes=MAX_MANIFEST_BYTES)
    except ValueError as exc:
        raise NamespaceMismatchError(
            where, {"manifest": (f"unreadable ({exc})", _EXPECTED_MANIFEST)}
        ) from None
    if not isinstance(document, dict) or not isinstance(document.get("identity"), dict):
        raise NamespaceMismatchError(
            where, {"manifest": ("unreadable (not a kvtiers manifest)", _EXPECTED_MANIFEST)}
        )
    expected: dict[str, Any] = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "chunk_format_version": chunkformat.FORMAT_VERSION,
        "namespace": identity.namespace,
        "digest": identity.hexdigest,
    }
    differences: dict[str, tuple[object, object]] = {}
    for name, value in expected.items():
        _diff(document.get(name, _ABSENT), value, name, differences)
    _diff(document["identity"], identity.to_dict(), "", differences)
    if differences:
        raise NamespaceMismatchError(where, differences)


def open_namespace(
    root: Path,
    identity: NamespaceIdentity,
    *,
    create: bool = True,
    file_mode: int = DEFAULT_FILE_MODE,
    dir_mode: int = DEFAULT_DIR_MODE,
) -> Path:
    """The directory of ``identity``'s namespace under ``root``, its manifest checked.

    A namespace directory that is a symbolic link raises
    :class:`~kvtiers.errors.SymlinkEscapeError`. An existing manifest must match (see
    :func:`check_manifest`). A missing one is
    published when ``create`` is true, racing safely with other processes doing the same;
    otherwise :class:`FileNotFoundError` is raised. A manifest that cannot be written
    raises :class:`~kvtiers.errors.ConfigError` (path ``root``), and a namespace
    directory this call created is removed again.
    """
    namespace_dir = Path(root) / identity.namespace
    path = namespace_dir / MANIFEST_NAME
    if namespace_dir.is_symlink():
        raise SymlinkEscapeError(
            f"{namespace_dir} is a symbolic link; a namespace must be a real directory under "
            "its root (a link may lead outside it): remove the link"
        )
    try:
        data = read_manifest(path)
    except FileNotFoundError:
        if not create:
            raise FileNotFoundError(
                f"{path}: no kvtiers namespace here for this cache identity; "
                "open it with create=True to start one"
            ) from None
        try:
            _create(namespace_dir, identity, file_mode=file_mode, dir_mode=dir_mode)
            return namespace_dir
        except FileExistsError:
            data = read_manifest(path)
    check_manifest(data, identity, where=str(path))
    return namespace_dir


def differences(stored: object, expected: object) -> dict[str, tuple[object, object]]:
    """Every leaf where two identities (``to_dict`` forms, or manifests) differ, by dotted
    name, with the two values; a field only one side has is paired with ``"<absent>"``."""
    out: dict[str, tuple[object, object]] = {}
    _diff(stored, expected, "", out)
    return out


def _create(namespace_dir: Path, identity: NamespaceIdentity, *, file_mode: int,
            dir_mode: int) -> None:
    """Publish the manifest of a new namespace (no clobbering); on failure remove the
    namespace directory if this call made it and it is still empty."""
    existed = namespace_dir.is_dir()
    try:
        publish_bytes(
            namespace_dir / MANIFEST_NAME,
            [manifest_bytes(identity)],
            file_mode=file_mode,
            dir_mode=dir_mode,
            replace=False,
            root=namespace_dir.parent,
        )
    except FileExistsError:
        raise
    except OSError as exc:
        if not existed:
            # Fails (and is ignored) when another process has put something there since.
            with contextlib.suppress(OSError):
                os.rmdir(namespace_dir)
        hint = {
            errno.ENOSPC: "free space on that filesystem or point root at another one",
            errno.EDQUOT: "raise the quota or point root at another filesystem",
            errno.EROFS: "the filesystem is read-only; mount it read-write or point root "
            "at a writable directory",
        }.get(exc.errno or 0, "check the directory's permissions and filesystem")
        raise ConfigError(
            f"cannot create the namespace {namespace_dir.name} under {namespace_dir.parent}: "
            f"{exc.strerror or exc}; {hint}",
            path="root",
        ) from None


def read_manifest(path: Path) -> bytes:
    """The manifest's bytes (at most one over the limit). A missing manifest raises
    :class:`FileNotFoundError`; anything else that cannot be read, including something
    other than a regular file in its place, raises
    :class:`~kvtiers.errors.NamespaceMismatchError` at once."""
    try:
        return read_regular(path, MAX_MANIFEST_BYTES + 1, follow_symlinks=True)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise NamespaceMismatchError(
            str(path),
            {"manifest": (f"unreadable ({exc.strerror or exc})", _EXPECTED_MANIFEST)},
        ) from None


def _diff(
    stored: object,
    expected: object,
    path: str,
    out: dict[str, tuple[object, object]],
) -> None:
    """Record in ``out`` every leaf where ``stored`` and ``expected`` differ."""
    if isinstance(stored, dict) and isinstance(expected, dict):
        for name in sorted(set(stored) | set(expected), key=str):
            where = f"{path}.{name}" if path else str(name)
            _diff(stored.get(name, _ABSENT), expected.get(name, _ABSENT), where, out)
    elif (
        isinstance(stored, list)
        and isinstance(expected, list)
        and any(isinstance(item, dict) for item in (*stored, *expected))
    ):
        if len(stored) != len(expected):
            out[f"len({path})"] = (len(stored), len(expected))
        # Items past the shorter list are covered by the length difference just recorded.
        for idx, (s, e) in enumerate(zip(stored, expected, strict=False)):
            _diff(s, e, f"{path}[{idx}]", out)
    elif type(stored) is not type(expected) or stored != expected:
        # Type first: JSON ``true`` and ``1.0`` compare equal to ``1`` in Python.
        out[path] = (stored, expected)
