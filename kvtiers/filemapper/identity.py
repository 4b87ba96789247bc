"""The cache identity a namespace is named after, and its digest.

:class:`NamespaceIdentity` holds every setting that changes what the bytes of a stored
chunk mean: engine (whose hashing made the keys), model name, revision and fingerprint,
the model's compute dtype, weight quantization, KV-scale source, K-changing overrides
(RoPE), draft model, load format (weights not read from the checkpoint) and a digest of
the model config the engine loaded, KV dtype, layout and canonical format, hash and chunk
granularity, per group the block size, layers, bytes per block and attention reach, the
parallel sizes (left out only when the configuration is parallelism-agnostic and the
operator opted in), the block-hash algorithm, the chunk blob format version, an optional
user salt, the opt-in under which an engine integration accepted an identity with fewer
inputs than it reads (``identity_source``; empty for a complete one) and the schema
version of this identity. The rank is never part of it: every rank of one engine shares
one namespace. ``docs/on-disk-format.md`` documents each field.

Invariants:

- the digest is sha256 of the canonical JSON (sorted keys, compact separators, ASCII), so
  it is the same in every process and on every machine, and any change to any field
  changes it;
- every field is always written, whatever its value (no field is added "only when set"),
  and any change to the set of fields bumps :data:`SCHEMA_VERSION`;
- a chunk format bump (:data:`kvtiers.core.chunkformat.FORMAT_VERSION`) changes the
  digest, so it opens a new namespace (a cold miss) instead of failing on the old one;
- the namespace name is a safe single path component of at most 145 characters: a
  sanitised model name (its first 128 characters) followed by the first 16 hex digits of
  the digest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvtiers.core import chunkformat
from kvtiers.core.config import OffloadingConfig
from kvtiers.errors import ConfigError

SCHEMA_VERSION = 3
NAMESPACE_DIGEST_HEX_CHARS = 16
#: The model name part of a namespace name keeps at most this many characters.
NAMESPACE_MODEL_CHARS = 128

_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class GroupIdentity:
    """The identity of one KV-cache group."""

    tokens_per_block: int
    layer_names: tuple[str, ...]
    bytes_per_block: int
    attention: str = "full"


@dataclass(frozen=True)
class ParallelIdentity:
    """The parallel sizes a chunk's bytes depend on (never the rank)."""

    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int


@dataclass(frozen=True)
class NamespaceIdentity:
    """Everything that decides whether a stored chunk may be served to this engine.

    ``parallel`` is ``None`` when the configuration is parallelism-agnostic (and the
    operator opted in), so engines sharded differently share one namespace.
    """

    engine: str
    model_name: str
    model_revision: str
    kv_dtype: str
    kv_layout: str
    tokens_per_hash: int
    blocks_per_chunk: int
    groups: tuple[GroupIdentity, ...]
    parallel: ParallelIdentity | None
    hash_algorithm: str
    salt: str = ""
    model_fingerprint: str = ""
    compute_dtype: str = ""
    quantization: str = ""
    kv_scales: str = ""
    model_overrides: str = ""
    draft_model: str = ""
    canonical_format: str = ""
    load_format: str = ""
    model_config: str = ""
    identity_source: str = ""
    chunk_format_version: int = chunkformat.FORMAT_VERSION
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def from_config(cls, config: OffloadingConfig) -> NamespaceIdentity:
        """The identity of ``config``; its rank is left out."""
        par = config.parallel
        parallel = None
        if not par.is_parallelism_agnostic:
            parallel = ParallelIdentity(
                world_size=par.world_size,
                tp_size=par.tp_size,
                pp_size=par.pp_size,
                pcp_size=par.pcp_size,
                dcp_size=par.dcp_size,
            )
        return cls(
            engine=config.engine,
            model_name=config.model.name,
            model_revision=config.model.revision,
            kv_dtype=config.model.dtype,
            kv_layout=config.model.kv_layout,
            tokens_per_hash=config.cache.tokens_per_hash,
            blocks_per_chunk=config.cache.blocks_per_chunk,
            groups=tuple(
                GroupIdentity(
                    tokens_per_block=g.tokens_per_block,
                    layer_names=tuple(g.layer_names),
                    bytes_per_block=g.bytes_per_block,
                    attention=g.attention,
                )
                for g in config.groups
            ),
            parallel=parallel,
            hash_algorithm=config.cache.hash_algorithm,
            salt=config.salt,
            model_fingerprint=config.model.fingerprint,
            compute_dtype=config.model.compute_dtype,
            quantization=config.model.quantization,
            kv_scales=config.model.kv_scales,
            model_overrides=config.model.overrides,
            draft_model=config.model.draft_model,
            canonical_format=config.model.canonical_format,
            load_format=config.model.load_format,
            model_config=config.model.config_digest,
            identity_source=config.identity_source,
            # Read at call time: the version this build writes, not the one imported first.
            chunk_format_version=chunkformat.FORMAT_VERSION,
        )

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON-serialisable form: every field, lists instead of tuples."""
        return {
            "schema_version": self.schema_version,
            "engine": self.engine,
            "model_name": self.model_name,
            "model_revision": self.model_revision,
            "model_fingerprint": self.model_fingerprint,
            "compute_dtype": self.compute_dtype,
            "quantization": self.quantization,
            "kv_scales": self.kv_scales,
            "model_overrides": self.model_overrides,
            "draft_model": self.draft_model,
            "load_format": self.load_format,
            "model_config": self.model_config,
            "kv_dtype": self.kv_dtype,
            "kv_layout": self.kv_layout,
            "canonical_format": self.canonical_format,
            "chunk_format_version": self.chunk_format_version,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_chunk": self.blocks_per_chunk,
            "groups": [
                {
                    "tokens_per_block": g.tokens_per_block,
                    "layer_names": list(g.layer_names),
                    "bytes_per_block": g.bytes_per_block,
                    "attention": g.attention,
                }
                for g in self.groups
            ],
            "parallel": None
            if self.parallel is None
            else {
                "world_size": self.parallel.world_size,
                "tp_size": self.parallel.tp_size,
                "pp_size": self.parallel.pp_size,
                "pcp_size": self.parallel.pcp_size,
                "dcp_size": self.parallel.dcp_size,
            },
            "hash_algorithm": self.hash_algorithm,
            "salt": self.salt,
            "identity_source": self.identity_source,
        }

    @classmethod
    def from_dict(cls, data: object) -> NamespaceIdentity:
        """Parse :meth:`to_dict`'s form strictly.

        A missing, unknown or mistyped field raises :class:`~kvtiers.errors.ConfigError`
        whose ``path`` names it (``groups[1].layer_names[0]``).
        """
        top = _fields(data, _TOP_FIELDS, "")
        groups_raw = top["groups"]
        if not isinstance(groups_raw, list):
            raise ConfigError(f"expected a list, got {groups_raw!r}", path="groups")
        groups = []
        for idx, raw in enumerate(groups_raw):
            where = f"groups[{idx}]"
            g = _fields(raw, _GROUP_FIELDS, where)
            names = g["layer_names"]
            if not isinstance(names, list):
                raise ConfigError(f"expected a list, got {names!r}", path=f"{where}.layer_names")
            for pos, name in enumerate(names):
                _expect(str, name, f"{where}.layer_names[{pos}]")
            groups.append(
                GroupIdentity(
                    g["tokens_per_block"], tuple(names), g["bytes_per_block"], g["attention"]
                )
            )
        parallel = None
        if top["parallel"] is not None:
            p = _fields(top["parallel"], _PARALLEL_FIELDS, "parallel")
            parallel = ParallelIdentity(**p)
        return cls(
            engine=top["engine"],
            model_name=top["model_name"],
            model_revision=top["model_revision"],
            kv_dtype=top["kv_dtype"],
            kv_layout=top["kv_layout"],
            tokens_per_hash=top["tokens_per_hash"],
            blocks_per_chunk=top["blocks_per_chunk"],
            groups=tuple(groups),
            parallel=parallel,
            hash_algorithm=top["hash_algorithm"],
            salt=top["salt"],
            model_fingerprint=top["model_fingerprint"],
            compute_dtype=top["compute_dtype"],
            quantization=top["quantization"],
            kv_scales=top["kv_scales"],
            model_overrides=top["model_overrides"],
            draft_model=top["draft_model"],
            canonical_format=top["canonical_format"],
            load_format=top["load_format"],
            model_config=top["model_config"],
            identity_source=top["identity_source"],
            chunk_format_version=top["chunk_format_version"],
            schema_version=top["schema_version"],
        )

    def canonical_json(self) -> bytes:
        """The bytes the digest is taken over."""
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode("ascii")

    @cached_property
    def digest(self) -> bytes:
        """sha256 of :meth:`canonical_json` (32 raw bytes); chunk headers carry it."""
        return hashlib.sha256(self.canonical_json()).digest()

    @property
    def hexdigest(self) -> str:
        return self.digest.hex()

    @property
    def namespace(self) -> str:
        """``<safe model name>-<first 16 hex digits of the digest>``, one path component;
        the model name part is cut to its first :data:`NAMESPACE_MODEL_CHARS` characters
        (the manifest and the digest keep the full name)."""
        safe = _UNSAFE_NAME_CHARS.sub("_", self.model_name.replace("/", "__"))
        if safe.startswith("."):
            safe = "_" + safe
        # A file name holds 255 bytes: long model names keep their first characters here;
        # the digest, made from the full name, keeps the namespaces apart.
        return f"{safe[:NAMESPACE_MODEL_CHARS]}-{self.hexdigest[:NAMESPACE_DIGEST_HEX_CHARS]}"


# Field name -> expected type; ``object`` means "checked by the caller".
_TOP_FIELDS: dict[str, type] = {
    "schema_version": int,
    "engine": str,
    "model_name": str,
    "model_revision": str,
    "model_fingerprint": str,
    "compute_dtype": str,
    "quantization": str,
    "kv_scales": str,
    "model_overrides": str,
    "draft_model": str,
    "load_format": str,
    "model_config": str,
    "kv_dtype": str,
    "kv_layout": str,
    "canonical_format": str,
    "chunk_format_version": int,
    "tokens_per_hash": int,
    "blocks_per_chunk": int,
    "groups": object,
    "parallel": object,
    "hash_algorithm": str,
    "salt": str,
    "identity_source": str,
}
_GROUP_FIELDS: dict[str, type] = {
    "tokens_per_block": int,
    "layer_names": object,
    "bytes_per_block": int,
    "attention": str,
}
_PARALLEL_FIELDS: dict[str, type] = {
    "world_size": int,
    "tp_size": int,
    "pp_size": int,
    "pcp_size": int,
    "dcp_size": int,
}


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _expect(kind: type, value: object, path: str) -> None:
    # bool is an int subclass; a JSON true must not pass for a count.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"expected {kind.__name__}, got {value!r}", path=path)


def _fields(data: object, spec: Mapping[str, type], where: str) -> dict[str, Any]:
    """``data`` as a dict with exactly the fields of ``spec``, scalar types checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected an object, got {data!r}", path=where or "identity")
    for name in spec:
        if name not in data:
            raise ConfigError("missing field", path=_join(where, name))
    for name in data:
        if name not in spec:
            raise ConfigError("unknown field", path=_join(where, str(name)))
    for name, kind in spec.items():
        if kind is not object:
            _expect(kind, data[name], _join(where, name))
    return dict(data)
