"""NamespaceIdentity and FileMapper: golden strings, one namespace move per identity field,
rank and parallelism-agnostic collapsing, strict parsing, and key ⇄ file name."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.core import chunkformat
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.publish import temp_path_for
from kvtiers.errors import ConfigError
from kvtiers.filemapper import (
    CHUNK_SUFFIX,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    FileMapper,
    NamespaceIdentity,
)


def base_config() -> OffloadingConfig:
    """Two groups (full attention + sliding window), chunks of 4 blocks, TP 2."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(16, ("layers.0.attn", "layers.1.attn"), 65536),
            OffloadingGroupConfig(16, ("layers.2.swa",), 32768),
        ),
        model=OffloadingModelConfig("meta-llama/Llama-3.1-8B", "main", "bfloat16", "NHD"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=4),
        parallel=OffloadingParallelConfig(rank=0, world_size=2, tp_size=2),
        engine="vllm",
        salt="",
    )


GOLDEN_KEY = make_offload_key(bytes(range(16)), 1)
# Computed once from base_config() and pinned: a change here is a change of the on-disk
# layout that orphans every existing cache, so it needs a SCHEMA_VERSION bump.
GOLDEN_DIGEST = "67863f7916041c38d61d23985ceff5a6a56256467c23f1228c830d401aa4e0b2"
GOLDEN_NAMESPACE = "meta-llama__Llama-3.1-8B-67863f7916041c38"
GOLDEN_RELATIVE_PATH = f"{GOLDEN_NAMESPACE}/00/01/000102030405060708090a0b0c0d0e0f_g1.kvc"
GOLDEN_OBJECT_KEY = f"prod/cache/{GOLDEN_RELATIVE_PATH}"


def replace_model(**changes: Any) -> Callable[[OffloadingConfig], OffloadingConfig]:
    return lambda c: dataclasses.replace(c, model=dataclasses.replace(c.model, **changes))


def replace_cache(**changes: Any) -> Callable[[OffloadingConfig], OffloadingConfig]:
    return lambda c: dataclasses.replace(c, cache=dataclasses.replace(c.cache, **changes))


def replace_parallel(**changes: Any) -> Callable[[OffloadingConfig], OffloadingConfig]:
    return lambda c: dataclasses.replace(c, parallel=dataclasses.replace(c.parallel, **changes))


def replace_group0(**changes: Any) -> Callable[[OffloadingConfig], OffloadingConfig]:
    def mutate(c: OffloadingConfig) -> OffloadingConfig:
        first = dataclasses.replace(c.groups[0], **changes)
        return dataclasses.replace(c, groups=(first, *c.groups[1:]))

    return mutate


# identity field (dotted as in the manifest) -> a config change that touches only it
FIELD_MUTATIONS: dict[str, Callable[[OffloadingConfig], OffloadingConfig]] = {
    "engine": lambda c: dataclasses.replace(c, engine="sglang"),
    "model_name": replace_model(name="meta-llama/Llama-3.1-70B"),
    "model_revision": replace_model(revision="0e9e39f"),
    "kv_dtype": replace_model(dtype="float8_e4m3fn"),
    "kv_layout": replace_model(kv_layout="HND"),
    "model_fingerprint": replace_model(fingerprint="sha256:" + "ab" * 32),
    "compute_dtype": replace_model(compute_dtype="float16"),
    "quantization": replace_model(quantization="awq"),
    "kv_scales": replace_model(kv_scales="calculated"),
    "model_overrides": replace_model(overrides='{"rope_theta":500000.0}'),
    "draft_model": replace_model(draft_model="eagle3:org/draft@main"),
    "canonical_format": replace_model(canonical_format="v1-nhd"),
    "load_format": replace_model(load_format="dummy"),
    "model_config": replace_model(config_digest="sha256:" + "cd" * 32),
    "identity_source": lambda c: dataclasses.replace(c, identity_source="offloading-config-only"),
    "tokens_per_hash": replace_cache(tokens_per_hash=32),
    "blocks_per_chunk": replace_cache(blocks_per_chunk=2),
    "hash_algorithm": replace_cache(hash_algorithm="sha256"),
    "groups.tokens_per_block": replace_group0(tokens_per_block=32),
    "groups.layer_names": replace_group0(layer_names=("layers.0.attn", "layers.1.mlp")),
    "groups.layer_names order": replace_group0(layer_names=("layers.1.attn", "layers.0.attn")),
    "groups.bytes_per_block": replace_group0(bytes_per_block=131072),
    "groups.attention": replace_group0(attention="sliding_window:4096"),
    "groups (fewer)": lambda c: dataclasses.replace(c, groups=c.groups[:1]),
    "groups (order)": lambda c: dataclasses.replace(c, groups=c.groups[::-1]),
    "parallel.world_size": replace_parallel(world_size=4),
    "parallel.tp_size": replace_parallel(tp_size=4),
    "parallel.pp_size": replace_parallel(pp_size=2),
    "parallel.pcp_size": replace_parallel(pcp_size=2),
    "parallel.dcp_size": replace_parallel(dcp_size=2),
    "parallel (agnostic)": replace_parallel(is_parallelism_agnostic=True),
    "salt": lambda c: dataclasses.replace(c, salt="tenant-a"),
}


def golden_identity() -> NamespaceIdentity:
    return NamespaceIdentity.from_config(base_config())


def leaf_fields(data: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted names of an identity dict's fields, groups and parallel expanded."""
    names = set()
    for name, value in data.items():
        if name == "groups":
            names |= leaf_fields(value[0], "groups.")
        elif name == "parallel":
            names |= leaf_fields(value, "parallel.")
        else:
            names.add(prefix + name)
    return names


# --- golden strings ---------------------------------------------------------------------


def test_golden_digest_and_namespace() -> None:
    identity = golden_identity()
    assert identity.hexdigest == GOLDEN_DIGEST
    assert identity.digest == bytes.fromhex(GOLDEN_DIGEST)
    assert identity.namespace == GOLDEN_NAMESPACE


def test_golden_path_and_object_key(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, golden_identity())
    assert mapper.relative_path(GOLDEN_KEY) == GOLDEN_RELATIVE_PATH
    assert mapper.path(GOLDEN_KEY) == tmp_path / GOLDEN_RELATIVE_PATH
    assert mapper.object_key(GOLDEN_KEY, "prod/cache") == GOLDEN_OBJECT_KEY


def test_canonical_json_is_sorted_compact_ascii() -> None:
    identity = dataclasses.replace(golden_identity(), salt="é")
    text = identity.canonical_json().decode("ascii")
    assert text.startswith('{"blocks_per_chunk":4,"canonical_format":"","chunk_format_version":1,')
    assert ", " not in text and ": " not in text
    assert '"salt":"\\u00e9"' in text


@pytest.mark.parametrize(
    "prefix", ["prod/cache", "/prod/cache", "prod/cache/", "//prod/cache//"]
)
def test_object_key_strips_prefix_slashes(prefix: str, tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, golden_identity())
    assert mapper.object_key(GOLDEN_KEY, prefix) == GOLDEN_OBJECT_KEY


@pytest.mark.parametrize("prefix", ["", "/", "//"])
def test_object_key_without_prefix_is_the_relative_path(prefix: str, tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, golden_identity())
    assert mapper.object_key(GOLDEN_KEY, prefix) == GOLDEN_RELATIVE_PATH


# --- every identity field moves the namespace -------------------------------------------


@pytest.mark.parametrize("field", sorted(FIELD_MUTATIONS))
def test_changing_an_identity_field_moves_the_namespace(field: str) -> None:
    base = golden_identity()
    changed = NamespaceIdentity.from_config(FIELD_MUTATIONS[field](base_config()))
    assert changed != base
    assert changed.digest != base.digest
    assert changed.namespace != base.namespace
    assert FileMapper("/r", changed).relative_path(GOLDEN_KEY) != GOLDEN_RELATIVE_PATH


def test_changing_schema_version_moves_the_namespace() -> None:
    base = golden_identity()
    changed = dataclasses.replace(base, schema_version=SCHEMA_VERSION + 1)
    assert changed.namespace != base.namespace


def test_a_chunk_format_bump_moves_the_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    base = golden_identity()
    monkeypatch.setattr(chunkformat, "FORMAT_VERSION", chunkformat.FORMAT_VERSION + 1)
    bumped = NamespaceIdentity.from_config(base_config())
    assert bumped.chunk_format_version == base.chunk_format_version + 1
    assert bumped.namespace != base.namespace


def test_every_identity_field_has_a_mutation() -> None:
    """A field added to the identity without a namespace-move test fails here."""
    covered = {name.split(" ")[0] for name in FIELD_MUTATIONS} | {
        "schema_version",
        "chunk_format_version",
    }
    assert leaf_fields(golden_identity().to_dict()) <= covered


def test_rank_does_not_move_the_namespace() -> None:
    base = golden_identity()
    other_rank = NamespaceIdentity.from_config(replace_parallel(rank=1)(base_config()))
    assert other_rank == base
    assert other_rank.namespace == base.namespace
    assert "rank" not in other_rank.canonical_json().decode()


def test_parallelism_agnostic_collapses_parallel_sizes() -> None:
    agnostic = replace_parallel(is_parallelism_agnostic=True)
    tp2 = NamespaceIdentity.from_config(agnostic(base_config()))
    tp4 = NamespaceIdentity.from_config(
        replace_parallel(world_size=8, tp_size=4, pp_size=2, rank=5)(agnostic(base_config()))
    )
    assert tp2.parallel is None
    assert tp2.to_dict()["parallel"] is None
    assert tp4.namespace == tp2.namespace
    assert tp2.namespace != golden_identity().namespace


# --- namespace name ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_name", "safe"),
    [
        ("meta-llama/Llama-3.1-8B", "meta-llama__Llama-3.1-8B"),
        ("org/sub/model", "org__sub__model"),
        ("my model:v2@x", "my_model_v2_x"),
        (".hidden", "_.hidden"),
        ("..", "_.."),
        ("../../etc", "_..__..__etc"),
        ("模型", "__"),
        ("a\\b", "a_b"),
    ],
)
def test_namespace_name_is_a_safe_path_component(model_name: str, safe: str) -> None:
    identity = NamespaceIdentity.from_config(replace_model(name=model_name)(base_config()))
    assert identity.namespace == f"{safe}-{identity.hexdigest[:16]}"
    assert Path(identity.namespace).name == identity.namespace
    assert not identity.namespace.startswith(".")


# --- to_dict / from_dict ----------------------------------------------------------------


def test_dict_round_trip() -> None:
    for identity in (
        golden_identity(),
        NamespaceIdentity.from_config(FIELD_MUTATIONS["parallel (agnostic)"](base_config())),
    ):
        restored = NamespaceIdentity.from_dict(identity.to_dict())
        assert restored == identity
        assert restored.digest == identity.digest
        assert isinstance(restored.groups[0].layer_names, tuple)


def _mutated_dict(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = golden_identity().to_dict()
    edit(data)
    return data


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (lambda d: d.pop("salt"), "salt"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(tokens_per_hash="16"), "tokens_per_hash"),
        (lambda d: d.update(tokens_per_hash=True), "tokens_per_hash"),
        (lambda d: d.update(tokens_per_hash=16.0), "tokens_per_hash"),
        (lambda d: d.update(engine=None), "engine"),
        (lambda d: d.update(groups={}), "groups"),
        (lambda d: d["groups"][1].pop("bytes_per_block"), "groups[1].bytes_per_block"),
        (lambda d: d["groups"][0].update(tokens_per_block=[16]), "groups[0].tokens_per_block"),
        (lambda d: d["groups"][0].update(layer_names="l0"), "groups[0].layer_names"),
        (lambda d: d["groups"][0]["layer_names"].append(3), "groups[0].layer_names[2]"),
        (lambda d: d["groups"].append("g"), "groups[2]"),
        (lambda d: d["parallel"].update(rank=0), "parallel.rank"),
        (lambda d: d["parallel"].pop("dcp_size"), "parallel.dcp_size"),
        (lambda d: d.update(parallel=[]), "parallel"),
    ],
)
def test_from_dict_rejects_missing_extra_and_mistyped_fields(
    edit: Callable[[dict[str, Any]], None], path: str
) -> None:
    with pytest.raises(ConfigError) as info:
        NamespaceIdentity.from_dict(_mutated_dict(edit))
    assert info.value.path == path
    assert path in str(info.value)


def test_from_dict_rejects_a_non_object() -> None:
    with pytest.raises(ConfigError):
        NamespaceIdentity.from_dict([1, 2])


# --- key <-> file name ------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        GOLDEN_KEY,
        make_offload_key(b"\xff" * 32, 0),
        make_offload_key(b"\x00\x01", 2**32 - 1),
        make_offload_key(bytes.fromhex("deadbeef" * 4), 7),
    ],
)
def test_key_from_name_inverts_relative_path(key: OffloadKey, tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, golden_identity())
    name = mapper.path(key).name
    assert name.endswith(CHUNK_SUFFIX)
    assert mapper.key_from_name(name) == key


@pytest.mark.parametrize(
    "name",
    [
        "",
        MANIFEST_NAME,
        temp_path_for(Path("000102030405060708090a0b0c0d0e0f_g1.kvc")).name,
        "000102030405060708090a0b0c0d0e0f_g1.kvc.bak",
        "000102030405060708090a0b0c0d0e0f_g1",
        "000102030405060708090A0B0C0D0E0F_g1.kvc",
        "000102030405060708090a0b0c0d0e0_g1.kvc",
        "ab_g0.kvc",
        "0001_g01.kvc",
        "0001_g-1.kvc",
        "0001_g.kvc",
        "0001g1.kvc",
        "0001_g4294967296.kvc",
        "0001_g" + "9" * 5000 + ".kvc",
        "00/01/0001_g1.kvc",
        "zz01_g1.kvc",
    ],
)
def test_key_from_name_rejects_other_names(name: str, tmp_path: Path) -> None:
    assert FileMapper(tmp_path, golden_identity()).key_from_name(name) is None


def test_keys_with_too_short_a_hash_are_refused(tmp_path: Path) -> None:
    mapper = FileMapper(tmp_path, golden_identity())
    for key in (OffloadKey(b"\x00\x00\x00\x01"), make_offload_key(b"\x07", 0)):
        with pytest.raises(ValueError, match="block hash"):
            mapper.relative_path(key)


def test_mapper_locations(tmp_path: Path) -> None:
    mapper = FileMapper(str(tmp_path), golden_identity())
    assert mapper.root == tmp_path
    assert mapper.namespace == GOLDEN_NAMESPACE
    assert mapper.namespace_dir == tmp_path / GOLDEN_NAMESPACE
    assert mapper.manifest_path == tmp_path / GOLDEN_NAMESPACE / MANIFEST_NAME


@settings(max_examples=200, deadline=None)
@given(block_hash=st.binary(min_size=2, max_size=64), group=st.integers(0, 2**32 - 1))
def test_paths_stay_two_levels_under_the_namespace(block_hash: bytes, group: int) -> None:
    mapper = FileMapper("/srv/kv", golden_identity())
    key = make_offload_key(block_hash, group)
    path = mapper.path(key)
    assert path.parent.parent.parent == mapper.namespace_dir
    assert Path(os.path.normpath(path)).is_relative_to(mapper.namespace_dir)
    assert path.parent.name == block_hash[1:2].hex()
    assert path.parent.parent.name == block_hash[:1].hex()
    assert mapper.key_from_name(path.name) == key
