"""The cache identity of what an SGLang rank stores, in kvtiers' existing identity fields.

Inputs: SGLang's ``HiCacheStorageConfig`` (model name, TP/PP/CP/DCP ranks and sizes, MLA),
the registered host pools (layout, class, dtype, page size, layers, page geometry), the
extra config's kvtiers keys, and — read from SGLang's runtime context when the engine has
published them — the server arguments that change a page's bytes (revision, KV cache
dtype, compute dtype, quantization, model overrides, speculative draft model).

Mapping (each field of :class:`~kvtiers.filemapper.NamespaceIdentity`; ``docs/sglang.md``
has the table):

* ``engine`` ``sglang``; ``hash_algorithm`` :data:`HASH_ALGORITHM` (SGLang's page keys: a
  sha256 chain over each page's token ids, seeded per request namespace);
* ``tokens_per_hash`` and every group's ``tokens_per_block`` the KV pool's page size,
  ``blocks_per_chunk`` 1: one chunk per page and part;
* one group per part of a page of each pool (see :mod:`.pages`): ``bytes_per_block`` the
  part's bytes, ``attention`` ``full`` for the KV pool and the pool's name otherwise, and
  ``layer_names`` one per layer the pool holds, canonically
  ``<pool>.<part>.layer<L>[@<shard>]`` where ``<part>`` is ``part<j>of<n>`` (zero-copy) or
  ``page`` (copied), ``L`` the model's layer index (a pipeline stage holds its own; packed
  draft layers follow as ``draft<d>``), and
  ``<shard>`` which slice of the page this rank holds, joined by ``.``: ``pp<r>of<n>``,
  ``cp<r>of<n>``, ``dcp<r>of<n>`` and (for pools TP ranks shard) ``tp<r>of<n>``, each when
  that size exceeds 1. The
  rank of a shard has no field of its own; it is part of what the chunk's tensors are, so
  it is written where the tensors are named;
* ``kv_layout`` each pool as ``<pool>=<layout>/<class>/<dtype>``, joined by ``;``, plus
  ``/<format tag>`` when the pool names its own page format; ``kv_dtype`` SGLang's
  ``--kv-cache-dtype`` (the logical dtype: ``fp8_e4m3`` and ``fp8_e5m2`` both store bytes),
  or the KV pool's dtype when it is ``auto``;
* ``parallel`` the TP, PP, attention-CP and DCP sizes (world size TP x PP);
* model name, revision and fingerprint (:func:`~kvtiers.filemapper.fingerprint.resolve_model`),
  compute dtype, quantization, ``model_overrides`` (canonical JSON of
  ``--json-model-override-args``), ``draft_model`` (canonical JSON of the speculative
  algorithm, draft model and its revision), and ``salt`` (``kvtiers_salt``).

Ranks (decided here, documented in ``docs/sglang.md``): pools whose pages every TP rank
holds whole — MLA's KV pool and its KV-derived pools, as SGLang's ``is_mla_model`` says,
except Mamba states, which are TP-sharded — form one *replicated* identity shared by
every rank; SGLang's one writer rank (``is_storage_writer``) stores them and every rank
reads. Every other pool is in a *sharded* identity per rank. So one rank has at most two
identities (two namespaces per tier).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvtiers.errors import ConfigError
from kvtiers.filemapper.fingerprint import is_immutable_revision, resolve_model
from kvtiers.integrations.sglang.config import EXTRA_CONFIG, BackendOptions
from kvtiers.integrations.sglang.pages import PagePool

logger = logging.getLogger(__name__)

ENGINE = "sglang"
#: SGLang's page keys (``get_hash_str``: sha256 chained over a page's token ids).
HASH_ALGORITHM = "sglang:sha256"
#: SGLang's name of the KV pool, and of the pool TP ranks shard even under MLA.
KV_POOL = "kv"
MAMBA_POOL = "mamba"

_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def engine_args() -> Any | None:
    """SGLang's server arguments for this process, or ``None`` when none are published
    (a backend built outside an engine, such as in tests)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # unpublished, or a release without the runtime context
        return None


def is_replicated(pool_name: str, storage_config: Any) -> bool:
    """Whether every TP rank holds whole pages of ``pool_name`` (see the module
    docstring)."""
    return bool(storage_config.is_mla_model) and pool_name != MAMBA_POOL


@dataclass(frozen=True)
class Identity:
    """One identity of a rank: its kvtiers config, the pools it covers (group order:
    each pool's parts in turn) and whether this rank writes it."""

    config: OffloadingConfig
    pools: tuple[PagePool, ...]
    replicated: bool
    writer: bool

    def first_group(self, pool: PagePool) -> int:
        """The group index of ``pool``'s first part."""
        first = 0
        for other in self.pools:
            if other is pool:
                return first
            first += other.parts
        raise KeyError(pool.name)


def _shard(storage_config: Any, replicated: bool) -> str:
    parts = []
    if storage_config.pp_size > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    if storage_config.attn_cp_size > 1:
        parts.append(f"cp{storage_config.attn_cp_rank}of{storage_config.attn_cp_size}")
    if getattr(storage_config, "dcp_size", 1) > 1:
        parts.append(f"dcp{storage_config.dcp_rank}of{storage_config.dcp_size}")
    if not replicated and storage_config.tp_size > 1:
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    return ".".join(parts)


def _layers(pool: Any) -> list[str] | None:
    """The layers a page of ``pool`` holds: the model's ``layer<L>`` of its stage, then
    ``draft<d>`` for the speculative draft layers packed after them (MTP)."""
    start, end = getattr(pool, "start_layer", None), getattr(pool, "end_layer", None)
    count = getattr(pool, "layer_num", None)
    count = count if isinstance(count, int) and count > 0 else None
    if isinstance(start, int) and isinstance(end, int) and end > start:
        names = [f"layer{layer}" for layer in range(start, end)]
        return names + [f"draft{d}" for d in range((count or 0) - len(names))]
    return None if count is None else [f"layer{layer}" for layer in range(count)]


def _groups(pool: PagePool, tokens_per_page: int, shard: str) -> list[OffloadingGroupConfig]:
    suffix = f"@{shard}" if shard else ""
    layers = _layers(pool.pool)
    groups = []
    for part, nbytes in enumerate(pool.part_bytes):
        label = f"part{part}of{pool.parts}" if pool.zero_copy else "page"
        names = (
            tuple(f"{pool.name}.{label}.{layer}{suffix}" for layer in layers)
            if layers is not None else (f"{pool.name}.{label}{suffix}",)
        )
        groups.append(OffloadingGroupConfig(
            tokens_per_block=tokens_per_page,
            layer_names=names,
            bytes_per_block=nbytes,
            attention="full" if pool.name == KV_POOL else pool.name,
        ))
    return groups


def _layout(pools: Sequence[PagePool]) -> str:
    described = []
    for pool in pools:
        dtype = str(getattr(pool.pool, "dtype", "")).removeprefix("torch.")
        text = f"{pool.name}={pool.layout or 'unknown'}/{type(pool.pool).__name__}/{dtype}"
        tag = getattr(pool.pool, "storage_format_tag", None)
        described.append(f"{text}/{tag}" if tag else text)
    return ";".join(described)


def _canonical_json(text: object) -> str:
    if not text or text == "{}":
        return ""
    if not isinstance(text, str):
        return json.dumps(text, sort_keys=True, separators=(",", ":"), default=str)
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return text


def _revision(options: BackendOptions, args: Any | None) -> str | None:
    engine_revision = None if args is None else getattr(args, "revision", None)
    if options.revision is None:
        return engine_revision
    if engine_revision is not None and engine_revision != options.revision:
        raise ConfigError(
            f"model_revision {options.revision!r} disagrees with SGLang's --revision "
            f"{engine_revision!r}; drop it or make them equal",
            path=f"{EXTRA_CONFIG}.model_revision",
        )
    return options.revision


@dataclass(frozen=True)
class _ModelInputs:
    name: str
    revision: str
    fingerprint: str
    kv_dtype: str
    compute_dtype: str
    quantization: str
    overrides: str
    draft_model: str


def _model(storage_config: Any, options: BackendOptions, args: Any | None) -> _ModelInputs:
    source = (None if args is None else getattr(args, "model_path", None)) or (
        storage_config.model_name
    )
    if not source:
        raise ConfigError(
            "SGLang gave the storage backend no model name; the cache identity needs one",
            path="HiCacheStorageConfig.model_name",
        )
    revision = _revision(options, args)
    try:
        model = resolve_model(str(source), revision)
    except OSError as exc:
        raise ConfigError(
            f"cannot fingerprint the model for the cache identity: {exc}", path="model_path"
        ) from None
    if not model.fingerprint and not is_immutable_revision(model.revision):
        warn_once(
            f"model {model.name!r} has no pinned commit and no local files kvtiers can "
            "fingerprint: the cache identity cannot tell its revisions apart; pin --revision "
            "to a commit hash"
        )
    kv_dtype = "" if args is None else str(getattr(args, "kv_cache_dtype", "") or "")
    draft = ""
    if args is not None and getattr(args, "speculative_algorithm", None):
        draft = _canonical_json({
            "algorithm": str(args.speculative_algorithm),
            "model": str(getattr(args, "speculative_draft_model_path", None) or ""),
            "revision": str(getattr(args, "speculative_draft_model_revision", None) or ""),
        })
    return _ModelInputs(
        name=model.name,
        revision=model.revision,
        fingerprint=model.fingerprint,
        kv_dtype=kv_dtype,
        compute_dtype="" if args is None else str(getattr(args, "dtype", "") or ""),
        quantization="" if args is None else str(getattr(args, "quantization", "") or ""),
        overrides="" if args is None else _canonical_json(
            getattr(args, "json_model_override_args", "")),
        draft_model=draft,
    )


def identities(
    storage_config: Any, pools: Sequence[PagePool], options: BackendOptions, args: Any | None,
) -> list[Identity]:
    """This rank's identities over ``pools`` (the KV pool first): the replicated one
    and the sharded one, each when it covers a pool."""
    if args is None:
        warn_once(
            "kvtiers found no SGLang server arguments in this process (a storage backend "
            "built outside an engine?): the cache identity holds what SGLang's storage "
            "config and host pools say, without the revision, KV cache dtype, compute "
            "dtype, quantization, overrides or draft model"
        )
    anchor = pools[0]
    model = _model(storage_config, options, args)
    found = []
    for replicated in (True, False):
        chosen = tuple(p for p in pools if is_replicated(p.name, storage_config) == replicated)
        if not chosen:
            continue
        shard = _shard(storage_config, replicated)
        groups = [g for p in chosen for g in _groups(p, anchor.page_size, shard)]
        kv_dtype = model.kv_dtype
        if not kv_dtype or kv_dtype == "auto":
            kv_dtype = str(getattr(anchor.pool, "dtype", "unknown")).removeprefix("torch.")
        tp, pp = storage_config.tp_size, storage_config.pp_size
        config = OffloadingConfig(
            groups=tuple(groups),
            model=OffloadingModelConfig(
                name=model.name, revision=model.revision, fingerprint=model.fingerprint,
                dtype=kv_dtype, kv_layout=_layout(chosen), compute_dtype=model.compute_dtype,
                quantization=model.quantization, overrides=model.overrides,
                draft_model=model.draft_model,
            ),
            cache=OffloadingCacheConfig(
                tokens_per_hash=anchor.page_size, blocks_per_chunk=1,
                hash_algorithm=HASH_ALGORITHM,
            ),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=tp * pp, tp_size=tp, pp_size=pp,
                pcp_size=storage_config.attn_cp_size,
                dcp_size=getattr(storage_config, "dcp_size", 1),
            ),
            engine=ENGINE,
            salt=options.salt,
        )
        writer = not replicated or bool(getattr(storage_config, "is_storage_writer", True))
        found.append(Identity(config, chosen, replicated, writer))
    return found
