"""Optional dependencies: which extra installs each one, and the error when one is missing.

kvtiers' core needs numpy, torch, xxhash and PyYAML; everything else comes with an extra
(``pip install 'kvtiers[s3]'``). :func:`require` checks for a module before a feature uses
it, and :func:`hint_for` turns any ``ModuleNotFoundError`` for one of them into a one-line
message naming the extra, so a missing package never surfaces as a traceback. This module
imports nothing heavy.
"""

from __future__ import annotations

import importlib.util

from kvtiers.errors import KVTiersError

EXTRAS: dict[str, str] = {
    "boto3": "s3",
    "botocore": "s3",
    "kvikio": "gds",
    "blosc2": "codec",
    "fsspec": "fsspec",
    "prometheus_client": "metrics",
    "tqdm": "demo",
    "matplotlib": "demo",
    "moto": "demo",
    "flask": "demo",
    "flask_cors": "demo",
    "vllm": "vllm",
}
"""Top-level module name → the extra that installs it."""


class MissingDependencyError(KVTiersError):
    """An optional package a feature needs is not installed; the message names the extra."""


def hint_for(module: str, purpose: str = "") -> str:
    """``'<module>' is not installed[ (needed for <purpose>)]; install it with: pip install
    'kvtiers[<extra>]'`` for a known optional module; a generic line for any other."""
    top = module.partition(".")[0]
    needed = f" (needed for {purpose})" if purpose else ""
    extra = EXTRAS.get(top)
    if extra is None:
        return f"{top!r} is not installed{needed}; install it with: pip install {top}"
    return f"{top!r} is not installed{needed}; install it with: pip install 'kvtiers[{extra}]'"


def require(module: str, *, purpose: str) -> None:
    """Raise :class:`MissingDependencyError` (see :func:`hint_for`) unless the top-level
    ``module`` can be imported."""
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(hint_for(module, purpose))
