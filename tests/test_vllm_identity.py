"""The cache identity through both vLLM routes, built the way vLLM's engine core builds its
scheduler.

Each case makes vLLM 0.33.0's real config objects (``VllmConfig``, ``ModelConfig``,
``CacheConfig``, ``ParallelConfig``, ``KVTransferConfig``, ``KVCacheConfig`` and its specs)
and constructs vLLM's own ``OffloadingConnector`` in the scheduler role, with no
"current vLLM config" set, exactly as ``EngineCore`` does: route 1 loads
``KVTiersOffloadingSpec``, route 2 loads vLLM's ``TieringOffloadingSpec`` with a
``KVTiersFileTier`` below it. The test reads the namespace the kvtiers file tier opened.

``ModelConfig`` and ``VllmConfig`` are allocated without their validation (which imports
the model's implementation, beyond the no-deps test install) and given the fields vLLM's
validation would set; every other config object is built through its constructor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload import base as vbase

from kvtiers.core import chunkformat
from kvtiers.errors import ConfigError
from kvtiers.filemapper import MANIFEST_NAME, FileMapper, NamespaceIdentity
from kvtiers.integrations.vllm import KVTiersConnector, compat, translate
from kvtiers.integrations.vllm import engine as engine_module

ROUTES = ("spec", "tiering")
BLOCK_SIZE = 16
NUM_BLOCKS = 16
TOTAL_KV_HEADS = 2
HEAD_SIZE = 16


@dataclasses.dataclass(frozen=True)
class Engine:
    """One engine's settings; every field maps to a vLLM config value."""

    model: str
    revision: str | None = None
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: str = "auto"
    quantization: str | None = None
    kv_cache_scheme: dict[str, Any] | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    hf_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    hash_algo: str = "sha256"
    kv_cache_layout: str = "LBNHC"
    sliding_window: int | None = None
    draft_model: str | None = None
    speculative_method: str = "draft_model"
    load_format: str = "auto"
    loader_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Fields of the model config vLLM loaded (from --hf-config-path, say) that the model
    # directory's config.json does not have.
    loaded_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    tp_size: int = 1
    rank: int = 0
    canonical_layout: bool = False
    block_size: int = BLOCK_SIZE
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    tier: dict[str, Any] = dataclasses.field(default_factory=dict)


def model_config(engine: Engine) -> Any:
    # Keyword arguments LlamaConfig's annotations may not list (they vary by release).
    settings: dict[str, Any] = {
        "rope_theta": engine.rope_theta,
        "max_position_embeddings": engine.max_position_embeddings,
    }
    hf = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=TOTAL_KV_HEADS,
        num_hidden_layers=2, vocab_size=256, **settings,
    )
    if engine.kv_cache_scheme is not None:
        hf.quantization_config = {"quant_method": "compressed-tensors",
                                  "kv_cache_scheme": engine.kv_cache_scheme}
    for name, value in engine.hf_overrides.items():
        setattr(hf, name, value)  # vLLM applies hf_overrides to the HF config it loads
    for name, value in engine.loaded_config.items():
        setattr(hf, name, value)
    hf._name_or_path = str(engine.model)  # as transformers records where it read the config
    config = ModelConfig.__new__(ModelConfig)
    fields = {
        "model": engine.model, "revision": engine.revision, "dtype": engine.dtype,
        "quantization": engine.quantization, "hf_config": hf, "hf_text_config": hf,
        "hf_overrides": dict(engine.hf_overrides), "max_model_len": 1024,
        "model_impl": "auto",
    }
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    config.__dict__["_model_info"] = SimpleNamespace(architecture="LlamaForCausalLM")
    config.__dict__["_supports_multimodal_for_mm_prefix"] = lambda: False
    object.__setattr__(config, "model_arch_config", config.get_model_arch_config())
    return config


def speculative_config(engine: Engine) -> Any:
    if engine.draft_model is None:
        return None
    config = SpeculativeConfig.__new__(SpeculativeConfig)
    fields = {
        "method": engine.speculative_method, "model": engine.draft_model, "revision": None,
        "quantization": None, "num_speculative_tokens": 3, "disable_eagle_block_drop": True,
    }
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


def kv_cache_config(engine: Engine) -> Any:
    heads = TOTAL_KV_HEADS // engine.tp_size
    full = FullAttentionSpec(
        block_size=engine.block_size, num_kv_heads=heads, head_size=HEAD_SIZE,
        dtype=torch.float16,
    )
    if engine.sliding_window is None:
        groups = [KVCacheGroupSpec(["l0", "l1"], full)]
    else:
        window = SlidingWindowSpec(
            block_size=engine.block_size, num_kv_heads=heads, head_size=HEAD_SIZE,
            dtype=torch.float16, sliding_window=engine.sliding_window,
        )
        groups = [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], window)]
    page = full.page_size_bytes
    tensor = KVCacheTensor(
        size=page * 2 * NUM_BLOCKS, layers=["l0", "l1"], layer_stride=page * NUM_BLOCKS,
        block_stride=page,
    )
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=groups)


def vllm_config(engine: Engine, route: str, root: Path) -> Any:
    tier = {"root": str(root), "io": "posix", "threads": 1, **engine.tier}
    if route == "spec":
        extra: dict[str, Any] = {
            "spec_name": "KVTiersOffloadingSpec", "spec_module_path": "kvtiers.integrations.vllm",
            "kvtiers": {"tiers": [{"kind": "cpu", "capacity": "64KiB"},
                                  {"kind": "file", **tier}]},
        }
    else:
        extra = {
            "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [{"type": "KVTiersFileTier",
                                 "module_path": "kvtiers.integrations.vllm", **tier}],
        }
    if engine.canonical_layout:
        extra["canonical_layout"] = True
    extra.update(engine.extra)
    cache = CacheConfig(
        block_size=engine.block_size, cache_dtype=engine.cache_dtype,
        prefix_caching_hash_algo=engine.hash_algo,
    )
    cache.kv_cache_layout = engine.kv_cache_layout  # resolved by the engine core first
    parallel = ParallelConfig(tensor_parallel_size=engine.tp_size)
    parallel.rank = engine.rank
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        engine_id=f"identity-{uuid.uuid4().hex}", kv_connector_extra_config=extra,
    )
    config = VllmConfig.__new__(VllmConfig)
    fields = {
        "model_config": model_config(engine), "cache_config": cache,
        "parallel_config": parallel, "kv_transfer_config": transfer, "kv_events_config": None,
        "speculative_config": speculative_config(engine), "attention_config": AttentionConfig(),
        "load_config": LoadConfig(
            load_format=engine.load_format, model_loader_extra_config=engine.loader_config
        ),
    }
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


def file_tier(connector: Any, route: str) -> Any:
    return manager_tier(connector.scheduler.manager, route)


def manager_tier(manager: Any, route: str) -> Any:
    if route == "spec":
        return manager.stack.tiers[1]
    return manager.secondary_tiers[0].tier


@pytest.fixture(autouse=True)
def v1_model_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's connector asks which model runner is in use; the V2 check needs a platform.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A local model directory: a config and (tiny, fake) weight files."""
    path = tmp_path / "models" / "tiny"
    path.mkdir(parents=True)
    LlamaConfig(hidden_size=64, num_hidden_layers=2).to_json_file(str(path / "config.json"))
    (path / "model-00001-of-00002.safetensors").write_bytes(b"a" * 100)
    (path / "model-00002-of-00002.safetensors").write_bytes(b"b" * 50)
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    return path


def no_current_config() -> None:
    from vllm.config import get_current_vllm_config_or_none

    assert get_current_vllm_config_or_none() is None


def identity_of(
    engine: Engine, route: str, root: Path, connector_class: type = OffloadingConnector
) -> NamespaceIdentity:
    """The identity the file tier opens when vLLM's scheduler is built for ``engine`` (by
    vLLM's own connector unless ``connector_class`` says otherwise)."""
    no_current_config()
    connector = connector_class(
        vllm_config(engine, route, root), KVConnectorRole.SCHEDULER, kv_cache_config(engine)
    )
    try:
        identity: NamespaceIdentity = file_tier(connector, route).manager.mapper.identity
        return identity
    finally:
        connector.shutdown()


FP8 = {"cache_dtype": "fp8"}
# identity input -> (engine settings before, after): only that input differs
CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "revision": ({}, {"revision": "r3"}),
    "hash algorithm": ({}, {"hash_algo": "sha256_cbor"}),
    "KV dtype": ({}, FP8),
    "compute dtype under fp8 KV": (FP8, {**FP8, "dtype": torch.float16}),
    "weight quantization": ({}, {"quantization": "awq"}),
    "KV scale source": (FP8, {**FP8, "kv_cache_scheme": {"num_bits": 8, "type": "float"}}),
    "rope_theta": ({}, {"rope_theta": 500000.0}),
    "max_position_embeddings": ({}, {"max_position_embeddings": 4096}),
    "hf_overrides": ({}, {"hf_overrides": {"partial_rotary_factor": 0.5}}),
    "sliding window": ({"sliding_window": 128}, {"sliding_window": 256}),
    "KV layout": ({}, {"kv_cache_layout": "LBHNC"}),
    "draft model": ({}, {"draft_model": "org/draft"}),
    "salt": ({}, {"extra": {"kvtiers_salt": "tenant-a"}}),
    "load format": ({}, {"load_format": "dummy"}),
    "loaded model config": ({}, {"loaded_config": {"rms_norm_eps": 1e-3}}),
}


def base_engine(model_dir: Path, **changes: Any) -> Engine:
    return dataclasses.replace(Engine(model=str(model_dir), revision="r2"), **changes)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_identity_input_moves_the_namespace(
    route: str, change: str, model_dir: Path, tmp_path: Path
) -> None:
    before_settings, after_settings = CHANGES[change]
    before = identity_of(base_engine(model_dir, **before_settings), route, tmp_path / "kv")
    after = identity_of(base_engine(model_dir, **after_settings), route, tmp_path / "kv")
    assert after.namespace != before.namespace, change


@pytest.mark.parametrize("route", ROUTES)
def test_the_sliding_window_size_moves_the_namespace(
    route: str, model_dir: Path, tmp_path: Path
) -> None:
    small = identity_of(base_engine(model_dir, sliding_window=128), route, tmp_path / "kv")
    large = identity_of(base_engine(model_dir, sliding_window=256), route, tmp_path / "kv")
    assert [g.attention for g in small.groups] == ["full", "sliding_window:128"]
    assert [g.attention for g in large.groups] == ["full", "sliding_window:256"]
    assert small.namespace != large.namespace


@pytest.mark.parametrize("route", ROUTES)
def test_identity_fields_are_read_from_the_engine_configs(
    route: str, model_dir: Path, tmp_path: Path
) -> None:
    engine = dataclasses.replace(
        base_engine(model_dir), cache_dtype="fp8", quantization="awq",
        kv_cache_scheme={"num_bits": 8}, draft_model="org/draft", hash_algo="sha256_cbor",
    )
    identity = identity_of(engine, route, tmp_path / "kv")
    assert identity.model_name == str(model_dir.resolve())
    assert identity.model_revision == "r2"
    assert identity.model_fingerprint.startswith("sha256:")
    assert (identity.compute_dtype, identity.kv_dtype) == ("bfloat16", "fp8")
    assert identity.quantization == "awq"
    assert identity.kv_scales == 'checkpoint:{"num_bits":8}'
    assert '"rope_theta":10000.0' in identity.model_overrides
    assert '"model":"org/draft"' in identity.draft_model
    assert identity.hash_algorithm == "vllm:sha256_cbor"
    layout = "LBNHC" if route == "spec" else "LBNHC+vllm-cpu-chunk"
    assert identity.kv_layout == layout
    assert identity.chunk_format_version == chunkformat.FORMAT_VERSION
    assert identity.load_format == ""
    assert identity.model_config.startswith("sha256:")
    assert identity.identity_source == ""


@pytest.mark.parametrize("route", ROUTES)
def test_a_chunk_format_bump_moves_the_namespace(
    route: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    monkeypatch.setattr(chunkformat, "FORMAT_VERSION", chunkformat.FORMAT_VERSION + 1)
    after = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    assert after.namespace != before.namespace


@pytest.mark.parametrize("route", ROUTES)
def test_a_respelled_model_path_keeps_the_namespace(
    route: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    absolute = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    linked = identity_of(base_engine(link), route, tmp_path / "kv")
    monkeypatch.chdir(model_dir.parent)
    relative = identity_of(base_engine(Path("tiny")), route, tmp_path / "kv")
    dotted = identity_of(base_engine(Path("../models/tiny/")), route, tmp_path / "kv")
    assert absolute.namespace == linked.namespace == relative.namespace == dotted.namespace


@pytest.mark.parametrize("route", ROUTES)
def test_tier_settings_keep_the_namespace(route: str, model_dir: Path, tmp_path: Path) -> None:
    base = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    other = identity_of(
        base_engine(model_dir, tier={"threads": 3, "capacity": "1MiB"}), route, tmp_path / "kv"
    )
    assert other.namespace == base.namespace


def test_rank_keeps_the_namespace(model_dir: Path, tmp_path: Path) -> None:
    ranks = [
        identity_of(base_engine(model_dir, tp_size=2, rank=rank), "tiering", tmp_path / "kv")
        for rank in (0, 1)
    ]
    assert ranks[0].namespace == ranks[1].namespace


def test_parallel_sizes_leave_the_identity_only_by_opt_in(
    model_dir: Path, tmp_path: Path
) -> None:
    # vLLM 0.34 reports pages parallelism-agnostic only in its canonical layout.
    canonical = compat.AGNOSTIC_NEEDS_CANONICAL

    def namespace(tp_size: int, **extra: Any) -> NamespaceIdentity:
        engine = base_engine(model_dir, tp_size=tp_size, extra=extra, canonical_layout=canonical)
        return identity_of(engine, "tiering", tmp_path / "kv")

    # vLLM reports this layout parallelism-agnostic; without the opt-in the sizes stay.
    assert namespace(1).parallel is not None
    assert namespace(1).namespace != namespace(2).namespace
    opted = [namespace(tp, kvtiers_parallel_agnostic=True) for tp in (1, 2)]
    assert opted[0].parallel is None
    assert opted[0].namespace == opted[1].namespace


def test_the_parallel_opt_in_needs_vllms_word_on_the_layout(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM 0.34 no longer reports direct-layout pages parallelism-agnostic: the opt-in
    then leaves the sizes in the identity, so engines sharded differently never share."""
    engine = base_engine(model_dir, extra={"kvtiers_parallel_agnostic": True})
    opted = identity_of(engine, "tiering", tmp_path / "kv")
    assert (opted.parallel is not None) == compat.AGNOSTIC_NEEDS_CANONICAL


def test_route_1_honours_the_parallel_opt_in(model_dir: Path, tmp_path: Path) -> None:
    """Route 1 stores kvtiers' own layout (it refuses ``canonical_layout``): it may leave
    the sizes out only where vLLM reports its direct layout parallelism-agnostic."""
    plain = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    opted = identity_of(
        base_engine(model_dir, extra={"kvtiers_parallel_agnostic": True}), "spec", tmp_path / "kv"
    )
    assert plain.parallel is not None
    assert (opted.parallel is not None) == compat.AGNOSTIC_NEEDS_CANONICAL


def test_canonical_layout_has_its_own_namespace(model_dir: Path, tmp_path: Path) -> None:
    direct = identity_of(base_engine(model_dir), "tiering", tmp_path / "kv")
    canonical = identity_of(base_engine(model_dir, canonical_layout=True), "tiering",
                            tmp_path / "kv")
    assert direct.canonical_format == ""
    assert canonical.canonical_format.startswith("v")
    assert canonical.namespace != direct.namespace


# --- cold misses through the scheduler-construction path ---------------------------------

KEY = vbase.make_offload_key(bytes(range(16)), 0)


def plant_chunk(identity: NamespaceIdentity, root: Path, payload_bytes: int) -> None:
    """One valid chunk of ``identity``'s namespace, as an earlier engine would leave it."""
    path = FileMapper(root, identity).path(KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(chunkformat.encode(identity.digest, KEY, os.urandom(payload_bytes)))


def lookup_after_restart(engine: Engine, route: str, root: Path) -> Any:
    connector = OffloadingConnector(
        vllm_config(engine, route, root), KVConnectorRole.SCHEDULER, kv_cache_config(engine)
    )
    try:
        tier = file_tier(connector, route)
        tier.manager.wait_index()
        return tier.manager.lookup(KEY, None)
    finally:
        connector.shutdown()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda e: dataclasses.replace(e, revision="r3"), id="revision"),
        pytest.param(lambda e: dataclasses.replace(e, hash_algo="sha256_cbor"), id="hash"),
    ],
)
def test_revision_and_hash_algorithm_changes_are_cold_misses(
    route: str, change: Callable[[Engine], Engine], tmp_path: Path
) -> None:
    """An engine started with another ``--revision`` or ``--prefix-caching-hash-algo``
    must not find the chunks of the previous one; the same engine again must."""
    from kvtiers.core.manager import LookupResult

    root = tmp_path / "kv"
    first = Engine(model="org/model", revision="r2")
    identity = identity_of(first, route, root)
    chunk_bytes = identity.groups[0].bytes_per_block * identity.blocks_per_chunk
    plant_chunk(identity, root, chunk_bytes)
    assert lookup_after_restart(first, route, root) is LookupResult.HIT
    assert lookup_after_restart(change(first), route, root) is LookupResult.MISS


def test_engine_configs_are_found_without_a_current_config(
    model_dir: Path, tmp_path: Path
) -> None:
    """The identity differs from one built with no engine configs at all: they were read."""
    identity = identity_of(base_engine(model_dir, quantization="awq"), "spec", tmp_path / "kv")
    assert identity.quantization == "awq"
    assert identity.model_revision == "r2"


@pytest.fixture(autouse=True)
def _no_leaked_shared_memory() -> Iterator[None]:
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {name for name in after - before if name.startswith("kvtiers-identity-")}


def test_fake_weights_are_never_read(model_dir: Path, tmp_path: Path) -> None:
    """The fingerprint uses weight sizes, not contents: same sizes, same identity."""
    before = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    (model_dir / "model-00001-of-00002.safetensors").write_bytes(b"z" * 100)
    same = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    (model_dir / "model-00001-of-00002.safetensors").write_bytes(b"z" * 101)
    grown = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    assert same.namespace == before.namespace
    assert grown.namespace != before.namespace


@pytest.mark.parametrize("route", ROUTES)
def test_the_namespace_is_logged_at_start(
    route: str, model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="kvtiers.integrations.vllm.translate"):
        identity = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    assert f"namespace {identity.namespace}" in caplog.text


# --- without the engine's configs the identity fails closed ------------------------------

OPT_IN = {"kvtiers_identity": "offloading-config-only"}


def manager_outside_a_connector(engine: Engine, route: str, root: Path) -> Any:
    """The scheduler's manager of ``engine``'s spec built from vLLM's offloading config
    directly, as a tool or a connector that wraps vLLM's would: no vLLM frame holds the
    engine's configs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    offloading = build_offloading_config(vllm_config(engine, route, root), kv_cache_config(engine))
    return OffloadingSpecFactory.create_spec(offloading).get_manager()


@pytest.mark.parametrize("route", ROUTES)
def test_outside_a_connector_a_persistent_tier_is_refused(
    route: str, model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    with pytest.raises(ConfigError) as caught:
        manager_outside_a_connector(base_engine(model_dir), route, root)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("kv_connector_extra_config.kvtiers_identity: ")
    assert "no VllmConfig" in message and "quantization" in message
    assert "KVTiersConnector" in message and "kvtiers_identity: offloading-config-only" in message
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize("route", ROUTES)
def test_outside_a_connector_the_opt_in_opens_a_marked_namespace(
    route: str, model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    engine = base_engine(model_dir, extra=OPT_IN)
    manager = manager_outside_a_connector(engine, route, root)
    try:
        partial: NamespaceIdentity = manager_tier(manager, route).manager.mapper.identity
    finally:
        manager.shutdown()
    assert partial.identity_source == "offloading-config-only"
    manifest = json.loads((root / partial.namespace / MANIFEST_NAME).read_text())
    assert manifest["identity"]["identity_source"] == "offloading-config-only"
    # What the offloading config does not carry is missing, as the marker says.
    assert (partial.quantization, partial.compute_dtype, partial.model_config) == ("", "", "")
    # The same engine through vLLM's connector: the opt-in is not needed, the identity is
    # complete and its namespace is another.
    complete = identity_of(engine, route, root)
    assert complete.identity_source == ""
    assert complete.namespace != partial.namespace


def test_outside_a_connector_a_cpu_only_stack_is_built_with_a_warning(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(translate, "_warned", set())
    cpu_only = {"kvtiers": {"tiers": [{"kind": "cpu", "capacity": "64KiB"}]}}
    with caplog.at_level("WARNING", logger="kvtiers.integrations.vllm.translate"):
        manager = manager_outside_a_connector(
            base_engine(model_dir, extra=cpu_only), "spec", tmp_path / "kv"
        )
    manager.shutdown()
    assert "could not find the VllmConfig" in caplog.text
    assert "nothing persists" in caplog.text


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_identity_opt_in_is_refused(
    route: str, model_dir: Path, tmp_path: Path
) -> None:
    engine = base_engine(model_dir, extra={"kvtiers_identity": "partial"})
    with pytest.raises(ConfigError, match="kvtiers_identity: expected 'offloading-config-only'"):
        identity_of(engine, route, tmp_path / "kv")


@pytest.mark.parametrize("route", ROUTES)
def test_kvtiers_connector_hands_its_configs_to_the_identity(
    route: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVTiersConnector's identity is the one vLLM's connector gives, without a frame read."""
    engine = base_engine(model_dir, quantization="awq")
    through_frames = identity_of(engine, route, tmp_path / "kv")
    monkeypatch.setattr(engine_module, "MAX_FRAMES", 0)
    with pytest.raises(ConfigError, match="no VllmConfig"):
        identity_of(engine, route, tmp_path / "kv")
    handed = identity_of(engine, route, tmp_path / "kv", connector_class=KVTiersConnector)
    assert handed == through_frames
    assert (handed.quantization, handed.identity_source) == ("awq", "")
    # Handed only while the connector is built.
    assert engine_module.find_engine_configs() is None


def test_kvtiers_connector_is_found_by_vllms_connector_factory() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    transfer = KVTransferConfig(
        kv_connector="KVTiersConnector", kv_connector_module_path="kvtiers.integrations.vllm",
        kv_role="kv_both",
    )
    found = KVConnectorFactory.get_connector_class(transfer)
    assert found is KVTiersConnector
    assert KVConnectorFactory.supports_hma_config(transfer)


# --- identity inputs vLLM gives in more than one spelling ---------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("load_format", ["safetensors", "pt", "fastsafetensors"])
def test_loaders_of_the_checkpoint_keep_the_namespace(
    route: str, load_format: str, model_dir: Path, tmp_path: Path
) -> None:
    auto = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    other = identity_of(base_engine(model_dir, load_format=load_format), route, tmp_path / "kv")
    assert other.namespace == auto.namespace


def test_a_loaders_settings_are_recorded_by_digest(model_dir: Path, tmp_path: Path) -> None:
    """Loader settings name where the weights come from and may hold credentials: the
    namespace follows them, the manifest never shows them."""
    def identity(uri: str) -> NamespaceIdentity:
        engine = base_engine(
            model_dir, load_format="tensorizer",
            loader_config={"tensorizer_uri": uri, "s3_secret_access_key": "hunter2"},
        )
        return identity_of(engine, "spec", tmp_path / "kv")

    first, second = identity("s3://a/model.tensors"), identity("s3://b/model.tensors")
    assert first.load_format.startswith("tensorizer:sha256:")
    assert first.namespace != second.namespace
    manifest = (tmp_path / "kv" / first.namespace / MANIFEST_NAME).read_text()
    assert "hunter2" not in manifest and "s3://a" not in manifest


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "suffix"])
def test_speculation_without_draft_layers_keeps_the_namespace(
    route: str, method: str, model_dir: Path, tmp_path: Path
) -> None:
    plain = identity_of(base_engine(model_dir), route, tmp_path / "kv")
    speculating = identity_of(
        base_engine(model_dir, draft_model=method, speculative_method=method),
        route, tmp_path / "kv",
    )
    assert speculating.draft_model == ""
    assert speculating.namespace == plain.namespace


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model"])
def test_speculation_with_draft_layers_moves_the_namespace(
    method: str, model_dir: Path, tmp_path: Path
) -> None:
    plain = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    speculating = identity_of(
        base_engine(model_dir, draft_model="org/draft", speculative_method=method),
        "spec", tmp_path / "kv",
    )
    assert f'"method":"{method}"' in speculating.draft_model
    assert speculating.namespace != plain.namespace


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("alias", "name"), [("NHD", "LBNHC"), ("HND", "LBHNC")])
def test_layout_aliases_name_the_layout_they_stand_for(
    route: str, alias: str, name: str, model_dir: Path, tmp_path: Path
) -> None:
    canonical = route == "tiering"
    by_name = identity_of(
        base_engine(model_dir, kv_cache_layout=name, canonical_layout=canonical), route,
        tmp_path / "kv",
    )
    by_alias = identity_of(
        base_engine(model_dir, kv_cache_layout=alias, canonical_layout=canonical), route,
        tmp_path / "kv",
    )
    assert by_alias.kv_layout.startswith(name)
    if canonical:
        assert by_alias.canonical_format == f"v1-{alias.lower()}"
    assert by_alias.namespace == by_name.namespace


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_layout_is_refused_in_one_line(
    route: str, model_dir: Path, tmp_path: Path
) -> None:
    engine = base_engine(model_dir, kv_cache_layout="NDH", canonical_layout=route == "tiering")
    with pytest.raises(ConfigError) as caught:
        identity_of(engine, route, tmp_path / "kv")
    message = str(caught.value)
    assert "\n" not in message
    assert "unknown KV cache layout 'NDH'" in message and "LBNHC" in message


def kvtiers_diff(capsys: pytest.CaptureFixture[str], root: Path, a: str, b: str) -> list[str]:
    """The field lines ``kvtiers diff`` prints for namespaces ``a`` and ``b`` under ``root``."""
    from kvtiers import cli

    capsys.readouterr()
    assert cli.main(["diff", str(root), a, b]) == 1  # the identities differ
    lines = capsys.readouterr().out.splitlines()
    # The field lines follow "N field(s) differ"; the A/B lines above may wrap (indented).
    start = next(i for i, line in enumerate(lines) if line.endswith(("differs:", "differ:")))
    return [line.strip() for line in lines[start + 1:]]


def test_kvtiers_diff_names_the_load_format_and_the_identity_source(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "kv"
    real = identity_of(base_engine(model_dir), "spec", root)
    dummy = identity_of(base_engine(model_dir, load_format="dummy"), "spec", root)
    assert kvtiers_diff(capsys, root, real.namespace, dummy.namespace) == [
        'load_format: "" -> "dummy"'
    ]
    manager = manager_outside_a_connector(base_engine(model_dir, extra=OPT_IN), "spec", root)
    try:
        partial: NamespaceIdentity = manager_tier(manager, "spec").manager.mapper.identity
    finally:
        manager.shutdown()
    assert 'identity_source: "offloading-config-only" -> ""' in kvtiers_diff(
        capsys, root, partial.namespace, real.namespace
    )


def test_a_cache_of_vllm_033s_default_block_size_is_a_cold_miss_under_034s(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.34's default ``block_size`` is 64 (0.33's 16): a key then hashes 64 tokens,
    so a cache written under the old default is another namespace, and ``kvtiers diff``
    says why, one line per field."""
    root = tmp_path / "kv"
    for route in ROUTES:
        old = identity_of(base_engine(model_dir, block_size=16), route, root)
        new = identity_of(base_engine(model_dir, block_size=64), route, root)
        assert old.namespace != new.namespace
        lines = kvtiers_diff(capsys, root, old.namespace, new.namespace)
        assert "tokens_per_hash: 16 -> 64" in lines
        assert len({line.split(":")[0] for line in lines}) == len(lines)  # a line a field


def test_a_hash_lookahead_moves_the_namespace(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a hash lookahead (vLLM 0.34 under EAGLE / MTP) a key also covers the tokens
    after its block: the identity's hash algorithm says so."""
    plain = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    monkeypatch.setattr(translate, "hash_lookahead", lambda vllm_config: 1)
    ahead = identity_of(base_engine(model_dir), "spec", tmp_path / "kv")
    assert ahead.hash_algorithm == plain.hash_algorithm + ".lookahead-1"
    assert ahead.namespace != plain.namespace


def test_the_hash_lookahead_is_read_from_the_engine_config() -> None:
    assert compat.hash_lookahead(SimpleNamespace(num_hash_lookahead_tokens=2)) == 2
    assert compat.hash_lookahead(SimpleNamespace(num_hash_lookahead_tokens=0)) == 0
    assert compat.hash_lookahead(SimpleNamespace()) == 0  # vLLM 0.32 has no such field
