"""Lossless codecs of the lower tiers: the header field, round trips on every KV dtype,
damaged and undecodable chunks, mixed chunks in one namespace, the config key, verify."""

from __future__ import annotations

import functools
import io
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kvtiers.config.stack import parse_stack
from kvtiers.config.tiers import CodecName, FileTierConfig, FsspecTierConfig, S3TierConfig
from kvtiers.core import chunkformat, codec
from kvtiers.core.chunkformat import HEADER_BYTES
from kvtiers.core.codec import CODEC_BLOSC2, CODEC_NONE, CodecUnavailableError, make_codec
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult
from kvtiers.core.tier import BuiltTier
from kvtiers.errors import ConfigError, CorruptChunkError
from kvtiers.filemapper import FileMapper, NamespaceIdentity
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.testing.driver import TierDriver
from kvtiers.testing.s3 import BUCKET, MotoServer
from kvtiers.tools.commands import verify
from kvtiers.tools.locations import open_location
from tests.test_file_support import CTX, offloading_config

pytest.importorskip("blosc2")

CHUNK = 8192
HIT, MISS = LookupResult.HIT, LookupResult.MISS
DIGEST = bytes(range(32))
KEY = b"k" * 20

#: Every dtype a KV cache is stored in, as torch names it and as the identity records it.
KV_DTYPES = [
    (torch.float32, "float32"),
    (torch.bfloat16, "bfloat16"),
    (torch.float16, "float16"),
    (torch.float8_e4m3fn, "fp8_e4m3"),
    (torch.float8_e5m2, "fp8_e5m2"),
    (torch.int8, "int8"),
    (torch.uint8, "uint8"),
]


def kv_bytes(dtype: torch.dtype, size: int, seed: int) -> bytes:
    """``size`` bytes of KV-like values of ``dtype``: normal values, a few loud channels."""
    generator = torch.Generator().manual_seed(seed)
    elements = size // torch.empty((), dtype=dtype).element_size()
    channels = 64
    scale = torch.ones(channels)
    scale[::16] = 20.0
    values = torch.randn(elements // channels, channels, generator=generator) * scale
    if dtype in (torch.int8, torch.uint8):
        values = values.clamp(-100, 100).round() + (128 if dtype == torch.uint8 else 0)
    return values.to(dtype).flatten().view(torch.uint8).numpy().tobytes()


def kv_payloads(ids: range | list[int], dtype: torch.dtype = torch.bfloat16
                ) -> dict[OffloadKey, bytes]:
    return {conformance_key(i): kv_bytes(dtype, CHUNK, i) for i in ids}


# -- the format -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["blosc2-zstd", "blosc2-lz4"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), KV_DTYPES, ids=[n for _, n in KV_DTYPES])
def test_every_kv_dtype_round_trips_through_a_blob(
    name: str, dtype: torch.dtype, kv_dtype: str
) -> None:
    encoder = make_codec(name, kv_dtype=kv_dtype)
    assert encoder is not None
    for payload in (kv_bytes(dtype, 1 << 16, 1), bytes(1 << 16), bytes(range(256)) * 256):
        blob = chunkformat.encode(DIGEST, KEY, payload, encoder)
        assert bytes(chunkformat.decode(blob, namespace_digest=DIGEST, key=KEY)) == payload


def test_a_compressible_payload_is_stored_encoded_and_smaller() -> None:
    payload = kv_bytes(torch.bfloat16, 1 << 16, 3)
    encoder = make_codec("blosc2-zstd", kv_dtype="bfloat16")
    blob = chunkformat.encode(DIGEST, KEY, payload, encoder)
    header = chunkformat.decode_header(blob, namespace_digest=DIGEST, key=KEY)
    assert header.codec == CODEC_BLOSC2
    assert header.payload_bytes == len(payload)
    assert header.stored_bytes == len(blob) - HEADER_BYTES < len(payload)
    assert header.checksum == chunkformat.payload_checksum(blob[HEADER_BYTES:])
    assert header.payload_checksum == chunkformat.payload_checksum(payload)


def test_an_incompressible_payload_is_stored_as_it_is() -> None:
    payload = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    blob = chunkformat.encode(DIGEST, KEY, payload, make_codec("blosc2-zstd", kv_dtype="uint8"))
    assert blob[HEADER_BYTES:] == payload
    assert chunkformat.decode_header(blob, namespace_digest=DIGEST, key=KEY).codec == CODEC_NONE


def test_a_header_without_codec_is_the_format_of_before() -> None:
    """Bytes 13-15 and 352-375 stay zero: old chunks and new uncompressed ones are one
    format, and nothing bumps FORMAT_VERSION (the namespace digest depends on it)."""
    header = chunkformat.encode_header(DIGEST, KEY, b"payload", created_ns=5)
    assert header[13:16] == bytes(3)
    assert header[352:376] == bytes(24)
    assert chunkformat.FORMAT_VERSION == 1


def _reseal(blob: bytearray) -> None:
    """Recompute the header checksum after editing header fields."""
    blob[88:96] = bytes(8)
    sealed = xxhash.xxh3_64_intdigest(bytes(blob[:HEADER_BYTES]))
    blob[88:96] = struct.pack("<Q", sealed)


def test_a_wrong_decoded_payload_is_caught_after_decoding() -> None:
    payload = kv_bytes(torch.bfloat16, 1 << 16, 4)
    blob = bytearray(chunkformat.encode(DIGEST, KEY, payload,
                                        make_codec("blosc2-zstd", kv_dtype="bfloat16")))
    blob[360] ^= 0x01  # the decoded payload's checksum, header re-sealed
    _reseal(blob)
    with pytest.raises(CorruptChunkError) as caught:
        chunkformat.decode(blob, namespace_digest=DIGEST, key=KEY)
    assert caught.value.check == "decoded payload checksum"


def test_a_stored_length_not_below_the_payload_is_corrupt() -> None:
    payload = kv_bytes(torch.bfloat16, 1 << 16, 5)
    blob = bytearray(chunkformat.encode(DIGEST, KEY, payload,
                                        make_codec("blosc2-zstd", kv_dtype="bfloat16")))
    blob[352:360] = struct.pack("<Q", len(payload))
    _reseal(blob)
    with pytest.raises(CorruptChunkError) as caught:
        chunkformat.decode_header(blob, namespace_digest=DIGEST, key=KEY)
    assert caught.value.check == "stored length"


def test_an_unknown_codec_code_is_refused_not_decoded() -> None:
    payload = kv_bytes(torch.bfloat16, 1 << 16, 6)
    blob = bytearray(chunkformat.encode(DIGEST, KEY, payload,
                                        make_codec("blosc2-zstd", kv_dtype="bfloat16")))
    blob[13] = 77
    _reseal(blob)
    with pytest.raises(CodecUnavailableError, match=r"codec 77.*newer"):
        chunkformat.decode(blob, namespace_digest=DIGEST, key=KEY)


def test_typesize_follows_the_kv_dtype() -> None:
    assert [codec.typesize_of(n) for _, n in KV_DTYPES] == [4, 2, 2, 1, 1, 1, 1]


# -- through the tiers ------------------------------------------------------------------
@pytest.fixture
def make_file_tier(tmp_path: Path) -> Iterator[Callable[..., TierDriver]]:
    from kvtiers.tiers.file.factory import build_tier

    built: list[BuiltTier] = []

    def make(codec_name: CodecName = "none", *, dtype: str = "bfloat16",
             root: Path | None = None,
             **fields: Any) -> TierDriver:
        offloading = offloading_config(dtype=dtype)
        geometry = ChunkGeometry.from_config(offloading)
        region = BytearrayRegion(8, geometry.slot_bytes)
        config = FileTierConfig(name="file", root=str(root or tmp_path), threads=2,
                                codec=codec_name, **fields)
        tier = build_tier(config, offloading, primary_region=region, name="file")
        built.append(tier)
        return TierDriver(tier, region, geometry)

    yield make
    for tier in built:
        tier.shutdown()


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvc") if "quarantine" not in p.parts)


@pytest.mark.parametrize(("dtype", "kv_dtype"), KV_DTYPES, ids=[n for _, n in KV_DTYPES])
def test_the_file_tier_round_trips_every_kv_dtype_with_a_codec(
    make_file_tier: Callable[..., TierDriver], dtype: torch.dtype, kv_dtype: str
) -> None:
    tier = make_file_tier("blosc2-zstd", dtype=kv_dtype)
    data = kv_payloads(range(4), dtype)
    assert set(tier.store(data).succeeded_keys) == set(data)
    reader = make_file_tier("blosc2-zstd", dtype=kv_dtype)
    result, loaded = reader.load(list(data))
    assert set(result.succeeded_keys) == set(data)
    assert loaded == data


def test_file_chunks_with_a_codec_are_smaller_on_disk(
    make_file_tier: Callable[..., TierDriver], tmp_path: Path
) -> None:
    tier = make_file_tier("blosc2-zstd")
    tier.store(kv_payloads(range(4)))
    sizes = [p.stat().st_size for p in _chunk_files(tmp_path)]
    assert len(sizes) == 4
    assert all(size < HEADER_BYTES + CHUNK for size in sizes)


def test_mixed_chunks_in_one_namespace_both_load(
    make_file_tier: Callable[..., TierDriver], tmp_path: Path
) -> None:
    plain = make_file_tier("none")
    encoded = make_file_tier("blosc2-lz4")
    first, second = kv_payloads(range(3)), kv_payloads(range(3, 6))
    plain.store(first)
    encoded.store(second)
    namespaces = {p.parent.parent.parent for p in _chunk_files(tmp_path)}
    assert len(namespaces) == 1, "a codec is no part of the identity"
    both = first | second
    readers: tuple[CodecName, ...] = ("none", "blosc2-zstd")
    for codec_name in readers:
        reader = make_file_tier(codec_name)
        assert [reader.manager.lookup(k, CTX) for k in both] == [HIT] * 6
        result, loaded = reader.load(list(both))
        assert set(result.succeeded_keys) == set(both)
        assert loaded == both


def test_a_damaged_compressed_file_is_a_quarantined_miss(
    make_file_tier: Callable[..., TierDriver], tmp_path: Path
) -> None:
    tier = make_file_tier("blosc2-zstd")
    data = kv_payloads(range(2))
    tier.store(data)
    victim = FileMapper(tmp_path, NamespaceIdentity.from_config(offloading_config())).path(
        conformance_key(0)
    )
    with victim.open("r+b") as f:
        f.seek(HEADER_BYTES + 40)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 40)
        f.write(bytes([byte[0] ^ 0x10]))
    result, loaded = tier.load(list(data))
    assert set(result.corrupt_keys) == {conformance_key(0)}
    assert loaded == {conformance_key(1): data[conformance_key(1)]}
    tier.manager.on_schedule_end(tier.ctx)
    assert tier.manager.lookup(conformance_key(0), CTX) == MISS
    assert tier.manager.get_stats()["corrupt_chunks"] == 1
    assert not victim.exists()


@pytest.fixture
def without_blosc2(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A reader on a machine without the codec package."""
    import importlib.util
    import sys

    real_find_spec = importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "blosc2", None)  # import blosc2 -> ImportError
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "blosc2" else real_find_spec(name, *a),
    )
    codec._blosc2.cache_clear()
    yield
    codec._blosc2.cache_clear()


def test_a_reader_without_the_codec_refuses_a_compressed_chunk_as_a_counted_miss(
    make_file_tier: Callable[..., TierDriver], tmp_path: Path,
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture,
) -> None:
    writer = make_file_tier("blosc2-zstd")
    data = kv_payloads(range(2))
    writer.store(data)
    files = _chunk_files(tmp_path)
    request.getfixturevalue("without_blosc2")
    reader = make_file_tier("none")
    for attempt in range(2):
        result, loaded = reader.load([conformance_key(0)])
        assert loaded == {} and not result.corrupt_keys
        assert list(result.failed_keys) == [conformance_key(0)]
        reader.manager.on_schedule_end(reader.ctx)
        if attempt == 0:
            # Backed off; the back-off ends (the clock moves on) and it is tried again.
            reader.manager.backoff.clock = functools.partial(float, 1e12)
    stats = reader.manager.get_stats()
    assert stats["unreadable_chunks"] == 1
    assert stats["corrupt_chunks"] == 0
    assert reader.manager.lookup(conformance_key(0), CTX) == MISS
    assert _chunk_files(tmp_path) == files, "the chunk stays for readers that can decode it"
    assert "pip install 'kvtiers[codec]'" in caplog.text


def test_a_codec_whose_package_is_missing_is_a_one_line_config_error(
    without_blosc2: None, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as caught:
        FileTierConfig(name="file", root=str(tmp_path), codec="blosc2-zstd")
    message = str(caught.value)
    assert "\n" not in message
    assert "'blosc2' is not installed" in message and "kvtiers[codec]" in message
    assert caught.value.path == "codec"
    FileTierConfig(name="file", root=str(tmp_path))  # codec: none needs nothing


def test_yaml_validation_of_the_codec_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_stack({"tiers": [{"kind": "cpu", "capacity": "1GiB"},
                               {"kind": "file", "root": str(tmp_path), "codec": "gzip"}]})
    assert "blosc2-zstd" in str(caught.value) and "codec" in str(caught.value)
    with pytest.raises(ConfigError, match="gds: true") as caught:
        FileTierConfig(name="f", root=str(tmp_path), gds=True, codec="blosc2-zstd")
    assert caught.value.path == "codec"
    assert FileTierConfig(name="f", root=str(tmp_path)).codec == "none"
    assert S3TierConfig(name="s", bucket="kv-cache").codec == "blosc2-zstd"
    assert FsspecTierConfig(name="m", url="memory://kv").codec == "none"


@pytest.fixture
def make_s3_tier(s3_endpoint: MotoServer) -> Iterator[Callable[..., TierDriver]]:
    from kvtiers.tiers.s3.factory import build_tier

    built: list[BuiltTier] = []

    def make(codec_name: CodecName, **fields: Any) -> TierDriver:
        offloading = offloading_config()
        geometry = ChunkGeometry.from_config(offloading)
        region = BytearrayRegion(8, geometry.slot_bytes)
        config = S3TierConfig(name="s3", bucket=BUCKET, prefix="codec", threads=2,
                              endpoint_url=s3_endpoint.endpoint_url, codec=codec_name,
                              **fields)
        tier = build_tier(config, offloading, primary_region=region, name="s3")
        built.append(tier)
        return TierDriver(tier, region, geometry)

    yield make
    for tier in built:
        tier.shutdown()


def test_s3_mixed_chunks_load_and_compressed_ones_send_fewer_bytes(
    make_s3_tier: Callable[..., TierDriver],
) -> None:
    plain = make_s3_tier("none")
    encoded = make_s3_tier("blosc2-zstd")
    first, second = kv_payloads(range(10, 13)), kv_payloads(range(13, 16))
    plain.store(first)
    encoded.store(second)
    backend = encoded.manager.backend
    sizes = {k: backend.store.head(backend.object_key(k)) for k in first | second}
    assert all(sizes[k] == HEADER_BYTES + CHUNK for k in first)
    assert all(sizes[k] < HEADER_BYTES + CHUNK for k in second)
    both = first | second
    reader = make_s3_tier("none")
    result, loaded = reader.load(list(both))
    assert set(result.succeeded_keys) == set(both)
    assert loaded == both


def test_s3_a_damaged_compressed_object_is_a_deleted_miss(
    make_s3_tier: Callable[..., TierDriver],
) -> None:
    tier = make_s3_tier("blosc2-zstd")
    data = kv_payloads(range(20, 22))
    tier.store(data)
    backend = tier.manager.backend
    name = backend.object_key(conformance_key(20))
    blob = bytearray(backend.store.read(name, 1 << 20))
    blob[HEADER_BYTES + 10] ^= 0x01
    backend.store.delete(name)
    backend.store.put_if_absent(name, [bytes(blob)])
    result, loaded = tier.load(list(data))
    assert set(result.corrupt_keys) == {conformance_key(20)}
    assert loaded == {conformance_key(21): data[conformance_key(21)]}
    assert backend.store.head(name) is None


def test_fsspec_tier_round_trips_with_a_codec() -> None:
    pytest.importorskip("fsspec")
    from kvtiers.tiers.fsspec.factory import build_tier

    offloading = offloading_config()
    geometry = ChunkGeometry.from_config(offloading)
    region = BytearrayRegion(8, geometry.slot_bytes)
    tier = build_tier(FsspecTierConfig(name="m", url="memory://codec-test", codec="blosc2-zstd"),
                      offloading, primary_region=region, name="m")
    try:
        driver = TierDriver(tier, region, geometry)
        data = kv_payloads(range(4))
        driver.store(data)
        assert driver.load(list(data))[1] == data
    finally:
        tier.shutdown()


def test_verify_checks_compressed_chunks_and_finds_a_damaged_one(
    make_file_tier: Callable[..., TierDriver], tmp_path: Path
) -> None:
    tier = make_file_tier("blosc2-zstd")
    tier.store(kv_payloads(range(3)))
    out = io.StringIO()
    assert verify(open_location(str(tmp_path)), out) == 0, out.getvalue()
    assert "3 chunks ok, 0 corrupt" in out.getvalue()
    victim = _chunk_files(tmp_path)[0]
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + 5] ^= 0x01
    victim.write_bytes(bytes(raw))
    out = io.StringIO()
    assert verify(open_location(str(tmp_path)), out) == 1
    assert "payload checksum check failed" in out.getvalue()
