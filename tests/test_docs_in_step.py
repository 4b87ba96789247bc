"""The documentation names no expected failure that the suite does not have.

A paragraph of ``README.md`` or ``docs/*.md`` that calls a test an expected failure
(``xfail``) must name it as ``tests/<file>.py::<test>``, and that test must carry an
``xfail`` mark. Once the defect is fixed and the mark removed, the paragraph fails here
until the page says what is true.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))

_MENTION = re.compile(r"expected[ -]failure|xfail", re.IGNORECASE)
_TEST_ID = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def mentions(page: Path) -> Iterator[str]:
    """The paragraphs of ``page`` that speak of an expected failure, each on one line."""
    for paragraph in re.split(r"\n\s*\n", page.read_text()):
        if _MENTION.search(paragraph):
            yield " ".join(paragraph.split())


def _marks_xfail(node: ast.AST) -> bool:
    return "xfail" in ast.unparse(node)


def is_xfail(repo: Path, path: str, name: str) -> bool:
    """Whether test ``name`` of ``repo/path`` carries an ``xfail`` mark: on the function
    (a parameter's marks included) or on the whole module (``pytestmark``)."""
    source = repo / path
    if not source.is_file():
        return False
    tree = ast.parse(source.read_text())
    module_marked = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _marks_xfail(node.value)
        for node in tree.body
    )
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return module_marked or any(_marks_xfail(d) for d in node.decorator_list)
    return False


def stale_mentions(repo: Path, pages: tuple[Path, ...]) -> list[str]:
    """One line per expected failure a page names that is not one in the suite."""
    problems = []
    for page in pages:
        where = page.relative_to(repo)
        for paragraph in mentions(page):
            ids = _TEST_ID.findall(paragraph)
            if not ids:
                problems.append(
                    f"{where}: speaks of an expected failure without naming its test "
                    f"(tests/<file>.py::<test>): {paragraph[:100]}"
                )
            problems.extend(
                f"{where}: names {path}::{name} as an expected failure, but it has no "
                "xfail mark"
                for path, name in ids
                if not is_xfail(repo, path, name)
            )
    return problems


def test_the_pages_name_only_expected_failures_the_suite_has() -> None:
    assert stale_mentions(REPO, PAGES) == []


def test_a_stale_or_unnamed_expected_failure_is_reported(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.xfail(reason='known')\ndef test_known():\n    pass\n\n"
        "@pytest.mark.parametrize('v', [pytest.param(1, marks=pytest.mark.xfail)])\n"
        "def test_param(v):\n    pass\n\n"
        "def test_fixed():\n    pass\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        "Known: `tests/test_x.py::test_known` and `tests/test_x.py::test_param` are\n"
        "expected failures.\n\n"
        "Fixed since: `tests/test_x.py::test_fixed` is an expected failure.\n\n"
        "Something is an xfail here.\n\n"
        "Nothing to see in this paragraph.\n"
    )
    problems = stale_mentions(tmp_path, (page,))
    assert len(problems) == 2
    assert "tests/test_x.py::test_fixed as an expected failure, but it has no xfail" in (
        problems[0]
    )
    assert "without naming its test" in problems[1]
