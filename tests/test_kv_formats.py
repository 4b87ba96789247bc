"""KV formats no CPU engine runs, round-tripped byte-exact through every tier, codec on and off.

vLLM's CPU build runs neither MLA with prefix caching (its CPU platform turns prefix
caching off for MLA) nor the per-token-head quantized formats (its attention backends take
``auto`` and the fp8 kinds only): docs/vllm.md, "Model shapes on the CPU build". Their
chunks are tested here at class level, as the worker would lay them out in a slot:

* ``fp8_e4m3`` / ``fp8_e5m2`` with per-tensor scales: K and V values only (the scales are
  layer constants, never in the cache);
* ``fp8_per_token_head`` / ``int8_per_token_head``: K values, K's float32 scale per token
  and head, then the same for V (the scales travel in the chunk with their values);
* ``mla_bfloat16``: one latent per token (512 latent + 64 rope dims, bfloat16), the same on
  every tensor-parallel rank;
* ``mla_fp8_scaled``: per token 512 fp8 latent values, 4 float32 group scales and 64
  bfloat16 rope dims (656 bytes, the fp8 MLA cache's token layout).

Each chunk goes through the CPU tier (the primary's slots) and each lower tier (file, S3 on
a moto server, fsspec in memory) with ``codec: none`` and ``blosc2-zstd`` (the file tier
with ``blosc2-lz4`` too), and must load back byte for byte: a codec shuffling by the
identity's element size must not mix the scales' bytes into the values' or lose either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtiers.config.tiers import CodecName, FileTierConfig, FsspecTierConfig, S3TierConfig
from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.core.specs import CPULoadStoreSpec
from kvtiers.core.tier import BuiltTier
from kvtiers.policies import load_policy
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tiers.cpu import CpuTierManager, SlotRegion
from tests.test_file_support import offloading_config

TOKENS = 16
HEADS = 2
HEAD_DIM = 64
LATENT, ROPE = 512, 64
CHUNKS = 3


def _normal(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """KV-like values: per channel normal, every 16th channel 20 times louder."""
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    values[..., ::16] *= 20.0
    return values


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _per_tensor(dtype: torch.dtype) -> Callable[[int], bytes]:
    def make(seed: int) -> bytes:
        k, v = (_normal((TOKENS, HEADS, HEAD_DIM), seed + i) for i in (0, 1))
        return _raw(k.to(dtype)) + _raw(v.to(dtype))

    return make


def _per_token_head(dtype: torch.dtype, top: float) -> Callable[[int], bytes]:
    def make(seed: int) -> bytes:
        parts = []
        for i in (0, 1):  # K, then V
            values = _normal((TOKENS, HEADS, HEAD_DIM), seed + i)
            scales = values.abs().amax(dim=-1) / top
            quantized = (values / scales.unsqueeze(-1)).clamp(-top, top)
            if not dtype.is_floating_point:
                quantized = quantized.round()
            parts += [_raw(quantized.to(dtype)), _raw(scales.to(torch.float32))]
        return b"".join(parts)

    return make


def _mla_bfloat16(seed: int) -> bytes:
    return _raw(_normal((TOKENS, LATENT + ROPE), seed).to(torch.bfloat16))


def _mla_fp8_scaled(seed: int) -> bytes:
    latent = _normal((TOKENS, LATENT), seed)
    scales = latent.view(TOKENS, 4, LATENT // 4).abs().amax(dim=-1) / 448.0
    quantized = (latent.view(TOKENS, 4, -1) / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    rope = _normal((TOKENS, ROPE), seed + 1).to(torch.bfloat16)
    rows = [
        _raw(quantized[t]) + _raw(scales[t].to(torch.float32)) + _raw(rope[t])
        for t in range(TOKENS)
    ]
    return b"".join(rows)


#: name -> (the identity's KV dtype, one chunk's bytes from a seed).
FORMATS: dict[str, tuple[str, Callable[[int], bytes]]] = {
    "fp8_e4m3": ("fp8_e4m3", _per_tensor(torch.float8_e4m3fn)),
    "fp8_e5m2": ("fp8_e5m2", _per_tensor(torch.float8_e5m2)),
    "fp8_per_token_head": ("fp8_per_token_head", _per_token_head(torch.float8_e4m3fn, 448.0)),
    "int8_per_token_head": ("int8_per_token_head", _per_token_head(torch.int8, 127.0)),
    "mla_bfloat16": ("bfloat16", _mla_bfloat16),
    "mla_fp8_scaled": ("fp8_ds_mla", _mla_fp8_scaled),
}
#: Bytes of one chunk of each format.
CHUNK_BYTES = {
    "fp8_e4m3": 2 * TOKENS * HEADS * HEAD_DIM,
    "fp8_e5m2": 2 * TOKENS * HEADS * HEAD_DIM,
    "fp8_per_token_head": 2 * TOKENS * HEADS * (HEAD_DIM + 4),
    "int8_per_token_head": 2 * TOKENS * HEADS * (HEAD_DIM + 4),
    "mla_bfloat16": TOKENS * (LATENT + ROPE) * 2,
    "mla_fp8_scaled": TOKENS * (LATENT + 4 * 4 + ROPE * 2),
}
#: (tier kind, codec): every lower tier with the codec off and on; the second codec on
#: the file tier only (the codec is the tiers' shared code: once is enough for it).
TIER_CODECS: list[tuple[str, CodecName]] = [
    (kind, codec) for kind in ("file", "s3", "fsspec") for codec in ("none", "blosc2-zstd")
] + [("file", "blosc2-lz4")]


def _payloads(fmt: str) -> dict[OffloadKey, bytes]:
    make = FORMATS[fmt][1]
    return {conformance_key(i): make(100 * i) for i in range(CHUNKS)}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_has_its_layout_size(fmt: str) -> None:
    payloads = _payloads(fmt)
    assert {len(p) for p in payloads.values()} == {CHUNK_BYTES[fmt]}
    assert len(set(payloads.values())) == CHUNKS


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_cpu_tier_round_trips_each_format(fmt: str) -> None:
    payloads = _payloads(fmt)
    size = CHUNK_BYTES[fmt]
    manager = CpuTierManager(
        CHUNKS, size, load_policy("lru")(CHUNKS), region=SlotRegion(CHUNKS, size)
    )
    assert manager.region is not None
    ctx = ReqContext("formats")
    keys = list(payloads)
    stored = manager.prepare_store(keys, ctx)
    assert stored is not None and list(stored) == keys
    spec = manager.get_spec(keys)
    assert isinstance(spec, CPULoadStoreSpec)
    for index, key in enumerate(keys):
        manager.region.view(int(spec.slot_ids[index]))[:size] = payloads[key]
    manager.complete_store(keys, ctx)
    assert all(manager.lookup(key, ctx) is LookupResult.HIT for key in keys)
    manager.prepare_load(keys, ctx)
    spec = manager.get_spec(keys)
    assert isinstance(spec, CPULoadStoreSpec)
    loaded = {
        key: bytes(manager.region.view(int(spec.slot_ids[i]))[:size])
        for i, key in enumerate(keys)
    }
    manager.complete_load(keys, ctx)
    assert loaded == payloads


@pytest.fixture
def make_tier(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., TierDriver[Any]]]:
    built: list[BuiltTier[Any]] = []

    def make(kind: str, fmt: str, codec_name: CodecName) -> TierDriver[Any]:
        kv_dtype = FORMATS[fmt][0]
        offloading = offloading_config(dtype=kv_dtype, bytes_per_block=CHUNK_BYTES[fmt])
        geometry = ChunkGeometry.from_config(offloading)
        region = BytearrayRegion(CHUNKS, geometry.slot_bytes)
        config: Any
        if kind == "file":
            from kvtiers.tiers.file.factory import build_tier

            config = FileTierConfig(name="file", root=str(tmp_path), threads=2, codec=codec_name)
        elif kind == "s3":
            from kvtiers.tiers.s3.factory import build_tier  # type: ignore[assignment]

            endpoint: MotoServer = request.getfixturevalue("s3_endpoint")
            config = S3TierConfig(name="s3", bucket=BUCKET, prefix=f"{fmt}-{codec_name}",
                                  threads=2, endpoint_url=endpoint.endpoint_url,
                                  codec=codec_name)
        else:
            pytest.importorskip("fsspec")
            from kvtiers.tiers.fsspec.factory import build_tier  # type: ignore[assignment]

            config = FsspecTierConfig(name="m", url=f"memory://formats-{fmt}-{codec_name}",
                                      codec=codec_name)
        tier = build_tier(config, offloading, primary_region=region, name=config.name)
        built.append(tier)
        return TierDriver(tier, region, geometry)

    yield make
    for tier in built:
        tier.shutdown()


@pytest.mark.parametrize(("kind", "codec_name"), TIER_CODECS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_lower_tier_round_trips_each_format_byte_exact(
    make_tier: Callable[..., TierDriver[Any]], fmt: str, kind: str, codec_name: CodecName
) -> None:
    if codec_name != "none":
        pytest.importorskip("blosc2")
    payloads = _payloads(fmt)
    writer = make_tier(kind, fmt, codec_name)
    assert set(writer.store(payloads).succeeded_keys) == set(payloads)
    # A new tier over the same place (a restart) reads what the first one wrote; on S3
    # the same tier reads the objects back from the bucket (a second tier's start-up is
    # the slow part of the test, and restarts on S3 are tests/test_s3_tier.py's).
    reader = writer if kind == "s3" else make_tier(kind, fmt, codec_name)
    result, loaded = reader.load(list(payloads))
    assert set(result.succeeded_keys) == set(payloads)
    assert loaded == payloads
    if kind == "s3":
        backend = reader.manager.backend
        sizes = [backend.store.head(backend.object_key(key)) for key in payloads]
        stored = sum(sizes) - HEADER_BYTES * CHUNKS
        if codec_name == "none":
            assert stored == CHUNK_BYTES[fmt] * CHUNKS
        else:  # stored encoded only where that is smaller, so never larger
            assert stored <= CHUNK_BYTES[fmt] * CHUNKS
