"""The vLLM releases kvtiers' integration supports, checked when the integration loads.

vLLM marks out-of-tree offloading specs and secondary tiers as experimental; their
interfaces change between minor releases. The range below is what the project's tests
run: the class-level integration tests on vLLM 0.33.0 and 0.34.0 (``make test``) and on
vLLM 0.32.0 (the CPU build, ``make e2e``), which also runs real engines. What differs
between these releases is adapted in :mod:`kvtiers.integrations.vllm.compat`. Loading
the integration under any other vLLM raises
:class:`~kvtiers.errors.UnsupportedVersionError` with one line that names the version
found and the range, instead of a raw error from inside vLLM later.

``KVTIERS_VLLM_UNCHECKED=1`` in the environment turns the refusal into one warning: what
``make vllm-compat`` sets so the class-level tests show how an unsupported release
actually behaves. It is for checking a release, never for serving.
"""

from __future__ import annotations

import logging
import os
import re

from kvtiers.errors import UnsupportedVersionError

logger = logging.getLogger(__name__)

#: The environment variable that lets an unsupported vLLM load with a warning (see above).
UNCHECKED_ENV = "KVTIERS_VLLM_UNCHECKED"

#: The lowest supported release and the first unsupported one: ``[low, high)``.
SUPPORTED_LOW = (0, 32, 0)
SUPPORTED_HIGH = (0, 35, 0)
#: The range as a pip requirement specifier (also the ``kvtiers[vllm]`` extra's).
SUPPORTED_SPECIFIER = ">=0.32,<0.35"

_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str) -> tuple[int, int, int] | None:
    """The ``(major, minor, patch)`` a version string starts with (``0.33.1.dev3+g…`` gives
    ``(0, 33, 1)``), or ``None`` when it does not start with one."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def check_vllm_version(version: str | None = None) -> str:
    """Return ``version`` (default: the installed vLLM's ``__version__``) if supported.

    Raises :class:`~kvtiers.errors.UnsupportedVersionError` (one line) otherwise, unless
    :data:`UNCHECKED_ENV` is ``1``: then it logs that line as a warning and returns.
    """
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    found = release(version)
    if found is None or not SUPPORTED_LOW <= found < SUPPORTED_HIGH:
        refusal = UnsupportedVersionError(
            f"kvtiers.integrations.vllm supports vLLM {SUPPORTED_SPECIFIER} (0.32.x to "
            f"0.34.x), this environment has vLLM {version}: install a supported release, "
            f"e.g. pip install 'vllm{SUPPORTED_SPECIFIER}', or check this one with "
            f"make vllm-compat VLLM={version or '<version>'} (see docs/vllm.md)"
        )
        if os.environ.get(UNCHECKED_ENV) != "1":
            raise refusal
        logger.warning("%s; loading it anyway (%s=1: for checking, never serving)",
                       refusal, UNCHECKED_ENV)
    return version
