"""Model fingerprints: what defines a model's weights when no immutable revision says so.

A cache identity must change when the weights change. A commit hash (40 hex digits) pins
them; a branch name (``main``) or a local directory does not. For those,
:func:`resolve_model` records a fingerprint read cheaply, without opening a weight file:

- a Hugging Face hub snapshot directory (``…/models--org--name/snapshots/<commit>/``)
  stands for the hub model ``org/name`` at that commit, whatever path reached it;
- any other local directory: sha256 over its ``config.json`` bytes, the names and sizes of
  its weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) and the
  bytes of its weight index files; its name is its real path, so a relative and an
  absolute spelling, or a symlink, name one model;
- a single model file (GGUF): its real path, name and size;
- a hub name with a moving revision: the commit the local hub cache resolved that
  revision to (the one the engine loaded), found without network access.

Limits (documented in ``docs/on-disk-format.md``): weights rewritten in place with the same
file names and sizes and the same ``config.json`` keep their fingerprint; pin a revision
or set a salt when a directory's weights change that way.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIX = ".index.json"
#: A config or index file larger than this is not read whole (its size is hashed instead).
MAX_METADATA_BYTES = 64 << 20

_COMMIT = re.compile(r"[0-9a-f]{40}")
_HUB_REPO_DIR = re.compile(r"models--(.+)")


@dataclass(frozen=True)
class ModelIdentity:
    """How the identity names a model: ``name``, ``revision`` (empty when none was
    pinned) and ``fingerprint`` (empty when the revision is an immutable commit)."""

    name: str
    revision: str
    fingerprint: str


def is_immutable_revision(revision: str | None) -> bool:
    """Whether ``revision`` is a full commit hash (40 lowercase hex digits)."""
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def hub_snapshot(path: Path) -> tuple[str, str] | None:
    """``(repo id, commit)`` when ``path`` is a hub cache snapshot directory, else ``None``."""
    commit, snapshots, repo_dir = path.name, path.parent.name, path.parent.parent.name
    match = _HUB_REPO_DIR.fullmatch(repo_dir)
    if snapshots != "snapshots" or match is None or not _COMMIT.fullmatch(commit):
        return None
    return match.group(1).replace("--", "/"), commit


def directory_fingerprint(path: Path) -> str:
    """``sha256:<hex>`` over ``path``'s config, weight file names and sizes, and indexes.

    Raises :class:`FileNotFoundError` when ``path`` has no ``config.json`` (it is then not
    a model directory the engine could load).
    """
    digest = hashlib.sha256()
    config = path / CONFIG_NAME
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME}, so this is not a model directory")
    _add_file(digest, CONFIG_NAME, config)
    with os.scandir(path) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        if name.endswith(INDEX_SUFFIX):
            _add_file(digest, name, path / name)
        elif name.endswith(WEIGHT_SUFFIXES):
            # stat follows symlinks: hub snapshots link to blobs.
            digest.update(f"weight\0{name}\0{(path / name).stat().st_size}\n".encode())
    return "sha256:" + digest.hexdigest()


def _add_file(digest: hashlib._Hash, name: str, path: Path) -> None:
    size = path.stat().st_size
    if size > MAX_METADATA_BYTES:
        digest.update(f"large\0{name}\0{size}\n".encode())
        return
    digest.update(f"file\0{name}\0{size}\n".encode())
    digest.update(path.read_bytes())


def hub_cache_commit(repo_id: str, revision: str) -> str | None:
    """The commit the local hub cache holds for ``repo_id`` at ``revision``, or ``None``
    (no ``huggingface_hub``, or nothing cached). Never touches the network."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, CONFIG_NAME, revision=revision)
    except ValueError:
        # Not a valid repo id (e.g. a path that does not exist here).
        return None
    if not isinstance(found, str):
        return None
    snapshot = hub_snapshot(Path(found).parent)
    return None if snapshot is None else snapshot[1]


def resolve_model(name: str, revision: str | None) -> ModelIdentity:
    """How the identity names model ``name`` asked for at ``revision`` (see the module
    docstring); ``revision`` ``None`` or empty means none was pinned."""
    given = revision or ""
    path = Path(name)
    if path.is_dir():
        real = Path(os.path.realpath(path))
        snapshot = hub_snapshot(real)
        if snapshot is not None:
            return ModelIdentity(name=snapshot[0], revision=snapshot[1], fingerprint="")
        return ModelIdentity(
            name=str(real), revision=given, fingerprint=directory_fingerprint(real)
        )
    if path.is_file():
        # A single-file model (GGUF): its real path, and its size for a fingerprint.
        real = Path(os.path.realpath(path))
        size = real.stat().st_size
        digest = hashlib.sha256(f"weight\0{real.name}\0{size}\n".encode()).hexdigest()
        return ModelIdentity(name=str(real), revision=given, fingerprint="sha256:" + digest)
    if is_immutable_revision(given):
        return ModelIdentity(name=name, revision=given, fingerprint="")
    commit = hub_cache_commit(name, given or "main")
    return ModelIdentity(
        name=name, revision=given, fingerprint="" if commit is None else f"hub-commit:{commit}"
    )
