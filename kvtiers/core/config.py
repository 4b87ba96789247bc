"""The configuration boundary: plain frozen values describing a cache's geometry.

Built from a YAML ``model:`` section, by the simulator, or translated from an engine's own
configuration by an integration module. Core code reads these and nothing else (no
``extra_config`` grab-bag). Construction validates; a bad value raises
:class:`~kvtiers.errors.ConfigError` naming the field.

Chunk terms: a *block* is ``tokens_per_block`` tokens of one group on the GPU; a *chunk*
is ``blocks_per_chunk`` consecutive blocks of one group, the unit every tier stores;
``tokens_per_hash`` is the granularity of the chained prefix hash. A chunk's last token
must fall on a hash boundary so its key (the hash there) fingerprints the whole prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvtiers.errors import ConfigError

#: Algorithms kvtiers' own prefix hashing implements.
HASH_ALGORITHMS = ("xxh3_128", "sha256")
# Keys computed by an engine are recorded as "<engine>:<its algorithm>", e.g. "vllm:sha256".
_ENGINE_HASH = re.compile(r"[a-z0-9_.-]+:[A-Za-z0-9_.-]+")


def _positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"expected a positive integer, got {value!r}", path=name)


@dataclass(frozen=True)
class OffloadingGroupConfig:
    """One KV-cache group: its block size, its layers and the bytes one block occupies.

    ``bytes_per_block`` is summed over every layer tensor of the group (what one worker
    stores per block).

    ``attention`` says how far back the group's attention reaches, which decides what its
    stored blocks hold: ``full``, or the engine's description of a bounded window
    (``sliding_window:4096``, ``chunked_local:8192``, ``mamba``).
    """

    tokens_per_block: int
    layer_names: tuple[str, ...]
    bytes_per_block: int
    attention: str = "full"

    def __post_init__(self) -> None:
        _positive(self.tokens_per_block, "tokens_per_block")
        _positive(self.bytes_per_block, "bytes_per_block")
        if not isinstance(self.attention, str) or not self.attention:
            raise ConfigError(
                f"expected a non-empty string, got {self.attention!r}", path="attention"
            )
        if not self.layer_names:
            raise ConfigError("a group needs at least one layer", path="layer_names")
        if len(set(self.layer_names)) != len(self.layer_names):
            raise ConfigError("layer names repeat within a group", path="layer_names")


@dataclass(frozen=True)
class OffloadingModelConfig:
    """Model-level identity: everything about the model that changes the bytes of K or V.

    ``name``, ``dtype`` (the KV cache dtype) and ``kv_layout`` are required. ``revision``
    is the revision asked for (empty when none was pinned); ``fingerprint`` stands in for an
    immutable revision when there is none (see :mod:`kvtiers.filemapper.fingerprint`).
    The rest are empty when they do not apply: ``compute_dtype`` (the dtype the model
    computes K and V in), ``quantization`` (weight quantization method), ``kv_scales``
    (where the scales of a quantized KV cache come from), ``overrides`` (canonical JSON of
    the settings that change K, e.g. RoPE), ``draft_model`` (a speculative-decoding draft
    whose KV shares the cache), ``canonical_format`` (the engine's canonical chunk byte
    format when it stores that instead of its direct layout), ``load_format`` (how the
    engine made weights other than the checkpoint's, e.g. ``dummy``) and ``config_digest``
    (a digest of the model config the engine loaded).
    """

    name: str
    revision: str = "main"
    dtype: str = "bfloat16"
    kv_layout: str = "NHD"
    fingerprint: str = ""
    compute_dtype: str = ""
    quantization: str = ""
    kv_scales: str = ""
    overrides: str = ""
    draft_model: str = ""
    canonical_format: str = ""
    load_format: str = ""
    config_digest: str = ""

    def __post_init__(self) -> None:
        for name in ("name", "dtype", "kv_layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"expected a non-empty string, got {value!r}", path=name)
        for name in (
            "revision", "fingerprint", "compute_dtype", "quantization", "kv_scales",
            "overrides", "draft_model", "canonical_format", "load_format", "config_digest",
        ):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"expected a string, got {value!r}", path=name)


@dataclass(frozen=True)
class OffloadingCacheConfig:
    """Hash granularity, chunk size and the block-hash algorithm.

    ``hash_algorithm`` is one of :data:`HASH_ALGORITHMS` when kvtiers hashes the tokens,
    or ``"<engine>:<algorithm>"`` when an engine supplies the keys (it is part of the
    cache identity either way)."""

    tokens_per_hash: int
    blocks_per_chunk: int = 1
    hash_algorithm: str = "xxh3_128"

    def __post_init__(self) -> None:
        _positive(self.tokens_per_hash, "tokens_per_hash")
        _positive(self.blocks_per_chunk, "blocks_per_chunk")
        if self.hash_algorithm not in HASH_ALGORITHMS and not _ENGINE_HASH.fullmatch(
            self.hash_algorithm
        ):
            raise ConfigError(
                f"unknown hash algorithm {self.hash_algorithm!r}; use one of "
                + ", ".join(HASH_ALGORITHMS)
                + ", or '<engine>:<algorithm>' for keys an engine computes",
                path="hash_algorithm",
            )


@dataclass(frozen=True)
class OffloadingParallelConfig:
    """Parallel layout. ``rank`` is never part of a cache's identity."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    # True when a block's bytes are the same under any parallel layout AND the operator
    # opted in to sharing: the parallel sizes are then left out of the cache identity and
    # differently-sharded engines share it.
    is_parallelism_agnostic: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size"):
            _positive(getattr(self, name), name)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank} is outside [0, world_size={self.world_size})", path="rank"
            )


@dataclass(frozen=True)
class OffloadingConfig:
    """Everything a tier, worker or mover needs to know about the cache it holds.

    ``engine`` names the serving engine whose hashing produced the keys; ``salt`` is an
    optional user string that separates otherwise identical caches; ``identity_source`` is
    empty when every identity input was known, else the name of the operator's opt-in that
    accepted fewer (e.g. ``offloading-config-only``), so such caches never share a
    namespace with complete ones.
    """

    groups: tuple[OffloadingGroupConfig, ...]
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig = field(default_factory=OffloadingParallelConfig)
    engine: str = "kvtiers"
    salt: str = ""
    identity_source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.identity_source, str):
            raise ConfigError(
                f"expected a string, got {self.identity_source!r}", path="identity_source"
            )
        if not self.groups:
            raise ConfigError("at least one KV-cache group is required", path="groups")
        for idx, group in enumerate(self.groups):
            if self.tokens_per_chunk(idx) % self.cache.tokens_per_hash:
                raise ConfigError(
                    f"a chunk of {self.tokens_per_chunk(idx)} tokens "
                    f"(tokens_per_block {group.tokens_per_block} x blocks_per_chunk "
                    f"{self.cache.blocks_per_chunk}) does not end on a hash boundary of "
                    f"tokens_per_hash {self.cache.tokens_per_hash}; pick sizes that divide",
                    path=f"groups[{idx}].tokens_per_block",
                )

    @property
    def blocks_per_chunk(self) -> int:
        return self.cache.blocks_per_chunk

    @property
    def tokens_per_hash(self) -> int:
        return self.cache.tokens_per_hash

    def tokens_per_chunk(self, group_idx: int) -> int:
        """Tokens one chunk of ``group_idx`` covers."""
        return self.groups[group_idx].tokens_per_block * self.cache.blocks_per_chunk

    def chunk_bytes(self, group_idx: int) -> int:
        """Payload bytes of one chunk of ``group_idx``."""
        return self.groups[group_idx].bytes_per_block * self.cache.blocks_per_chunk
