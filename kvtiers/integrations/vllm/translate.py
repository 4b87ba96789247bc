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

Identity inputs come from vLLM's offloading config and the engine's own configs found by
:func:`~kvtiers.integrations.vllm.engine.find_engine_configs`, never from vLLM's
process-global current config (unset while vLLM builds its scheduler). Without the
engine's configs the identity would hold only what the offloading config carries:
:func:`identity_source` refuses that for a stack that persists anything, unless the
operator accepts it (``kvtiers_identity: offloading-config-only``), and then marks the
identity so such a namespace never mixes with complete ones.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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
    OffloadScope,
    ReqContext,
    RequestOffloadingContext,
    TierFilter,
    TierMatcher,
)
from kvtiers.errors import ConfigError, InvalidKeyError
from kvtiers.filemapper.fingerprint import is_immutable_revision, resolve_model
from kvtiers.filemapper.identity import NamespaceIdentity
from kvtiers.integrations.vllm.compat import HAS_METADATA_ONLY, hash_lookahead
from kvtiers.integrations.vllm.engine import (
    EngineConfigs,
    group_attention,
    layout_name,
    model_inputs,
)

logger = logging.getLogger(__name__)

ENGINE = "vllm"
EXTRA_CONFIG = "kv_connector_extra_config"

#: vLLM's ``prefix_caching_hash_algo`` names.
HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's default ``prefix_caching_hash_algo``.
DEFAULT_HASH_ALGORITHM = "sha256"
#: Algorithms whose chain seed is random per process unless PYTHONHASHSEED is set.
_SEEDED_AT_RANDOM = frozenset({"xxhash", "xxhash_cbor"})
#: The ``kvtiers_identity`` value that accepts an identity built from vLLM's offloading
#: config alone; the identity records it (``identity_source``).
OFFLOADING_CONFIG_ONLY = "offloading-config-only"
#: What an identity without the engine's configs lacks (for the messages below).
_MISSING_INPUTS = (
    "the revision, weight quantization, compute dtype, KV scales, RoPE overrides, draft "
    "model, load format, model config and block-hash algorithm"
)

_warned_unstable = False
_warned: set[str] = set()


def block_hash_algorithm(extra_config: Mapping[str, Any], engine: EngineConfigs | None) -> str:
    """vLLM's ``prefix_caching_hash_algo``: from the engine's cache config when the
    connector's configs were found, else ``extra_config["prefix_caching_hash_algo"]``, else
    vLLM's default. The two must agree when both are given."""
    engine_name = (
        None if engine is None else str(engine.vllm.cache_config.prefix_caching_hash_algo)
    )
    given = extra_config.get("prefix_caching_hash_algo")
    if given is not None and engine_name is not None and given != engine_name:
        raise ConfigError(
            f"prefix_caching_hash_algo {given!r} disagrees with the engine's "
            f"--prefix-caching-hash-algo {engine_name!r}; drop it or make them equal",
            path=f"{EXTRA_CONFIG}.prefix_caching_hash_algo",
        )
    name = engine_name or given or DEFAULT_HASH_ALGORITHM
    if name not in HASH_ALGORITHMS:
        raise ConfigError(
            f"unknown block-hash algorithm {name!r}; vLLM 0.33 has "
            + ", ".join(HASH_ALGORITHMS),
            path=f"{EXTRA_CONFIG}.prefix_caching_hash_algo",
        )
    return str(name)


def identity_source(
    extra_config: Mapping[str, Any], engine: EngineConfigs | None, *, persistent: bool
) -> str:
    """The identity's ``identity_source``: empty when the engine's configs were found;
    :data:`OFFLOADING_CONFIG_ONLY` without them when ``extra_config["kvtiers_identity"]``
    accepts that. Without them and without the opt-in, a stack with a ``persistent`` tier
    is refused (:class:`~kvtiers.errors.ConfigError`): its namespace could hold KV
    computed under settings the identity cannot see. One that persists nothing is built,
    with a warning."""
    where = f"{EXTRA_CONFIG}.kvtiers_identity"
    opt_in = extra_config.get("kvtiers_identity")
    if opt_in is not None and opt_in != OFFLOADING_CONFIG_ONLY:
        raise ConfigError(
            f"expected {OFFLOADING_CONFIG_ONLY!r} (or no key), got {opt_in!r}", path=where
        )
    if engine is not None:
        return ""
    if opt_in is not None:
        _warn_once(
            f"kvtiers_identity {OFFLOADING_CONFIG_ONLY}: the cache identity holds only what "
            f"vLLM's offloading config carries, without {_MISSING_INPUTS}; its namespaces "
            "are marked so and never shared with complete ones"
        )
        return OFFLOADING_CONFIG_ONLY
    if persistent:
        raise ConfigError(
            "kvtiers found no VllmConfig for the cache identity (this spec or tier was "
            "built outside vLLM's connector), so the identity would lack "
            f"{_MISSING_INPUTS}, and a persistent tier could serve KV computed under other "
            'settings; build it through "kv_connector": "KVTiersConnector" with '
            '"kv_connector_module_path": "kvtiers.integrations.vllm", or accept the weaker '
            f"identity with kvtiers_identity: {OFFLOADING_CONFIG_ONLY} (its namespaces are "
            "kept apart)",
            path=where,
        )
    _warn_once(
        "kvtiers could not find the VllmConfig of the connector building it (built "
        "outside vLLM's connector?): the cache identity holds only what vLLM's offloading "
        f"config carries, without {_MISSING_INPUTS}; nothing persists, so nothing is "
        "served from it later"
    )
    return ""


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


def model_revision(extra_config: Mapping[str, Any], engine_revision: str | None) -> str | None:
    """``extra_config["model_revision"]``, else the engine's ``--revision`` (``None`` when
    neither pins one). The two must agree when both are given."""
    given = extra_config.get("model_revision")
    if given is None:
        return engine_revision
    if not isinstance(given, str) or not given:
        raise ConfigError(
            f"expected a non-empty string, got {given!r}", path=f"{EXTRA_CONFIG}.model_revision"
        )
    if engine_revision is not None and given != engine_revision:
        raise ConfigError(
            f"model_revision {given!r} disagrees with the engine's --revision "
            f"{engine_revision!r}; drop it or make them equal",
            path=f"{EXTRA_CONFIG}.model_revision",
        )
    return given


def parallel_agnostic(extra_config: Mapping[str, Any], layout_agnostic: bool) -> bool:
    """Whether the parallel sizes leave the identity: only when vLLM reports a layout whose
    bytes do not depend on them AND ``extra_config["kvtiers_parallel_agnostic"]`` opts in."""
    opt_in = extra_config.get("kvtiers_parallel_agnostic", False)
    if not isinstance(opt_in, bool):
        raise ConfigError(
            f"expected true or false, got {opt_in!r}",
            path=f"{EXTRA_CONFIG}.kvtiers_parallel_agnostic",
        )
    if opt_in and not layout_agnostic:
        _warn_once(
            "kvtiers_parallel_agnostic is set but vLLM reports this KV layout depends on the "
            "parallel sizes; they stay in the cache identity"
        )
    return opt_in and layout_agnostic


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


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
    engine: EngineConfigs | None,
    group_bytes_per_block: Sequence[int],
    hash_algorithm: str,
    layout_agnostic: bool,
    persistent: bool,
    kv_layout_suffix: str = "",
    canonical_format: str = "",
) -> OffloadingConfig:
    """kvtiers' identity of a cache vLLM describes with ``config`` and, when found, the
    engine's own configs ``engine`` (see :mod:`kvtiers.integrations.vllm.engine`);
    ``persistent`` says whether the stack keeps chunks beyond the process (without the
    engine's configs it is then refused unless the operator opted in: see
    :func:`identity_source`).

    ``kv_layout_suffix`` marks a chunk byte layout other than kvtiers' own (the secondary
    tiers store vLLM's CPU chunk layout), so the two never share a namespace;
    ``canonical_format`` is vLLM's canonical format id when it stores canonical pages;
    ``layout_agnostic`` is whether vLLM reports those bytes independent of the parallel
    sizes (they leave the identity only with the operator's opt-in as well).
    """
    extra = config.extra_config
    user_salt = extra.get("kvtiers_salt", "")
    if not isinstance(user_salt, str):
        raise ConfigError(
            f"expected a string, got {user_salt!r}", path=f"{EXTRA_CONFIG}.kvtiers_salt"
        )
    source = identity_source(extra, engine, persistent=persistent)
    inputs = None if engine is None else model_inputs(engine, config.model.dtype)
    revision = model_revision(extra, None if inputs is None else inputs.revision)
    try:
        model = resolve_model(config.model.name if inputs is None else inputs.model, revision)
    except OSError as exc:
        raise ConfigError(
            f"cannot fingerprint the model for the cache identity: {exc}", path="model"
        ) from None
    if not model.fingerprint and not is_immutable_revision(model.revision):
        _warn_once(
            f"model {model.name!r} has no pinned commit and no local files kvtiers can "
            "fingerprint: the cache identity cannot tell its revisions apart; pin --revision "
            "to a commit hash"
        )
    layout = config.kv_cache_layout or (None if inputs is None else inputs.kv_layout)
    if layout is not None:
        layout = layout_name(layout, path="cache_config.kv_cache_layout")
    par = config.parallel
    # With a hash lookahead (vLLM 0.34, EAGLE / MTP) a key also covers the tokens after its
    # block: another meaning of the same algorithm's keys.
    ahead = 0 if engine is None else hash_lookahead(engine.vllm)
    lookahead = f".lookahead-{ahead}" if ahead else ""
    try:
        translated = OffloadingConfig(
            groups=tuple(
                OffloadingGroupConfig(
                    tokens_per_block=group.tokens_per_block,
                    layer_names=tuple(group.layer_names),
                    bytes_per_block=nbytes,
                    attention=group_attention(
                        engine, group, group.tokens_per_block * config.cache.blocks_per_chunk
                    ),
                )
                for group, nbytes in zip(config.groups, group_bytes_per_block, strict=True)
            ),
            model=OffloadingModelConfig(
                name=model.name,
                revision=model.revision,
                fingerprint=model.fingerprint,
                dtype=config.model.dtype,
                kv_layout=(layout or "unresolved") + kv_layout_suffix,
                compute_dtype="" if inputs is None else inputs.compute_dtype,
                quantization="" if inputs is None else inputs.quantization,
                kv_scales="" if inputs is None else inputs.kv_scales,
                overrides="" if inputs is None else inputs.overrides,
                draft_model="" if inputs is None else inputs.draft_model,
                canonical_format=canonical_format,
                load_format="" if inputs is None else inputs.load_format,
                config_digest="" if inputs is None else inputs.config_digest,
            ),
            cache=OffloadingCacheConfig(
                tokens_per_hash=config.cache.tokens_per_hash,
                blocks_per_chunk=config.cache.blocks_per_chunk,
                hash_algorithm=f"{ENGINE}:{hash_algorithm}" + lookahead,
            ),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=par.world_size,
                tp_size=par.tp_size,
                pp_size=par.pp_size,
                pcp_size=par.pcp_size,
                dcp_size=par.dcp_size,
                is_parallelism_agnostic=parallel_agnostic(extra, layout_agnostic),
            ),
            engine=ENGINE,
            salt=user_salt,
            identity_source=source,
        )
    except ConfigError as exc:
        raise ConfigError(
            f"vLLM's offloading config does not fit kvtiers: {exc.message}", path=exc.path
        ) from None
    # Named in the log so an operator can `kvtiers diff` it against an earlier namespace.
    logger.info(
        "kvtiers cache identity for %s: namespace %s",
        model.name,
        NamespaceIdentity.from_config(translated).namespace,
    )
    return translated


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
            # vLLM's keys are bytes too: the same object serves (no copy, no call); the
            # stack's door checks it.
            return key  # type: ignore[return-value]
        if type(key) is not bytes or len(key) <= GROUP_INDEX_BYTES:
            raise InvalidKeyError(
                f"vLLM key {key!r:.80}: expected bytes (a block hash + 4-byte group id)"
            )
        group = key[-GROUP_INDEX_BYTES:]
        position = self._to_position.get(group)
        if position is None:
            raise InvalidKeyError(
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

    def all_to_kvtiers(self, keys: Collection[bytes]) -> Collection[OffloadKey]:
        """``keys`` as kvtiers keys: the same collection when nothing needs rewriting."""
        if self.identity:
            return keys  # type: ignore[return-value]
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


def kvtiers_context(ctx: Any, keys: KeyMap | None = None) -> ReqContext:
    """kvtiers' request context for vLLM's ``ReqContext`` ``ctx``. With ``keys`` (the key
    map of the stack it is for) a key's position is the end token vLLM recorded for it."""
    return ReqContext(
        req_id=ctx.req_id,
        kv_transfer_params=ctx.kv_transfer_params,
        kv_hints=getattr(ctx, "kv_hints", None),  # vLLM 0.33 on
        load_tier_filter=_tier_filter(ctx.load_tier_filter),
        key_position=None if keys is None else _key_position(ctx, keys),
    )


def _key_position(ctx: Any, keys: KeyMap) -> Callable[[OffloadKey], int | None] | None:
    """vLLM's record of the end token of each key in ``ctx`` (0.32 and 0.33 keep one),
    read with kvtiers' keys."""
    position = getattr(ctx, "get_offload_key_position", None)
    if position is None or keys.identity:
        return position
    to_vllm = keys.to_vllm
    return lambda key: position(to_vllm(key))


def vllm_request_context(ctx: RequestOffloadingContext) -> Any:
    """vLLM's request context for kvtiers' ``ctx``: its offload scope is vLLM's policy."""
    policy = (
        vbase.OffloadPolicy.REQUEST_LEVEL
        if ctx.scope is OffloadScope.REQUEST_LEVEL
        else vbase.OffloadPolicy.CHUNK_LEVEL
    )
    return vbase.RequestOffloadingContext(policy=policy)


def with_request_contexts(event: Any, contexts: Mapping[Any, Any]) -> list[Any]:
    """vLLM's stored ``event`` with the request context of each of its keys a store
    landed (``contexts``, by vLLM key), split where consecutive keys came from different
    requests (vLLM 0.34's tracker reads a self-describing store's payload from it); any
    other event as it is."""
    if event.removed or not any(key in contexts for key in event.keys):
        return [event]
    parts: list[Any] = []
    run: list[Any] = []
    current: Any = None
    for key in event.keys:
        context = contexts.get(key)
        if run and context is not current:
            parts.append(dataclasses.replace(event, keys=run, req_context=current))
            run = []
        run.append(key)
        current = context
    parts.append(dataclasses.replace(event, keys=run, req_context=current))
    return parts


def vllm_event(
    event: OffloadingEvent,
    keys: KeyMap,
    ownership: str | None = None,
    locality: Any = None,
) -> Any | None:
    """vLLM's ``OffloadingEvent`` for a kvtiers event (``ownership`` fills a missing one;
    ``locality``, a vLLM ``Locality``, replaces the tier kind's, but not the ``REMOTE`` of
    a chunk another server published, announced by a listing). ``None`` for a
    bookkeeping-only removal this vLLM cannot express.

    Every store is ``removal_expected``: each kvtiers tier announces the removal of what
    it announced stored (evictions, vanished chunks), so vLLM's event tracker keeps a
    chunk's self-describing payload (its block hashes, tokens and block size) until the
    last tier holding it removes it, and every removal names the same hashes as the
    store did."""
    if event.metadata_only and not HAS_METADATA_ONLY:
        return None
    if event.listed or (locality is None and event.locality is not None):
        locality = None if event.locality is None else vbase.Locality(event.locality.value)
    extra = {"metadata_only": True} if event.metadata_only else {}
    return vbase.OffloadingEvent(
        keys=keys.all_to_vllm(event.keys),
        medium=vbase.Medium(event.medium.value),
        removed=event.removed,
        locality=locality,
        ownership=event.ownership if event.ownership is not None else ownership,
        removal_expected=not event.removed,
        **extra,
    )
