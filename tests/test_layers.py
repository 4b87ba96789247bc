"""Imports point down the floors of docs/architecture.md ("Layers and imports"), no two
modules import each other, nothing above the tiers names a concrete tier, and tests and
benchmarks take their helpers from the shipped kit (:mod:`kvtiers.testing`).

Each package of ``kvtiers`` sits on a floor; a module may import its own floor and the
floors below it, never one above. ``errors``, ``optional`` and ``release`` are leaves every
floor may import. The checks read every module's imports with ``ast`` (type-checking-only
imports and imports inside functions included: a lazy import is still a dependency, and
two modules that import each other lazily are one knot however late it is tied).
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
    "release",
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


def module_name(path: Path, root: Path) -> str:
    """The ``kvtiers.*`` name of the module at ``path`` in the package at ``root`` (a
    package's ``__init__`` is the package)."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("kvtiers", *parts))


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module → {module it imports: first line}, for the package at ``root``: ``from p
    import m`` of a submodule ``m`` names ``p.m``, of anything else ``p`` itself; imports of
    modules outside the package are left out."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in paths else node.module
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                if target in paths and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every set of two or more modules that import each other, directly or round a
    circle (the strongly connected components of ``graph``), each sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in graph:
        if start in order:
            continue
        # Iterative depth-first search: (module, its edges not yet walked).
        walk = [(start, iter(graph[start]))]
        order[start] = low[start] = len(order)
        stack.append(start)
        on_stack.add(start)
        while walk:
            module, edges = walk[-1]
            target = next(edges, None)
            if target is not None:
                if target not in order:
                    order[target] = low[target] = len(order)
                    stack.append(target)
                    on_stack.add(target)
                    walk.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[module] = min(low[module], order[target])
                continue
            walk.pop()
            if walk:
                parent = walk[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == order[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return sorted(circles)


def describe_circle(graph: dict[str, dict[str, int]], circle: list[str]) -> list[str]:
    """The imports that tie ``circle``: ``module:line imports target`` within it."""
    members = set(circle)
    return [
        f"{module}:{line} imports {target}"
        for module in circle
        for target, line in graph[module].items()
        if target in members
    ]


def test_no_two_modules_import_each_other() -> None:
    graph = import_graph(PACKAGE)
    assert [describe_circle(graph, circle) for circle in import_circles(graph)] == []


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        (
            # A circle tied inside a function is a circle still.
            {"a.py": "from kvtiers.b import x\n",
             "b.py": "def f():\n    from kvtiers.a import y\n"},
            [["kvtiers.a", "kvtiers.b"]],
        ),
        (
            {"a.py": "import kvtiers.b\n", "b.py": "import kvtiers.c\n",
             "c.py": "if False:\n    import kvtiers.a\n"},
            [["kvtiers.a", "kvtiers.b", "kvtiers.c"]],
        ),
        ({"a.py": "import kvtiers.b\n", "b.py": "import json\n"}, []),
    ],
)
def test_the_check_sees_a_circle(
    tmp_path: Path, sources: dict[str, str], expected: list[list[str]]
) -> None:
    for name, source in sources.items():
        (tmp_path / name).write_text(source)
    assert import_circles(import_graph(tmp_path)) == expected


#: Floors above the tiers that see tiers through core's contracts only
#: (:mod:`kvtiers.core.primary`). The test kit (``testing``) is not among them: it builds
#: the concrete tiers it tests (the crash harness, the object-store conformance suite).
CONTRACT_ONLY = ("logs", "stack", "engine", "tools", "integrations", *TOP)


def concrete_tiers(root: Path) -> set[str]:
    """The modules of the package at ``root`` that are a concrete tier: under ``tiers/``,
    a tier's manager (a class deriving from ``OffloadingManager``, or from such a class),
    its factory (``factory.py``), and a tier package that imports either."""
    tiers = root / "tiers"
    managers: set[str] = {"OffloadingManager"}
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted(tiers.rglob("*.py")):
        module = module_name(path, root)
        classes[module] = [
            # A generic base (``Base[T]``) counts as ``Base``.
            (node.name, [ast.unparse(base.value if isinstance(base, ast.Subscript) else base)
                         .rsplit(".", 1)[-1] for base in node.bases])
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef)
        ]
    # A subclass of a subclass counts: go round until no new manager class turns up.
    grew = True
    while grew:
        before = len(managers)
        for found in classes.values():
            managers.update(name for name, bases in found if managers.intersection(bases))
        grew = len(managers) != before
    concrete = {
        module for module, found in classes.items()
        if module.endswith(".factory")
        or any(managers.intersection(bases) for _, bases in found)
    }
    graph = import_graph(root)
    packages = {
        module for module in classes
        if (root / Path(*module.split(".")[1:]) / "__init__.py").exists()
        and module != "kvtiers.tiers"
    }
    return concrete | {p for p in packages if concrete.intersection(graph.get(p, {}))}


def concrete_tier_imports(root: Path) -> list[str]:
    """Every import of a concrete tier from a floor that sees tiers through contracts."""
    concrete = concrete_tiers(root)
    graph = import_graph(root)
    return [
        f"{module}:{line} imports {target}"
        for module, edges in sorted(graph.items())
        if (*module.split("."), "__init__")[1] in CONTRACT_ONLY
        for target, line in edges.items()
        if target in concrete
    ]


def test_nothing_above_the_tiers_names_a_concrete_tier() -> None:
    # The composite and the adapters ask a tier for what core's contracts say
    # (kvtiers/core/primary.py), so any tier that keeps them can stand in its place.
    assert concrete_tier_imports(PACKAGE) == []


def test_the_concrete_tiers_are_found() -> None:
    # The rule above has teeth only if it knows the tiers: each kind's manager module.
    found = concrete_tiers(PACKAGE)
    assert {"kvtiers.tiers.cpu.manager", "kvtiers.tiers.file.manager",
            "kvtiers.tiers.object.manager", "kvtiers.tiers.cpu.factory",
            "kvtiers.tiers.cpu"} <= found
    assert "kvtiers.tiers.jobs" not in found


def test_the_check_sees_a_concrete_tier_import(tmp_path: Path) -> None:
    (tmp_path / "tiers" / "kind").mkdir(parents=True)
    (tmp_path / "stack").mkdir()
    (tmp_path / "tiers" / "__init__.py").write_text("")
    (tmp_path / "tiers" / "kind" / "__init__.py").write_text("")
    (tmp_path / "tiers" / "kind" / "manager.py").write_text(
        "class Base(OffloadingManager):\n    pass\nclass KindManager(Base):\n    pass\n"
    )
    (tmp_path / "tiers" / "kind" / "helper.py").write_text("class Helper:\n    pass\n")
    (tmp_path / "stack" / "x.py").write_text(
        "from kvtiers.tiers.kind.helper import Helper\n"
        "def f():\n    from kvtiers.tiers.kind.manager import KindManager\n"
    )
    assert concrete_tier_imports(tmp_path) == [
        "kvtiers.stack.x:3 imports kvtiers.tiers.kind.manager"
    ]


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
