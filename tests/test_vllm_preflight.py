"""KVTiersConnector's start-time checks while vLLM checks its configuration.

vLLM looks the connector class up through its own factory (``VllmConfig``'s checks do,
before any model loads); kvtiers' package runs the stack's checks at that import. Here the
factory is called as vLLM calls it, in a fresh interpreter: a stack that cannot start
fails the look-up with one ``ConfigError`` line naming the key, and the package is not
left half-imported; a good stack passes without anything created on disk.
(tests/e2e/test_serve_preflight.py does the same with a real ``vllm serve``.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

LOOK_UP = """
import json, sys
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from kvtiers.errors import ConfigError
stack = json.loads(sys.argv[1])
config = KVTransferConfig(
    kv_connector="KVTiersConnector", kv_role="kv_both",
    kv_connector_module_path="kvtiers.integrations.vllm",
    kv_connector_extra_config={"kvtiers": stack})
try:
    found = KVConnectorFactory.get_connector_class(config)
except ConfigError as exc:
    print(json.dumps({"error": str(exc), "path": exc.path,
                      "imported": "kvtiers.integrations.vllm" in sys.modules}))
else:
    print(json.dumps({"found": found.__name__}))
"""


def _look_up(stack: dict[str, object]) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", LOOK_UP, json.dumps(stack)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answer: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return answer


def test_a_stack_that_cannot_start_fails_vllms_look_up_in_one_line(tmp_path: Path) -> None:
    answer = _look_up({"tiers": [{"kind": "cpu", "capacity": "16MiB"},
                                 {"kind": "file", "root": "/proc/kvtiers-preflight"}]})
    assert answer["path"] == "tiers[1].root"
    assert str(answer["error"]).startswith(
        "tiers[1].root: the root /proc/kvtiers-preflight does not exist and cannot be created")
    assert "\n" not in str(answer["error"])
    assert answer["imported"] is False


def test_a_good_stack_passes_and_nothing_is_created(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    answer = _look_up({"tiers": [{"kind": "cpu", "capacity": "16MiB"},
                                 {"kind": "file", "root": str(root)}]})
    assert answer == {"found": "KVTiersConnector"}
    assert not root.exists()
    assert list(tmp_path.iterdir()) == []

