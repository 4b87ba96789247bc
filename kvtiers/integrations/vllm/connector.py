"""``KVTiersConnector``: vLLM's ``OffloadingConnector`` that hands its configs to kvtiers.

vLLM gives an offloading spec and its secondary tiers only the offloading config, not the
``VllmConfig`` and ``KVCacheConfig`` the cache identity needs
(:mod:`kvtiers.integrations.vllm.engine`). This connector is vLLM's own
``OffloadingConnector`` in every respect, except that it builds it inside
:func:`~kvtiers.integrations.vllm.engine.handing`: every kvtiers spec and tier built in
that call is handed the connector's own two configs instead of searching vLLM's frames
for them. Select it with ``"kv_connector": "KVTiersConnector"`` and
``"kv_connector_module_path": "kvtiers.integrations.vllm"`` (both routes). Its KV events
also carry the medium names the stack file gives its tiers (``event_medium``,
:mod:`~kvtiers.integrations.vllm.media`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvtiers.integrations.vllm.engine import EngineConfigs, handing
from kvtiers.integrations.vllm.media import medium_names, renamed


class KVTiersConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector``, with its configs handed to the specs and tiers it
    builds (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        with handing(EngineConfigs(vllm=vllm_config, kv_cache=kv_cache_config)):
            super().__init__(vllm_config, role, kv_cache_config)

    def take_events(self) -> Iterable[Any]:
        """vLLM's events, with the media the stack's tiers name (route 1: a kvtiers spec's
        manager; under any other manager, unchanged)."""
        events = super().take_events()
        manager = getattr(getattr(self, "connector_scheduler", None), "manager", None)
        stack = getattr(manager, "stack", None)
        names = medium_names(stack.config) if stack is not None else {}
        return renamed(events, names) if names else events
