"""``KVTiersConnector``: vLLM's ``OffloadingConnector`` that hands its configs to kvtiers.

vLLM gives an offloading spec and its secondary tiers only the offloading config, not the
``VllmConfig`` and ``KVCacheConfig`` the cache identity needs
(:mod:`kvtiers.integrations.vllm.engine`). This connector is vLLM's own
``OffloadingConnector`` in every respect, except that it builds it inside
:func:`~kvtiers.integrations.vllm.engine.handing`: every kvtiers spec and tier built in
that call is handed the connector's own two configs instead of searching vLLM's frames
for them. Select it with ``"kv_connector": "KVTiersConnector"`` and
``"kv_connector_module_path": "kvtiers.integrations.vllm"`` (both routes).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvtiers.integrations.vllm.engine import EngineConfigs, handing


class KVTiersConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector``, with its configs handed to the specs and tiers it
    builds (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        with handing(EngineConfigs(vllm=vllm_config, kv_cache=kv_cache_config)):
            super().__init__(vllm_config, role, kv_cache_config)
