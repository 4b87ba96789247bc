"""Prefix hashing is chained, chunk keys sit on chunk boundaries, and keys are the same in
every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.hashing import (
    PrefixHasher,
    block_hashes,
    chunk_keys,
    request_chunk_keys,
)
from kvtiers.core.keys import get_offload_block_hash, get_offload_group_idx
from kvtiers.errors import ConfigError

TOKENS = list(range(1000, 1000 + 130))


def _config(algorithm: str = "xxh3_128") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(16, ("a.0", "a.1"), 4096),
            OffloadingGroupConfig(32, ("b.0",), 2048),
        ),
        model=OffloadingModelConfig(name="m"),
        cache=OffloadingCacheConfig(
            tokens_per_hash=8, blocks_per_chunk=2, hash_algorithm=algorithm
        ),
    )


@pytest.mark.parametrize(("algorithm", "size"), [("xxh3_128", 16), ("sha256", 32)])
def test_only_full_blocks_are_hashed(algorithm: str, size: int) -> None:
    hashes = block_hashes(TOKENS, 8, algorithm)
    assert len(hashes) == 130 // 8
    assert {len(h) for h in hashes} == {size}
    assert len(set(hashes)) == len(hashes)


def test_hash_fingerprints_the_whole_prefix() -> None:
    base = block_hashes(TOKENS, 8)
    changed = list(TOKENS)
    changed[3] += 1
    other = block_hashes(changed, 8)
    assert all(a != b for a, b in zip(base, other, strict=True))
    changed_late = list(TOKENS)
    changed_late[100] += 1
    late = block_hashes(changed_late, 8)
    assert late[:12] == base[:12]
    assert late[12:] != base[12:]


def test_algorithms_differ() -> None:
    assert block_hashes(TOKENS, 8, "sha256")[0][:16] != block_hashes(TOKENS, 8)[0]


def test_chunk_key_is_the_hash_at_the_chunk_end() -> None:
    hashes = block_hashes(TOKENS, 8)
    keys = chunk_keys(hashes, tokens_per_chunk=32, tokens_per_hash=8, group_idx=1)
    assert len(keys) == 130 // 32
    expected = [hashes[3], hashes[7], hashes[11], hashes[15]]
    assert [get_offload_block_hash(k) for k in keys] == expected
    assert {get_offload_group_idx(k) for k in keys} == {1}


def test_request_keys_per_group() -> None:
    keys = request_chunk_keys(TOKENS, _config())
    assert [len(g) for g in keys] == [130 // 32, 130 // 64]
    assert get_offload_block_hash(keys[0][1]) == get_offload_block_hash(keys[1][0])
    assert keys[0][1] != keys[1][0]


def test_incremental_hashing_matches_one_shot() -> None:
    hasher = PrefixHasher(8)
    for start in range(0, len(TOKENS), 5):
        hasher.extend(TOKENS[start : start + 5])
    assert hasher.hashes == block_hashes(TOKENS, 8)


def test_chunk_must_end_on_a_hash_boundary() -> None:
    with pytest.raises(ValueError, match="multiple"):
        chunk_keys([], tokens_per_chunk=12, tokens_per_hash=8, group_idx=0)


_CHILD = """
import json, sys
from tests.test_hashing import TOKENS, _config
from kvtiers.core.hashing import request_chunk_keys
out = {a: [[k.hex() for k in g] for g in request_chunk_keys(TOKENS, _config(a))]
       for a in ("xxh3_128", "sha256")}
print(json.dumps(out))
"""


def test_keys_are_identical_across_processes() -> None:
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, check=True,
            cwd=os.path.dirname(os.path.dirname(__file__)),
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
    local = {a: [[k.hex() for k in g] for g in request_chunk_keys(TOKENS, _config(a))]
             for a in ("xxh3_128", "sha256")}
    assert results[0] == local


def test_golden_hashes() -> None:
    # A change here silently turns every persisted cache into misses: bump the identity's
    # schema version together with it.
    tokens = list(range(16))
    assert block_hashes(tokens, 16)[0].hex() == "7903e5772335d743eaf9addc7c8a6023"
    assert block_hashes(tokens, 16, "sha256")[0].hex() == (
        "c8fd7986b000fc513da809b06ad4a79ab7cbf179ea4c467ac3990f1b447c2fad"
    )


def test_engine_supplied_algorithms_are_recorded_not_computed() -> None:
    cache = OffloadingCacheConfig(tokens_per_hash=16, hash_algorithm="vllm:sha256_cbor")
    assert cache.hash_algorithm == "vllm:sha256_cbor"
    with pytest.raises(ConfigError, match="unknown hash algorithm"):
        OffloadingCacheConfig(tokens_per_hash=16, hash_algorithm="md5")
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        block_hashes(TOKENS, 8, "vllm:sha256_cbor")
