"""Fixtures for the real-engine tests: the tiny model, an S3 server, engine processes.

These tests run only in ``.venv-engine`` (``make e2e``: the CPU build of vLLM); the
default collection ignores this directory. Engines are slow to start, so engines run in
two processes (:func:`run_engines`): the first writes the persistent tiers, the second
reads them back (a real restart) and holds every other engine. A result summary is
printed at the end of the session.

The S3 tier talks to the moto server that this (pytest) process runs for the whole
session (``moto_server`` in ``tests/conftest.py``): a stack's ``endpoint_url: embedded``
server lives inside the engine process and would die with it, while the restart test
needs a bucket that outlives the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtiers.testing.s3 import MotoServer
from tests.e2e.tiny_model import make_tiny_llama

REPO = Path(__file__).resolve().parents[2]
#: Seconds one engine process may take (start-ups of ~10 s each on 2 busy cores).
PROCESS_TIMEOUT_S = 900
#: Lines for the session's closing summary, one per engine.
SUMMARY: list[str] = []

#: Settings for vLLM's CPU build: the engine core in the engine's own process (so kvtiers'
#: counters are readable), no thread pinning on a shared machine, 1 GiB of KV cache, and
#: no model hub (the model is a local directory).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

#: Settings for ``vllm serve`` processes (tests/e2e/test_serve.py): the same, except that
#: the engine core runs in a process of its own, as deployed.
SERVER_ENV = {k: v for k, v in ENGINE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def s3_bucket(moto_server: MotoServer) -> tuple[str, str]:
    """The session's moto server (``tests/conftest.py``) with a bucket: (endpoint, bucket)."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=moto_server.endpoint_url,
        aws_access_key_id=ENGINE_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=ENGINE_ENV["AWS_SECRET_ACCESS_KEY"],
        region_name=ENGINE_ENV["AWS_DEFAULT_REGION"],
    ).create_bucket(Bucket="kvtiers-e2e")
    return moto_server.endpoint_url, "kvtiers-e2e"


def run_engines(workdir: Path, label: str, engines: list[dict[str, Any]]) -> dict[str, Any]:
    """Run ``engines`` one after another in a new process; their results by name.

    The process's output goes to ``workdir/<label>.log``. An engine that did not finish
    has no result; the caller's look-up then fails with :func:`result`'s message.
    """
    plan = workdir / f"{label}.json"
    out = workdir / f"{label}-results.json"
    log = workdir / f"{label}.log"
    plan.write_text(json.dumps({"out": str(out), "engines": engines}))
    env = {**os.environ, **ENGINE_ENV}
    with log.open("w") as sink:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.engine_run", str(plan)],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=PROCESS_TIMEOUT_S,
            check=False,
        )
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results["_process"] = {"returncode": proc.returncode, "log": str(log)}
    return results


def result(results: dict[str, Any], name: str) -> dict[str, Any]:
    """Engine ``name``'s result, or a failure quoting the end of its process's log."""
    if name not in results:
        process = results["_process"]
        tail = Path(process["log"]).read_text(errors="replace").splitlines()[-40:]
        pytest.fail(
            f"engine {name!r} has no result (process exit status {process['returncode']}); "
            f"end of {process['log']}:\n" + "\n".join(tail)
        )
    return results[name]


def summarize(name: str, res: dict[str, Any], baseline: list[list[int]] | None) -> None:
    """Add one line about engine ``name`` to the session summary."""
    vllm = res["vllm"]
    kv = res.get("kvtiers", {})
    same = "-" if baseline is None else ("same" if res["tokens"] == baseline else "DIFFERENT")
    line = (
        f"{name:<14} start {res['start_s']:5.1f}s  tokens {same:<9} "
        f"vLLM ext. hits {vllm.get('vllm:external_prefix_cache_hits', 0):6.0f} tok "
        f"loaded {vllm.get('vllm:kv_offload_load_bytes', 0) / 1024:6.0f} KiB"
    )
    if kv:
        line += (
            f"  kvtiers hits {kv['hits']:3d} promotions {kv['promotions']:3d} "
            f"cascades {kv['cascades']:3d} corrupt {kv['corrupt_chunks']:3d}"
        )
    if "reset" in res:
        reset = res["reset"]
        line += f"  reset: {reset['steps_after_reset']} steps, unfinished {reset['unfinished']}"
    SUMMARY.append(line)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SUMMARY:
        terminalreporter.section("kvtiers e2e: engines")
        for line in SUMMARY:
            terminalreporter.write_line(line)
