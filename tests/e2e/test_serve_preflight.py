"""A real ``vllm serve`` whose stack cannot start fails before the model loads, in one line.

The stack names a bucket the S3 server does not have, over a file root that does not exist
yet. Through ``KVTiersConnector``, vLLM imports kvtiers while it checks its configuration;
the stack's start-time checks run then (:mod:`kvtiers.integrations.vllm.preflight`), so
the server exits before vLLM starts loading the model, the reason is one line naming the
YAML key, and neither the file root nor a namespace directory is left behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtiers.testing.serve import VllmServer, kv_transfer_config
from tests.e2e.conftest import SERVER_ENV

pytestmark = pytest.mark.timeout(600)

#: What vLLM's CPU model runner logs as it starts loading a model.
MODEL_LOADING = "Starting to load model"


def test_bad_bucket_fails_before_the_model_loads(
    model_dir: Path, tmp_path: Path, s3_bucket: tuple[str, str]
) -> None:
    endpoint, _bucket = s3_bucket
    root = tmp_path / "root"
    stack = tmp_path / "stack.yaml"
    stack.write_text(json.dumps({
        "tiers": [
            {"kind": "cpu", "capacity": "64MiB"},
            {"kind": "file", "root": str(root), "threads": 2},
            {"kind": "s3", "bucket": "no-such-kvtiers-bucket", "endpoint_url": endpoint,
             "max_attempts": 1},
        ],
    }))
    log = tmp_path / "server.log"
    server = VllmServer(
        model_dir,
        ["--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
         "--enforce-eager", "--kv-transfer-config",
         kv_transfer_config(stack, connector="KVTiersConnector")],
        log=log, env=SERVER_ENV,
    )
    with pytest.raises(RuntimeError, match="exited with"):
        server.start()
    text = log.read_text(errors="replace")
    assert MODEL_LOADING not in text, "the model was loaded before the stack was checked"
    reasons = [line for line in text.splitlines()
               if "tiers[2].bucket" in line and "does not exist" in line]
    assert reasons, f"no one-line reason naming tiers[2].bucket in:\n{server.tail()}"
    assert "no-such-kvtiers-bucket" in reasons[0]
    assert not root.exists(), f"a failed start left {sorted(root.rglob('*'))}"
