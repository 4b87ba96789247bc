"""Imports point down the floors of docs/architecture.md ("Layers and imports"), and
tests and benchmarks take their helpers from the shipped kit (:mod:`kvtiers.testing`).

Each package of ``kvtiers`` sits on a floor; a module may import its own floor and the
floors below it, never one above. ``errors`` and ``optional`` are leaves every floor may
import. The check reads every module's imports with ``ast`` (type-checking-only imports
and imports inside functions included: a lazy import up a floor is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvtiers

#: Lowest first; the order of docs/architecture.md's list.
FLOORS = (
    "errors",
    "optional",
    "core",
    "filemapper",
    "policies",
    "config",
    "tiers",
    "logs",
    "stack",
    "service",
    "engine",
    "tools",
    "integrations",
    "testing",
)
#: Modules at the package's top level that sit above every floor.
TOP = ("cli", "__init__", "__main__")
PACKAGE = Path(kvtiers.__file__).parent
REPOSITORY = PACKAGE.parent


def floor_of(module: str) -> int | None:
    """The floor of a ``kvtiers.*`` module name; ``None`` outside kvtiers or at the top."""
    parts = module.split(".")
    if parts[0] != "kvtiers" or len(parts) < 2:
        return None
    if parts[1] in TOP:
        return len(FLOORS)
    return FLOORS.index(parts[1])


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``tree``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def upward_imports(root: Path) -> list[str]:
    """Every import in the package at ``root`` that points up a floor."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("kvtiers", *path.relative_to(root).with_suffix("").parts))
        own = floor_of(module)
        if own is None:
            continue
        for line, target in imported_modules(ast.parse(path.read_text(), str(path))):
            other = floor_of(target)
            if other is not None and other > own:
                problems.append(f"{path.relative_to(root)}:{line} imports {target}")
    return problems


def test_every_package_has_a_floor() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert packages | modules <= set(FLOORS) | set(TOP)


def test_no_import_points_up_a_floor() -> None:
    assert upward_imports(PACKAGE) == []


def test_relative_imports_are_not_used() -> None:
    # The floor check reads absolute names only; a relative import would slip past it.
    relative = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert relative == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from kvtiers.tiers.index import ChunkIndex\n",
            ["core/x.py:1 imports kvtiers.tiers.index"],
        ),
        ("import kvtiers.stack.builder\n", ["core/x.py:1 imports kvtiers.stack.builder"]),
        ("from kvtiers.errors import ConfigError\n", []),
    ],
)
def test_the_check_sees_an_upward_import(tmp_path: Path, source: str, expected: list[str]) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "x.py").write_text(source)
    assert upward_imports(tmp_path) == expected


def _imports_under(directory: Path) -> list[tuple[str, str]]:
    return [
        (f"{path.relative_to(REPOSITORY)}:{line}", target)
        for path in sorted(directory.rglob("*.py"))
        for line, target in imported_modules(ast.parse(path.read_text(), str(path)))
    ]



def test_helpers_are_imported_from_the_shipped_kit_not_from_conftest() -> None:
    # Fixtures come from conftest by name; helper classes from kvtiers.testing.
    offenders = [
        where for where, target in _imports_under(REPOSITORY / "tests")
        if target == "tests.conftest" or target.startswith("tests.conftest.")
    ]
    assert offenders == []


def test_no_benchmark_imports_from_tests() -> None:
    offenders = [
        where for where, target in _imports_under(REPOSITORY / "benchmarks")
        if target == "tests" or target.startswith("tests.")
    ]
    assert offenders == []
