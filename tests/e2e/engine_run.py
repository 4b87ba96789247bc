"""Real vLLM engines, one after another in one process.

Run as ``python -m tests.e2e.engine_run RUN.json``.

The engine tests start one process per group of engines, so a restart is a real restart:
nothing is shared with the engines that wrote a persistent tier but the tier itself. The
run file (JSON) holds ``out`` (where results go, rewritten after each engine so a crash
keeps what was measured) and ``engines``, each a mapping:

* ``name``; ``model``, ``revision``, ``dtype``, ``block_size``, ``max_model_len`` — the
  engine's model and cache geometry; ``stack`` — a kvtiers stack mapping run through
  ``KVTiersOffloadingSpec``, or ``null`` for no offloading;
* ``extra_config`` (optional) — more ``kv_connector_extra_config`` entries (e.g.
  ``kvtiers_group_bytes_per_block``);
* ``connector`` (optional, default ``OffloadingConnector``) — vLLM's own connector, or
  ``KVTiersConnector`` (from ``kvtiers.integrations.vllm``);
* ``load_format``, ``hf_config_path``, ``kv_cache_dtype`` (optional) — vLLM's
  ``--load-format``, ``--hf-config-path`` and ``--kv-cache-dtype``;
* ``prompts`` — token-id lists, generated greedily (``max_tokens`` each) in one batch, or
  one after another when ``one_at_a_time`` is set (for models whose outputs on the CPU
  build depend on what else is in the batch);
* ``reset_after_steps`` (optional) — instead, submit the prompts, step the engine that
  many times, call ``reset_prefix_cache(reset_connector=True)`` and step on until every
  request finished or ``reset_max_steps`` steps passed;
* ``tensor_parallel_size`` (optional, default 1) — ranks, each a worker process of
  vLLM's multiprocessing executor;
* ``record_transfers`` (optional) — record, per prompt and KV-cache group, the chunk
  positions (0 = the prompt's first chunk) the connector loaded and stored: result
  ``transfers`` = ``{"loads": [...], "stores": [...], "keys": [...]}``, one list per
  prompt of per-group position lists (``keys``: per group, each stored position's key in
  hex).

Each result (``out[name]``): generated tokens, the prompt tokens vLLM counted as cached
per request, vLLM's counters and the kvtiers stack's counters (read at the end), and for
a reset what happened after it. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller) so the stack's counters are read
straight from the scheduler's manager.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def _vllm_counters(llm: Any) -> dict[str, float]:
    """vLLM's counters and gauges (histograms left out), by metric name."""
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            counters[metric.name] = counters.get(metric.name, 0.0) + float(value)
    return counters


def _kvtiers_manager(llm: Any) -> Any:
    """The scheduler's ``KVTiersManager`` (engine core in this process)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector.connector_scheduler.manager


def _record_transfers(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Record the chunk positions of every load and store the connector prepares, per
    prompt and KV-cache group, by wrapping the scheduler's manager (see the module
    docstring). A key's position is its index in the request's offload keys of its group
    (vLLM's scheduler state: this is a test harness, not kvtiers)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    manager = scheduler.manager
    groups = len(scheduler.config.kv_group_configs)
    record: dict[str, Any] = {
        kind: [[[] for _ in range(groups)] for _ in prompts] for kind in ("loads", "stores")
    }
    record["keys"] = [[{} for _ in range(groups)] for _ in prompts]
    by_prompt = {tuple(ids): i for i, ids in enumerate(prompts)}

    def note(kind: str, keys: Any, req_context: Any) -> None:
        status = scheduler._req_status[req_context.req_id]
        prompt = by_prompt[tuple(status.req.prompt_token_ids)]
        for group, state in enumerate(status.group_states):
            index = {key: i for i, key in enumerate(state.offload_keys)}
            positions = [index[key] for key in keys if key in index]
            record[kind][prompt][group].extend(positions)
            if kind == "stores":
                for position in positions:
                    record["keys"][prompt][group][position] = bytes(
                        state.offload_keys[position]
                    ).hex()

    prepare_load, prepare_store = manager.prepare_load, manager.prepare_store

    def load(keys: Any, req_context: Any) -> Any:
        note("loads", keys, req_context)
        return prepare_load(keys, req_context)

    def store(keys: Any, req_context: Any) -> Any:
        output = prepare_store(keys, req_context)
        if output is not None:
            note("stores", output.keys_to_store, req_context)
        return output

    manager.prepare_load, manager.prepare_store = load, store
    return record


def _sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _generate(llm: Any, run: dict[str, Any]) -> dict[str, Any]:
    """The prompts in one batch (or one at a time): tokens and cached prompt tokens per
    request."""
    batches = [[ids] for ids in run["prompts"]] if run.get("one_at_a_time") else [run["prompts"]]
    results = [
        output
        for batch in batches
        for output in llm.generate(
            [{"prompt_token_ids": ids} for ids in batch],
            _sampling(run["max_tokens"]),
            use_tqdm=False,
        )
    ]
    return {
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "num_cached_tokens": [r.num_cached_tokens for r in results],
    }


def _generate_with_reset(llm: Any, run: dict[str, Any]) -> dict[str, Any]:
    """The prompts, with the prefix cache and the connector's reset after
    ``reset_after_steps`` engine steps; then step on until every request finished or
    ``reset_max_steps`` more steps passed."""
    engine = llm.llm_engine
    params = _sampling(run["max_tokens"])
    names = [f"req-{i}" for i in range(len(run["prompts"]))]
    for name, ids in zip(names, run["prompts"], strict=True):
        engine.add_request(name, {"prompt_token_ids": ids}, params)
    outputs: dict[str, Any] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out

    for _ in range(run["reset_after_steps"]):
        step()
    unfinished_at_reset = len(names) - len(outputs)
    # vLLM refuses reset_running_requests=True while loads are in flight (its limitation),
    # so running requests keep their GPU blocks; the connector's cache is reset under them.
    reset_ok = llm.reset_prefix_cache(reset_running_requests=False, reset_connector=True)
    started = time.monotonic()
    steps = 0
    while engine.has_unfinished_requests() and steps < run["reset_max_steps"]:
        step()
        steps += 1
    return {
        "tokens": [
            list(outputs[n].outputs[0].token_ids) if n in outputs else None for n in names
        ],
        "num_cached_tokens": [
            outputs[n].num_cached_tokens if n in outputs else None for n in names
        ],
        "reset": {
            "reset_ok": bool(reset_ok),
            "unfinished_at_reset": unfinished_at_reset,
            "steps_after_reset": steps,
            "seconds_after_reset": time.monotonic() - started,
            "unfinished": engine.has_unfinished_requests(),
        },
    }


def run_engine(run: dict[str, Any]) -> dict[str, Any]:
    """Start the engine ``run`` describes, generate, and return what was measured."""
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if run["stack"] is not None:
        connector = run.get("connector", "OffloadingConnector")
        kwargs["kv_transfer_config"] = {
            "kv_connector": connector,
            **(
                {"kv_connector_module_path": "kvtiers.integrations.vllm"}
                if connector == "KVTiersConnector"
                else {}
            ),
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KVTiersOffloadingSpec",
                "spec_module_path": "kvtiers.integrations.vllm",
                "kvtiers": run["stack"],
                **run.get("extra_config", {}),
            },
        }
    ranks = run.get("tensor_parallel_size", 1)
    if ranks > 1:
        kwargs["tensor_parallel_size"] = ranks
        kwargs["distributed_executor_backend"] = "mp"
    for name in ("load_format", "hf_config_path", "kv_cache_dtype"):
        if run.get(name) is not None:
            kwargs[name] = run[name]
    started = time.monotonic()
    llm = LLM(
        model=run["model"],
        revision=run["revision"],
        dtype=run["dtype"],
        block_size=run["block_size"],
        max_model_len=run["max_model_len"],
        max_num_seqs=len(run["prompts"]),
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )
    result: dict[str, Any] = {"start_s": time.monotonic() - started}
    if run.get("record_transfers") and run["stack"] is not None:
        result["transfers"] = _record_transfers(llm, run["prompts"])
    if run.get("reset_after_steps") is None:
        result.update(_generate(llm, run))
    else:
        result.update(_generate_with_reset(llm, run))
    if run["stack"] is not None:
        stack = _kvtiers_manager(llm).stack.manager
        stack.wait_idle()
        result["kvtiers"] = dict(stack.get_stats())
    result["vllm"] = _vllm_counters(llm)
    llm.llm_engine.engine_core.shutdown()
    return result


def _release_engine() -> None:
    """Tear down what an engine left in the process so the next one can start."""
    import gc

    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def main(argv: list[str]) -> None:
    plan = json.loads(Path(argv[0]).read_text())
    results: dict[str, Any] = {}
    for run in plan["engines"]:
        results[run["name"]] = run_engine(run)
        _release_engine()
        Path(plan["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
