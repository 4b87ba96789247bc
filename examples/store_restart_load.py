"""Store a prompt's KV cache, restart the stack, load it back and check every byte.

What an engine's offloading connector does, with kvtiers' public API only: describe the
cache identity, build a stack (host memory in front of a directory), store the KV blocks
of a prompt, shut everything down, build the stack again (its index is rebuilt from the
directory), find the prefix, load it into fresh "GPU" blocks and compare.

Run it with ``python examples/store_restart_load.py [DIR]`` (default: a temporary
directory). It prints one line and exits 0 when every byte came back.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import kvtiers

LAYERS = ("layer0", "layer1")
PAGE_BYTES = 4096  # one layer's KV page for one block of 16 tokens
NUM_GPU_BLOCKS = 64


def run(root: Path) -> int:
    # The cache identity; an engine integration derives it from the engine's config.
    identity = kvtiers.OffloadingConfig(
        groups=(kvtiers.OffloadingGroupConfig(
            tokens_per_block=16, layer_names=LAYERS, bytes_per_block=len(LAYERS) * PAGE_BYTES),),
        model=kvtiers.OffloadingModelConfig(name="example/model"),
        cache=kvtiers.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
    )
    stack_file = {
        "tiers": [
            {"kind": "cpu", "capacity": "4MiB"},
            {"kind": "file", "root": str(root), "capacity": "64MiB"},
        ]
    }
    prompt = list(range(1000, 1000 + 16 * 12))  # 12 blocks = 6 chunks of tokens
    blocks = list(range(12))

    # Run 1: compute the prompt's KV on the "GPU", then store it.
    with kvtiers.load_stack(stack_file, identity) as stack:
        kv = {name: torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.uint8) for name in LAYERS}
        for name in LAYERS:
            kv[name][blocks] = torch.randint(0, 256, (len(blocks), PAGE_BYTES), dtype=torch.uint8)
        expected = {name: kv[name][blocks].clone() for name in LAYERS}
        worker = stack.make_worker(kv)
        glue = kvtiers.OffloadScheduler(stack.manager, identity)
        glue.add_request("r1", prompt)
        plan = glue.plan_store("r1", len(prompt), [blocks])
        assert plan is not None, "the primary accepted nothing"
        worker.submit_store(plan.job_id, plan.groups)
        worker.wait([plan.job_id])
        for result in worker.get_finished():
            glue.complete(result.job_id, result.success)
        glue.finish_request("r1")
        glue.end_step()
        worker.shutdown()
    # Leaving the block shut the stack down: cascades to the file tier finished first.

    # Run 2: a new process would start here. The CPU tier is empty; the file tier is not.
    with kvtiers.load_stack(stack_file, identity) as stack:
        kv = {name: torch.zeros(NUM_GPU_BLOCKS, PAGE_BYTES, dtype=torch.uint8) for name in LAYERS}
        worker = stack.make_worker(kv)
        glue = kvtiers.OffloadScheduler(stack.manager, identity)
        glue.add_request("r2", prompt)
        match = glue.match_prefix("r2")
        while match.pending:  # promotions from the file tier land over a few steps
            glue.end_step()
            match = glue.match_prefix("r2")
        fresh_blocks = list(range(20, 32))
        plan = glue.plan_load("r2", match, [fresh_blocks])
        assert plan is not None, "nothing to load"
        worker.submit_load(plan.job_id, plan.groups)
        worker.wait([plan.job_id])
        results = worker.get_finished()
        for result in results:
            glue.complete(result.job_id, result.success)
        glue.finish_request("r2")
        glue.end_step()
        worker.shutdown()
        loaded_blocks = match.tokens // 16
        same = all(
            torch.equal(kv[name][fresh_blocks[:loaded_blocks]], expected[name][:loaded_blocks])
            for name in LAYERS
        )
    ok = all(r.success for r in results) and loaded_blocks == len(blocks) and same
    print(f"{'ok' if ok else 'FAILED'}: {match.tokens} of {len(prompt)} tokens loaded after "
          f"the restart, bytes {'identical' if same else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        raise SystemExit(run(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        raise SystemExit(run(Path(tmp)))
