"""A simulated engine that drives a tier stack exactly as a serving engine would.

The "GPU" KV cache is a set of torch byte tensors (CPU, or CUDA when asked), one per layer
of each KV-cache group, shaped ``(num_blocks, page_bytes)``. The content of a block is a
deterministic function of the tokens up to its end, its group and its layer, so every
block that comes back from the tiers is checked byte for byte against what it must be.

Per request: hash the prompt, look up the longest offloaded prefix (stepping while
promotions land), load it into freshly allocated GPU blocks and verify it, "compute" the
rest by writing the expected content, store the newly full chunks, release the blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvtiers.core.config import OffloadingConfig
from kvtiers.core.worker import KVCacheTensors, KVTensorRef, TransferResult
from kvtiers.engine.scheduler import OffloadScheduler, PrefixMatch, TransferPlan
from kvtiers.errors import KVTiersError

if TYPE_CHECKING:
    import torch

    from kvtiers.stack.builder import Stack

_MIX = np.uint64(0x9E3779B97F4A7C15)
# An engine step while waiting for promotions or probes; real engines step about this often.
STEP_S = 0.001
MAX_WAIT_STEPS = 10_000


def block_seeds(token_ids: Sequence[int], tokens_per_block: int, group_idx: int) -> list[int]:
    """A 64-bit seed per full block: chained over the tokens, so it names the prefix."""
    tokens = np.asarray(token_ids, dtype="<i8")
    previous = group_idx.to_bytes(8, "little")
    seeds = []
    for start in range(0, len(tokens) // tokens_per_block * tokens_per_block, tokens_per_block):
        block = tokens[start : start + tokens_per_block].tobytes()
        previous = xxhash.xxh3_64_digest(previous + block)
        seeds.append(int.from_bytes(previous, "little"))
    return seeds


def page_content(seed: int, layer: int, page_bytes: int) -> np.ndarray:
    """The bytes one layer's page of a block must hold (every 8-byte word distinct)."""
    words = -(-page_bytes // 8)
    base = np.uint64((seed + layer * 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF)
    values = (np.arange(1, words + 1, dtype=np.uint64) * _MIX) ^ base
    return values.view(np.uint8)[:page_bytes]


@dataclass
class RequestReport:
    """What happened to one request."""

    req_id: str
    prompt_tokens: int
    reused_tokens: int = 0
    promoted_chunks: int = 0
    loaded_bytes: int = 0
    load_s: float = 0.0
    stored_bytes: int = 0
    store_s: float = 0.0
    verified_blocks: int = 0
    verification_failures: int = 0
    load_failures: int = 0
    store_failures: int = 0
    wait_steps: int = 0


@dataclass
class _Allocation:
    blocks: list[list[int]] = field(default_factory=list)


class SimulatedEngine:
    """Runs requests through ``stack`` one at a time; see the module docstring."""

    def __init__(
        self, stack: Stack, *, num_gpu_blocks: int, device: str = "cpu", settle: bool = True
    ) -> None:
        """``settle``: after each request wait until cascades have landed, as an engine
        with time between requests would; ``False`` runs requests back to back, so stores
        meet primary slots still pinned by cascades (back-pressure)."""
        import torch

        self.stack = stack
        self.settle = settle
        self.config: OffloadingConfig = stack.offloading
        self.glue = OffloadScheduler(stack.manager, self.config)
        self.tensors: list[torch.Tensor] = []
        refs: list[list[KVTensorRef]] = []
        self.page_bytes: list[int] = []
        for group_idx, group in enumerate(self.config.groups):
            layers = len(group.layer_names)
            if group.bytes_per_block % layers:
                raise KVTiersError(
                    f"group {group_idx}: bytes_per_block {group.bytes_per_block} is not a "
                    f"multiple of its {layers} layers"
                )
            page = group.bytes_per_block // layers
            self.page_bytes.append(page)
            group_refs = []
            for _ in range(layers):
                group_refs.append(KVTensorRef(len(self.tensors), page))
                self.tensors.append(
                    torch.zeros((num_gpu_blocks, page), dtype=torch.uint8, device=device)
                )
            refs.append(group_refs)
        self.kv = KVCacheTensors(self.tensors, refs)
        self.worker = stack.make_worker(self.kv)
        self._free = [list(range(num_gpu_blocks - 1, -1, -1)) for _ in self.config.groups]
        self._results: dict[int, TransferResult] = {}

    # -- one request ------------------------------------------------------------------
    def run_request(self, req_id: str, token_ids: Sequence[int]) -> RequestReport:
        report = RequestReport(req_id, len(token_ids))
        self.glue.add_request(req_id, token_ids)
        allocation = self._allocate(len(token_ids))
        try:
            match = self._wait_for_prefix(req_id, len(token_ids), report)
            loaded = self._load(req_id, match, allocation, token_ids, report)
            self._compute(token_ids, allocation, loaded)
            self._store(req_id, len(token_ids), allocation, report)
        finally:
            self.glue.end_step()
            self._release(allocation)
            self.glue.finish_request(req_id)
        if self.settle:
            self.stack.manager.wait_idle()
        return report

    def _wait_for_prefix(
        self, req_id: str, num_tokens: int, report: RequestReport
    ) -> PrefixMatch:
        match = self.glue.match_prefix(req_id, max_tokens=num_tokens - 1)
        report.promoted_chunks = match.promoted
        while match.pending:
            if report.wait_steps >= MAX_WAIT_STEPS:
                raise KVTiersError(f"{req_id}: its prefix was still pending after "
                                   f"{MAX_WAIT_STEPS} engine steps")
            report.wait_steps += 1
            self.glue.end_step()
            self.stack.manager.wait_idle()
            if self.stack.manager.has_pending_work():
                time.sleep(STEP_S)
            match = self.glue.match_prefix(req_id, max_tokens=num_tokens - 1)
        return match

    def _load(
        self,
        req_id: str,
        match: PrefixMatch,
        allocation: _Allocation,
        token_ids: Sequence[int],
        report: RequestReport,
    ) -> int:
        """Load the matched prefix; returns how many tokens are now valid on the GPU."""
        plan = self.glue.plan_load(req_id, match, allocation.blocks) if match.tokens else None
        if plan is None:
            return 0
        result = self._run(plan, store=False)
        if not result.success:
            report.load_failures += 1
            return 0
        report.loaded_bytes += result.transfer_bytes
        report.load_s += result.transfer_s
        report.reused_tokens = match.tokens
        for group_idx, group in enumerate(self.config.groups):
            seeds = block_seeds(token_ids[: match.tokens], group.tokens_per_block, group_idx)
            for block, seed in enumerate(seeds):
                report.verified_blocks += 1
                if not self._block_matches(group_idx, allocation.blocks[group_idx][block], seed):
                    report.verification_failures += 1
        return match.tokens

    def _compute(self, token_ids: Sequence[int], allocation: _Allocation, valid: int) -> None:
        """Write the expected content of every full block past the loaded prefix."""
        import torch

        for group_idx, group in enumerate(self.config.groups):
            seeds = block_seeds(token_ids, group.tokens_per_block, group_idx)
            first = valid // group.tokens_per_block
            for block in range(first, len(seeds)):
                gpu_block = allocation.blocks[group_idx][block]
                for layer, ref in enumerate(self.kv.groups[group_idx]):
                    content = page_content(seeds[block], layer, ref.page_bytes)
                    self.tensors[ref.tensor_idx][gpu_block].copy_(torch.from_numpy(content))

    def _store(
        self, req_id: str, num_tokens: int, allocation: _Allocation, report: RequestReport
    ) -> None:
        plan = self.glue.plan_store(req_id, num_tokens, allocation.blocks)
        if plan is None:
            return
        result = self._run(plan, store=True)
        if result.success:
            report.stored_bytes += result.transfer_bytes
            report.store_s += result.transfer_s
        else:
            report.store_failures += 1

    def _run(self, plan: TransferPlan, *, store: bool) -> TransferResult:
        submit = self.worker.submit_store if store else self.worker.submit_load
        if not submit(plan.job_id, plan.groups):
            result = TransferResult(plan.job_id, success=False)
        else:
            self.worker.wait([plan.job_id])
            for finished in self.worker.get_finished():
                self._results[finished.job_id] = finished
            result = self._results.pop(plan.job_id)
        self.glue.complete(plan.job_id, result.success)
        return result

    def _block_matches(self, group_idx: int, gpu_block: int, seed: int) -> bool:
        for layer, ref in enumerate(self.kv.groups[group_idx]):
            actual = self.tensors[ref.tensor_idx][gpu_block].cpu().numpy()
            if not np.array_equal(actual, page_content(seed, layer, ref.page_bytes)):
                return False
        return True

    # -- GPU blocks -------------------------------------------------------------------
    def _allocate(self, num_tokens: int) -> _Allocation:
        allocation = _Allocation()
        for group_idx, group in enumerate(self.config.groups):
            needed = -(-num_tokens // group.tokens_per_block)
            free = self._free[group_idx]
            if needed > len(free):
                self._release(allocation)
                raise KVTiersError(
                    f"a request of {num_tokens} tokens needs {needed} GPU blocks of group "
                    f"{group_idx}; the simulated GPU has {len(free)} free"
                )
            allocation.blocks.append([free.pop() for _ in range(needed)])
        return allocation

    def _release(self, allocation: _Allocation) -> None:
        for group_idx, blocks in enumerate(allocation.blocks):
            self._free[group_idx].extend(reversed(blocks))
        allocation.blocks = []

    def shutdown(self) -> None:
        self.worker.shutdown()
