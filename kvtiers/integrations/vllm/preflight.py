"""The stack's start-time checks while vLLM checks its configuration, before the model loads.

vLLM builds connectors only once the model is loaded and its KV cache sized, which takes
minutes for a real model. But it looks the connector class up earlier: ``VllmConfig``'s
own checks ask whether ``KVTiersConnector`` supports the hybrid KV-cache manager, which
imports this package (``kv_connector_module_path``). :func:`check_while_configuring` runs
at that import: when vLLM's connector-class look-up below it holds the
``kv_transfer_config`` and that names a kvtiers stack (``kvtiers_config`` or ``kvtiers``),
the stack file is read and :func:`~kvtiers.stack.preflight.preflight` runs on it, as the
engine would build it (a cpu primary in ``/dev/shm``). A problem is one
:class:`~kvtiers.errors.ConfigError` line, also logged, and the import fails, so vLLM
stops before loading anything. The engine core and worker processes import the package
through the same look-up before they build their connectors (the checks run again there,
before the stack's exporter listens); an import by any other path (vLLM loading the
offloading spec, a test) checks nothing, and the build checks anyway
(:func:`~kvtiers.stack.preflight.check_before_build`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any

from kvtiers.config import StackConfig, load_stack_config
from kvtiers.config.tiers import CPUTierConfig
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.engine import vllm_frame_locals

logger = logging.getLogger(__name__)

#: How many frames below the import are searched for vLLM's configuration check.
MAX_FRAMES = 64
#: The ``/dev/shm`` name the check stands in for a cpu primary's per-engine one.
PREFLIGHT_SHM_NAME = "kvtiers-preflight"


def check_while_configuring() -> None:
    """Run the stack's start-time checks if vLLM is checking a configuration that names
    a kvtiers stack (see the module docstring); raise one :class:`ConfigError` line on a
    problem. Returns quietly otherwise."""
    extra = _extra_config_being_checked()
    if extra is None:
        return
    path, inline = extra.get("kvtiers_config"), extra.get("kvtiers")
    if (path is None) == (inline is None):
        return  # not route 1's spec, or a mistake the spec itself reports
    source = path if path is not None else inline
    if not isinstance(source, (str, Mapping)):
        return  # a mistake the spec itself reports when it is built
    stack = load_stack_config(source)
    from kvtiers.stack.preflight import check_before_build

    try:
        check_before_build(as_engine_builds(stack), None)
    except ConfigError as exc:
        logger.error("kvtiers: %s", exc)
        raise


def as_engine_builds(stack: StackConfig) -> StackConfig:
    """``stack`` with its cpu primary in ``/dev/shm``, as vLLM's engine places it."""
    primary = stack.tiers[0]
    if not isinstance(primary, CPUTierConfig) or primary.shared_memory_name is not None:
        return stack
    shared = dataclasses.replace(primary, shared_memory_name=PREFLIGHT_SHM_NAME)
    return dataclasses.replace(stack, tiers=(shared, *stack.tiers[1:]))


#: The vLLM function whose import of this package is a connector-class look-up.
LOOK_UP = "get_connector_class"


def _extra_config_being_checked() -> Mapping[str, Any] | None:
    """The ``kv_connector_extra_config`` of the ``kv_transfer_config`` that vLLM's
    connector-class look-up (:data:`LOOK_UP`) below the caller holds, or ``None``.

    Only that look-up: vLLM also imports this package to load the offloading spec, in
    processes where the stack already runs (the API server, for its metrics), and a check
    there would find the stack's own exporter on its port. Frames outside the ``vllm``
    package are never read."""
    try:
        from vllm.config import KVTransferConfig
    except ImportError:
        return None
    for local in vllm_frame_locals(sys._getframe(1), MAX_FRAMES, function=LOOK_UP):
        found = local.get("kv_transfer_config")
        if isinstance(found, KVTransferConfig):
            extra = found.kv_connector_extra_config
            return extra if isinstance(extra, Mapping) else None
    return None
