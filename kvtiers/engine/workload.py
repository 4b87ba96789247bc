"""Synthetic serving workloads: multi-turn conversations that share system prompts.

Each conversation starts from one of a few system prompts; every turn's prompt is the
whole conversation so far plus a new user message, so consecutive turns share ever longer
prefixes and conversations share their system prompt. Everything is derived from a seed,
so a workload is the same in every process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of a conversation workload (token counts are inclusive ranges)."""

    conversations: int = 16
    system_prompts: int = 3
    turns: int = 3
    system_tokens: tuple[int, int] = (512, 1024)
    user_tokens: tuple[int, int] = (48, 160)
    reply_tokens: tuple[int, int] = (48, 160)
    vocab_size: int = 32000
    seed: int = 0


@dataclass(frozen=True)
class Request:
    """One prompt to prefill: ``conversation`` and ``turn`` say where it came from."""

    req_id: str
    token_ids: tuple[int, ...]
    conversation: int
    turn: int


def conversation_requests(spec: WorkloadSpec) -> list[Request]:
    """The workload's prompts, turn by turn, conversations interleaved within a turn."""
    rng = np.random.default_rng(spec.seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        count = int(rng.integers(bounds[0], bounds[1] + 1))
        return [int(t) for t in rng.integers(0, spec.vocab_size, size=count)]

    systems = [tokens(spec.system_tokens) for _ in range(spec.system_prompts)]
    histories = [list(systems[c % spec.system_prompts]) for c in range(spec.conversations)]
    requests = []
    for turn in range(spec.turns):
        for conversation in range(spec.conversations):
            histories[conversation] += tokens(spec.user_tokens)
            requests.append(Request(f"c{conversation}t{turn}", tuple(histories[conversation]),
                                    conversation, turn))
            histories[conversation] += tokens(spec.reply_tokens)
    return requests
