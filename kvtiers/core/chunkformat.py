"""The chunk blob format, the same on every persistent medium (files, objects).

A blob is a fixed 4096-byte header followed by the payload (the chunk's bytes), so the
payload starts 4 KiB-aligned for O_DIRECT and GPUDirect Storage. Header layout
(little-endian)::

    offset size  field
         0    8  magic  b"KVTCHUNK"
         8    2  format version (1)
        10    2  header size (4096)
        12    1  checksum algorithm (1 = xxh3_128 of the payload)
        13    3  zero
        16    8  payload length in bytes
        24   16  payload checksum
        40   32  namespace digest (sha256 of the namespace identity)
        72    2  key length in bytes (<= 256)
        74    6  zero
        80    8  creation time, nanoseconds since the epoch
        88    8  header checksum: xxh3_64 of the whole header with these 8 bytes zeroed
        96  256  key bytes, zero padded
       352 3744  zero

Decoding checks, in order: length of the header, magic, format version, header size,
header checksum, checksum algorithm, namespace digest, key, payload length, payload
checksum. The first failure raises :class:`~kvtiers.errors.CorruptChunkError` naming it.
Bump ``FORMAT_VERSION`` for any layout change; old blobs then read as corrupt (misses).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import xxhash

from kvtiers.core.buffers import Buffer
from kvtiers.errors import CorruptChunkError

MAGIC = b"KVTCHUNK"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
CHECKSUM_XXH3_128 = 1
MAX_KEY_BYTES = 256
NAMESPACE_DIGEST_BYTES = 32

_FIXED = struct.Struct("<8sHHB3xQ16s32sH6xQQ")
_HEADER_CHECKSUM_OFFSET = 88
_KEY_OFFSET = 96



@dataclass(frozen=True)
class ChunkHeader:
    """A decoded header whose own fields passed verification."""

    payload_bytes: int
    checksum: bytes
    namespace_digest: bytes
    key: bytes
    created_ns: int


def payload_checksum(payload: Buffer) -> bytes:
    """xxh3_128 digest of ``payload`` (16 bytes)."""
    return xxhash.xxh3_128_digest(payload)


def encode_header(
    namespace_digest: bytes,
    key: bytes,
    payload: Buffer,
    *,
    created_ns: int | None = None,
) -> bytes:
    """The 4096-byte header for ``payload`` stored under ``key`` in a namespace."""
    if len(namespace_digest) != NAMESPACE_DIGEST_BYTES:
        raise ValueError(f"namespace digest must be {NAMESPACE_DIGEST_BYTES} bytes")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    header = bytearray(HEADER_BYTES)
    _FIXED.pack_into(
        header,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        CHECKSUM_XXH3_128,
        len(memoryview(payload).cast("B")),
        payload_checksum(payload),
        namespace_digest,
        len(key),
        time.time_ns() if created_ns is None else created_ns,
        0,
    )
    header[_KEY_OFFSET : _KEY_OFFSET + len(key)] = key
    struct.pack_into("<Q", header, _HEADER_CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(header))
    return bytes(header)


def decode_header(header: Buffer, *, namespace_digest: bytes, key: bytes) -> ChunkHeader:
    """Verify a header against the namespace and key it must belong to."""
    view = memoryview(header).cast("B")
    if len(view) < HEADER_BYTES:
        raise CorruptChunkError("length", f"header is {len(view)} bytes, need {HEADER_BYTES}")
    view = view[:HEADER_BYTES]
    (magic, version, header_bytes, algorithm, payload_bytes, checksum, digest, key_len,
     created_ns, stored_header_checksum) = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptChunkError("magic")
    if version != FORMAT_VERSION:
        raise CorruptChunkError("version", f"format {version}, this build reads {FORMAT_VERSION}")
    if header_bytes != HEADER_BYTES:
        raise CorruptChunkError("header size")
    zeroed = bytearray(view)
    zeroed[_HEADER_CHECKSUM_OFFSET : _HEADER_CHECKSUM_OFFSET + 8] = bytes(8)
    if xxhash.xxh3_64_intdigest(zeroed) != stored_header_checksum:
        raise CorruptChunkError("header checksum")
    if algorithm != CHECKSUM_XXH3_128:
        raise CorruptChunkError("checksum algorithm", f"unknown algorithm {algorithm}")
    if digest != namespace_digest:
        raise CorruptChunkError("namespace", "the chunk belongs to another cache identity")
    if key_len > MAX_KEY_BYTES or bytes(view[_KEY_OFFSET : _KEY_OFFSET + key_len]) != key:
        raise CorruptChunkError("key", "the chunk was stored under another key")
    return ChunkHeader(payload_bytes, checksum, digest, bytes(key), created_ns)


def verify_payload(header: ChunkHeader, payload: Buffer) -> None:
    """Check ``payload`` against a decoded header's length and checksum."""
    size = len(memoryview(payload).cast("B"))
    if size != header.payload_bytes:
        raise CorruptChunkError(
            "payload length", f"{size} bytes, header says {header.payload_bytes}"
        )
    if payload_checksum(payload) != header.checksum:
        raise CorruptChunkError("payload checksum")


def encode(namespace_digest: bytes, key: bytes, payload: Buffer) -> bytes:
    """A whole blob: header followed by the payload."""
    return encode_header(namespace_digest, key, payload) + bytes(payload)


def decode(blob: Buffer, *, namespace_digest: bytes, key: bytes) -> memoryview:
    """Verify a whole blob and return a zero-copy view of its payload."""
    view = memoryview(blob).cast("B")
    header = decode_header(view, namespace_digest=namespace_digest, key=key)
    payload = view[HEADER_BYTES:]
    verify_payload(header, payload)
    return payload
