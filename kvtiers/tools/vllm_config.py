"""The ``--kv-transfer-config`` that turns a kvtiers stack on in vLLM (``kvtiers vllm-config``).

Route 1 (a whole stack as vLLM's offloading spec) through :class:`KVTiersConnector`, the
connector that hands kvtiers the engine's configs and checks the stack while vLLM checks
its configuration, before the model loads (see ``docs/vllm.md``). No vLLM import: the
JSON is text for a command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The connector kvtiers recommends, and the module vLLM imports it from.
CONNECTOR = "KVTiersConnector"
MODULE = "kvtiers.integrations.vllm"
#: vLLM's own connector, which loads kvtiers only when it builds the spec.
VLLM_CONNECTOR = "OffloadingConnector"


def transfer_config(stack_file: str | Path, *, connector: str = CONNECTOR,
                    **extra: Any) -> dict[str, Any]:
    """Route 1's ``--kv-transfer-config`` mapping for ``stack_file``; ``connector`` is
    :data:`CONNECTOR` or vLLM's :data:`VLLM_CONNECTOR`; ``extra`` adds keys to
    ``kv_connector_extra_config``."""
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both"}
    if connector == CONNECTOR:
        config["kv_connector_module_path"] = MODULE
    config["kv_connector_extra_config"] = {
        "spec_name": "KVTiersOffloadingSpec",
        "spec_module_path": MODULE,
        "kvtiers_config": str(stack_file),
        **extra,
    }
    return config


def transfer_config_json(stack_file: str | Path, *, connector: str = CONNECTOR,
                         **extra: Any) -> str:
    """:func:`transfer_config` as the one-line JSON vLLM's flag takes."""
    return json.dumps(transfer_config(stack_file, connector=connector, **extra),
                      separators=(",", ":"))
