"""The docs say what the code does: every metric the stack exports is in the README's
metrics table with each of its label values, every page names metrics as exported, and
the output a page shows of ``kvtiers diff`` is worded as the command words it."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from kvtiers.stack.metrics_catalog import ENGINE, HISTOGRAMS, STACK, TIER
from kvtiers.tools.identity import differ_heading

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _families() -> dict[str, dict[str, set[str]]]:
    """Exported family name → label → the values the catalogue gives it."""
    families: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for spec in (*STACK.values(), *ENGINE.values(), *TIER.values()):
        labels = families[spec.family]
        for name, value in spec.labels.items():
            labels[name].add(value)
    for name, _help in HISTOGRAMS.values():
        families.setdefault(name, defaultdict(set))  # no fixed labels
    return families


def _metrics_table() -> dict[str, str]:
    """README's metrics table: each metric name it lists → its row's labels cell. A name
    written ``…_suffix`` continues the first name of its cell."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`kvtiers_"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        stem = names[0].split("_", 3)
        for name in names:
            if name.startswith("…"):
                name = "_".join(stem[:2]) + name[1:]
            rows[name] = cells[1]
    return rows


def test_every_exported_metric_and_label_value_is_in_the_readme() -> None:
    rows = _metrics_table()
    for family, labels in _families().items():
        assert family in rows, f"README's metrics table lacks {family}"
        for label, values in labels.items():
            for value in values:
                assert re.search(rf"\b{re.escape(value)}\b", rows[family]), (
                    f"README's metrics table lacks {family}{{{label}={value!r}}}")


def test_the_pages_name_counters_as_exported() -> None:
    """A counter is scraped as ``<name>_total``: a page naming ``<name>`` alone (as in
    ``kvtiers_stack_demotions{outcome=...}``) names nothing a scrape finds."""
    counters = {spec.name for spec in (*STACK.values(), *TIER.values())
                if spec.kind == "counter"}
    for page in PAGES:
        for name in re.findall(r"kvtiers_(?:stack|tier)_[a-z_]+", page.read_text()):
            assert name not in counters, f"{page.name} names {name}, exported as {name}_total"


def test_the_pages_show_diff_headings_as_diff_prints_them() -> None:
    """A page quoting ``kvtiers diff`` shows its "N field(s) differ(s):" line as printed."""
    heading = re.compile(r"^\s*(\d+) fields? differs?:\s*$", re.MULTILINE)
    for page in PAGES:
        for match in heading.finditer(page.read_text()):
            shown = match.group(0).strip()
            assert shown == differ_heading(int(match.group(1))), (
                f"{page.name} shows {shown!r}; kvtiers diff prints "
                f"{differ_heading(int(match.group(1)))!r}")
