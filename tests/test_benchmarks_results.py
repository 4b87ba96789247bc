"""``benchmarks/``'s harness: every committed result in the one schema, the shared
statistics and writers, and the benches' imports kept to public names."""

from __future__ import annotations

import ast
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _load(name: str) -> ModuleType:
    # The benches import their siblings by bare name, as a script run from benchmarks/ does.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


harness = _load("harness")
convert_results = _load("convert_results")

RESULT_FILES = sorted(RESULTS.glob("*.json"))


def _document(**changes: Any) -> dict[str, Any]:
    doc = harness.result("demo", harness.machine_note(), parameters={"quick": True},
                         tables={"rows": [{"n": 1}]}, summary={"ratio": 0.5})
    doc.update(changes)
    return doc


def test_there_are_results_to_check() -> None:
    assert len(RESULT_FILES) >= 15


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: path.name)
def test_every_result_file_is_in_the_schema(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert harness.validate(doc) == []
    bench = doc["bench"]
    assert any((BENCHMARKS / name).exists() for name in (f"bench_{bench}.py", f"{bench}.py"))
    harness.from_document(doc)  # its sections do not share a key, so the bench's page can read it


def test_every_results_page_has_its_json() -> None:
    pages = {path.stem for path in RESULTS.glob("*.md")}
    assert sorted(pages - {path.stem for path in RESULT_FILES}) == []


def test_the_converter_finds_nothing_left_to_convert(capsys: pytest.CaptureFixture[str]) -> None:
    assert convert_results.main(["--check"]) == 0
    assert capsys.readouterr().out == ""


def test_the_converter_keeps_an_old_file_whole_and_its_note_verbatim() -> None:
    old = {"machine": "2026-01-01 00:00 UTC; CPU x, 2 cores", "passes": 3, "batch": 8,
           "command": "c", "rows": [{"us": 1.5}], "load": "1.0"}
    doc = convert_results.convert("sglang", old)
    assert harness.validate(doc) == []
    assert doc["machine"] == {"original": old["machine"]}
    assert harness.from_document(doc) == {**old, "machine": {"original": old["machine"]}}
    bare = convert_results.convert("promotion", [{"p50": 0.1}])
    assert bare["tables"] == {"rows": [{"p50": 0.1}]}
    assert set(bare["machine"]) == {"unknown"}, "no note is made up for a file without one"
    quoted = convert_results.convert("promotion", [], "# T\n\nMachine: cpu x; today.\n")
    assert quoted["machine"]["unknown"].endswith("written by the same run, says: cpu x; today.")


def test_validate_names_what_is_wrong() -> None:
    assert harness.validate(_document()) == []
    assert harness.validate([1]) != []
    assert harness.validate(_document(schema=harness.SCHEMA_VERSION + 1)) != []
    assert harness.validate(_document(bench="")) != []
    assert harness.validate(_document(machine={"cpu": "x"})) != []
    assert harness.validate(_document(machine={"unknown": "why", "cpu": "x"})) != []
    assert harness.validate(_document(tables={"rows": [1, 2]})) != []
    assert harness.validate(_document(summary={"ratio": "fast"})) != []
    assert harness.validate(_document(summary={"ratio": harness.spread([1.0, 2.0])})) == []
    reordered = {key: _document()[key] for key in reversed(harness.DOCUMENT_KEYS)}
    assert harness.validate(reordered) != []


def test_write_result_refuses_another_shape_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="machine"):
        harness.write_result(_document(machine={}), tmp_path, "demo", "# page")
    assert list(tmp_path.iterdir()) == []
    paths = harness.write_result(_document(), tmp_path, "demo", "# page")
    assert [path.name for path in paths] == ["demo.json", "demo.md"]
    assert harness.read_result(paths[0]) == _document(machine=harness.read_result(
        paths[0])["machine"])


def test_machine_note_has_the_common_keys_and_its_extras() -> None:
    note = harness.machine_note(torch="2.0")
    assert tuple(note)[: len(harness.MACHINE_KEYS)] == harness.MACHINE_KEYS
    assert note["torch"] == "2.0" and isinstance(note["cores"], int)
    assert "torch 2.0" in harness.machine_sentence(note)
    assert "load_end" in harness.finish_note(note)
    with pytest.raises(ValueError):
        harness.machine_note(cpu="mine")
    assert harness.machine_sentence({"unknown": "none kept"}) == "unknown (none kept)"
    assert harness.machine_sentence({"original": {"cpu": "x", "cores": "2"}}) == "cpu x; cores 2"


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [1.0, 2.0, 4.0, 8.0, 16.0, 3.5]])
def test_percentile_is_linear_between_ranks(values: list[float]) -> None:
    assert harness.percentile(values, 0) == min(values)
    assert harness.percentile(values, 100) == max(values)
    assert harness.percentile(values, 50) == pytest.approx(statistics.median(values))
    if len(values) > 1:
        quartiles = statistics.quantiles(values, n=4, method="inclusive")
        assert harness.percentile(values, 25) == pytest.approx(quartiles[0])
        assert harness.percentile(values, 75) == pytest.approx(quartiles[2])
    spread = harness.spread(values)
    assert tuple(spread) == harness.SPREAD_KEYS and spread["n"] == len(values)


def test_percentile_refuses_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        harness.percentile([], 50)
    with pytest.raises(ValueError):
        harness.percentile([1.0], 101)


def test_to_document_and_from_document_are_inverse() -> None:
    flat = {"machine": {"unknown": "test"}, "quick": True, "rows": [{"a": 1}], "seconds": 2.0,
            "notes": ["x"]}
    doc = harness.to_document("demo", flat, parameters=("quick", "absent"), tables=("rows",),
                        summary=("seconds",))
    assert doc["extra"] == {"notes": ["x"]} and doc["parameters"] == {"quick": True}
    assert harness.from_document(doc) == flat
    clash = _document(extra={"quick": False})
    with pytest.raises(ValueError, match="quick"):
        harness.from_document(clash)


def test_markdown_table() -> None:
    assert harness.markdown_table(["a", "b"], [[1, "x"]]) == [
        "| a | b |", "|---|---:|", "| 1 | x |"]
    with pytest.raises(ValueError):
        harness.markdown_table(["a", "b"], [[1]])


def test_common_flags() -> None:
    parser = harness.bench_parser("A bench.\n\nMore.", rounds=7)
    args = parser.parse_args(["--quick"])
    assert (args.quick, args.out, args.no_write, args.rounds) == (
        True, harness.RESULTS, False, 7)
    assert not hasattr(args, "seed")


def _sibling_imports(path: Path, siblings: set[str]) -> list[str]:
    """What ``path`` takes from its sibling scripts by a private name, and any import of
    ``tests``: ``from sibling import _name``, ``sibling._name``, ``import tests...``."""
    tree = ast.parse(path.read_text())
    bound: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root == "tests":
                found.append(f"{path.name}: from {node.module}")
            if node.module in siblings:
                found += [f"{path.name}: {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tests":
                    found.append(f"{path.name}: import {alias.name}")
                if alias.name in siblings:
                    bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")):
            found.append(f"{path.name}: {node.value.id}.{node.attr}")
    return found


def test_no_bench_takes_another_benchs_privates_or_tests(tmp_path: Path) -> None:
    scripts = sorted(BENCHMARKS.glob("*.py"))
    siblings = {path.stem for path in scripts}
    assert [found for path in scripts for found in _sibling_imports(path, siblings)] == []
    # The check sees both spellings of a reach into a sibling.
    offender = tmp_path / "bench_offender.py"
    offender.write_text("import bench_file\nfrom harness import _is_number\n"
                        "from tests.conftest import x\nbench_file._private()\n")
    assert len(_sibling_imports(offender, siblings)) == 3
