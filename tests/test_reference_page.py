"""docs/configuration.md is generated from the schema: it fails here while stale, and
every key of every section must say what it means."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvtiers.config import TIER_KINDS
from kvtiers.config.reference_page import missing_meanings, render_reference
from kvtiers.config.schema import field_specs

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_the_page_is_current() -> None:
    assert PAGE.read_text() == render_reference(), (
        "docs/configuration.md is stale; regenerate it with "
        "`python -m kvtiers.config.reference_page > docs/configuration.md`"
    )


def test_every_key_has_a_meaning() -> None:
    assert missing_meanings() == [], "give these fields a docstring in kvtiers/config/"


def test_every_key_of_every_tier_kind_is_a_row() -> None:
    page = render_reference()
    for kind in TIER_KINDS.values():
        section = page.split(f"## Tier kind `{kind.name}`")[1].split("\n## ")[0]
        for spec in field_specs(kind.config_type):
            assert f"\n| `{spec.name}` |" in section, f"{kind.name}.{spec.name} missing"


def test_a_new_undocumented_key_is_reported() -> None:
    from kvtiers.config import reference_page
    from kvtiers.config.tiers import CPUTierConfig

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(CPUTierConfig):
        op_deadline_s: float = 5.0

    assert reference_page.meaning(Extended, "capacity")
    assert reference_page.meaning(Extended, "op_deadline_s") == ""
