"""The ``model:`` section: cache identity and geometry when no engine supplies them.

The demo, the tests and the CLI tools read it to build an
:class:`~kvtiers.core.config.OffloadingConfig`. A group lists its layers either by count
(``num_layers: 4``, named ``g<group>.layer<j>``) or by name (``layer_names: [...]``), and
gives ``page_bytes``, the bytes of one layer's page for one block; a group's
``bytes_per_block`` is its layer count times ``page_bytes``. The optional identity keys
(``fingerprint``, ``compute_dtype``, ``quantization``, ``kv_scales``, ``overrides``,
``draft_model``, ``canonical_format``, a group's ``attention``) mean what
``docs/on-disk-format.md`` says of the identity fields of the same names.

The core configuration classes check their own values; their errors are re-raised here
with the YAML path of the field that caused them (``model.groups[0].tokens_per_block``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from kvtiers.config.paths import item_path, join_path
from kvtiers.config.schema import Range, Section, example
from kvtiers.config.sizes import Size
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvtiers.errors import ConfigError

MODEL_PATH = "model"


@contextmanager
def _located(prefix: str, renames: dict[str, str] | None = None) -> Iterator[None]:
    """Re-raise a core :class:`ConfigError` with its path placed under ``prefix``."""
    try:
        yield
    except ConfigError as exc:
        path = (renames or {}).get(exc.path, exc.path)
        raise ConfigError(exc.message, path=join_path(prefix, path)) from None


@dataclass(frozen=True, kw_only=True)
class GroupSection(Section):
    """One KV-cache group: block size, layers (by count or by name), one page's bytes."""

    what: ClassVar[str] = "a model group"

    tokens_per_block: int = field(metadata=example("tokens_per_block: 16"))
    """Tokens in one GPU block of this group (the engine's block size)."""
    page_bytes: Size = field(metadata=example("page_bytes: 16KiB"))
    """Bytes of one layer's KV page for one block (K and V together)."""
    num_layers: Annotated[int, Range(1)] | None = None
    """How many layers the group has (named ``g<group>.layer<j>``); give this or
    layer_names."""
    layer_names: tuple[str, ...] | None = None
    """The group's layer names, in order; give this or num_layers."""
    attention: str = "full"
    """How far back the group attends: ``full``, or e.g. ``sliding_window:4096``."""

    def _check(self) -> None:
        if (self.num_layers is None) == (self.layer_names is None):
            raise ConfigError(
                "give exactly one of num_layers (a count) or layer_names (a list)",
                path="num_layers" if self.num_layers is not None else "",
            )

    def resolved_layer_names(self, group_idx: int) -> tuple[str, ...]:
        """The layer names, generated as ``g<group>.layer<j>`` when only a count is given."""
        if self.layer_names is not None:
            return self.layer_names
        assert self.num_layers is not None
        return tuple(f"g{group_idx}.layer{j}" for j in range(self.num_layers))


@dataclass(frozen=True, kw_only=True)
class ParallelSection(Section):
    """Parallel sizes; the world size is their product. Defaults: one process."""

    what: ClassVar[str] = "the parallel section"

    tp_size: Annotated[int, Range(1)] = 1
    """Tensor-parallel size."""
    pp_size: Annotated[int, Range(1)] = 1
    """Pipeline-parallel size."""
    pcp_size: Annotated[int, Range(1)] = 1
    """Prefill context-parallel size."""
    dcp_size: Annotated[int, Range(1)] = 1
    """Decode context-parallel size."""
    is_parallelism_agnostic: bool = False
    """A block's bytes are the same under any parallel layout: the sizes are left out of
    the identity, so differently sharded engines share the cache."""


@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """Model identity and cache geometry, as the ``model:`` section of a stack file."""

    what: ClassVar[str] = "the model section"

    name: str = field(metadata=example("name: org/model"))
    """The model's name (``org/model``); part of the cache identity and namespace name."""
    revision: str = "main"
    """An immutable model revision (a commit hash): weights that change must change it."""
    dtype: str = "bfloat16"
    """The KV cache's dtype."""
    kv_layout: str = "NHD"
    """The KV layout the attention backend uses."""
    tokens_per_hash: int = 16
    """Tokens per prefix hash; each chunk's key is the hash at its last token boundary."""
    blocks_per_chunk: int = 1
    """GPU blocks per offloaded chunk: the unit of lookup, store, load and eviction."""
    # The algorithms kvtiers' own hashing implements (the demo and tools hash tokens here).
    hash_algorithm: Literal["xxh3_128", "sha256"] = "xxh3_128"
    """The prefix hash: stable across processes and machines either way."""
    salt: str = ""
    """A string that separates otherwise identical caches (e.g. per tenant)."""
    fingerprint: str = ""
    """What defines the weights when no immutable revision is pinned (set by the engine
    integration from config.json and the weight files' names and sizes)."""
    compute_dtype: str = ""
    """The model's compute dtype, when it differs from the KV dtype (e.g. under fp8 KV)."""
    quantization: str = ""
    """The weights' quantization method (e.g. ``awq``, ``fp8``); empty when unquantized."""
    kv_scales: str = ""
    """Where KV-cache quantization scales come from, when the KV dtype is quantized."""
    overrides: Mapping[str, Any] | None = None
    """Model overrides that change K or V (rope_scaling, rope_theta,
    max_position_embeddings, hf_overrides)."""
    draft_model: str = ""
    """The speculative-decoding draft model, when one shares the KV cache."""
    canonical_format: str = ""
    """The engine's canonical KV layout format id, when the engine stores that layout."""
    groups: tuple[GroupSection, ...] = field(
        metadata=example("groups: [{tokens_per_block: 16, num_layers: 4, page_bytes: 16KiB}]")
    )
    """The KV-cache groups (hybrid models have several, e.g. full and sliding-window
    attention)."""
    parallel: ParallelSection = ParallelSection()
    """Parallel sizes (see model.parallel)."""

    def _check(self) -> None:
        if not self.groups:
            raise ConfigError(
                "at least one group is required, e.g. "
                "[{tokens_per_block: 16, num_layers: 4, page_bytes: 16KiB}]",
                path="groups",
            )

    def to_offloading_config(self, rank: int = 0) -> OffloadingConfig:
        """The core configuration for process ``rank``; errors carry ``model.…`` paths."""
        groups = []
        for idx, group in enumerate(self.groups):
            with _located(item_path(join_path(MODEL_PATH, "groups"), idx)):
                names = group.resolved_layer_names(idx)
                groups.append(
                    OffloadingGroupConfig(
                        tokens_per_block=group.tokens_per_block,
                        layer_names=names,
                        bytes_per_block=len(names) * group.page_bytes,
                        attention=group.attention,
                    )
                )
        with _located(MODEL_PATH):
            model = OffloadingModelConfig(
                name=self.name,
                revision=self.revision,
                dtype=self.dtype,
                kv_layout=self.kv_layout,
                fingerprint=self.fingerprint,
                compute_dtype=self.compute_dtype,
                quantization=self.quantization,
                kv_scales=self.kv_scales,
                overrides=""
                if not self.overrides
                else json.dumps(dict(self.overrides), sort_keys=True, separators=(",", ":")),
                draft_model=self.draft_model,
                canonical_format=self.canonical_format,
            )
            cache = OffloadingCacheConfig(
                tokens_per_hash=self.tokens_per_hash,
                blocks_per_chunk=self.blocks_per_chunk,
                hash_algorithm=self.hash_algorithm,
            )
        parallel = self.parallel
        # ``rank`` is this call's argument, not a key: its errors point at the section.
        with _located(join_path(MODEL_PATH, "parallel"), {"rank": ""}):
            parallel_config = OffloadingParallelConfig(
                rank=rank,
                world_size=parallel.tp_size
                * parallel.pp_size
                * parallel.pcp_size
                * parallel.dcp_size,
                tp_size=parallel.tp_size,
                pp_size=parallel.pp_size,
                pcp_size=parallel.pcp_size,
                dcp_size=parallel.dcp_size,
                is_parallelism_agnostic=parallel.is_parallelism_agnostic,
            )
        with _located(MODEL_PATH):
            return OffloadingConfig(
                groups=tuple(groups),
                model=model,
                cache=cache,
                parallel=parallel_config,
                salt=self.salt,
            )
