"""The SGLang releases kvtiers' storage backend supports, checked when it loads.

HiCache's storage interface (``HiCacheStorage``, its ``v1`` and ``v2`` calls, the host
pools' page accessors) changes between SGLang releases; the tests run SGLang 0.5.23's own
classes (``make test``). Loading the backend under any other release raises
:class:`~kvtiers.errors.UnsupportedVersionError` with one line naming the version found,
instead of a raw error from inside SGLang later.
"""

from __future__ import annotations

import re

from kvtiers.errors import UnsupportedVersionError

#: The lowest supported release and the first unsupported one: ``[low, high)``.
SUPPORTED_LOW = (0, 5, 23)
SUPPORTED_HIGH = (0, 5, 24)
#: The range as a pip requirement specifier (also the ``kvtiers[sglang]`` extra's).
SUPPORTED_SPECIFIER = "==0.5.23"

_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def check_sglang_version(version: str | None = None) -> str:
    """Return ``version`` (default: the installed SGLang's) if supported; else raise
    :class:`~kvtiers.errors.UnsupportedVersionError` (one line)."""
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("sglang")
        except PackageNotFoundError:
            version = None
    match = None if version is None else _RELEASE.match(version.strip())
    found = None if match is None else tuple(int(part) for part in match.groups())
    if version is None or found is None or not SUPPORTED_LOW <= found < SUPPORTED_HIGH:
        has = "no SGLang" if version is None else f"SGLang {version}"
        raise UnsupportedVersionError(
            f"kvtiers.integrations.sglang supports SGLang {SUPPORTED_SPECIFIER}, this "
            f"environment has {has}: install it with "
            f"pip install 'sglang{SUPPORTED_SPECIFIER}' (see docs/sglang.md)"
        )
    return version
