"""Scheduler glue: what an engine's offloading connector does each step, per request.

For every request it keeps the chunk keys of each KV-cache group (computed incrementally
from token ids), and turns the manager's group-unaware answers into per-group transfers:

* :meth:`OffloadScheduler.match_prefix` — look up each group's chunks in order; the usable
  prefix is the minimum across groups, floored to a whole number of every group's blocks.
  Lookups continue through ``HIT_PENDING`` chunks so all promotions of a prefix start in
  the same step; any pending chunk inside the usable prefix means "ask again next step".
  A ``RETRY`` (a shared tier probing) ends a group's prefix for the step but not its
  lookups, so all of a prefix's missing keys are probed in one batch and a prefix another
  engine published is usable within three steps (probe, promote, load).
* :meth:`OffloadScheduler.plan_load` — pin the prefix's chunks once (``prepare_load``),
  then one ``get_spec`` per group, each carrying the group's ``gpu_block_offset``.
* :meth:`OffloadScheduler.plan_store` — reserve newly full chunks of every group in one
  ``prepare_store`` and describe, per group, which GPU blocks fill the accepted chunks.
* :meth:`OffloadScheduler.complete` — route a worker's job result back to
  ``complete_load`` / ``complete_store``, with the manager generation the job was planned
  in.
* :meth:`OffloadScheduler.reset_cache` — the reset fence: the manager drops every chunk and
  fences the memory of jobs in flight; their completions reach it with their (older)
  generation, so each frees its own job's fenced slots and nothing newer, and the manager
  hears ``on_reset_flushed`` once the last of those jobs has finished.

Invariant: every key pinned or reserved here is released exactly once, by ``complete``, or
by the manager's reset (for jobs in flight at a reset, whose completions then release only
their fenced memory).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvtiers.core.config import OffloadingConfig
from kvtiers.core.hashing import PrefixHasher, chunk_keys
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import (
    LookupResult,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
)
from kvtiers.core.specs import GPULoadStoreSpec, GroupTransfer
from kvtiers.errors import UnknownKeyError


@dataclass
class _Request:
    ctx: ReqContext
    hasher: PrefixHasher
    keys: list[list[OffloadKey]]
    # Per group: leading chunks already handled by plan_store (stored, present or skipped).
    stored_chunks: list[int]
    num_tokens: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """The usable offloaded prefix of a request.

    ``chunks[g]`` chunks of group ``g`` cover ``tokens`` tokens (the last may be used only
    in part); ``pending`` means some of them are still arriving: ask again next step.
    ``promoted`` counts chunks whose lookup started or awaited a promotion.
    """

    tokens: int
    chunks: tuple[int, ...]
    pending: bool
    promoted: int = 0


@dataclass(frozen=True)
class TransferPlan:
    """One worker job: its groups, and the keys to complete when it finishes."""

    job_id: int
    kind: Literal["load", "store"]
    req_id: str
    keys: tuple[OffloadKey, ...]
    groups: tuple[GroupTransfer, ...]


class OffloadScheduler:
    """Per-request bookkeeping over one manager. Not thread-safe: the scheduler's thread."""

    def __init__(self, manager: OffloadingManager, config: OffloadingConfig) -> None:
        self.manager = manager
        self.config = config
        self._requests: dict[str, _Request] = {}
        # Job id → its plan and the manager generation it was planned in.
        self._jobs: dict[int, tuple[TransferPlan, int]] = {}
        self._job_ids = itertools.count()
        self._block_lcm = math.lcm(*(g.tokens_per_block for g in config.groups))
        # Jobs in flight at a reset_cache whose completions have not come yet.
        self._fenced_jobs: set[int] = set()

    # -- requests -------------------------------------------------------------------
    def add_request(
        self, req_id: str, token_ids: Sequence[int], ctx: ReqContext | None = None
    ) -> None:
        """Start tracking a request and hash its tokens."""
        ctx = ctx or ReqContext(req_id=req_id)
        request = _Request(
            ctx=ctx,
            hasher=PrefixHasher(self.config.tokens_per_hash, self.config.cache.hash_algorithm),
            keys=[[] for _ in self.config.groups],
            stored_chunks=[0] * len(self.config.groups),
        )
        self._requests[req_id] = request
        self.manager.on_new_request(ctx)
        self.extend_request(req_id, token_ids)

    def extend_request(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens (e.g. decoded ones); new full chunks get keys."""
        request = self._requests[req_id]
        request.hasher.extend(token_ids)
        request.num_tokens += len(token_ids)
        for group_idx, keys in enumerate(request.keys):
            keys[:] = chunk_keys(
                request.hasher.hashes,
                tokens_per_chunk=self.config.tokens_per_chunk(group_idx),
                tokens_per_hash=self.config.tokens_per_hash,
                group_idx=group_idx,
            )

    def chunk_keys(self, req_id: str, group_idx: int) -> list[OffloadKey]:
        return list(self._requests[req_id].keys[group_idx])

    def finish_request(self, req_id: str) -> None:
        """No more plans for this request; jobs in flight still complete normally."""
        request = self._requests.pop(req_id)
        self.manager.on_request_finished(request.ctx)

    # -- loads ----------------------------------------------------------------------
    def match_prefix(self, req_id: str, *, max_tokens: int | None = None) -> PrefixMatch:
        """The longest prefix every group can load, floored to whole blocks of all groups.

        ``max_tokens`` caps it (an engine must recompute at least the last token); chunks
        beyond the cap are not looked up, so no promotion starts that could not be used.
        The match is pending while a chunk inside it is still arriving (``HIT_PENDING``),
        or while a lookup that could lengthen it answered ``RETRY``."""
        request = self._requests[req_id]
        limit = request.num_tokens if max_tokens is None else min(max_tokens, request.num_tokens)
        ready_tokens: list[int] = []
        reach_tokens: list[int] = []
        retried: list[bool] = []
        promoted = 0
        for group_idx, keys in enumerate(request.keys):
            tokens_per_chunk = self.config.tokens_per_chunk(group_idx)
            ready = None
            count = 0
            retry = False
            for key in keys[: -(-limit // tokens_per_chunk)]:
                result = self.manager.lookup(key, request.ctx)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.HIT_PENDING:
                    promoted += 1
                if result is LookupResult.RETRY:
                    # The group's prefix ends here for this step, but the lookups go on:
                    # every key a shared tier must probe is queued now, in one batch,
                    # instead of one key per step.
                    retry = True
                elif retry:
                    continue
                elif result is LookupResult.HIT:
                    count += 1
                else:
                    ready = count if ready is None else ready
                    count += 1
            ready_tokens.append((count if ready is None else ready) * tokens_per_chunk)
            reach_tokens.append(count * tokens_per_chunk)
            retried.append(retry)
        usable = self._floor_blocks(min(min(reach_tokens), limit))
        ready_usable = self._floor_blocks(min(min(ready_tokens), limit))
        # A RETRY matters when its group is the one that limits the prefix.
        retry_pending = any(
            retry and self._floor_blocks(min(reach, limit)) == usable
            for retry, reach in zip(retried, reach_tokens, strict=True)
        )
        chunks = tuple(
            -(-usable // self.config.tokens_per_chunk(g)) for g in range(len(self.config.groups))
        )
        return PrefixMatch(
            usable, chunks, pending=ready_usable < usable or retry_pending, promoted=promoted
        )

    def _floor_blocks(self, tokens: int) -> int:
        return tokens // self._block_lcm * self._block_lcm

    def plan_load(
        self,
        req_id: str,
        match: PrefixMatch,
        gpu_blocks: Sequence[Sequence[int]],
        *,
        gpu_cached_tokens: int = 0,
    ) -> TransferPlan | None:
        """Pin and describe loading tokens ``[gpu_cached_tokens, match.tokens)``.

        ``gpu_blocks[g]`` are the request's GPU block ids of group ``g`` by logical block
        index; each group loads from its first block not wholly cached on the GPU.
        Returns None when there is nothing to load. ``match`` must not be pending.
        """
        if match.pending:
            raise ValueError("the prefix is still arriving; call match_prefix next step")
        request = self._requests[req_id]
        if match.tokens <= gpu_cached_tokens:
            return None
        spans = []
        all_keys: list[OffloadKey] = []
        for group_idx, keys in enumerate(request.keys):
            tokens_per_block = self.config.groups[group_idx].tokens_per_block
            per_chunk = self.config.blocks_per_chunk
            first_block = gpu_cached_tokens // tokens_per_block
            end_block = match.tokens // tokens_per_block
            group_keys = keys[first_block // per_chunk : -(-end_block // per_chunk)]
            spans.append((group_idx, first_block, end_block, group_keys))
            all_keys.extend(group_keys)
        self.manager.prepare_load(all_keys, request.ctx)
        groups = []
        for group_idx, first_block, end_block, group_keys in spans:
            spec = self.manager.get_spec(group_keys).set_gpu_block_offset(first_block)
            gpu = GPULoadStoreSpec(gpu_blocks[group_idx][first_block:end_block])
            groups.append(GroupTransfer(gpu, spec))
        return self._register("load", req_id, all_keys, groups)

    # -- stores ---------------------------------------------------------------------
    def plan_store(
        self, req_id: str, num_computed_tokens: int, gpu_blocks: Sequence[Sequence[int]]
    ) -> TransferPlan | None:
        """Reserve and describe storing every newly full chunk up to
        ``num_computed_tokens``. Chunks already present, or refused because the primary is
        full of pinned data, are not stored (and not offered again)."""
        request = self._requests[req_id]
        wanted: list[tuple[int, int, OffloadKey]] = []
        for group_idx, keys in enumerate(request.keys):
            full = min(len(keys), num_computed_tokens // self.config.tokens_per_chunk(group_idx))
            for chunk_idx in range(request.stored_chunks[group_idx], full):
                wanted.append((group_idx, chunk_idx, keys[chunk_idx]))
            request.stored_chunks[group_idx] = max(request.stored_chunks[group_idx], full)
        if not wanted:
            return None
        # In token order across groups: a manager that can take only the leading keys (a
        # prompt longer than the primary) then keeps a prefix every group can load.
        wanted.sort(key=lambda w: ((w[1] + 1) * self.config.tokens_per_chunk(w[0]), w[0]))
        accepted = self.manager.prepare_store([key for _, _, key in wanted], request.ctx)
        if not accepted:
            return None
        accepted_set = set(accepted)
        per_chunk = self.config.blocks_per_chunk
        groups = []
        keys_in_job: list[OffloadKey] = []
        # One transfer per group, in group order (empty where a group stores nothing): the
        # worker reads a transfer's position as its group.
        for group_idx in range(len(self.config.groups)):
            chunks = [(c, k) for g, c, k in wanted if g == group_idx and k in accepted_set]
            blocks = gpu_blocks[group_idx]
            block_ids = [blocks[c * per_chunk + i] for c, _ in chunks for i in range(per_chunk)]
            group_keys = [k for _, k in chunks]
            keys_in_job.extend(group_keys)
            groups.append(
                GroupTransfer(GPULoadStoreSpec(block_ids), self.manager.get_spec(group_keys))
            )
        return self._register("store", req_id, keys_in_job, groups)

    # -- completions ----------------------------------------------------------------
    def _register(
        self,
        kind: Literal["load", "store"],
        req_id: str,
        keys: list[OffloadKey],
        groups: list[GroupTransfer],
    ) -> TransferPlan:
        plan = TransferPlan(next(self._job_ids), kind, req_id, tuple(keys), tuple(groups))
        self._jobs[plan.job_id] = (plan, self.manager.generation)
        return plan

    def complete(self, job_id: int, success: bool) -> TransferPlan:
        """Route a finished worker job back to the manager, with its generation: a job
        from before a reset frees only its own fenced memory (the manager forgot its keys,
        which may be reserved or pinned anew since)."""
        try:
            plan, generation = self._jobs.pop(job_id)
        except KeyError:
            raise UnknownKeyError(f"job {job_id} is not in flight") from None
        ctx = self._ctx_of(plan.req_id)
        if plan.kind == "load":
            self.manager.complete_load(plan.keys, ctx, generation=generation)
        else:
            self.manager.complete_store(plan.keys, ctx, success=success, generation=generation)
        if job_id in self._fenced_jobs:
            self._fenced_jobs.discard(job_id)
            if not self._fenced_jobs:
                self.manager.on_reset_flushed()
        return plan

    def _ctx_of(self, req_id: str) -> ReqContext:
        request = self._requests.get(req_id)
        return request.ctx if request is not None else ReqContext(req_id=req_id)

    def reset_cache(self) -> None:
        """Drop every chunk the manager can drop: jobs in flight still finish on the
        workers; the manager has forgotten their keys and fenced their memory, which each
        one's completion frees (it carries the job's older generation), and it hears
        ``on_reset_flushed`` when the last one finished (at once when none is in flight).
        Active requests store again from their first chunk."""
        self.manager.reset_cache()
        self._fenced_jobs.update(self._jobs)
        for request in self._requests.values():
            request.stored_chunks = [0] * len(request.stored_chunks)
        if not self._fenced_jobs:
            self.manager.on_reset_flushed()

    @property
    def jobs_in_flight(self) -> int:
        return len(self._jobs)

    def end_step(self, new_req_ids: Sequence[str] = ()) -> None:
        """End of a scheduler step: the manager flushes promotions and polls movers."""
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=tuple(new_req_ids)))
