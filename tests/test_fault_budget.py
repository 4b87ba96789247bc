"""``capacity_scope: root`` (docs/architecture.md, "Liveness"): several namespaces over one
root share one capacity, the least recently used namespace's chunks going first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtiers.config.tiers import FileTierConfig
from kvtiers.errors import ConfigError
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.testing.conformance import conformance_key
from tests.test_file_support import BLOB, offloading_config, open_tier

BUDGET = 4  # chunks


def identity(salt: str) -> NamespaceIdentity:
    return NamespaceIdentity.from_config(offloading_config(salt=salt))


def chunk_files(root: Path) -> dict[str, int]:
    """Chunk files per namespace directory under ``root``."""
    counts = {}
    for namespace in sorted(p for p in root.iterdir() if p.is_dir()):
        counts[namespace.name] = sum(
            1 for path in namespace.rglob("*.kvc") if "quarantine" not in path.parts
        )
    return counts


def test_namespaces_over_one_root_share_one_budget_oldest_namespace_first(
    tmp_path: Path,
) -> None:
    names = []
    for n, salt in enumerate(("a", "b", "c")):
        tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity(salt),
                         capacity_scope="root")
        names.append(tier.manager.namespace_dir.name)
        stored = tier.store(range(10 * n, 10 * n + 3))
        assert len(stored) == 3
        tier.manager.wait_deletions()
        usage = tier.manager.get_stats()["usage_bytes"]
        tier.close()
        assert usage == 3 * BLOB
        # Each namespace gets a newer mtime than the previous one's chunks.
        for path in tier.manager.namespace_dir.rglob("*.kvc"):
            os.utime(path, (1000.0 * (n + 1), 1000.0 * (n + 1)))
        files = chunk_files(tmp_path)
        assert sum(files.values()) <= BUDGET, files
    files = chunk_files(tmp_path)
    # "a" (least recently used) went first and entirely; "b" kept what the budget left.
    assert files == {names[0]: 0, names[1]: 1, names[2]: 3}


def test_a_namespace_opened_over_a_root_over_budget_trims_the_others(tmp_path: Path) -> None:
    old = open_tier(tmp_path, identity=identity("old"))
    old.store(range(6))
    old.close()
    tier = open_tier(tmp_path, capacity_chunks=BUDGET, identity=identity("new"),
                     capacity_scope="root")
    try:
        tier.manager.wait_deletions()
        assert sum(chunk_files(tmp_path).values()) == BUDGET
        # The remaining foreign chunks still count: a store of 2 gives up 2 of them.
        assert tier.store([100, 101]) == [conformance_key(100), conformance_key(101)]
        tier.manager.wait_deletions()
        assert chunk_files(tmp_path)[old.manager.namespace_dir.name] == BUDGET - 2
    finally:
        tier.close()


def test_root_scope_needs_a_capacity() -> None:
    with pytest.raises(ConfigError, match="set a capacity"):
        FileTierConfig(name="file", root="/tmp/x", capacity_scope="root")
