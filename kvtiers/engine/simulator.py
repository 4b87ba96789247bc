"""A simulated engine that drives a tier stack exactly as a serving engine would.

The "GPU" KV cache is a set of torch byte tensors (CPU, or CUDA when asked), one per layer
of each KV-cache group, shaped ``(num_blocks, page_bytes)``. The content of a block is a
deterministic function of the tokens up to its end, its group and its layer, so every
block that comes back from the tiers is checked byte for byte against what it must be.

Per request: hash the prompt, look up the longest offloaded prefix (stepping while
promotions land), load it into freshly allocated GPU blocks and verify it, "compute" the
rest by writing the expected content, store the newly full chunks, release the blocks.

With a :class:`TimeModel` the engine also keeps simulated time: a request's
time-to-first-token is the slowest of its promotions (each lower tier's one job:
``latency_s + bytes / bytes_per_s``, tiers in parallel) plus the prefill of the prompt
tokens it did not load (``tokens / prefill_tokens_per_s``). Loads from the primary and
engine steps are taken as free. A stack with a cost model learns the modelled job times,
not the wall-clock ones of the machine running the simulation.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
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

    from kvtiers.config import StackConfig
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


@dataclass(frozen=True)
class TierTime:
    """A medium's simulated speed for one job: ``latency_s + bytes / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bytes_per_s > 0:
            raise ValueError(f"a tier time needs latency_s >= 0 and bytes_per_s > 0, got "
                             f"{self.latency_s} and {self.bytes_per_s}")

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes > 0 else 0.0


@dataclass(frozen=True)
class TimeModel:
    """Simulated time: the engine's prefill rate and each lower tier's speed (by name;
    a tier not named moves bytes in no time)."""

    prefill_tokens_per_s: float
    tiers: Mapping[str, TierTime] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(
                f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")

    def transfer_s(self, tier: str, num_bytes: int) -> float:
        """Seconds of one job of ``num_bytes`` from (or to) ``tier``."""
        time = self.tiers.get(tier)
        return 0.0 if time is None else time.seconds(num_bytes)

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    @classmethod
    def from_stack(
        cls, config: StackConfig, prefill_tokens_per_s: float | None = None
    ) -> TimeModel | None:
        """The time a stack file declares: each lower tier's ``load_latency_s`` and
        ``load_bytes_per_s`` (a tier with neither is instant; one alone takes the other
        as 0 s or unbounded), and the ``promotion:`` section's prefill rate unless
        ``prefill_tokens_per_s`` is given. ``None`` when there is no prefill rate."""
        rate = prefill_tokens_per_s
        if rate is None and config.promotion is not None:
            rate = config.promotion.prefill_tokens_per_s
        if rate is None:
            return None
        from kvtiers.config.tiers import LowerTierConfig

        tiers = {
            tier.name: TierTime(tier.load_latency_s or 0.0,
                                float(tier.load_bytes_per_s or float("inf")))
            for tier in config.tiers[1:]
            if isinstance(tier, LowerTierConfig)
            and (tier.load_latency_s is not None or tier.load_bytes_per_s is not None)
        }
        return cls(rate, tiers)


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
    #: Per lower tier: bytes promoted from it for this request.
    promoted_bytes: dict[str, int] = field(default_factory=dict)
    #: Per tier: bytes written into it while this request ran (the primary's from the
    #: GPU, a lower tier's by cascades).
    written_bytes: dict[str, int] = field(default_factory=dict)
    #: Simulated time-to-first-token, seconds (with a :class:`TimeModel`, else 0).
    ttft_s: float = 0.0
    #: Simulated time-to-first-token had the whole prompt been recomputed.
    recompute_s: float = 0.0


@dataclass
class _Allocation:
    blocks: list[list[int]] = field(default_factory=list)


class SimulatedEngine:
    """Runs requests through ``stack`` one at a time; see the module docstring."""

    def __init__(
        self,
        stack: Stack,
        *,
        num_gpu_blocks: int,
        device: str = "cpu",
        settle: bool = True,
        time_model: TimeModel | None = None,
    ) -> None:
        """``settle``: after each request wait until cascades have landed, as an engine
        with time between requests would; ``False`` runs requests back to back, so stores
        meet primary slots still pinned by cascades (back-pressure). ``time_model``: keep
        simulated time (see the module docstring); a cost model in the stack then learns
        from the modelled job times."""
        import torch

        self.stack = stack
        self.settle = settle
        self.time_model = time_model
        if time_model is not None and stack.manager.cost is not None:
            stack.manager.cost.transfer_time = time_model.transfer_s
        self._tier_names = [tier.name for tier in stack.tiers]
        self.config: OffloadingConfig = stack.offloading
        # With a tenants: section the scheduler drives the stack through its tenants.
        self.glue = OffloadScheduler(stack.tenants or stack.manager, self.config)
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
        before = self.stack.manager.get_stats()
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
        self._account(report, before, self.stack.manager.get_stats())
        return report

    def _account(
        self, report: RequestReport, before: Mapping[str, float], after: Mapping[str, float]
    ) -> None:
        """Bytes per tier from the stack's counters, and the simulated times."""
        primary, *lower = self._tier_names
        report.written_bytes[primary] = report.stored_bytes
        for name in lower:
            for counter, into in (("promoted_bytes", report.promoted_bytes),
                                  ("cascaded_bytes", report.written_bytes)):
                key = f"{name}.{counter}"
                into[name] = int(after.get(key, 0) - before.get(key, 0))
        model = self.time_model
        if model is not None:
            load = max((model.transfer_s(name, moved)
                        for name, moved in report.promoted_bytes.items()), default=0.0)
            report.ttft_s = load + model.prefill_s(report.prompt_tokens - report.reused_tokens)
            report.recompute_s = model.prefill_s(report.prompt_tokens)

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
