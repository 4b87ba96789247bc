"""Doubles of SGLang 0.5.23's host KV pools, and a ``HiCacheStorageConfig`` maker.

SGLang's host pool classes (``sglang/srt/mem_cache/pool_host/mha.py``, ``mla.py``) cannot
be imported on a CPU-only torch: their module imports ``sglang.srt.configs``, which
imports torchvision, and the package index's torchvision links CUDA torch
(``docs/sglang.md``). These doubles keep exactly the page geometry the storage backend
relies on — the host tensor's shape per layout, ``get_page_buffer_meta``,
``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page`` and the
attributes the backend reads — and none of the device transfers:

* :class:`MHATokenToKVPoolHost`: K and V, ``(2, size, layers, heads, head_dim)`` for
  ``page_first``, ``(2, layers, size, heads, head_dim)`` for ``layer_first``,
  ``(2, pages, layers, page_size, heads, head_dim)`` for ``page_first_direct`` and
  ``(2, pages, heads, page_size, layers, head_dim)`` for ``page_head``; a page-first
  page is two buffers (its K, its V), a layer-first one two per layer.
* :class:`MLATokenToKVPoolHost`: one latent per token, ``(size, layers, 1, dim)`` for
  ``page_first``, ``(layers, size, 1, dim)`` for ``layer_first``; one buffer per page.
* :class:`StatePoolHost`: a hybrid model's extra pool whose data page is gathered
  (``torch.cat``) from per-page state tensors, as SGLang's Mamba pool does; it has no
  page buffers, so it is stored as a copied flat page.

Indices are token indices, as SGLang passes them: page ``p`` starts at ``p * page_size``.

:func:`require_sglang` is how a test module asks for SGLang: where ``make test`` runs it
(``KVTIERS_REQUIRE_SGLANG=1``) a missing or unsupported SGLang fails the run; elsewhere the
module is skipped with the reason and the command that installs it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

#: Set by ``make test``: the SGLang tests must run, never skip.
REQUIRE_ENV = "KVTIERS_REQUIRE_SGLANG"
#: SGLang's keys of a dynamic backend's extra config, naming the kvtiers backend.
DYNAMIC_EXTRA = {
    "backend_name": "kvtiers",
    "module_path": "kvtiers.integrations.sglang",
    "class_name": "KVTiersHiCacheStorage",
    "interface_v1": 1,
}


def require_sglang() -> None:
    """Import the SGLang integration, or fail (under ``make test``) or skip the calling
    test module with the reason."""
    try:
        import kvtiers.integrations.sglang  # noqa: F401
    except ImportError as exc:
        reason = f"SGLang 0.5.23 is needed ({exc}); `make test` installs it"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason, allow_module_level=True)


@dataclass
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` the backend reads, for code that
    builds the real one (:func:`storage_config`)."""

    model_name: str
    extra_config: dict[str, Any]
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = True
    enable_storage_metrics: bool = False
    dcp_size: int = 1
    dcp_rank: int = 0


def page_keys(n: int, seed: str = "a") -> list[str]:
    """``n`` page keys shaped like SGLang's (sha256 hex digests)."""
    return [hashlib.sha256(f"{seed}-{i}".encode()).hexdigest() for i in range(n)]


def build_backend(
    tiers: list[dict[str, Any]], pool: Any, *, extra_pools: Sequence[tuple[str, Any]] = (),
    model: str = "org/model", extra: dict[str, Any] | None = None, **config: Any,
) -> Any:
    """The kvtiers backend as SGLang builds it: the factory's ``dynamic`` route with
    ``tiers`` as the stack, then the host pools' registration. ``config`` sets
    :class:`StorageConfig` fields."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    options = {**DYNAMIC_EXTRA, "kvtiers_config": {"tiers": tiers}, **(extra or {})}
    built = StorageBackendFactory.create_backend(
        "dynamic",
        storage_config(StorageConfig(model_name=model, extra_config=options, **config)),
        pool,
    )
    built.register_mem_pool_host(pool)
    for name, extra_pool in extra_pools:
        built.register_mem_host_pool_v2(extra_pool, name)
    built.on_host_pools_registered()
    return built


def storage_config(config: StorageConfig) -> Any:
    """SGLang's own ``HiCacheStorageConfig`` with ``config``'s values."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank,
        pp_size=config.pp_size, attn_cp_rank=config.attn_cp_rank,
        attn_cp_size=config.attn_cp_size, is_mla_model=config.is_mla_model,
        enable_storage_metrics=config.enable_storage_metrics,
        is_page_first_layout=config.is_page_first_layout, model_name=config.model_name,
        extra_config=dict(config.extra_config), dcp_size=config.dcp_size,
        dcp_rank=config.dcp_rank,
    )


class _HostPool:
    """What every double shares: page arithmetic and the attributes SGLang's
    ``HostKVCache`` has."""

    storage_format_tag: str | None = None

    def __init__(self, *, pages: int, page_size: int, layers: int, layout: str,
                 dtype: torch.dtype, start_layer: int = 0) -> None:
        self.page_size = page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layer_num = layers
        self.start_layer = start_layer
        self.end_layer = start_layer + layers
        self.layout = layout
        self.dtype = dtype
        self.device = "cpu"
        self.pin_memory = False

    def fill_random(self, generator: torch.Generator) -> None:
        """Random bytes in every page (tests compare pages byte for byte)."""
        raw = self.kv_buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))

    def zero(self) -> None:
        self.kv_buffer.zero_()

    def page_bytes(self, index: int) -> bytes:
        """The flat data page at token index ``index``, as bytes."""
        return bytes(self.get_data_page(index, flat=True).contiguous().view(torch.uint8).numpy())

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.get_data_page(0, flat=True).numel(), dtype=self.dtype)

    kv_buffer: torch.Tensor

    def _page_view(self, index: int) -> torch.Tensor:
        """The page at token index ``index`` as a view into ``kv_buffer`` (the layout's
        own shape); each pool lays its buffer out differently."""
        raise NotImplementedError

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page_view(index)
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        target = self._page_view(index)
        target.copy_(data_page.reshape(target.shape))


class MHATokenToKVPoolHost(_HostPool):
    """K and V per token and layer (see the module docstring)."""

    def __init__(self, *, pages: int, page_size: int, layers: int, heads: int,
                 head_dim: int, layout: str = "page_first",
                 dtype: torch.dtype = torch.bfloat16, start_layer: int = 0) -> None:
        super().__init__(pages=pages, page_size=page_size, layers=layers, layout=layout,
                         dtype=dtype, start_layer=start_layer)
        self.head_num = heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        shapes = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_size, heads, head_dim),
            "page_head": (2, pages, heads, page_size, layers, head_dim),
        }
        if layout not in shapes:
            raise ValueError(f"unsupported layout {layout!r}")
        self.kv_buffer = torch.zeros(shapes[layout], dtype=dtype)

    def _page_view(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + self.page_size]
        page = index // self.page_size
        return self.kv_buffer[:, page : page + 1]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        token_bytes = self.head_num * self.head_dim * item
        ptrs: list[int] = []
        for start in indices.tolist()[:: self.page_size]:
            if self.layout == "layer_first":
                for layer in range(self.layer_num):
                    k = base + start * token_bytes + layer * self.size * token_bytes
                    ptrs += [k, k + v_offset]
                size = self.page_size * token_bytes
            else:
                k = base + start * self.layer_num * token_bytes
                ptrs += [k, k + v_offset]
                size = self.layer_num * self.page_size * token_bytes
        return ptrs, [size] * len(ptrs)


class MLATokenToKVPoolHost(_HostPool):
    """One latent vector per token and layer (see the module docstring)."""

    def __init__(self, *, pages: int, page_size: int, layers: int, kv_cache_dim: int,
                 layout: str = "page_first", dtype: torch.dtype = torch.bfloat16,
                 start_layer: int = 0) -> None:
        super().__init__(pages=pages, page_size=page_size, layers=layers, layout=layout,
                         dtype=dtype, start_layer=start_layer)
        self.kv_cache_dim = kv_cache_dim
        shapes = {
            "layer_first": (layers, self.size, 1, kv_cache_dim),
            "page_first": (self.size, layers, 1, kv_cache_dim),
        }
        if layout not in shapes:
            raise ValueError(f"unsupported layout {layout!r}")
        self.kv_buffer = torch.zeros(shapes[layout], dtype=dtype)

    def _page_view(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, index : index + self.page_size]
        return self.kv_buffer[index : index + self.page_size]

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        base = self.kv_buffer.data_ptr()
        ptrs: list[int] = []
        for start in indices.tolist()[:: self.page_size]:
            if self.layout == "layer_first":
                ptrs += [base + start * self.kv_cache_dim * item
                         + layer * self.size * self.kv_cache_dim * item
                         for layer in range(self.layer_num)]
                size = self.page_size * self.kv_cache_dim * item
            else:
                ptrs.append(base + start * self.layer_num * self.kv_cache_dim * item)
                size = self.layer_num * self.page_size * self.kv_cache_dim * item
        return ptrs, [size] * len(ptrs)


class StatePoolHost(_HostPool):
    """Per-page state tensors whose data page is gathered (see the module docstring)."""

    def __init__(self, *, pages: int, page_size: int, layers: int, state_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(pages=pages, page_size=page_size, layers=layers,
                         layout="page_first", dtype=dtype)
        self.conv = torch.zeros((pages, layers, state_dim), dtype=dtype)
        self.temporal = torch.zeros((pages, layers, 2 * state_dim), dtype=dtype)
        self.kv_buffer = self.conv

    def fill_random(self, generator: torch.Generator) -> None:
        for tensor in (self.conv, self.temporal):
            raw = tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))

    def zero(self) -> None:
        self.conv.zero_()
        self.temporal.zero_()

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = index // self.page_size
        return torch.cat([self.conv[page].flatten(), self.temporal[page].flatten()])

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        page = index // self.page_size
        conv = self.conv[page].numel()
        self.conv[page].copy_(data_page[:conv].reshape(self.conv[page].shape))
        self.temporal[page].copy_(data_page[conv:].reshape(self.temporal[page].shape))


def page_indices(pages: list[int], page_size: int) -> torch.Tensor:
    """The token indices SGLang passes for ``pages`` (page numbers), ``page_size`` each."""
    return torch.tensor(
        [page * page_size + t for page in pages for t in range(page_size)], dtype=torch.int64
    )
