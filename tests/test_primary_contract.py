"""Core's primary-tier contract (:mod:`kvtiers.core.primary`): the stack decides staging
when it is built, and the cpu tier is one implementation of the protocols."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtiers.config import load_stack_config
from kvtiers.core.primary import DirectPrimary, HoldingPrimary, SlottedPrimary
from kvtiers.stack.builder import load_stack, stages
from kvtiers.tiers.cpu.manager import CpuTierManager

MODEL = {
    "name": "test/primary",
    "tokens_per_hash": 16,
    "blocks_per_chunk": 1,
    "groups": [{"tokens_per_block": 16, "num_layers": 1, "page_bytes": "4KiB"}],
}


def stack_file(root: Path, **file_tier: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"kind": "cpu", "capacity": "16KiB"},
            {"kind": "file", "root": str(root), "io": "posix", "threads": 1, **file_tier},
        ],
        "model": MODEL,
    }


@pytest.mark.parametrize(
    ("file_tier", "expected"),
    [
        ({}, True),
        ({"write": "back"}, False),
        ({"write_after_hits": 2}, False),
        ({"admission": "never"}, False),
    ],
)
def test_the_builder_decides_whether_the_primary_stages(
    tmp_path: Path, file_tier: dict[str, Any], expected: bool
) -> None:
    # Staging is the stack's decision, passed to the primary's factory: every chunk the
    # primary stores reaches a lower tier only under write: through with no count.
    config = stack_file(tmp_path, **file_tier)
    assert stages(load_stack_config(config)) is expected
    with load_stack(config) as stack:
        primary = stack.tiers[0].manager
        assert isinstance(primary, CpuTierManager)
        assert primary.staging is expected


def test_a_stack_of_one_primary_does_not_stage() -> None:
    assert stages(load_stack_config({"tiers": [{"kind": "cpu", "capacity": "16KiB"}],
                                     "model": MODEL})) is False


def test_the_cpu_tier_is_the_contracts_primary(tmp_path: Path) -> None:
    with load_stack(stack_file(tmp_path)) as stack:
        primary = stack.tiers[0].manager
        assert isinstance(primary, SlottedPrimary)
        assert isinstance(primary, HoldingPrimary)
        assert isinstance(primary, DirectPrimary)
        lower = stack.tiers[1].manager
        assert not isinstance(lower, HoldingPrimary)
