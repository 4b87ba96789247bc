"""Convert results written before the shared schema into it, keeping every number.

A results file of the older kinds (each bench's own dict, a bare list of rows, or only a
markdown page) becomes a :mod:`harness` result document: its ``machine`` note is kept
verbatim as ``{"original": ...}``, or ``{"unknown": ...}`` where the file had none (no
note is made up); the other keys go to the sections the bench's own ``LAYOUT`` names
(read from the bench's source, so nothing heavy is imported), the rest to ``extra``.
A file already in the schema is left alone, so a run over ``results/`` is repeatable.

    python benchmarks/convert_results.py [--check] [FILE ...]   # default: results/*.json, file.md
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

import harness

HERE = Path(__file__).resolve().parent

#: Results files whose bench is not named by their stem, with the reason.
BENCH_OF = {
    "cpu-threads1": "cpu",  # bench_cpu.py --threads 1
    "s3-seaweedfs": "s3",  # bench_s3.py against SeaweedFS
    "promotion-serve": "promotion",  # the real-server runs promotion.md describes
}

#: Layouts for files no bench writes (the real-server promotion runs were driven by hand).
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "promotion-serve": {"tables": ("wait_bound", "before")},
}

#: Why a file holds no machine note, where the reason is known.
NO_NOTE = {
    "listing": "bench_listing.py wrote no machine note before the schema",
    "promotion": "bench_promotion.py wrote a bare list of rows before the schema",
    "promotion-serve": "the real-server runs were recorded without one; promotion.md "
                       "describes them",
}


def bench_layout(bench: str) -> dict[str, tuple[str, ...]]:
    """The ``LAYOUT`` literal of ``bench_<bench>.py``, read from its source."""
    tree = ast.parse((HERE / f"bench_{bench}.py").read_text())
    for node in tree.body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "LAYOUT" and node.value is not None):
            layout: dict[str, tuple[str, ...]] = ast.literal_eval(node.value)
            return layout
    raise LookupError(f"bench_{bench}.py has no LAYOUT")


def convert(stem: str, old: Any, page: str = "") -> dict[str, Any]:
    """The result document for an older results file ``stem`` holding ``old``; ``page``
    is the markdown the same run wrote, whose machine line is quoted where ``old`` kept
    no note (as text beside the reason, not as a measured note)."""
    flat = dict(old) if isinstance(old, dict) else {"rows": old}
    original = flat.pop("machine", None)
    bench = BENCH_OF.get(stem, stem)
    if original:
        flat["machine"] = {"original": original}
    else:
        why = NO_NOTE.get(stem, "the original results recorded none")
        line = next((text for text in page.splitlines() if text.startswith("Machine: ")), "")
        flat["machine"] = {"unknown": why + (f"; {stem}.md, written by the same run, says: "
                                             f"{line.removeprefix('Machine: ')}" if line else "")}
    layout = LAYOUTS.get(stem) or bench_layout(bench)
    return harness.to_document(bench, flat, **layout)


_CASE = re.compile(r"\((\d+) MiB per case, median of (\d+) passes")
_ROW_KEYS = ("tier_process", "raw_pwrite", "process_ratio", "raw_onedir", "onedir_ratio",
             "tier_power", "raw_fsync", "power_ratio", "tier_read", "raw_read", "load_ratio")


def file_page(text: str) -> dict[str, Any]:
    """``bench_file.py``'s flat dict read back from the ``file.md`` it wrote before it
    wrote JSON: the numbers as the page printed them (two decimals, three for seconds)."""
    lines = text.splitlines()
    machine = next(line for line in lines if line.startswith("Machine: "))
    command = next(line for line in lines if line.startswith("Command: `"))
    case = _CASE.search(command)
    if case is None:
        raise ValueError("file.md's command line does not say the volume and passes")
    rows = []
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) != 2 + len(_ROW_KEYS) or not cells[1].isdigit():
            continue
        size, unit = cells[0].split()
        rows.append({"chunk_bytes": int(size) << (20 if unit == "MiB" else 10),
                     "threads": int(cells[1]),
                     **{key: float(cell) for key, cell in zip(_ROW_KEYS, cells[2:], strict=True)}})
    fresh_line = next(line for line in lines if line.startswith("Fresh namespace"))
    fresh = {name.replace(" ", "_"): float(value) for name, value in
             re.findall(r"([a-z][a-z ]+?) (\d+\.\d+)(?=,|;)", fresh_line.split("): ", 1)[1])}
    ratios = re.search(r"fresh (\d+\.\d+)x, existing (\d+\.\d+)x", fresh_line)
    rebuild = re.search(r"Index rebuild of (\d+) chunk files .*?: (\d+\.\d+) s", text)
    if ratios is None or rebuild is None:
        raise ValueError("file.md lacks the fresh-namespace ratios or the rebuild line")
    fresh["fresh_ratio"], fresh["existing_ratio"] = map(float, ratios.groups())
    return {
        "machine": machine.removeprefix("Machine: ").rstrip("."),
        "command": command.split("`")[1],
        "volume_bytes": int(case.group(1)) << 20,
        "repeats": int(case.group(2)),
        "rows": rows,
        "fresh": fresh,
        "rebuild_chunks": int(rebuild.group(1)),
        "rebuild_s": float(rebuild.group(2)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="results files (default: every results/*.json and file.md)")
    parser.add_argument("--check", action="store_true",
                        help="say what would change, write nothing; exit 1 if anything would")
    args = parser.parse_args(argv)
    files = args.files or [*sorted(harness.RESULTS.glob("*.json")), harness.RESULTS / "file.md"]
    pending = 0
    for path in files:
        if path.suffix == ".md":
            target = path.with_suffix(".json")
            if target.exists():
                continue
            doc = convert(path.stem, file_page(path.read_text()))
        else:
            old = json.loads(path.read_text())
            if isinstance(old, dict) and "schema" in old:
                continue
            page = path.with_suffix(".md")
            target = path
            doc = convert(path.stem, old, page.read_text() if page.exists() else "")
        pending += 1
        print(f"{'would convert' if args.check else 'converted'} {path.name} -> {target.name}")
        if not args.check:
            harness.write_result(doc, target.parent, target.stem)
    return 1 if args.check and pending else 0


if __name__ == "__main__":
    sys.exit(main())
