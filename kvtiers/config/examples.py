"""The example stack files shipped inside the package (``kvtiers/configs/*.yaml``).

They are package data, so they exist in every install (a clone, a wheel, a site-packages
tree), and each is addressable by its name without the ``.yaml`` suffix: ``cpu``,
``cpu-file``, ``cpu-file-s3`` (and its write rules ``cpu-file-s3-writeback`` and
``cpu-file-s3-frequency``), ``cpu-slow-s3`` (cost-aware promotion), ``file-gds`` and
``demo`` (the stack ``kvtiers demo`` runs by default). Nothing here reads a file; callers
do.
"""

from __future__ import annotations

from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The directory that holds the example stack files."""

DEMO_EXAMPLE = "demo"


def example_names() -> list[str]:
    """The names of the shipped examples, sorted."""
    return sorted(path.stem for path in EXAMPLES_DIR.glob("*.yaml"))


def example_path(name: str) -> Path | None:
    """The file of the example called ``name`` (``cpu-file``), or ``None`` if there is none.

    A name is a bare word: anything with a path separator or a ``.yaml`` suffix is a path
    the caller should read as given, so this returns ``None`` for it."""
    if not name or "/" in name or "\\" in name or name.endswith((".yaml", ".yml")):
        return None
    path = EXAMPLES_DIR / f"{name}.yaml"
    return path if path.is_file() else None
