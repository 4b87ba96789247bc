"""``kvtiers identity --vllm``: the identity computed offline is the one the engine uses.

With vLLM's real config objects for an engine (built as tests/test_vllm_identity.py builds
them), :func:`kvtiers.integrations.vllm.offline.identity_of` must name the namespace that
vLLM's own ``OffloadingConnector`` opens on a file tier for the same configs, and create
nothing. The arguments go through vLLM's own ``EngineArgs`` parser. Parsing arguments
into a ``VllmConfig`` and building the model's layers need a vLLM platform, which the
class-level install lacks: tests/e2e/test_serve_ctrl_c.py runs that whole path against a
real ``vllm serve``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtiers import cli
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm import offline
from tests.test_vllm_identity import (
    base_engine,
    identity_of,
    kv_cache_config,
    model_dir,  # noqa: F401 (a fixture)
    v1_model_runner,  # noqa: F401 (a fixture)
    vllm_config,
)


@pytest.fixture(autouse=True)
def vllm_logging_stream() -> Iterator[None]:
    # `kvtiers identity --vllm` points vLLM's log at stderr through the environment; the
    # tests that run the command in this process leave it as it was (later tests' vLLM
    # subprocesses inherit it).
    saved = os.environ.get("VLLM_LOGGING_STREAM")
    yield
    if saved is None:
        os.environ.pop("VLLM_LOGGING_STREAM", None)
    else:
        os.environ["VLLM_LOGGING_STREAM"] = saved


ENGINES: dict[str, dict[str, Any]] = {
    "plain": {},
    "fp8 KV, sha256_cbor": {"cache_dtype": "fp8", "hash_algo": "sha256_cbor"},
    "sliding window": {"sliding_window": 128},
    "salted": {"extra": {"kvtiers_salt": "tenant-a"}},
}


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_offline_identity_is_the_connectors(name: str, model_dir: Path,  # noqa: F811
                                            tmp_path: Path) -> None:
    engine = base_engine(model_dir, **ENGINES[name])
    engine_root, offline_root = tmp_path / "engine", tmp_path / "offline"
    expected = identity_of(engine, "spec", engine_root)
    computed = offline.identity_of(vllm_config(engine, "spec", offline_root),
                                   kv_cache_config(engine))
    from kvtiers.filemapper import NamespaceIdentity

    assert NamespaceIdentity.from_config(computed).namespace == expected.namespace
    assert not offline_root.exists(), "computing the identity created the file tier's root"


def test_a_transfer_config_without_kvtiers_is_refused(model_dir: Path,  # noqa: F811
                                                      tmp_path: Path) -> None:
    engine = base_engine(model_dir)
    config = vllm_config(engine, "tiering", tmp_path / "kv")
    with pytest.raises(ConfigError, match="turn no kvtiers stack on"):
        offline.identity_of(config, kv_cache_config(engine))


def test_serve_arguments_parse_as_vllm_parses_them(model_dir: Path) -> None:  # noqa: F811
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip("vLLM's argument parser needs a platform (make e2e runs this)")
    args = offline.engine_args([str(model_dir), "--block-size", "32", "--port", "8001",
                                "--dtype", "float16", "--seed", "3"])
    assert (args.model, args.block_size, args.dtype, args.seed) == (
        str(model_dir), 32, "float16", 3)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_the_stack_file_and_a_transfer_config_together_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stack = tmp_path / "stack.yaml"
    stack.write_text(json.dumps({"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}))
    status, out, err = run(capsys, "identity", str(stack), "--vllm", "org/model",
                           "--kv-transfer-config", "{}")
    assert (status, out) == (2, "")
    assert "not both" in err and len(err.strip().splitlines()) == 1


def test_vllm_without_arguments_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "identity", "--vllm")
    assert (status, out) == (2, "")
    assert "--vllm needs the arguments" in err


def test_the_stack_files_transfer_config_is_added(tmp_path: Path) -> None:
    import argparse

    stack = tmp_path / "stack.yaml"
    argv = cli._vllm_arguments(argparse.Namespace(config=str(stack), vllm=["org/model"]))
    assert argv[:2] == ["org/model", "--kv-transfer-config"]
    extra = json.loads(argv[2])["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["kvtiers_config"]) == (offline.SPEC_NAME, str(stack))


def test_arguments_vllm_refuses_are_one_config_error(tmp_path: Path) -> None:
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        pytest.skip("vLLM's engine config needs a platform (make e2e runs this)")
    with pytest.raises(ConfigError, match="vLLM refuses these arguments"):
        offline.identity_from_args([str(tmp_path / "no-such-model")])
