"""Real KV for the codec benchmark: a vLLM CPU engine writes its chunks into a file tier.

Runs in the engine virtualenv (``.venv-engine``: vLLM's CPU build), from the repository
root::

    PYTHONPATH=$PWD .venv-engine/bin/python benchmarks/kv_dump.py OUT

It makes the tests' tiny random-weight Llama (``python -m tests.e2e.tiny_model``), then
runs one engine per KV dtype (``bfloat16``, then ``fp8`` when vLLM's CPU build takes it)
over a cpu + file stack whose file tier is ``OUT/<dtype>``, and prefills random prompts.
``OUT/summary.json`` records, per dtype, whether the engine ran and how many chunk files
it left. ``benchmarks/bench_codec.py --kv-root OUT/<dtype>`` then measures the codecs on
those chunks' payloads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

#: vLLM's CPU build in this process, no thread pinning, 1 GiB of KV cache, no hub.
_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # The tiny model's words are ids 3..1023 (tests/e2e/tiny_model.py).
    return [[rng.randrange(3, 1024) for _ in range(tokens)] for _ in range(count)]


def _run(model: Path, root: Path, kv_dtype: str, prompts: list[list[int]]) -> None:
    from vllm import LLM, SamplingParams

    stack = {
        "tiers": [
            {"kind": "cpu", "capacity": "256MiB", "policy": "lru"},
            {"kind": "file", "root": str(root), "threads": 2},
        ]
    }
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        kv_cache_dtype=kv_dtype,
        block_size=32,
        max_model_len=2048,
        max_num_seqs=8,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KVTiersOffloadingSpec",
                "spec_module_path": "kvtiers.integrations.vllm",
                "kvtiers": stack,
                "block_size": 256,
            },
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    core.scheduler.connector.connector_scheduler.manager.stack.manager.wait_idle()
    core.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the model and the file roots")
    parser.add_argument("--prompts", type=int, default=24, help="prompts per engine")
    parser.add_argument("--tokens", type=int, default=1536, help="tokens per prompt")
    parser.add_argument("--dtypes", default="auto,fp8",
                        help="KV dtypes, comma separated (auto: the model's bfloat16)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(_ENV)
    model = args.out / "tiny-llama"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tests.e2e.tiny_model", str(model)], check=True)
    summary: dict[str, Any] = {}
    for kv_dtype in args.dtypes.split(","):
        name = "bfloat16" if kv_dtype == "auto" else kv_dtype
        root = args.out / name
        try:
            _run(model, root, kv_dtype, _prompts(args.prompts, args.tokens, seed=len(name)))
        except Exception as exc:  # an unsupported KV dtype is a finding, not a crash
            summary[name] = {"ran": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
            continue
        summary[name] = {"ran": True, "chunks": len(list(root.rglob("*.kvc")))}
        print(f"{name}: {summary[name]['chunks']} chunk files under {root}", flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
