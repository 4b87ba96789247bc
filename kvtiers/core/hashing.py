"""Deterministic prefix hashing: token ids → chained block hashes → chunk keys per group.

The hash of hash-block ``i`` covers every token up to the end of that block::

    h[-1] = H(ROOT)                     (or the caller's parent hash)
    h[i]  = H(h[i-1] || tokens[i*T:(i+1)*T] as little-endian int64)

with ``T = tokens_per_hash``. The key of a chunk is the hash at the chunk's last token
boundary plus the group index, so one key fingerprints the whole prefix before it.
``H`` is xxh3_128 (16 bytes) or sha256 (32 bytes). Nothing here depends on the process
(no Python ``hash()``), so two engines on two machines compute the same keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from kvtiers.core.config import HASH_ALGORITHMS, OffloadingConfig
from kvtiers.core.keys import OffloadKey, make_offload_key

ROOT = b"kvtiers/prefix-hash/v1"

TokenIds = Sequence[int] | npt.NDArray[np.integer]


def hash_bytes(data: bytes, algorithm: str) -> bytes:
    """``H(data)`` for a named algorithm (``xxh3_128`` or ``sha256``)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest(data)
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()
    raise ValueError(f"unknown hash algorithm {algorithm!r}; use one of {HASH_ALGORITHMS}")


def root_hash(algorithm: str) -> bytes:
    """The parent of a request's first hash block."""
    return hash_bytes(ROOT, algorithm)


def block_hashes(
    token_ids: TokenIds,
    tokens_per_hash: int,
    algorithm: str = "xxh3_128",
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of every full ``tokens_per_hash`` block of ``token_ids``.

    ``parent`` continues an earlier chain (the last hash of the tokens before
    ``token_ids``); a trailing partial block is not hashed.
    """
    if tokens_per_hash <= 0:
        raise ValueError("tokens_per_hash must be positive")
    tokens = np.asarray(token_ids, dtype="<i8")
    full = len(tokens) // tokens_per_hash
    raw = tokens[: full * tokens_per_hash].tobytes()
    step = tokens_per_hash * 8
    previous = root_hash(algorithm) if parent is None else parent
    hashes = []
    for start in range(0, full * step, step):
        previous = hash_bytes(previous + raw[start : start + step], algorithm)
        hashes.append(previous)
    return hashes


def chunk_keys(
    hashes: Sequence[bytes],
    *,
    tokens_per_chunk: int,
    tokens_per_hash: int,
    group_idx: int,
) -> list[OffloadKey]:
    """Keys of every full chunk covered by ``hashes`` (which start at token 0)."""
    if tokens_per_chunk % tokens_per_hash:
        raise ValueError(
            f"tokens_per_chunk {tokens_per_chunk} is not a multiple of "
            f"tokens_per_hash {tokens_per_hash}"
        )
    per_chunk = tokens_per_chunk // tokens_per_hash
    return [
        make_offload_key(hashes[end - 1], group_idx)
        for end in range(per_chunk, len(hashes) + 1, per_chunk)
    ]


def request_chunk_keys(token_ids: TokenIds, config: OffloadingConfig) -> list[list[OffloadKey]]:
    """Chunk keys of a request's tokens, one list per KV-cache group."""
    hashes = block_hashes(token_ids, config.tokens_per_hash, config.cache.hash_algorithm)
    return [
        chunk_keys(
            hashes,
            tokens_per_chunk=config.tokens_per_chunk(group_idx),
            tokens_per_hash=config.tokens_per_hash,
            group_idx=group_idx,
        )
        for group_idx in range(len(config.groups))
    ]


class PrefixHasher:
    """Incremental hashing of one request as its tokens grow (decode steps append)."""

    def __init__(self, tokens_per_hash: int, algorithm: str = "xxh3_128") -> None:
        self.tokens_per_hash = tokens_per_hash
        self.algorithm = algorithm
        self.hashes: list[bytes] = []
        self._pending: list[int] = []

    def extend(self, token_ids: TokenIds) -> list[bytes]:
        """Add tokens; returns the hashes of the hash blocks they completed."""
        self._pending.extend(int(t) for t in np.asarray(token_ids).reshape(-1))
        full = len(self._pending) // self.tokens_per_hash * self.tokens_per_hash
        parent = self.hashes[-1] if self.hashes else None
        new = block_hashes(self._pending[:full], self.tokens_per_hash, self.algorithm, parent)
        del self._pending[:full]
        self.hashes.extend(new)
        return new
