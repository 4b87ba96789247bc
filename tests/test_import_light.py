"""`import kvtiers` (and its core, config and filemapper layers) stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "boto3", "botocore", "kvikio", "moto", "matplotlib", "fsspec",
         "prometheus_client", "tqdm", "vllm")


@pytest.mark.parametrize("module", ["kvtiers", "kvtiers.core", "kvtiers.config", "kvtiers.cli",
                                    "kvtiers.filemapper"])
def test_import_does_not_pull_heavy_dependencies(module: str) -> None:
    code = (
        f"import json, sys; import {module}; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
