"""Translation between vLLM 0.33's offloading types and kvtiers' own.

vLLM's ``OffloadingConfig`` becomes a kvtiers :class:`~kvtiers.core.config.OffloadingConfig`
(the cache identity every persistent tier names its namespace after), and vLLM's request
contexts, lookup results, events and keys are converted at the boundary.

Keys: a vLLM key ends in the KV-cache group's *id* in vLLM's ``KVCacheConfig``; a kvtiers
key ends in the group's *position* in the offloading config (workers and movers size a
chunk by it). :class:`KeyMap` rewrites the group part when the two differ (some groups are
not offloaded) and is a no-op otherwise.

Block hashes: vLLM chains block hashes from a seed (``NONE_HASH``). With ``sha256`` or
``sha256_cbor`` the seed is fixed (or ``PYTHONHASHSEED``), so keys are the same in every
process; with ``xxhash`` / ``xxhash_cbor`` and no ``PYTHONHASHSEED`` the seed is random per
process and a persistent tier can never hit after a restart. :func:`warn_unstable_hashes`
says so once per process. The identity records vLLM's algorithm as ``vllm:<name>``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.config import OffloadingConfig as VllmOffloadingConfig

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.core.manager import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    TierFilter,
    TierMatcher,
)
from kvtiers.errors import ConfigError

logger = logging.getLogger(__name__)

ENGINE = "vllm"
EXTRA_CONFIG = "kv_connector_extra_config"

#: vLLM's ``prefix_caching_hash_algo`` names.
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's default ``prefix_caching_hash_algo``.
DEFAULT_HASH_ALGORITHM = "sha256"
#: Algorithms whose chain seed is random per process unless PYTHONHASHSEED is set.
_SEEDED_AT_RANDOM = frozenset({"xxhash", "xxhash_cbor"})

_warned_unstable = False


def live_vllm_config() -> Any | None:
    """vLLM's current ``VllmConfig`` when the engine set one, else ``None``.

    ``vllm.config`` needs vLLM's full dependency set; with the light install that only
    imports ``vllm.v1.kv_offload`` there is no live config to read.
    """
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def block_hash_algorithm(extra_config: Mapping[str, Any]) -> str:
    """vLLM's ``prefix_caching_hash_algo``: from the engine's live config when there is
    one, else ``extra_config["prefix_caching_hash_algo"]``, else vLLM's default."""
    live = live_vllm_config()
    live_name = None if live is None else str(live.cache_config.prefix_caching_hash_algo)
    given = extra_config.get("prefix_caching_hash_algo")
    if given is not None and live_name is not None and given != live_name:
        raise ConfigError(
            f"prefix_caching_hash_algo {given!r} disagrees with the engine's "
            f"--prefix-caching-hash-algo {live_name!r}; drop it or make them equal",
            path=f"{EXTRA_CONFIG}.prefix_caching_hash_algo",
        )
    name = live_name or given or DEFAULT_HASH_ALGORITHM
    if name not in HASH_ALGORITHMS:
        raise ConfigError(
            f"unknown block-hash algorithm {name!r}; vLLM 0.33 has "
            + ", ".join(HASH_ALGORITHMS),
            path=f"{EXTRA_CONFIG}.prefix_caching_hash_algo",
        )
    return str(name)


def hashes_stable_across_processes(algorithm: str) -> bool:
    """Whether vLLM's block hashes under ``algorithm`` are the same in every process."""
    return algorithm not in _SEEDED_AT_RANDOM or os.environ.get("PYTHONHASHSEED") is not None


def warn_unstable_hashes(algorithm: str) -> bool:
    """Log (once per process) when keys will differ between processes; True if logged."""
    global _warned_unstable
    if hashes_stable_across_processes(algorithm) or _warned_unstable:
        return False
    _warned_unstable = True
    logger.warning(
        "vLLM hashes blocks with %s and PYTHONHASHSEED is not set, so every engine process "
        "seeds its block hashes at random: the persistent kvtiers tiers will never hit "
        "after a restart or across engines. Set PYTHONHASHSEED to the same value for every "
        "engine, or use --prefix-caching-hash-algo sha256_cbor.",
        algorithm,
    )
    return True


def model_revision(extra_config: Mapping[str, Any]) -> str:
    """``extra_config["model_revision"]``, else the engine's ``--revision``, else ``main``."""
    given = extra_config.get("model_revision")
    if given is not None:
        if not isinstance(given, str) or not given:
            raise ConfigError(
                f"expected a non-empty string, got {given!r}",
                path=f"{EXTRA_CONFIG}.model_revision",
            )
        return given
    live = live_vllm_config()
    revision = None if live is None else live.model_config.revision
    return str(revision) if revision else "main"


def derived_group_bytes(config: VllmOffloadingConfig) -> tuple[int, ...]:
    """Bytes one worker holds per block of each group, as the scheduler can know them.

    vLLM gives the scheduler only ``worker_kv_bytes_per_block``: the bytes of one block id
    across every KV tensor. vLLM's hybrid allocator gives every layer the same page size
    and lets the groups share tensors (one layer of each group per tensor), so group ``g``
    with ``n_g`` layers holds ``worker_kv_bytes_per_block * n_g / max(n)`` bytes per block.
    ``extra_config["kvtiers_group_bytes_per_block"]`` (one integer per group) overrides the
    derivation; the worker checks the result against the real tensors either way.
    """
    where = f"{EXTRA_CONFIG}.kvtiers_group_bytes_per_block"
    override = config.extra_config.get("kvtiers_group_bytes_per_block")
    if override is not None:
        values = tuple(override) if isinstance(override, (list, tuple)) else ()
        if len(values) != len(config.groups) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values
        ):
            raise ConfigError(
                f"expected {len(config.groups)} positive integers (one per offloaded KV-cache "
                f"group), got {override!r}",
                path=where,
            )
        return values
    total = config.worker_kv_bytes_per_block
    if total <= 0:
        raise ConfigError(
            "vLLM reported no KV bytes per block (worker_kv_bytes_per_block is "
            f"{total}); give the bytes per block of each group in kvtiers_group_bytes_per_block",
            path=where,
        )
    counts = [len(group.layer_names) for group in config.groups]
    widest = max(counts)
    derived = []
    for idx, count in enumerate(counts):
        if total * count % widest:
            raise ConfigError(
                f"cannot derive group {idx}'s bytes per block from {total} bytes per block "
                f"over {widest} shared tensors; give them in kvtiers_group_bytes_per_block",
                path=where,
            )
        derived.append(total * count // widest)
    return tuple(derived)


def translate_config(
    config: VllmOffloadingConfig,
    *,
    group_bytes_per_block: Sequence[int],
    hash_algorithm: str,
    kv_layout_suffix: str = "",
) -> OffloadingConfig:
    """kvtiers' identity of a cache vLLM describes with ``config``.

    ``kv_layout_suffix`` marks a chunk byte layout other than kvtiers' own (the secondary
    tiers store vLLM's CPU chunk layout), so the two never share a namespace.
    """
    extra = config.extra_config
    user_salt = extra.get("kvtiers_salt", "")
    if not isinstance(user_salt, str):
        raise ConfigError(
            f"expected a string, got {user_salt!r}", path=f"{EXTRA_CONFIG}.kvtiers_salt"
        )
    par = config.parallel
    try:
        return OffloadingConfig(
            groups=tuple(
                OffloadingGroupConfig(
                    tokens_per_block=group.tokens_per_block,
                    layer_names=tuple(group.layer_names),
                    bytes_per_block=nbytes,
                )
                for group, nbytes in zip(config.groups, group_bytes_per_block, strict=True)
            ),
            model=OffloadingModelConfig(
                name=config.model.name,
                revision=model_revision(extra),
                dtype=config.model.dtype,
                kv_layout=(config.kv_cache_layout or "NHD") + kv_layout_suffix,
            ),
            cache=OffloadingCacheConfig(
                tokens_per_hash=config.cache.tokens_per_hash,
                blocks_per_chunk=config.cache.blocks_per_chunk,
                hash_algorithm=f"{ENGINE}:{hash_algorithm}",
            ),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=par.world_size,
                tp_size=par.tp_size,
                pp_size=par.pp_size,
                pcp_size=par.pcp_size,
                dcp_size=par.dcp_size,
                is_parallelism_agnostic=par.is_parallelism_agnostic,
            ),
            engine=ENGINE,
            salt=user_salt,
        )
    except ConfigError as exc:
        raise ConfigError(
            f"vLLM's offloading config does not fit kvtiers: {exc.message}", path=exc.path
        ) from None


class KeyMap:
    """Rewrites the group part of keys between vLLM's group ids and kvtiers' positions."""

    def __init__(self, group_ids: Sequence[int]) -> None:
        self.identity = list(group_ids) == list(range(len(group_ids)))
        width = GROUP_INDEX_BYTES
        self._to_position = {
            gid.to_bytes(width, "big"): pos.to_bytes(width, "big")
            for pos, gid in enumerate(group_ids)
        }
        self._to_id = {pos: gid for gid, pos in self._to_position.items()}

    def to_kvtiers(self, key: bytes) -> OffloadKey:
        if self.identity:
            return OffloadKey(key)
        group = key[-GROUP_INDEX_BYTES:]
        position = self._to_position.get(group)
        if position is None:
            raise ValueError(
                f"key {key.hex()} names KV-cache group {int.from_bytes(group, 'big')}, "
                "which is not offloaded"
            )
        return OffloadKey(key[:-GROUP_INDEX_BYTES] + position)

    def to_vllm(self, key: OffloadKey) -> Any:
        if self.identity:
            return key
        return vbase.OffloadKey(
            key[:-GROUP_INDEX_BYTES] + self._to_id[key[-GROUP_INDEX_BYTES:]]
        )

    def all_to_kvtiers(self, keys: Iterable[bytes]) -> list[OffloadKey]:
        if self.identity:
            return [OffloadKey(key) for key in keys]
        return [self.to_kvtiers(key) for key in keys]

    def all_to_vllm(self, keys: Iterable[OffloadKey]) -> list[Any]:
        if self.identity:
            return list(keys)
        return [self.to_vllm(key) for key in keys]


_LOOKUP = {result: vbase.LookupResult[result.name] for result in LookupResult}


def vllm_lookup(result: LookupResult) -> Any:
    """vLLM's ``LookupResult`` of the same name."""
    return _LOOKUP[result]


def _tier_filter(filter_: Any) -> TierFilter:
    if filter_ == vbase.TierFilter.ALL:
        return TierFilter.ALL
    return TierFilter(
        matchers=tuple(
            TierMatcher(
                medium=None if m.medium is None else Medium(m.medium.value),
                locality=None if m.locality is None else Locality(m.locality.value),
            )
            for m in filter_.matchers
        )
    )


def kvtiers_context(ctx: Any) -> ReqContext:
    """kvtiers' request context for vLLM's ``ReqContext`` ``ctx``."""
    return ReqContext(
        req_id=ctx.req_id,
        kv_transfer_params=ctx.kv_transfer_params,
        load_tier_filter=_tier_filter(ctx.load_tier_filter),
    )


def vllm_request_context(ctx: RequestOffloadingContext) -> Any:
    policy = (
        vbase.OffloadPolicy.REQUEST_LEVEL
        if ctx.policy is OffloadPolicy.REQUEST_LEVEL
        else vbase.OffloadPolicy.CHUNK_LEVEL
    )
    return vbase.RequestOffloadingContext(policy=policy)


def vllm_event(event: OffloadingEvent, keys: KeyMap, ownership: str | None = None) -> Any:
    """vLLM's ``OffloadingEvent`` for a kvtiers event (``ownership`` fills a missing one)."""
    return vbase.OffloadingEvent(
        keys=keys.all_to_vllm(event.keys),
        medium=vbase.Medium(event.medium.value),
        removed=event.removed,
        locality=None if event.locality is None else vbase.Locality(event.locality.value),
        ownership=event.ownership if event.ownership is not None else ownership,
    )
