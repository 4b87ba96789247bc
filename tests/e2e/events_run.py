"""Real vLLM engines publishing KV events, each with a ZMQ subscriber beside it.

Run as ``python -m tests.e2e.events_run RUN.json``.

The run file (JSON) holds ``out`` (where results go, rewritten after each engine) and
``engines``, each a mapping: ``name``, ``model``, ``dtype``, ``block_size``,
``max_model_len``, ``stack`` (a kvtiers stack mapping run through
``KVTiersOffloadingSpec``) and ``phases``, each one of:

* ``{"name": ..., "do": "generate", "prompts": [[ids], ...], "max_tokens": n}`` — the
  prompts, one request after another (so the tiers see them in order);
* ``{"name": ..., "do": "reset_gpu"}`` — ``reset_prefix_cache()``: the GPU prefix cache
  only, so the next lookups reach the connector;
* ``{"name": ..., "do": "reset_all"}`` — ``reset_prefix_cache(reset_connector=True)``;
* ``{"name": ..., "do": "block", "root": dir}`` / ``{"do": "unblock", "root": dir}`` —
  move the namespace directory under the file root ``dir`` aside and put a regular file
  in its place (every publish into it then fails), and put it back;
* ``{"name": ..., "do": "idle"}`` — nothing (the phase's events are the flush's).

The subscriber is what a router runs: a ZMQ SUB socket bound on a loopback TCP port, to
which the engine's publisher (``kv_events_config``: ``publisher: zmq``, ``endpoint`` that
port) connects. It keeps each message's frames as they arrive (topic, the 8-byte sequence
number, the msgpack payload); the test decodes the payloads with vLLM's own event classes.
At the end of each phase the runner lets the stack's copies finish, runs one step that
stores nothing (a prompt shorter than a block) so that what the tiers recorded since the
phase's last step is published, then waits until the publisher has sent every batch it
was given (its queue drained) and the subscriber has received as many messages as the
publisher was handed: every batch is attributed to the phase whose steps made it, and the
keys each tier holds then are what a router should have been told.

Each result (``out[name]``): per phase, the messages received (topic, sequence number,
base64 payload) and the keys each tier holds at its end (hex), read from the stack's
managers; the kvtiers stack's counters at the end.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

#: Seconds to wait for the subscriber to receive what the publisher sent.
SYNC_TIMEOUT_S = 60.0


class Subscriber:
    """A SUB socket on a loopback port, receiving on its own thread."""

    def __init__(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._cond = threading.Condition()
        self.messages: list[list[bytes]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            with self._cond:
                self.messages.append(frames)
                self._cond.notify_all()
        self._sock.close(linger=0)
        self._ctx.term()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.messages) >= count, timeout_s)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)


class _Counting:
    """Counts the batches handed to the engine's publisher (wraps its ``publish``)."""

    def __init__(self, publisher: Any) -> None:
        self.count = 0
        self._publish = publisher.publish
        self.publisher = publisher
        publisher.publish = self

    def __call__(self, batch: Any) -> None:
        self.count += 1
        self._publish(batch)

    def drained(self, timeout_s: float) -> bool:
        """Whether the publisher thread sent every batch handed to it within the time."""
        queue = self.publisher._event_queue
        with queue.all_tasks_done:
            return queue.all_tasks_done.wait_for(lambda: queue.unfinished_tasks == 0, timeout_s)


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _generate(llm: Any, phase: dict[str, Any]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=phase["max_tokens"], ignore_eos=True)
    tokens = []
    for ids in phase["prompts"]:
        [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        tokens.append(list(out.outputs[0].token_ids))
    return tokens


#: The step that publishes what the tiers recorded: a prompt shorter than one block.
FLUSH = {"do": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1}


def _held(stack: Any) -> dict[str, list[str]]:
    """The keys each tier of ``stack`` holds ready, by tier name (hex)."""
    held: dict[str, list[str]] = {}
    for tier in stack.tiers:
        manager = tier.manager
        index = getattr(manager, "index", None)
        if index is not None:
            keys = [key for key, entry in index.items() if entry.state.name == "READY"]
        else:  # the cpu tier: its ready keys are those with a slot
            keys = [key for key in list(manager._slots)
                    if manager.slot_state(key).name == "READY"]
        held[tier.name] = sorted(key.hex() for key in keys)
    return held


def _namespace_dir(root: str) -> Path:
    [namespace] = [p.parent for p in Path(root).glob("*/manifest.json")]
    return namespace


def run_engine(run: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM

    subscriber = Subscriber()
    started = time.monotonic()
    llm = LLM(
        model=run["model"],
        dtype=run["dtype"],
        block_size=run["block_size"],
        max_model_len=run["max_model_len"],
        max_num_seqs=4,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        kv_transfer_config={
            # KVTiersConnector renames the media of tiers with event_medium.
            "kv_connector": run.get("connector", "OffloadingConnector"),
            **({"kv_connector_module_path": "kvtiers.integrations.vllm"}
               if run.get("connector") == "KVTiersConnector" else {}),
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "KVTiersOffloadingSpec",
                "spec_module_path": "kvtiers.integrations.vllm",
                "kvtiers": run["stack"],
                **run.get("extra_config", {}),
            },
        },
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": subscriber.endpoint,
            "topic": "kvtiers-e2e",
        },
    )
    result: dict[str, Any] = {"start_s": time.monotonic() - started, "phases": []}
    scheduler = _scheduler(llm)
    counting = _Counting(scheduler.kv_event_publisher)
    stack = scheduler.connector.connector_scheduler.manager.stack.manager
    seen = 0
    try:
        for phase in run["phases"]:
            record: dict[str, Any] = {"name": phase["name"]}
            do = phase["do"]
            if do == "generate":
                record["tokens"] = _generate(llm, phase)
            elif do == "reset_gpu":
                record["ok"] = bool(llm.reset_prefix_cache())
            elif do == "reset_all":
                record["ok"] = bool(llm.reset_prefix_cache(reset_connector=True))
            elif do == "block":
                path = _namespace_dir(phase["root"])
                path.rename(path.with_name(path.name + ".aside"))
                path.write_bytes(b"not a directory")
            elif do == "unblock":
                [aside] = Path(phase["root"]).glob("*.aside")
                path = aside.with_name(aside.name.removesuffix(".aside"))
                path.unlink()
                aside.rename(path)
            elif do != "idle":
                raise ValueError(f"unknown phase action {do!r}")
            # A restart's tiers index what they hold in the background: a phase ends once
            # they have, and the flush's step below takes the index in and announces it.
            for tier in stack.tiers:
                tier.manager.wait_index()
            stack.wait_idle()
            _generate(llm, FLUSH)
            record["held"] = _held(stack)
            if not counting.drained(SYNC_TIMEOUT_S):
                raise RuntimeError(f"phase {phase['name']}: the publisher did not drain")
            if not subscriber.wait_for(counting.count, SYNC_TIMEOUT_S):
                raise RuntimeError(
                    f"phase {phase['name']}: {counting.count} batches published, "
                    f"{len(subscriber.messages)} received"
                )
            messages = subscriber.messages[seen : counting.count]
            seen = counting.count
            record["messages"] = [
                {
                    "topic": frames[0].decode(),
                    "seq": int.from_bytes(frames[1], "big", signed=True),
                    "payload": base64.b64encode(frames[2]).decode(),
                }
                for frames in messages
            ]
            result["phases"].append(record)
        result["kvtiers"] = dict(stack.get_stats())
    finally:
        llm.llm_engine.engine_core.shutdown()
        subscriber.close()
    return result


def _release_engine() -> None:
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
    os.environ.setdefault("PYTHONHASHSEED", "0")
    for run in plan["engines"]:
        results[run["name"]] = run_engine(run)
        _release_engine()
        Path(plan["out"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
