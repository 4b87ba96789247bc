"""The chunk blob codec: round trip, and every kind of damage is a CorruptChunkError that
names the failed check."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash

from kvtiers.core import chunkformat
from kvtiers.core.chunkformat import HEADER_BYTES, decode, decode_header, encode, encode_header
from kvtiers.errors import CorruptChunkError

NAMESPACE = hashlib.sha256(b"namespace a").digest()
OTHER_NAMESPACE = hashlib.sha256(b"namespace b").digest()
KEY = bytes(range(16)) + (3).to_bytes(4, "big")
PAYLOAD = bytes((i * 7 + 3) % 251 for i in range(8192))
KEY_END = 96 + len(KEY)


def blob() -> bytearray:
    return bytearray(encode(NAMESPACE, KEY, PAYLOAD))


def resign(header: bytearray) -> bytearray:
    """Recompute the header checksum so a deliberate edit reaches the later checks."""
    header[88:96] = bytes(8)
    struct.pack_into("<Q", header, 88, xxhash.xxh3_64_intdigest(bytes(header[:HEADER_BYTES])))
    return header


def failed_check(data: bytes | bytearray, *, namespace: bytes = NAMESPACE, key: bytes = KEY) -> str:
    with pytest.raises(CorruptChunkError) as info:
        decode(data, namespace_digest=namespace, key=key)
    return info.value.check


# --- round trip -------------------------------------------------------------------------


def test_round_trip() -> None:
    data = blob()
    assert len(data) == HEADER_BYTES + len(PAYLOAD)
    payload = decode(data, namespace_digest=NAMESPACE, key=KEY)
    assert bytes(payload) == PAYLOAD
    assert payload.obj is data  # a view of the blob, not a copy


def test_header_fields_round_trip() -> None:
    header = encode_header(NAMESPACE, KEY, memoryview(PAYLOAD), created_ns=1234567890)
    assert len(header) == HEADER_BYTES
    decoded = decode_header(header, namespace_digest=NAMESPACE, key=KEY)
    assert decoded.payload_bytes == len(PAYLOAD)
    assert decoded.checksum == xxhash.xxh3_128_digest(PAYLOAD)
    assert decoded.namespace_digest == NAMESPACE
    assert decoded.key == KEY
    assert decoded.created_ns == 1234567890


def test_empty_payload_round_trips() -> None:
    data = encode(NAMESPACE, KEY, b"")
    assert bytes(decode(data, namespace_digest=NAMESPACE, key=KEY)) == b""


@pytest.mark.parametrize(
    ("namespace", "key"),
    [(NAMESPACE[:31], KEY), (NAMESPACE + b"\0", KEY), (NAMESPACE, b""), (NAMESPACE, b"k" * 257)],
)
def test_encode_refuses_bad_namespace_or_key(namespace: bytes, key: bytes) -> None:
    with pytest.raises(ValueError):
        encode_header(namespace, key, PAYLOAD)


# --- header damage ----------------------------------------------------------------------


def expected_check(offset: int) -> str:
    """The first check a change at ``offset`` trips (see the layout in chunkformat)."""
    if offset < 8:
        return "magic"
    if offset < 10:
        return "version"
    if offset < 12:
        return "header size"
    return "header checksum"


PADDING_SAMPLE = [*range(KEY_END, 352, 7), 351, 352, *range(353, HEADER_BYTES, 97), 4095]


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_meaningful_header_byte_is_covered(mask: int) -> None:
    original = blob()
    for offset in [*range(KEY_END), *PADDING_SAMPLE]:
        damaged = bytearray(original)
        damaged[offset] ^= mask
        assert failed_check(damaged) == expected_check(offset), f"offset {offset}"


def test_payload_byte_flips_are_detected() -> None:
    original = blob()
    for offset in [*range(0, len(PAYLOAD), 509), len(PAYLOAD) - 1]:
        damaged = bytearray(original)
        damaged[HEADER_BYTES + offset] ^= 0x01
        assert failed_check(damaged) == "payload checksum", f"payload offset {offset}"


def test_truncation_at_every_length_is_detected() -> None:
    small = encode(NAMESPACE, KEY, PAYLOAD[:100])
    for length in range(len(small)):
        expected = "length" if length < HEADER_BYTES else "payload length"
        assert failed_check(small[:length]) == expected, f"truncated to {length}"


def test_trailing_bytes_are_detected() -> None:
    assert failed_check(blob() + b"\0") == "payload length"


# --- the blob belongs elsewhere ---------------------------------------------------------


def test_wrong_namespace() -> None:
    assert failed_check(blob(), namespace=OTHER_NAMESPACE) == "namespace"


@pytest.mark.parametrize(
    "key",
    [KEY[:-1] + b"\x04", KEY[:-1], KEY + b"\0", bytes(len(KEY))],
    ids=["other group", "prefix", "extended", "zeros"],
)
def test_wrong_key(key: bytes) -> None:
    assert failed_check(blob(), key=key) == "key"


# --- re-signed edits isolate each field check --------------------------------------------


def test_wrong_version() -> None:
    data = blob()
    struct.pack_into("<H", data, 8, chunkformat.FORMAT_VERSION + 1)
    assert failed_check(resign(data)) == "version"


def test_wrong_header_size() -> None:
    data = blob()
    struct.pack_into("<H", data, 10, 8192)
    assert failed_check(resign(data)) == "header size"


def test_unknown_checksum_algorithm() -> None:
    data = blob()
    data[12] = 2
    assert failed_check(resign(data)) == "checksum algorithm"


def test_oversized_key_length() -> None:
    data = blob()
    struct.pack_into("<H", data, 72, chunkformat.MAX_KEY_BYTES + 1)
    assert failed_check(resign(data)) == "key"


def test_payload_length_field_disagrees() -> None:
    data = blob()
    struct.pack_into("<Q", data, 16, len(PAYLOAD) - 1)
    assert failed_check(resign(data)) == "payload length"


def test_resign_alone_keeps_the_blob_valid() -> None:
    assert bytes(decode(resign(blob()), namespace_digest=NAMESPACE, key=KEY)) == PAYLOAD
