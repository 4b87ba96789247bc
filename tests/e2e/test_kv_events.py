"""What a KV-cache-aware router sees of a cpu -> file -> s3 stack: vLLM's own ZMQ publisher
(``kv_events_config``) on a loopback port, a subscriber, and vLLM's event classes.

One engine process runs two engines (:mod:`tests.e2e.events_run`), both with route 1
through ``KVTiersConnector`` over a cpu tier of 8 chunks, a file tier of 10 and an s3 tier
of 15 (the session's moto server; both name their medium, ``event_medium``), chunks of 2
blocks of 32 tokens:

* ``events``: three prompts of 4 chunks stored (every tier evicts); the GPU prefix cache
  reset and the first prompt asked again (promoted from the file and s3 tiers); the file
  tier's namespace made unwritable and a fourth prompt stored (its cascade to the file
  tier fails); ``reset_prefix_cache(reset_connector=True)``; a fifth prompt;
* ``restart``: the same stack, so the file and s3 tiers start with what they hold; one
  prompt asked again.

The subscriber's payloads are decoded here with vLLM's ``KVEventBatch`` (msgspec), and a
router's view is rebuilt from them: per tier (medium and ownership) the chunks announced
stored and not removed, a chunk known by its last block hash (the chunk's key). After
every phase that view must be exactly what each tier holds, every announcement must be a
tier's (medium, locality, ownership), every store of the first engine self-describing
(block size, one hash per block, the tokens), and the sequence numbers 0, 1, 2, ...
"""

from __future__ import annotations

import base64
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.e2e.conftest import ENGINE_ENV, PROCESS_TIMEOUT_S, result
from tests.e2e.tiny_model import SPECIALS, VOCAB

BLOCK = 32
BLOCKS_PER_CHUNK = 2
CHUNKS_PER_PROMPT = 4
PROMPT_TOKENS = BLOCK * BLOCKS_PER_CHUNK * CHUNKS_PER_PROMPT
#: A chunk of the tiny model: 2 layers x (K, V) x 2 KV heads x 32 dims x 4 B per token.
CHUNK_BYTES = 2 * 2 * 2 * 32 * 4 * BLOCK * BLOCKS_PER_CHUNK
BLOB_BYTES = 4096 + CHUNK_BYTES
TOPIC = "kvtiers-e2e"
#: (medium, locality, ownership) of each tier's announcements: the file and s3 tiers name
#: their media (``event_medium``, renamed by ``KVTiersConnector``); the cpu tier keeps
#: vLLM's.
TIERS = {
    "cpu": ("CPU", "LOCAL", None),
    "file": ("shared_storage", "LOCAL", "file"),
    "s3": ("object_store", "REMOTE", "s3"),
}
BY_SOURCE = {(medium, owner): name for name, (medium, _, owner) in TIERS.items()}

pytestmark = pytest.mark.timeout(PROCESS_TIMEOUT_S + 60)


def _prompt(seed: int) -> list[int]:
    rng = random.Random(1000 + seed)
    return [rng.randrange(len(SPECIALS), VOCAB) for _ in range(PROMPT_TOKENS)]


PROMPTS = [_prompt(i) for i in range(5)]


def _generate(name: str, *prompts: int) -> dict[str, Any]:
    return {"name": name, "do": "generate", "prompts": [PROMPTS[i] for i in prompts],
            "max_tokens": 2}


def _stack(root: Path, s3: tuple[str, str]) -> dict[str, Any]:
    endpoint, bucket = s3
    return {"tiers": [
        {"kind": "cpu", "capacity": f"{8 * CHUNK_BYTES // 1024}KiB"},
        {"kind": "file", "root": str(root), "threads": 2,
         "capacity": f"{10 * BLOB_BYTES // 1024}KiB", "event_medium": TIERS["file"][0]},
        {"kind": "s3", "bucket": bucket, "prefix": "events", "endpoint_url": endpoint,
         "threads": 2, "capacity": f"{15 * BLOB_BYTES // 1024}KiB",
         "event_medium": TIERS["s3"][0]},
    ]}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, model_dir: Path,
            s3_bucket: tuple[str, str]) -> dict[str, Any]:
    import json
    import os
    import subprocess
    import sys

    workdir = tmp_path_factory.mktemp("kv-events")
    root = workdir / "root"
    common = {"model": str(model_dir), "dtype": "float32", "block_size": BLOCK,
              "max_model_len": 1024, "stack": _stack(root, s3_bucket),
              "extra_config": {"blocks_per_chunk": BLOCKS_PER_CHUNK},
              "connector": "KVTiersConnector"}
    plan = {
        "out": str(workdir / "results.json"),
        "engines": [
            {"name": "events", **common, "phases": [
                _generate("store", 0, 1, 2),
                {"name": "gpu_reset", "do": "reset_gpu"},
                _generate("promote", 0),
                {"name": "block", "do": "block", "root": str(root)},
                _generate("failed_cascade", 3),
                {"name": "unblock", "do": "unblock", "root": str(root)},
                {"name": "reset", "do": "reset_all"},
                _generate("after_reset", 4),
            ]},
            {"name": "restart", **common, "phases": [
                {"name": "start", "do": "idle"},
                _generate("promote_again", 1),
            ]},
        ],
    }
    (workdir / "plan.json").write_text(json.dumps(plan))
    log = workdir / "engines.log"
    with log.open("w") as sink:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.events_run", str(workdir / "plan.json")],
            cwd=Path(__file__).resolve().parents[2], env={**os.environ, **ENGINE_ENV},
            stdout=sink, stderr=subprocess.STDOUT, timeout=PROCESS_TIMEOUT_S, check=False,
        )
    out = workdir / "results.json"
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results["_process"] = {"returncode": proc.returncode, "log": str(log)}
    return results


# -- decoding, as a router does ------------------------------------------------------------
def _batches(phase: dict[str, Any]) -> list[tuple[str, int, Any]]:
    """(topic, sequence number, decoded ``KVEventBatch``) of each message of a phase."""
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [(m["topic"], m["seq"], decoder.decode(base64.b64decode(m["payload"])))
            for m in phase["messages"]]


def _event_hash(key_hex: str) -> Any:
    """The hash a tier's key (block hash + 4-byte group) is published as."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    return maybe_convert_block_hash(BlockHash(bytes.fromhex(key_hex)[:-4]))


@dataclass
class Router:
    """A router's view of one engine's offloaded tiers, rebuilt from its events: per
    tier, each live chunk by its last block hash, with the block hashes it announced."""

    chunks: dict[str, dict[Any, tuple[Any, ...]]] = field(
        default_factory=lambda: defaultdict(dict))
    stores: list[tuple[str, int, Any]] = field(default_factory=list)
    removals: list[tuple[str, int, Any]] = field(default_factory=list)
    cleared: list[int] = field(default_factory=list)
    gpu_stored: dict[Any, list[int]] = field(default_factory=lambda: defaultdict(list))

    def apply(self, seq: int, event: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        if isinstance(event, AllBlocksCleared):
            self.cleared.append(seq)
            return
        if event.medium == "GPU":
            if isinstance(event, BlockStored):
                for block_hash in event.block_hashes:
                    self.gpu_stored[block_hash].append(seq)
            return
        tier = BY_SOURCE[(event.medium, event.ownership)]
        assert (event.medium, event.locality, event.ownership) == TIERS[tier], event
        live = self.chunks[tier]
        if isinstance(event, BlockStored):
            key = event.block_hashes[-1]
            assert key not in live, f"{tier}: a second announcement of a live chunk: {event}"
            live[key] = tuple(event.block_hashes)
            self.stores.append((tier, seq, event))
        elif isinstance(event, BlockRemoved):
            named = [h for h in event.block_hashes if h in live]
            assert named, f"{tier}: a removal of chunks never announced: {event}"
            for block_hash in named:
                del live[block_hash]
            self.removals.append((tier, seq, event))

    def view(self) -> dict[str, set[Any]]:
        return {tier: set(self.chunks[tier]) for tier in TIERS}


def _replay(res: dict[str, Any]) -> list[tuple[str, Router, dict[str, set[Any]], list[int]]]:
    """Each phase's name, the router after it, the tiers' holdings then and its sequence
    numbers, checking the router's view against the holdings phase by phase."""
    router = Router()
    out = []
    for phase in res["phases"]:
        seqs = []
        for topic, seq, batch in _batches(phase):
            assert topic == TOPIC
            seqs.append(seq)
            for event in batch.events:
                router.apply(seq, event)
        held = {tier: {_event_hash(k) for k in keys} for tier, keys in phase["held"].items()}
        assert router.view() == held, f"after {phase['name']}: the router's view differs"
        out.append((phase["name"], router, held, seqs))
    return out


# -- the checks ----------------------------------------------------------------------------
def test_the_router_sees_exactly_what_each_tier_holds_after_every_phase(
    engines: dict[str, Any],
) -> None:
    for name in ("events", "restart"):
        phases = _replay(result(engines, name))
        seqs = [seq for *_, phase_seqs in phases for seq in phase_seqs]
        assert seqs == list(range(len(seqs))), f"{name}: sequence numbers {seqs}"
        final = phases[-1][2]
        assert all(final[tier] for tier in TIERS), f"{name}: a tier ends empty: {final}"


def test_every_tier_announces_stores_with_the_chunks_stride_and_removals_on_eviction(
    engines: dict[str, Any],
) -> None:
    res = result(engines, "events")
    router = _replay(res)[-1][1]
    for tier in TIERS:
        stored = [event for t, _, event in router.stores if t == tier]
        assert stored, f"no store announced for the {tier} tier"
        for event in stored:
            # Self-describing: one hash per block, the chunk's tokens, the block size.
            assert event.block_size == BLOCK, event
            assert len(event.block_hashes) == BLOCKS_PER_CHUNK, event
            assert len(event.token_ids) == BLOCK * BLOCKS_PER_CHUNK, event
        assert any(t == tier for t, _, _ in router.removals), f"the {tier} tier never evicted"
    kv = res["kvtiers"]
    assert all(kv[f"{tier}.evictions"] > 0 for tier in TIERS), kv


def test_promotions_are_announced_as_they_land_before_the_gpu_holds_them(
    engines: dict[str, Any],
) -> None:
    phases = _replay(result(engines, "events"))
    [(_, router, _, seqs)] = [p for p in phases if p[0] == "promote"]
    promoted = [(seq, event) for tier, seq, event in router.stores
                if tier == "cpu" and seq in seqs]
    first = {_event_hash(k) for k in result(engines, "events")["phases"][0]["held"]["cpu"]}
    keys = {event.block_hashes[-1] for _, event in promoted}
    assert len(keys) == CHUNKS_PER_PROMPT and not keys & first  # the prompt evicted first
    for seq, event in promoted:
        assert event.block_size == BLOCK and len(event.token_ids) == BLOCK * BLOCKS_PER_CHUNK
        # The GPU holds the block once it was loaded from the CPU tier: after the
        # promotion's announcement, in this phase (the GPU cache was reset before it).
        gpu = [s for s in router.gpu_stored[event.block_hashes[-1]] if s in seqs]
        assert gpu and seq <= min(gpu), (seq, gpu)
    kv = result(engines, "events")["kvtiers"]
    assert kv.get("file.promoted", 0) + kv.get("s3.promoted", 0) >= CHUNKS_PER_PROMPT


def test_a_failed_cascade_is_not_announced(engines: dict[str, Any]) -> None:
    res = result(engines, "events")
    phases = _replay(res)
    [(_, router, held, seqs)] = [p for p in phases if p[0] == "failed_cascade"]
    new = {event.block_hashes[-1] for tier, seq, event in router.stores
           if tier == "cpu" and seq in seqs}
    assert len(new) == CHUNKS_PER_PROMPT
    stored_in = {tier: {event.block_hashes[-1] for t, s, event in router.stores
                        if t == tier and s in seqs} for tier in TIERS}
    assert new <= stored_in["s3"]
    assert not new & stored_in["file"] and not new & held["file"]
    assert res["kvtiers"]["cascade_failures"] >= CHUNKS_PER_PROMPT


def test_reset_cache_clears_and_removes_what_the_cpu_tier_held(engines: dict[str, Any]) -> None:
    phases = _replay(result(engines, "events"))
    names = [name for name, *_ in phases]
    before = phases[names.index("reset") - 1][2]["cpu"]
    # vLLM publishes what a reset did at its next step (the phase's own flush).
    _, router, held, seqs = phases[names.index("reset")]
    assert held["cpu"] == set()
    assert any(seq in seqs for seq in router.cleared), "no AllBlocksCleared after the reset"
    removed = {h for tier, seq, event in router.removals if tier == "cpu" and seq in seqs
               for h in event.block_hashes}
    assert before and before <= removed


def test_a_restarted_engine_announces_what_its_persistent_tiers_hold(
    engines: dict[str, Any],
) -> None:
    phases = _replay(result(engines, "restart"))
    _, router, held, seqs = phases[0]
    for tier in ("file", "s3"):
        # Found at start, not stored by this engine: announced by their hashes alone.
        announced = [e for t, s, e in router.stores if t == tier and s in seqs]
        assert held[tier] and {e.block_hashes[-1] for e in announced} >= held[tier]
    assert held["cpu"] == set()
