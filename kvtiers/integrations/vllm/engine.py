"""The engine's own configuration, as the cache identity reads it.

vLLM 0.32 and 0.33 hand an offloading spec only its offloading ``OffloadingConfig`` (model
name, KV dtype, groups, parallel sizes) and a secondary tier only that spec. Everything
else that changes the bytes of K or V — the revision, weight quantization, compute dtype,
RoPE overrides, sliding windows, a draft model, the load format, the model config as
loaded, the block-hash algorithm — lives in the ``VllmConfig`` and ``KVCacheConfig`` the
connector was built with. vLLM builds the scheduler without setting its process-global
"current config", so that global cannot be trusted.

:func:`find_engine_configs` therefore takes the two objects from the connector that is
building this spec or tier, in this order:

1. handed over: :class:`~kvtiers.integrations.vllm.connector.KVTiersConnector` (vLLM's
   ``OffloadingConnector`` with kvtiers' name) builds vLLM's connector inside
   :func:`handing`, which gives its own two configs to every spec and tier built in that
   call;
2. otherwise, for vLLM's own ``OffloadingConnector``: the nearest enclosing vLLM frame
   (``OffloadingConnector.__init__`` for a spec, ``OffloadingConnectorScheduler.__init__``
   for a secondary tier) whose local ``vllm_config`` is a ``VllmConfig``.

Either way those are the very objects the connector was handed, in every process and role.
:func:`model_inputs` then reads each identity input from them.

Invariant: nothing here reads a process-global vLLM config; every value comes from the
objects found. When none are found (a spec built outside a connector) the caller refuses
a persistent tier unless the operator accepts the weaker identity
(:func:`~kvtiers.integrations.vllm.translate.identity_source`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kvtiers.errors import ConfigError

#: How many frames above the caller to search; vLLM's chain is 3 to 6 deep.
MAX_FRAMES = 32
#: KV cache dtypes whose values need scales.
_QUANTIZED_KV = ("fp8", "int8", "int4", "nvfp4", "mxfp4")
#: vLLM's load formats that read the model's own checkpoint files (whose names, sizes and
#: config the fingerprint covers), so the choice among them leaves the weights alone.
CHECKPOINT_LOAD_FORMATS = frozenset({
    "auto", "hf", "safetensors", "pt", "npcache", "fastsafetensors", "instanttensor",
    "mistral", "runai_streamer", "sharded_state", "runai_streamer_sharded",
})
#: vLLM's speculative methods that propose tokens without layers of their own, so they add
#: no KV to the cache (every other method, a custom one included, is recorded).
NO_KV_SPECULATIVE_METHODS = frozenset(
    {"ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator"}
)
#: Keys of a loaded model config that say where and by which library version it was read,
#: not what the model computes (a respelled path must keep the namespace).
_CONFIG_PROVENANCE_KEYS = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


@dataclass(frozen=True)
class EngineConfigs:
    """The ``VllmConfig`` (and ``KVCacheConfig``, when known) a connector was built with."""

    vllm: Any
    kv_cache: Any | None


_HANDED: ContextVar[EngineConfigs | None] = ContextVar("kvtiers_engine_configs", default=None)


@contextmanager
def handing(configs: EngineConfigs) -> Iterator[None]:
    """Within this block (this thread or task only), :func:`find_engine_configs` returns
    ``configs``: what a connector that knows its configs wraps its building in."""
    token = _HANDED.set(configs)
    try:
        yield
    finally:
        _HANDED.reset(token)


def handed_over() -> bool:
    """Whether the caller is being built inside :func:`handing` (by ``KVTiersConnector``)."""
    return _HANDED.get() is not None


def find_engine_configs() -> EngineConfigs | None:
    """The configs of the vLLM connector building the caller, or ``None`` (see the module
    docstring). Frames of modules outside the ``vllm`` package are never read."""
    handed = _HANDED.get()
    if handed is not None:
        return handed
    try:
        from vllm.config import VllmConfig
        from vllm.v1.kv_cache_interface import KVCacheConfig
    except ImportError:
        return None
    for local in vllm_frame_locals(sys._getframe(1), MAX_FRAMES):
        found = local.get("vllm_config")
        if isinstance(found, VllmConfig):
            kv_cache = local.get("kv_cache_config")
            return EngineConfigs(
                vllm=found,
                kv_cache=kv_cache if isinstance(kv_cache, KVCacheConfig) else None,
            )
    return None


def vllm_frame_locals(
    frame: FrameType | None, max_frames: int, *, function: str | None = None
) -> Iterator[Mapping[str, Any]]:
    """The local variables of ``frame`` and the frames that called it, ``max_frames`` in
    all, of those in the ``vllm`` package only (and, given ``function``, only of calls of
    a function of that name): the one way kvtiers reads what vLLM holds up the stack.
    Frames of modules outside vLLM are never read."""
    for _ in range(max_frames):
        if frame is None:
            return
        if ((function is None or frame.f_code.co_name == function)
                and str(frame.f_globals.get("__name__", "")).startswith("vllm.")):
            yield frame.f_locals
        frame = frame.f_back


def layout_name(name: str, path: str) -> str:
    """vLLM's name of the KV-cache layout ``name``, its compatibility aliases (``NHD``,
    ``HND``) resolved through vLLM's own table; a layout vLLM does not know raises a
    one-line :class:`~kvtiers.errors.ConfigError` at ``path``."""
    from vllm.config.cache import _layout_from_name
    from vllm.v1.kv_cache_layout import KVCacheLayout

    try:
        return str(_layout_from_name(name).name)
    except ValueError:
        raise ConfigError(
            f"unknown KV cache layout {name!r}; vLLM knows "
            + ", ".join(layout.name for layout in KVCacheLayout)
            + " (and the aliases NHD, HND)",
            path=path,
        ) from None


@dataclass(frozen=True)
class ModelInputs:
    """The identity inputs read from the engine's model, cache and speculative configs."""

    model: str
    revision: str | None
    compute_dtype: str
    quantization: str
    kv_scales: str
    overrides: str
    draft_model: str
    load_format: str
    config_digest: str
    hash_algorithm: str
    kv_layout: str | None


def _canonical(value: Mapping[str, Any]) -> str:
    """Compact sorted JSON; values JSON cannot hold are named by their type, never by
    their ``repr`` (which may hold a memory address and differ between processes)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), default=lambda o: type(o).__qualname__
    )


def _overrides(model_config: Any, cache_config: Any) -> str:
    """The settings that change K (stored after RoPE) or a layer's KV bytes."""
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    found: dict[str, Any] = {}
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "max_position_embeddings",
                 "partial_rotary_factor"):
        value = getattr(text, name, None)
        if value is not None:
            found[name] = value
    hf_overrides = getattr(model_config, "hf_overrides", None)
    if callable(hf_overrides):
        found["hf_overrides"] = f"callable:{getattr(hf_overrides, '__qualname__', '?')}"
    elif hf_overrides:
        found["hf_overrides"] = dict(hf_overrides)
    skipped = list(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ())
    if skipped:
        found["kv_cache_dtype_skip_layers"] = skipped
    return _canonical(found) if found else ""


def _kv_scales(model_config: Any, kv_dtype: str) -> str:
    """Where a quantized KV cache's scales come from: the checkpoint's KV scheme, or the
    default scales; empty for an unquantized KV cache."""
    if not kv_dtype.startswith(_QUANTIZED_KV):
        return ""
    quant = getattr(model_config.hf_config, "quantization_config", None)
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, Mapping) else None
    if scheme:
        return "checkpoint:" + _canonical(scheme if isinstance(scheme, Mapping) else {"": scheme})
    return "checkpoint" if model_config.quantization else "default"


def _draft_model(speculative_config: Any) -> str:
    """The speculative-decoding draft whose layers add KV to the cache; empty without one
    and for methods that add no layers (:data:`NO_KV_SPECULATIVE_METHODS`)."""
    if speculative_config is None or speculative_config.method in NO_KV_SPECULATIVE_METHODS:
        return ""
    return _canonical(
        {
            "method": speculative_config.method,
            "model": speculative_config.model,
            "revision": speculative_config.revision,
            "quantization": speculative_config.quantization,
            "num_speculative_tokens": speculative_config.num_speculative_tokens,
        }
    )


def _digest(value: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(value).encode()).hexdigest()


def _load_format(load_config: Any) -> str:
    """How the weights were made when not read from the checkpoint: the load format, with a
    digest of its loader settings when there are any (they may name where the weights come
    from, and may hold credentials, which must not reach a manifest); empty for the formats
    that read the checkpoint (:data:`CHECKPOINT_LOAD_FORMATS`)."""
    load_format = str(getattr(load_config, "load_format", "auto")).lower()
    if load_format in CHECKPOINT_LOAD_FORMATS:
        return ""
    extra = getattr(load_config, "model_loader_extra_config", None)
    return f"{load_format}:{_digest(dict(extra))}" if extra else load_format


def _without_provenance(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            key: _without_provenance(item)
            for key, item in value.items()
            if key not in _CONFIG_PROVENANCE_KEYS
        }
    if isinstance(value, (list, tuple)):
        return [_without_provenance(item) for item in value]
    return value


def _config_digest(model_config: Any) -> str:
    """A digest of the model config vLLM loaded (``--hf-config-path`` may read it from
    another directory than the weights'), less the keys that only say where it was read."""
    return _digest(_without_provenance(model_config.hf_config.to_dict()))


def model_inputs(engine: EngineConfigs, kv_dtype: str) -> ModelInputs:
    """Every identity input the engine's configs hold; ``kv_dtype`` is the resolved KV
    cache dtype vLLM put in the offloading config."""
    vllm = engine.vllm
    model_config, cache_config = vllm.model_config, vllm.cache_config
    layout = getattr(cache_config, "kv_cache_layout", None)
    if layout is None and engine.kv_cache is not None:
        layout = getattr(engine.kv_cache, "kv_cache_layout", None)
    return ModelInputs(
        model=str(model_config.model),
        revision=model_config.revision,
        compute_dtype=str(model_config.dtype).removeprefix("torch."),
        quantization=str(model_config.quantization or ""),
        kv_scales=_kv_scales(model_config, kv_dtype),
        overrides=_overrides(model_config, cache_config),
        draft_model=_draft_model(vllm.speculative_config),
        load_format=_load_format(vllm.load_config),
        config_digest=_config_digest(model_config),
        hash_algorithm=str(cache_config.prefix_caching_hash_algo),
        kv_layout=None if layout is None else str(layout),
    )


def group_attention(engine: EngineConfigs | None, group: Any, tokens_per_chunk: int) -> str:
    """How far back offloaded group ``group`` attends: from its KV-cache spec when the
    engine's ``KVCacheConfig`` is known, else from the offloading config's window in chunks.
    """
    if engine is not None and engine.kv_cache is not None:
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            FullAttentionSpec,
            MambaSpec,
            SlidingWindowSpec,
            iter_layer_specs,
        )

        spec = next(iter(iter_layer_specs(engine.kv_cache.kv_cache_groups[group.group_id]
                                          .kv_cache_spec)))
        if isinstance(spec, SlidingWindowSpec):
            return f"sliding_window:{spec.sliding_window}"
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return f"chunked_local:{spec.attention_chunk_size}"
        if isinstance(spec, MambaSpec):
            return "mamba"
        if isinstance(spec, FullAttentionSpec):
            return "full"
        return type(spec).__name__
    # vLLM 0.33 carries the window on the offloading config; 0.32's has no such field (and
    # its engine config, read above, is then the only source).
    window = getattr(group, "sliding_window_size_in_chunks", None)
    if window is None:
        return "full"
    return f"window:{window * tokens_per_chunk}"
