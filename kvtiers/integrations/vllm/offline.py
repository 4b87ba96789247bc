"""The cache identity a ``vllm serve`` command line gives, computed without serving.

``kvtiers identity --vllm ARGS...`` takes the arguments ``vllm serve`` takes and answers
with the namespace route 1 (:class:`~kvtiers.integrations.vllm.spec.KVTiersOffloadingSpec`)
would open for them, so an operator can compare it with the namespaces already stored
(``kvtiers inspect``, ``kvtiers diff``) before starting the server. It goes through vLLM's
own classes, as the engine does:

1. the arguments through vLLM's ``EngineArgs`` parser and ``create_engine_config`` (the
   engine's ``VllmConfig``; options only the HTTP server reads, such as ``--port``, are
   ignored);
2. the model's layers built on PyTorch's ``meta`` device (no weights read, no memory
   allocated) in a one-process group, each attention layer's KV-cache spec read as the
   model runner reads it, the KV-cache layout resolved as the engine core resolves it, and
   vLLM's ``get_kv_cache_configs`` grouping them (a ``KVCacheConfig``);
3. vLLM's ``build_offloading_config`` and the offloading spec vLLM's factory would create,
   with the two configs handed over as :class:`~kvtiers.integrations.vllm.connector.
   KVTiersConnector` hands them (:func:`~kvtiers.integrations.vllm.engine.handing`).
   Building the spec reads the stack file and computes the identity; it creates nothing
   (the stack is built only when vLLM asks the spec for its manager).

Limits: the answer holds for the platform this command runs on (vLLM's defaults, the
block size for one, depend on it: run it where the server runs); an engine of more than
one rank (tensor or pipeline parallel) is refused, since its layers cannot be built in
one process.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

from kvtiers.core.config import OffloadingConfig
from kvtiers.errors import ConfigError
from kvtiers.integrations.vllm.engine import EngineConfigs, handing

#: What ``kv_connector_extra_config`` must name for route 1's spec.
SPEC_NAME = "KVTiersOffloadingSpec"


def engine_args(argv: Sequence[str]) -> Any:
    """vLLM's ``EngineArgs`` for ``vllm serve``'s arguments ``argv`` (a leading model name
    is taken as ``--model``, as ``vllm serve MODEL`` takes it); options vLLM's engine does
    not know are left to the server and ignored."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = list(argv)
    if args and not args[0].startswith("-"):
        args = ["--model", args[0], *args[1:]]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm serve"))
    namespace, _ = parser.parse_known_args(args)
    return EngineArgs.from_cli_args(namespace)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _one_process_group() -> None:
    """vLLM's distributed state for one rank (gloo on loopback), which building the
    model's layers needs; left as it is when this process already has one."""
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo",
    )
    ensure_model_parallel_initialized(1, 1)


def kv_cache_config(vllm_config: Any) -> Any:
    """The ``KVCacheConfig`` the engine core would make for ``vllm_config``'s model (see
    the module docstring, step 2); its number of blocks is whatever the memory offered
    here gives, which no identity input depends on."""
    import torch
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    model_config = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        _one_process_group()
        model_class, _ = get_model_architecture(model_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            model_class(vllm_config=vllm_config, prefix="")
        specs: dict[str, Any] = {}
        # As the model runner's get_kv_cache_spec: a layer sharing another's KV has none.
        for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
            if isinstance(layer, Attention) and layer.kv_sharing_target_layer_name:
                continue
            spec = layer.get_kv_cache_spec(vllm_config)
            if spec and isinstance(spec, AttentionSpec):
                spec = customize_attention_spec(layer.get_attn_backend(), spec)
            if spec:
                specs[name] = spec
        layouts = get_supported_kv_cache_layouts(get_current_attn_backends(vllm_config))
        resolve_kv_cache_layout(vllm_config, [[layout.name for layout in layouts]],
                                list(specs.values()))
        room = 4 * sum(spec.max_memory_usage_bytes(vllm_config) for spec in specs.values())
        config = get_kv_cache_configs(vllm_config, [specs], [room])[0]
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return config


def identity_of(vllm_config: Any, kv_cache: Any) -> OffloadingConfig:
    """The cache identity route 1's spec computes for an engine with these configs: the
    spec vLLM's factory makes from vLLM's own offloading config, built with the configs
    handed over as :class:`KVTiersConnector` hands them. A ``kv_transfer_config`` that is
    not route 1's is a :class:`ConfigError`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from kvtiers.integrations.vllm.spec import KVTiersOffloadingSpec

    _require_kvtiers(vllm_config)
    with handing(EngineConfigs(vllm=vllm_config, kv_cache=kv_cache)):
        spec = OffloadingSpecFactory.create_spec(build_offloading_config(vllm_config, kv_cache))
    assert isinstance(spec, KVTiersOffloadingSpec)
    return spec.offloading


def _require_kvtiers(vllm_config: Any) -> None:
    """A :class:`ConfigError` unless ``vllm_config``'s transfer config is route 1's."""
    transfer = vllm_config.kv_transfer_config
    extra = {} if transfer is None else dict(transfer.kv_connector_extra_config or {})
    if extra.get("spec_name") != SPEC_NAME:
        raise ConfigError(
            "the arguments turn no kvtiers stack on: give --kv-transfer-config as "
            "`kvtiers vllm-config STACK` prints it (spec_name KVTiersOffloadingSpec)",
            path="kv_transfer_config",
        )


def identity_from_args(argv: Sequence[str]) -> OffloadingConfig:
    """The cache identity ``vllm serve ARGV`` would use (see the module docstring). What
    vLLM refuses in the arguments (a model it cannot find, a bad value) is one
    :class:`ConfigError` line, as ``vllm serve`` would refuse it."""
    try:
        vllm_config = engine_args(argv).create_engine_config()
    except (ValueError, TypeError, OSError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"vLLM refuses these arguments: {message}", path="vllm") from None
    _require_kvtiers(vllm_config)
    if vllm_config.parallel_config.world_size > 1:
        raise ConfigError(
            f"an engine of {vllm_config.parallel_config.world_size} ranks (tensor or "
            "pipeline parallel): its identity cannot be computed offline yet; read it in "
            "the server's log (`kvtiers cache identity … namespace`)",
            path="parallel_config",
        )
    return identity_of(vllm_config, kv_cache_config(vllm_config))
