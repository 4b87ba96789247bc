"""Tokens reused by vLLM's CPU manager and by kvtiers' CPU tier on the same traces.

Runs on each vLLM release kvtiers supports (0.32-0.34); the report names the one measured.

Each trace is a list of prompts (token ids); a prompt's keys are the chained hashes of its
full chunks of ``TOKENS_PER_CHUNK`` tokens. Every side replays a trace the way vLLM's
offloading connector drives a manager, one request at a time:

1. ``on_new_request`` with a request context that records each key's end-token position;
2. ``lookup`` from the head until the first miss: those chunks are reused;
3. ``prepare_load`` of the reused chunks and ``complete_load`` of them;
4. the rest stored ``STORES`` ways: in batches of ``STORE_BATCH`` chunks (a chunked
   prefill, one step each), or all at once (a prompt prefilled in one step); per store,
   ``prepare_store`` then ``complete_store`` of the accepted keys;
5. ``on_request_finished``. No ``touch``: vLLM's connector never calls it, and 0.34's
   managers have none.

A finished job's keys reach ``complete_load`` / ``complete_store`` as the installed
release's connector hands them (``route1.job_keys``): a set up to 0.33, a tuple in prefix
order from 0.34. vLLM's manager marks a stored job's chunks evictable in that order, so
its LRU and ARC see a request's chunks head first on 0.34 and in the set's order before.

A store larger than the room left is where the managers differ: vLLM stores none of it,
kvtiers' CPU tier the leading keys the free slots hold, evicting nothing for them;
``partial`` is kvtiers' tier with its previous rule (the one a tier staging for
write-through lower tiers keeps): the leading keys that fit, evicting for them.

Sides: ``vllm`` (``CPUOffloadingManager``), ``route1`` (the manager of a
``KVTiersOffloadingSpec`` over one ``cpu`` tier, called with vLLM's keys and contexts) and
``native`` (kvtiers' ``CpuTierManager`` with kvtiers' own contexts, which carry no
positions: keys go in head to tail and ``complete_store`` gets them in that order). Each
side holds the same number of chunks: 1-50% of the trace's distinct chunks, and 100%.

Traces: ``conversations`` (multi-turn conversations sharing system prompts, larger than
the demo's), ``demo-conversations`` (``kvtiers demo``'s own workload, whose longest prompt
outgrows the cache at 10%), ``system-prompt`` (many requests behind a few shared system
prompts), ``document-qa`` (questions over long documents picked with Zipf popularity) and
``scan-polluted`` (a hot set of shared prefixes, interrupted by long one-off prompts).

Reported: tokens reused as a share of all prompt tokens, per store mode, trace, capacity
and policy (``lru``, ``arc``; ``s3fifo`` for kvtiers only: vLLM has none), with kvtiers
minus vLLM in percentage points, and the trade against ``partial``. Then each of kvtiers'
ARC choices (``kvtiers/policies/arc.py``) against its alternative, natively, stores in
batches of 16: the same ARC with that one choice undone, and kvtiers' ARC as it was before
them all, so the rows show on which traces each choice wins. Then two tenants on one CPU
tier (``tenants:``, docs/tenants.md): a quiet tenant replays ``system-prompt`` while a
noisy neighbour sends ``NOISY_PER_QUIET`` one-off prompts of ``NOISY_TOKENS`` tokens
between its requests; the quiet tenant's tokens reused, alone,
beside the neighbour with no quotas, with the neighbour capped (``quota``) and with the
quiet tenant's share protected (``protected``), at capacities that are a share of the
quiet tenant's distinct chunks (``--tenants`` runs only this part, in about a
minute, and rewrites it into the report). Run from the repository root:
``.venv/bin/python benchmarks/bench_hit_rate.py [--quick] [--no-write] [--seeds N]``;
``lru`` and ``arc`` are checked again on the traces drawn with ``N`` other seeds (default
5). Writes ``benchmarks/results/hit_rate.md`` and ``hit_rate.json``; a report written over
one from another vLLM release keeps that release's summary in one line, and says whether
every count came out the same.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness import (
    bench_parser,
    from_document,
    machine_note,
    markdown_table,
    read_result,
    to_document,
    write_result,
)
from route1 import SLOT_BYTES, job_keys, route1_manager

from kvtiers.core.keys import make_offload_key
from kvtiers.core.manager import ReqContext
from kvtiers.engine.workload import WorkloadSpec, conversation_requests
from kvtiers.policies import ARCPolicy, EvictionPolicy, load_policy
from kvtiers.tiers.cpu.manager import CpuTierManager

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("tokens_per_chunk", "store_batch", "stores"),
    "tables": ("points", "tenants"),
}
TOKENS_PER_CHUNK = 32
STORE_BATCH = 16
#: How a request's chunks are stored: name → chunks per store (``None``: all at once).
STORES: dict[str, int | None] = {"batches of 16": STORE_BATCH, "whole prompt": None}
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
POLICIES = ("lru", "arc", "s3fifo")
VLLM_POLICIES = ("lru", "arc")
#: Seed ``n`` of a trace draws from its own seed plus ``SEED_STRIDE * n``.
SEED_STRIDE = 1000


# -- traces --------------------------------------------------------------------------------


def chunk_keys(tokens: Sequence[int]) -> list[bytes]:
    """The chained hash of each full chunk of ``tokens`` (group 0), head first."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - TOKENS_PER_CHUNK + 1, TOKENS_PER_CHUNK):
        block = np.asarray(tokens[start : start + TOKENS_PER_CHUNK], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


def _tokens(rng: np.random.Generator, count: int) -> list[int]:
    return [int(t) for t in rng.integers(0, 32000, size=count)]


def conversations(scale: int, seed: int = 0) -> list[list[int]]:
    spec = WorkloadSpec(
        conversations=12 * scale, system_prompts=4, turns=6, seed=1 + SEED_STRIDE * seed
    )
    return [list(request.token_ids) for request in conversation_requests(spec)]


def demo_conversations(scale: int, seed: int = 0) -> list[list[int]]:
    """``kvtiers demo``'s workload (its default ``WorkloadSpec``), at every scale."""
    spec = WorkloadSpec(seed=SEED_STRIDE * seed)
    return [list(request.token_ids) for request in conversation_requests(spec)]


def system_prompt(scale: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(2 + SEED_STRIDE * seed)
    systems = [_tokens(rng, int(rng.integers(1024, 2048))) for _ in range(6)]
    weights = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    prompts = []
    for _ in range(150 * scale):
        system = systems[int(rng.choice(len(systems), p=weights))]
        prompts.append(system + _tokens(rng, int(rng.integers(64, 512))))
    return prompts


def document_qa(scale: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(3 + SEED_STRIDE * seed)
    documents = [_tokens(rng, int(rng.integers(2048, 8192))) for _ in range(40 * scale)]
    ranks = np.arange(1, len(documents) + 1, dtype=np.float64)
    weights = ranks**-1.1
    weights /= weights.sum()
    prompts = []
    for _ in range(200 * scale):
        document = documents[int(rng.choice(len(documents), p=weights))]
        prompts.append(document + _tokens(rng, int(rng.integers(32, 128))))
    return prompts


def scan_polluted(scale: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(4 + SEED_STRIDE * seed)
    hot = [_tokens(rng, int(rng.integers(1024, 3072))) for _ in range(8)]
    prompts = []
    for index in range(240 * scale):
        if index % 12 == 11:  # a long prompt nobody asks again
            prompts.append(_tokens(rng, int(rng.integers(4096, 12288))))
        else:
            prompts.append(hot[int(rng.integers(0, len(hot)))] + _tokens(rng, 64))
    return prompts


TRACES: dict[str, Callable[[int, int], list[list[int]]]] = {
    "conversations": conversations,
    "demo-conversations": demo_conversations,
    "system-prompt": system_prompt,
    "document-qa": document_qa,
    "scan-polluted": scan_polluted,
}


# -- kvtiers' ARC with one choice undone --------------------------------------------------


class GhostToT2(ARCPolicy):
    """A re-stored ghost goes to T2, as in the ARC paper (it enters T1, then moves)."""

    def insert(self, key: Any) -> None:
        ghost = key in self._b1 or key in self._b2
        super().insert(key)
        if ghost:
            self.touch(key)


class StepPerChunk(ARCPolicy):
    """p moves one step per re-stored ghost, as in the ARC paper."""

    def insert(self, key: Any) -> None:
        self._grown = self._shrunk = False
        super().insert(key)


class NoShield(ARCPolicy):
    """A request's later stores may evict its own head."""

    shields_request_head = False


class T2Fallback(ARCPolicy):
    """The head is shielded, but T2 gives the victims when T1 holds only shielded keys (what
    vLLM's ARC does when T1 has no victim left)."""

    def evict(self, n: int, protected: Any = (), shielded: Any = ()) -> list[Any] | None:
        return super().evict(n, protected)

    def evictable(self, protected: Any = (), shielded: Any = ()) -> int:
        return super().evictable(protected)


class Before(GhostToT2, StepPerChunk, NoShield):
    """kvtiers' ARC before these choices: ghosts to T2, a step per chunk, no shield."""


#: Column → (the choice it undoes, the policy).
ABLATIONS: dict[str, tuple[str, type[EvictionPolicy]]] = {
    "ghost→T2": ("a re-stored ghost enters T1 (a store is not a use)", GhostToT2),
    "p per chunk": ("p moves one step each way per eviction round", StepPerChunk),
    "no shield": ("a running request's head is shielded from its own stores", NoShield),
    "T2 fallback": ("no T2 key is taken while T1 is over target and holds the head",
                    T2Fallback),
    "before": ("all four", Before),
}


# -- sides ---------------------------------------------------------------------------------


class Side:
    """One manager replaying requests the way vLLM's connector calls it."""

    name: str

    def context(self, req_id: str, keys: list[bytes]) -> Any:
        raise NotImplementedError

    def __init__(self, manager: Any, hit: Any) -> None:
        self.manager = manager
        self._hit = hit
        #: Chunks per store (``None``: a request's chunks in one store).
        self.batch: int | None = STORE_BATCH

    def replay(self, req_id: str, keys: list[bytes]) -> int:
        """Run one request; return how many of its chunks were reused."""
        manager = self.manager
        ctx = self.context(req_id, keys)
        manager.on_new_request(ctx)
        reused = 0
        for key in keys:
            if manager.lookup(key, ctx) is not self._hit:
                break
            reused += 1
        if reused:
            manager.prepare_load(keys[:reused], ctx)
            manager.complete_load(self.completed(keys[:reused]), ctx)
        batch = self.batch or max(len(keys) - reused, 1)
        for start in range(reused, len(keys), batch):
            self.store(keys[start : start + batch], ctx)
        manager.on_request_finished(ctx)
        return reused

    def completed(self, keys: list[bytes]) -> Any:
        """A job's keys as the caller hands them back."""
        raise NotImplementedError

    def store(self, keys: list[bytes], ctx: Any) -> None:
        out = self.manager.prepare_store(keys, ctx)
        if out is not None:
            self.manager.complete_store(self.completed(list(out.keys_to_store)), ctx)

    def shutdown(self) -> None:
        self.manager.shutdown()


class VllmSide(Side):
    """vLLM's ``CPUOffloadingManager`` (``vllm``) or kvtiers' route-1 manager (``route1``)."""

    def __init__(self, name: str, manager: Any) -> None:
        from vllm.v1.kv_offload import base as vbase

        super().__init__(manager, vbase.LookupResult.HIT)
        self.name = name
        self._vbase = vbase

    def context(self, req_id: str, keys: list[bytes]) -> Any:
        ctx = self._vbase.ReqContext(req_id=req_id)
        for index, key in enumerate(keys):
            ctx.set_offload_key_position(key, (index + 1) * TOKENS_PER_CHUNK)
        return ctx

    def completed(self, keys: list[bytes]) -> Any:
        return job_keys(keys)


class NativeSide(Side):
    """kvtiers' ``CpuTierManager`` with kvtiers' contexts (no positions)."""

    name = "native"

    def __init__(
        self, chunks: int, policy: str | type[EvictionPolicy], *, staging: bool = False
    ) -> None:
        from kvtiers.core.manager import LookupResult

        cls = load_policy(policy) if isinstance(policy, str) else policy
        super().__init__(CpuTierManager(chunks, SLOT_BYTES, cls(chunks)), LookupResult.HIT)
        # The rule of a tier staging for write-through lower tiers (``partial``).
        self.manager.staging = staging

    def context(self, req_id: str, keys: list[bytes]) -> Any:
        return ReqContext(req_id=req_id)

    def completed(self, keys: list[bytes]) -> Any:
        return keys

    def store(self, keys: list[bytes], ctx: Any) -> None:
        accepted = self.manager.prepare_store(keys, ctx)
        if accepted is not None:
            self.manager.complete_store(accepted, ctx)


def vllm_side(chunks: int, policy: str) -> Side:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return VllmSide("vllm", CPUOffloadingManager(chunks, cache_policy=policy))


def route1_side(chunks: int, policy: str) -> Side:
    """The manager of a ``KVTiersOffloadingSpec`` over one CPU tier of ``chunks`` slots."""
    return VllmSide(
        "route1", route1_manager(chunks, policy, blocks_per_chunk=2, label="hitrate")
    )


# -- two tenants on one cpu tier ----------------------------------------------------------
#: One-off prompts the noisy tenant sends between two of the quiet tenant's requests.
NOISY_PER_QUIET = 2
NOISY_TOKENS = 2048
#: The cpu tier's chunks as a share of the quiet tenant's distinct chunks.
TENANT_FRACTIONS = (0.25, 0.5, 1.0)
#: What the noisy tenant may hold (``quota``) and what of the quiet tenant's its stores
#: never evict (``protected``), as shares of the tier.
NOISY_QUOTA = 0.25
QUIET_PROTECTED = 0.75
TENANT_SETTINGS = ("alone", "no quotas", "noisy quota", "quiet protected")


def two_tenants(seed: int = 0) -> list[tuple[str, list[int]]]:
    """``(tenant, prompt)`` in arrival order: ``system-prompt`` (scale 1) for the quiet
    tenant, each request followed by the noisy tenant's one-off prompts."""
    rng = np.random.default_rng(5 + SEED_STRIDE * seed)
    arrivals: list[tuple[str, list[int]]] = []
    for prompt in system_prompt(1, seed):
        arrivals.append(("quiet", prompt))
        arrivals.extend(("noisy", _tokens(rng, NOISY_TOKENS)) for _ in range(NOISY_PER_QUIET))
    return arrivals


class TenantSide(Side):
    """kvtiers' stack of one ``lru`` cpu tier of ``chunks`` slots behind a ``tenants:``
    section; each request's tenant named in its ``kv_transfer_params``."""

    name = "tenants"

    def __init__(self, chunks: int, tenants: dict[str, Any]) -> None:
        from kvtiers.core.manager import LookupResult
        from kvtiers.stack.builder import load_stack
        from kvtiers.testing.objects import offloading_config

        self.stack = load_stack(
            {"tiers": [{"kind": "cpu", "capacity": chunks * SLOT_BYTES, "policy": "lru"}],
             "tenants": tenants},
            offloading_config((SLOT_BYTES,)),
        )
        assert self.stack.tenants is not None
        super().__init__(self.stack.tenants, LookupResult.HIT)

    def context(self, req_id: str, keys: list[bytes]) -> Any:
        return ReqContext(req_id=req_id, kv_transfer_params={
            "kvtiers_tenant": req_id.partition("-")[0]})

    def completed(self, keys: list[bytes]) -> Any:
        return keys

    def store(self, keys: list[bytes], ctx: Any) -> None:
        accepted = self.manager.prepare_store(keys, ctx)
        if accepted:
            self.manager.complete_store(accepted, ctx)

    def shutdown(self) -> None:
        self.stack.shutdown()


def tenant_section(setting: str, chunks: int) -> dict[str, Any]:
    """The ``tenants:`` section of one setting for a tier of ``chunks`` slots."""
    quiet: dict[str, Any] = {"name": "quiet"}
    noisy: dict[str, Any] = {"name": "noisy"}
    if setting == "noisy quota":
        noisy["quota"] = {"cpu": max(1, round(chunks * NOISY_QUOTA)) * SLOT_BYTES}
    elif setting == "quiet protected":
        quiet["protected"] = {"cpu": max(1, round(chunks * QUIET_PROTECTED)) * SLOT_BYTES}
    return {"members": [quiet, noisy]}


def run_tenants(seed: int = 0) -> list[dict[str, Any]]:
    """The quiet tenant's tokens reused (%) per capacity and setting."""
    arrivals = [(tenant, chunk_keys(prompt)) for tenant, prompt in two_tenants(seed)]
    quiet_keys = [keys for tenant, keys in arrivals if tenant == "quiet"]
    distinct = len({key for keys in quiet_keys for key in keys})
    total = sum(map(len, quiet_keys))
    rows = []
    for fraction in TENANT_FRACTIONS:
        chunks = max(1, round(distinct * fraction))
        reused: dict[str, float] = {}
        for setting in TENANT_SETTINGS:
            side = TenantSide(chunks, tenant_section(setting, chunks))
            side.batch = STORE_BATCH
            hits = 0
            for index, (tenant, keys) in enumerate(arrivals):
                if tenant == "noisy" and setting == "alone":
                    continue
                got = side.replay(f"{tenant}-{index}", keys)
                hits += got if tenant == "quiet" else 0
            side.shutdown()
            reused[setting] = 100.0 * hits / total
        rows.append({"fraction": fraction, "chunks": chunks, "quiet_reused": reused})
        print(f"tenants: {fraction:.0%} done", flush=True)
    return rows


def render_tenants(rows: list[dict[str, Any]]) -> str:
    """The report's section on two tenants (from its heading to the end of the page)."""
    table = markdown_table(
        ["capacity", "chunks", *TENANT_SETTINGS],
        [[f"{row['fraction']:.0%}", str(row["chunks"]),
          *(f"{row['quiet_reused'][s]:.1f}" for s in TENANT_SETTINGS)] for row in rows],
    )
    return "\n".join([
        TENANTS_HEADING,
        "",
        "The quiet tenant's share of prompt tokens reused (%) on `system-prompt` (scale 1), "
        f"one `lru` cpu tier; between two of its requests the noisy tenant sends "
        f"{NOISY_PER_QUIET} one-off prompts of {NOISY_TOKENS} tokens, stored in batches of "
        f"{STORE_BATCH}. Capacity: a share of the quiet tenant's distinct chunks. `alone`: no "
        f"neighbour; `noisy quota`: the neighbour capped at {NOISY_QUOTA:.0%} of the tier; "
        f"`quiet protected`: {QUIET_PROTECTED:.0%} of the tier kept for the quiet tenant. "
        "Counts only (the machine's load does not change them).",
        "",
        *table,
        "",
    ])


TENANTS_HEADING = "## Two tenants: a quiet tenant beside a noisy neighbour"


def with_tenants(page: str, rows: list[dict[str, Any]]) -> str:
    """``page`` with its two-tenant section replaced by (or, without one, followed by)
    the one for ``rows``."""
    head, _, _ = page.partition(TENANTS_HEADING)
    return head.rstrip("\n") + "\n\n" + render_tenants(rows)


def rerun_tenants(out: Path, write: bool) -> None:
    """``--tenants``: measure the two-tenant part and rewrite it into the report."""
    rows = run_tenants()
    print(render_tenants(rows))
    if not write:
        return
    doc = read_result(out / "hit_rate.json")
    doc["tables"]["tenants"] = rows
    page = (out / "hit_rate.md").read_text()
    write_result(doc, out, "hit_rate", with_tenants(page, rows))


# -- the run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    store: str
    trace: str
    policy: str
    fraction: float
    chunks: int
    reused: dict[str, float]  # side (or ablation) -> share of prompt tokens reused, in percent


def replay(side: Side, requests: list[list[bytes]], batch: int | None) -> float:
    side.batch = batch
    reused = 0
    total = 0
    for index, keys in enumerate(requests):
        reused += side.replay(f"r{index}", keys)
        total += len(keys)
    side.shutdown()
    return 100.0 * reused / total if total else 0.0


def run(
    scale: int, traces: Sequence[str], seed: int = 0, policies: Sequence[str] = POLICIES
) -> list[Point]:
    points = []
    for store, batch in STORES.items():
        for trace in traces:
            requests = [chunk_keys(prompt) for prompt in TRACES[trace](scale, seed)]
            distinct = len({key for keys in requests for key in keys})
            for policy in policies:
                for fraction in FRACTIONS:
                    chunks = max(1, round(distinct * fraction))
                    reused = {
                        "native": replay(NativeSide(chunks, policy), requests, batch),
                        "partial": replay(
                            NativeSide(chunks, policy, staging=True), requests, batch
                        ),
                    }
                    if policy in VLLM_POLICIES:
                        reused["vllm"] = replay(vllm_side(chunks, policy), requests, batch)
                        reused["route1"] = replay(route1_side(chunks, policy), requests, batch)
                    if policy == "arc" and batch == STORE_BATCH:
                        for column, (_, cls) in ABLATIONS.items():
                            reused[column] = replay(NativeSide(chunks, cls), requests, batch)
                    points.append(Point(store, trace, policy, fraction, chunks, reused))
                print(f"{store}: {trace} {policy} (seed {seed}): done", flush=True)
    return points


def trace_sizes(scale: int, traces: Sequence[str]) -> dict[str, dict[str, int]]:
    sizes = {}
    for trace in traces:
        requests = [chunk_keys(prompt) for prompt in TRACES[trace](scale, 0)]
        sizes[trace] = {
            "requests": len(requests),
            "chunks": sum(map(len, requests)),
            "distinct_chunks": len({key for keys in requests for key in keys}),
            "longest": max(map(len, requests)),
        }
    return sizes


def render(
    points: list[Point],
    sizes: dict[str, dict[str, int]],
    note: dict[str, str],
    other_seeds: dict[int, list[Point]],
) -> str:
    lines = [
        f"# Tokens reused: vLLM {note['vllm']}'s CPU manager vs kvtiers' CPU tier",
        "",
        f"Machine: {note['cpu']}, {note['cores']} cores, Python {note['python']}, vLLM "
        f"{note['vllm']}; {note['date']}; `{note['command']}`. Counts only: the machine's "
        "load does not change them.",
        *([f"Previous run: {note['previous']}"] if note.get("previous") else []),
        "",
        f"Chunks of {TOKENS_PER_CHUNK} tokens; a request's chunks stored in batches of "
        f"{STORE_BATCH} (a chunked prefill) or all in one store (a prompt prefilled in one "
        "step); capacity as a share of the trace's distinct chunks. Share of prompt tokens "
        "reused (%); `Δ` = kvtiers minus vLLM in percentage points. `partial` is kvtiers' "
        "tier with its previous rule for a store larger than the room left (the leading "
        "keys that fit, evicting for them, as a tier staging for write-through lower tiers "
        "still does); kvtiers' tier now takes only the free slots for them and evicts "
        "nothing, vLLM stores none of them.",
        "",
        *markdown_table(
            ["trace", "requests", "chunks", "distinct chunks", "longest prompt (chunks)"],
            ([trace, *(f"{size[key]:,}" for key in ("requests", "chunks", "distinct_chunks",
                                                    "longest"))]
             for trace, size in sizes.items())),
    ]
    for store in STORES:
        for policy in POLICIES:
            lines += ["", f"## {policy}, {store}", ""]
            rows = [p for p in points if p.policy == policy and p.store == store]
            if policy in VLLM_POLICIES:
                lines += markdown_table(
                    ["trace", "capacity", "chunks", "vLLM", "route1", "Δ route1", "native",
                     "Δ native", "partial", "Δ partial"],
                    ([p.trace, f"{p.fraction:.0%}", f"{p.chunks:,}", f"{p.reused['vllm']:.1f}",
                      *(cell for side in ("route1", "native", "partial") for cell in (
                          f"{p.reused[side]:.1f}",
                          f"{p.reused[side] - p.reused['vllm']:+.1f}"))]
                     for p in rows))
            else:
                lines += markdown_table(
                    ["trace", "capacity", "chunks", "native", "partial"],
                    ([p.trace, f"{p.fraction:.0%}", f"{p.chunks:,}", f"{p.reused['native']:.1f}",
                      f"{p.reused['partial']:.1f}"] for p in rows))
    lines += ["", "## Against the target (kvtiers ≥ vLLM at every point, lru and arc)", ""]
    lines += summary(points)
    lines += ["", "## The trade: a store larger than the room left", "", *trade(points)]
    lines += ["", "## Where the policies differ", "", *DIFFERENCES]
    lines += [
        "",
        f"## kvtiers' ARC: each choice against its alternative (native, batches of "
        f"{STORE_BATCH})",
        "",
    ]
    lines += ablations(points)
    if other_seeds:
        lines += [
            "",
            "## The same traces drawn with other seeds (lru and arc)",
            "",
            f"Seed n draws each trace from its own seed plus {SEED_STRIDE} times n: other "
            "prompts, same shapes, same capacities as shares of the distinct chunks. Last "
            "line of each: the points where kvtiers' ARC with one choice undone (native, "
            f"batches of {STORE_BATCH}) is below vLLM's.",
            "",
        ]
        for seed, seed_points in other_seeds.items():
            lines += [f"- seed {seed}: " + line[2:] for line in summary(seed_points)]
            arc = ablated(seed_points)
            below = {
                column: sum(1 for p in arc if p.reused[column] - p.reused["vllm"] < -0.05)
                for column in ABLATIONS
            }
            lines.append(
                f"- seed {seed}: points below vLLM with one arc choice undone: "
                + ", ".join(f"`{column}` {count}" for column, count in below.items())
            )
    return "\n".join(lines) + "\n"


def ablated(points: list[Point]) -> list[Point]:
    """The arc points that ran the ablations (stores in batches of ``STORE_BATCH``)."""
    return [p for p in points if p.policy == "arc" and ABLATIONS.keys() <= p.reused.keys()]


def ablations(points: list[Point]) -> list[str]:
    """The arc rows again, each column kvtiers' ARC with one choice undone, in percentage
    points against kvtiers' ARC as it is (negative: the choice wins there)."""
    columns = list(ABLATIONS)
    lines = [
        "Each column undoes one choice of `kvtiers/policies/arc.py` (`before`: all of them, "
        "kvtiers' ARC before this cycle) and gives its reuse minus kvtiers' ARC's: "
        "negative where the choice wins.",
        "",
    ]
    arc = ablated(points)
    lines += markdown_table(
        ["trace", "capacity", "vLLM", "kvtiers", *columns],
        ([p.trace, f"{p.fraction:.0%}", f"{p.reused['vllm']:.1f}", f"{p.reused['native']:.1f}",
          *(f"{p.reused[c] - p.reused['native']:+.1f}" for c in columns)] for p in arc))
    lines.append("")
    for column, (choice, _) in ABLATIONS.items():
        deltas = [(p.reused[column] - p.reused["native"], p) for p in arc]
        wins = [p for d, p in deltas if d < -0.05]
        losses = [(d, p) for d, p in deltas if d > 0.05]
        below = sum(1 for p in arc if p.reused[column] - p.reused["vllm"] < -0.05)
        text = (
            f"- `{column}` undoes: {choice}. The choice wins at {len(wins)} points "
            f"({', '.join(sorted({p.trace for p in wins})) or 'none'}), loses at "
            f"{len(losses)}"
        )
        if losses:
            text += " (" + ", ".join(f"{p.trace} {p.fraction:.0%} {d:+.1f}" for d, p in losses)
            text += ")"
        mean = sum(d for d, _ in deltas) / len(deltas)
        text += f"; mean {mean:+.2f} pp; without it {below}/{len(arc)} points are below vLLM."
        lines.append(text)
    return lines


def trade(points: list[Point]) -> list[str]:
    """Per store mode and policy: kvtiers' tier (native) against its previous rule
    (``partial``), by trace: what refusing to evict for a store larger than the room left
    wins and loses."""
    lines = [
        "kvtiers' tier (native) minus `partial` (its previous rule), in percentage points: "
        "positive where taking only the free slots for a store larger than the room left "
        "wins, negative where evicting for its leading keys did.",
        "",
    ]
    cells: list[list[object]] = []
    for store in STORES:
        for policy in POLICIES:
            for trace in dict.fromkeys(p.trace for p in points):
                deltas = [
                    p.reused["native"] - p.reused["partial"]
                    for p in points
                    if p.store == store and p.policy == policy and p.trace == trace
                ]
                if not deltas:
                    continue
                won = sum(1 for d in deltas if d > 0.05)
                lost = sum(1 for d in deltas if d < -0.05)
                cells.append([store, policy, trace, f"{sum(deltas) / len(deltas):+.2f}",
                              f"{max(deltas):+.1f}", f"{min(deltas):+.1f}", f"{won} / {lost}"])
    return lines + markdown_table(
        ["store", "policy", "trace", "mean", "best", "worst", "points won / lost"], cells,
        align="lllrrrr")


DIFFERENCES = [
    "- A store larger than the room left (its keys outnumber the free slots and what may "
    "be evicted for them): vLLM stores none of it; kvtiers stores its leading keys in the "
    "free slots and evicts nothing for them, since the chunks it would evict are what the "
    "next requests reuse, and the head of a prompt that does not fit is seldom asked "
    "again before it would be evicted itself (the trade above). A tier staging for "
    "write-through lower tiers still evicts for them (`partial`): there what it evicts "
    "lives on below, and the head reaches the tiers below.",
    "- LRU: both order a request's keys tail first and refresh them when it finishes; "
    "vLLM ranks a running request's keys above older ones, kvtiers shields them from that "
    "request's own later stores, so when a prompt outgrows the cache kvtiers keeps its "
    "head (what a later prompt can reuse) and may refuse the rest.",
    "- ARC: both count a request's reuse when it finishes (kvtiers at load for a request "
    "never announced), and a re-stored ghost enters T1 on both sides (a store is not a "
    "use; kvtiers sent it to T2 before this cycle). They differ on purpose: kvtiers shields "
    "a running request's head from its own stores, as its LRU does, and while T1 is over "
    "its target and holds that head it stores no more of the prompt rather than evict T2 "
    "(vLLM evicts T2 when T1 has no victim left); kvtiers moves p one step each way per "
    "eviction round, vLLM one step per re-stored ghost (at `prepare_store`). Smaller: "
    "kvtiers evicts T1 when it is larger than p (vLLM: at least as large) and bounds its "
    "ghosts as the ARC paper does (T1+B1 and all four lists; vLLM each ghost list to the "
    "capacity). The ablation section shows on which traces each of kvtiers' choices wins. "
    "With whole prompts stored at once there is one eviction round per request, so p moves "
    "once per request: on document-qa at 50% drawn with seed 1 that leaves kvtiers 0.9 pp "
    "below vLLM's ARC; p moved per re-stored chunk, as vLLM moves it, closes that point but "
    "falls below vLLM at 12 of the 210 whole-prompt arc points of the six seeds (per "
    "round: 1).",
]


def summary(points: list[Point]) -> list[str]:
    lines = []
    for store in STORES:
        for policy in VLLM_POLICIES:
            for side in ("route1", "native", "partial"):
                deltas = [
                    (p.reused[side] - p.reused["vllm"], p)
                    for p in points
                    if p.policy == policy and p.store == store
                ]
                if not deltas:
                    continue
                below = [(d, p) for d, p in deltas if d < -0.05]
                mean = sum(d for d, _ in deltas) / len(deltas)
                worst, where = min(deltas, key=lambda item: item[0])
                text = (
                    f"- {store}, {policy} {side}: mean {mean:+.2f} pp, worst {worst:+.1f} pp "
                    f"({where.trace} at {where.fraction:.0%}); "
                    f"{len(deltas) - len(below)}/{len(deltas)} points at or above vLLM"
                )
                if below:
                    text += "; below: " + ", ".join(
                        f"{p.trace} {p.fraction:.0%} ({d:+.1f})" for d, p in below
                    )
                lines.append(text)
    return lines


def interpreter() -> str:
    """The Python that runs this, as the report's command names it (relative to the
    repository root when it lives there, e.g. ``.venv-vllm34/bin/python``)."""
    path = Path(sys.executable)
    root = Path(__file__).resolve().parent.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def previous_note(path: Path, vllm_version: str, payload: dict[str, Any]) -> str | None:
    """What to say of the report at ``path`` that a new one (``payload``, as written to
    JSON) replaces: route 1 against vLLM in one line when it measured another vLLM release
    (or none named: 0.33.0 wrote no version), and whether every count is the same; else
    the line it carried itself. A note converted from before the schema is read as it was."""
    try:
        old = from_document(read_result(path))
        machine = old["machine"].get("original", old["machine"])
        old_version = machine.get("vllm", "0.33.0")
        if old_version == vllm_version:
            carried = machine.get("previous")
            return str(carried) if carried else None
        points = [p for p in old["points"] if p["policy"] in VLLM_POLICIES]
        seeds = [p for ps in old.get("other_seeds", {}).values() for p in ps]
        same = (old["points"] == payload["points"]
                and old.get("other_seeds") == payload["other_seeds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None

    def at_or_above(group: list[dict[str, Any]]) -> str:
        deltas = [p["reused"]["route1"] - p["reused"]["vllm"] for p in group]
        below = sum(d < -0.05 for d in deltas)
        return f"{len(deltas) - below}/{len(deltas)} (worst {min(deltas, default=0):+.1f} pp)"

    return (
        f"vLLM {old_version}, {machine.get('date', '?')}: route 1 at or above vLLM at "
        f"{at_or_above(points)} points, at {at_or_above(seeds)} on the other seeds; "
        + ("every count of every side the same as here." if same
           else "git history holds its tables.")
    )


def main() -> None:
    parser = bench_parser(__doc__, quick="smaller traces")
    parser.add_argument("--trace", choices=sorted(TRACES), nargs="+", help="default: all")
    parser.add_argument(
        "--seeds", type=int, default=5, help="other trace seeds to check lru and arc on"
    )
    parser.add_argument("--tenants", action="store_true",
                        help="only the two-tenant part, rewritten into the report")
    args = parser.parse_args()
    if args.tenants:
        rerun_tenants(args.out, not (args.quick or args.no_write))
        return
    scale = 1 if args.quick else 2
    traces = args.trace or list(TRACES)
    started = time.perf_counter()
    points = run(scale, traces)
    tenants = run_tenants()
    other_seeds = {
        seed: run(scale, traces, seed, policies=VLLM_POLICIES)
        for seed in range(1, args.seeds + 1)
    }
    command = f"{interpreter()} benchmarks/bench_hit_rate.py" + (
        " --quick" if args.quick else ""
    )
    import vllm

    note = machine_note(vllm=str(vllm.__version__), command=command)
    name = "hit_rate"
    payload = {
        "machine": note,
        "tokens_per_chunk": TOKENS_PER_CHUNK,
        "store_batch": STORE_BATCH,
        "stores": STORES,
        "points": [p.__dict__ for p in points],
        "tenants": tenants,
        "other_seeds": {
            str(seed): [p.__dict__ for p in seed_points]
            for seed, seed_points in other_seeds.items()
        },
    }
    # Compared as they read back from JSON (tuples become lists, keys strings).
    previous = previous_note(args.out / f"{name}.json", note["vllm"],
                             json.loads(json.dumps(payload)))
    if previous:
        note["previous"] = previous
    report = with_tenants(render(points, trace_sizes(scale, traces), note, other_seeds),
                          tenants)
    print(report)
    print(f"({time.perf_counter() - started:.0f} s)")
    if not (args.quick or args.no_write):
        write_result(to_document("hit_rate", payload, **LAYOUT), args.out, name, report)


if __name__ == "__main__":
    main()
