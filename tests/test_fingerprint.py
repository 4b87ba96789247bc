"""Model fingerprints: hub snapshots, local directories and hub names with moving
revisions (no network, no weight file opened)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtiers.filemapper.fingerprint import (
    directory_fingerprint,
    hub_snapshot,
    is_immutable_revision,
    resolve_model,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def make_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (path / "model.safetensors").write_bytes(b"w" * 64)
    return path


def hub_cache(root: Path, repo: str, commits: dict[str, str]) -> None:
    """A hub cache for ``repo``: ``refs/<name>`` -> commit, each with a snapshot."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    for ref, commit in commits.items():
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
        make_model(repo_dir / "snapshots" / commit)


def test_immutable_revisions_are_full_commit_hashes() -> None:
    assert is_immutable_revision(COMMIT)
    assert not is_immutable_revision("main")
    assert not is_immutable_revision(COMMIT[:12])
    assert not is_immutable_revision(None)


def test_a_snapshot_directory_is_the_hub_model_at_its_commit(tmp_path: Path) -> None:
    hub_cache(tmp_path, "org/name", {"main": COMMIT})
    snapshot = tmp_path / "models--org--name" / "snapshots" / COMMIT
    assert hub_snapshot(snapshot) == ("org/name", COMMIT)
    model = resolve_model(str(snapshot), None)
    assert (model.name, model.revision, model.fingerprint) == ("org/name", COMMIT, "")


@pytest.mark.parametrize(
    "change",
    [
        lambda p: (p / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}'),
        lambda p: (p / "model.safetensors").write_bytes(b"w" * 65),
        lambda p: (p / "extra.bin").write_bytes(b""),
        lambda p: (p / "model.safetensors.index.json").write_text("{}"),
    ],
    ids=["config", "weight size", "weight file", "index"],
)
def test_the_directory_fingerprint_follows_config_weights_and_index(
    tmp_path: Path, change: object
) -> None:
    model = make_model(tmp_path / "m")
    before = directory_fingerprint(model)
    change(model)  # type: ignore[operator]
    assert directory_fingerprint(model) != before


def test_weight_contents_and_other_files_do_not_count(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m")
    before = directory_fingerprint(model)
    (model / "model.safetensors").write_bytes(b"x" * 64)
    (model / "README.md").write_text("notes")
    assert directory_fingerprint(model) == before


def test_one_local_model_under_several_spellings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(tmp_path / "models" / "m")
    (tmp_path / "link").symlink_to(model)
    monkeypatch.chdir(tmp_path / "models")
    spellings = [str(model), "m", "./m/", "../models/m", str(tmp_path / "link")]
    resolved = {resolve_model(name, "main") for name in spellings}
    assert len(resolved) == 1
    only = resolved.pop()
    assert only.name == os.path.realpath(model)
    assert only.fingerprint.startswith("sha256:")


def test_a_directory_without_a_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path / "empty"), None)


def test_a_moving_hub_revision_records_the_cached_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    hub_cache(tmp_path, "org/name", {"main": COMMIT, "dev": OTHER_COMMIT})
    main = resolve_model("org/name", None)
    assert (main.name, main.revision, main.fingerprint) == ("org/name", "", f"hub-commit:{COMMIT}")
    assert resolve_model("org/name", "dev").fingerprint == f"hub-commit:{OTHER_COMMIT}"
    pinned = resolve_model("org/name", COMMIT)
    assert (pinned.revision, pinned.fingerprint) == (COMMIT, "")
    assert resolve_model("org/uncached", "main").fingerprint == ""


def test_a_single_model_file_is_named_by_its_real_path_and_size(tmp_path: Path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"g" * 10)
    first = resolve_model(str(weights), None)
    assert first.name == os.path.realpath(weights)
    weights.write_bytes(b"g" * 11)
    assert resolve_model(str(weights), None).fingerprint != first.fingerprint
