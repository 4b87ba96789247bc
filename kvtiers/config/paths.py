"""YAML paths as error messages show them: ``tiers[1].capacity``, ``model.groups[0]``.

The root of a document is the empty path. These helpers are the only place paths are
spelled, so the paths recorded while reading a file and those named by errors agree.
"""

from __future__ import annotations


def key_path(base: str, key: str) -> str:
    """Path of ``key`` in the mapping at ``base``: ``tiers[1]`` + ``capacity``."""
    return f"{base}.{key}" if base else key


def item_path(base: str, index: int) -> str:
    """Path of item ``index`` of the list at ``base``: ``tiers`` + 1 → ``tiers[1]``."""
    return f"{base}[{index}]"


def join_path(base: str, relative: str) -> str:
    """``relative`` (itself a path, possibly empty or starting with ``[``) below ``base``."""
    if not relative:
        return base
    if not base or relative.startswith("["):
        return base + relative
    return f"{base}.{relative}"


def parent_path(path: str) -> str:
    """One level up: ``tiers[1].capacity`` → ``tiers[1]`` → ``tiers`` → ``""``."""
    cut = max(path.rfind("."), path.rfind("["))
    return path[:cut] if cut > 0 else ""
