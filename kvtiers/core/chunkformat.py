"""The chunk blob format, the same on every persistent medium (files, objects).

A blob is a fixed 4096-byte header followed by the stored payload: the chunk's bytes, or
(with a codec, :mod:`kvtiers.core.codec`) those bytes encoded. The header starts the
payload 4 KiB-aligned for O_DIRECT and GPUDirect Storage. Header layout (little-endian)::

    offset size  field
         0    8  magic  b"KVTCHUNK"
         8    2  format version (1)
        10    2  header size (4096)
        12    1  checksum algorithm (1 = xxh3_128)
        13    1  codec of the stored payload (0 = none, 1 = blosc2)
        14    2  zero
        16    8  payload length in bytes (the chunk's bytes, decoded)
        24   16  checksum of the stored payload (the bytes after the header)
        40   32  namespace digest (sha256 of the namespace identity)
        72    2  key length in bytes (<= 256)
        74    6  zero
        80    8  creation time, nanoseconds since the epoch
        88    8  header checksum: xxh3_64 of the whole header with these 8 bytes zeroed
        96  256  key bytes, zero padded
       352    8  stored length in bytes (codec only; zero without one)
       360   16  xxh3_128 of the decoded payload (codec only; zero without one)
       376 3720  zero

Without a codec the stored payload is the payload, and bytes 352-375 stay zero: such a
header is byte for byte what this format was before codecs. A codec is recorded only when
it made the payload smaller (stored length below payload length), so a reader that knows
no codec finds the file or object shorter than the chunk and reads it as a miss.

Decoding checks, in order: length of the header, magic, format version, header size,
header checksum, checksum algorithm, namespace digest, key, stored length (codec only),
then the payload length and the stored payload's checksum; with a codec the decoded
payload is checked too (its length and its own checksum). The first failure raises
:class:`~kvtiers.errors.CorruptChunkError` naming it; a codec this reader cannot decode
raises :class:`~kvtiers.core.codec.CodecUnavailableError` (the chunk is not damaged).
Bump ``FORMAT_VERSION`` for any other layout change; old blobs then read as corrupt
(misses).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import xxhash

from kvtiers.core.buffers import Buffer
from kvtiers.core.codec import (
    CODEC_NONE,
    FORMAT_NAMES,
    Codec,
    CodecUnavailableError,
    Scratch,
    decode_into,
)
from kvtiers.errors import CorruptChunkError

MAGIC = b"KVTCHUNK"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
CHECKSUM_XXH3_128 = 1
MAX_KEY_BYTES = 256
NAMESPACE_DIGEST_BYTES = 32

_FIXED = struct.Struct("<8sHHBB2xQ16s32sH6xQQ")
_HEADER_CHECKSUM_OFFSET = 88
_KEY_OFFSET = 96
_CODEC_FIELDS = struct.Struct("<Q16s")
_CODEC_FIELDS_OFFSET = _KEY_OFFSET + MAX_KEY_BYTES


@dataclass(frozen=True)
class ChunkHeader:
    """A decoded header whose own fields passed verification.

    ``checksum`` covers the stored payload (``stored_bytes`` bytes after the header);
    without a codec that is the payload itself, and ``payload_checksum`` equals it."""

    payload_bytes: int
    checksum: bytes
    namespace_digest: bytes
    key: bytes
    created_ns: int
    codec: int = CODEC_NONE
    stored_bytes: int = -1
    payload_checksum: bytes = b""

    def __post_init__(self) -> None:
        if self.stored_bytes < 0:
            object.__setattr__(self, "stored_bytes", self.payload_bytes)
        if not self.payload_checksum:
            object.__setattr__(self, "payload_checksum", self.checksum)

    @property
    def blob_bytes(self) -> int:
        """The whole blob's length: header and stored payload."""
        return HEADER_BYTES + self.stored_bytes


def payload_checksum(payload: Buffer) -> bytes:
    """xxh3_128 digest of ``payload`` (16 bytes)."""
    return xxhash.xxh3_128_digest(payload)


def payload_hasher() -> xxhash.xxh3_128:
    """A streaming hasher whose ``digest()`` is :func:`payload_checksum` of the bytes fed
    to it, for readers that hash a payload piece by piece as it arrives."""
    return xxhash.xxh3_128()


def encode_header(
    namespace_digest: bytes,
    key: bytes,
    payload: Buffer,
    *,
    created_ns: int | None = None,
    checksum: bytes | None = None,
    codec: int = CODEC_NONE,
    stored: Buffer | None = None,
) -> bytes:
    """The 4096-byte header for ``payload`` stored under ``key`` in a namespace.

    Without a codec the payload is stored as it is; ``checksum``, when given, is its
    xxh3_128 computed by the caller. With ``codec`` (a header code of
    :mod:`kvtiers.core.codec`) ``stored`` holds the encoded bytes that follow the header
    (shorter than the payload), and ``checksum``, when given, is theirs."""
    if len(namespace_digest) != NAMESPACE_DIGEST_BYTES:
        raise ValueError(f"namespace digest must be {NAMESPACE_DIGEST_BYTES} bytes")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    payload_bytes = len(memoryview(payload).cast("B"))
    header = bytearray(HEADER_BYTES)
    if codec == CODEC_NONE:
        if stored is not None:
            raise ValueError("a payload stored as it is takes no separate stored bytes")
        digest = payload_checksum(payload) if checksum is None else checksum
    else:
        if stored is None:
            raise ValueError("an encoded payload needs its stored bytes")
        stored_bytes = len(memoryview(stored).cast("B"))
        if not 0 < stored_bytes < payload_bytes:
            raise ValueError(
                f"an encoded payload must be shorter than the payload ({stored_bytes} "
                f"of {payload_bytes} bytes); store it as it is"
            )
        digest = payload_checksum(stored) if checksum is None else checksum
        _CODEC_FIELDS.pack_into(
            header, _CODEC_FIELDS_OFFSET, stored_bytes, payload_checksum(payload)
        )
    _FIXED.pack_into(
        header,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        CHECKSUM_XXH3_128,
        codec,
        payload_bytes,
        digest,
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
    (magic, version, header_bytes, algorithm, codec, payload_bytes, checksum, digest, key_len,
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
    if codec == CODEC_NONE:
        return ChunkHeader(payload_bytes, checksum, digest, bytes(key), created_ns)
    stored_bytes, decoded_checksum = _CODEC_FIELDS.unpack_from(view, _CODEC_FIELDS_OFFSET)
    if not 0 < stored_bytes < payload_bytes:
        raise CorruptChunkError(
            "stored length", f"{stored_bytes} encoded bytes for a {payload_bytes}-byte payload"
        )
    return ChunkHeader(payload_bytes, checksum, digest, bytes(key), created_ns, codec,
                       stored_bytes, decoded_checksum)


def codec_name(code: int) -> str:
    """The name of a header's codec code, for messages."""
    return FORMAT_NAMES.get(code, f"unknown codec {code}")


def verify_payload(header: ChunkHeader, payload: Buffer) -> None:
    """Check ``payload``, read as it is stored, against a decoded header's length and
    checksum. For readers that take only unencoded chunks (a GPUDirect read lands in
    GPU memory): a chunk stored with a codec raises :class:`CodecUnavailableError`."""
    if header.codec != CODEC_NONE:
        raise CodecUnavailableError(
            f"the chunk is stored with codec {codec_name(header.codec)}, and this reader "
            "takes only chunks stored as they are"
        )
    size = len(memoryview(payload).cast("B"))
    if size != header.payload_bytes:
        raise CorruptChunkError(
            "payload length", f"{size} bytes, header says {header.payload_bytes}"
        )
    if payload_checksum(payload) != header.checksum:
        raise CorruptChunkError("payload checksum")


def finish_load(
    header: ChunkHeader,
    dest: memoryview,
    stored_got: int,
    scratch: Scratch,
    *,
    stored_checksum: bytes | None = None,
) -> None:
    """Verify (and, with a codec, decode in place) a payload read straight into ``dest``.

    ``dest`` is the chunk's buffer (``header.payload_bytes`` long); its first
    ``stored_got`` bytes are what followed the header. They must be exactly the stored
    payload, and its checksum (``stored_checksum`` when the reader hashed the bytes as
    they landed) must match before anything is decoded. With a codec the stored bytes
    are copied to this thread's ``scratch`` and decoded into ``dest``, and the decoded
    payload must match its own checksum. Any mismatch is a
    :class:`~kvtiers.errors.CorruptChunkError`; ``dest`` then holds no promised bytes."""
    if dest.nbytes != header.payload_bytes:
        raise CorruptChunkError(
            "payload length", f"{dest.nbytes} bytes, header says {header.payload_bytes}"
        )
    if stored_got != header.stored_bytes:
        raise CorruptChunkError(
            "payload length", f"{stored_got} stored bytes, header says {header.stored_bytes}"
        )
    stored = dest[: header.stored_bytes]
    digest = payload_checksum(stored) if stored_checksum is None else stored_checksum
    if digest != header.checksum:
        raise CorruptChunkError("payload checksum")
    if header.codec == CODEC_NONE:
        return
    copy = scratch.view(header.stored_bytes)
    copy[:] = stored
    decode_into(header.codec, copy, dest)
    if payload_checksum(dest) != header.payload_checksum:
        raise CorruptChunkError("decoded payload checksum")


def encode_blob(
    namespace_digest: bytes, key: bytes, payload: Buffer, codec: Codec | None
) -> tuple[bytes, Buffer]:
    """``(header, stored payload)`` of ``payload``: encoded with ``codec`` when that makes
    it smaller, else the payload itself (a zero-copy view)."""
    encoded = None if codec is None else codec.encode(payload)
    if codec is None or encoded is None:
        return encode_header(namespace_digest, key, payload), memoryview(payload).cast("B")
    header = encode_header(namespace_digest, key, payload, codec=codec.format_id, stored=encoded)
    return header, encoded


def encode(
    namespace_digest: bytes, key: bytes, payload: Buffer, codec: Codec | None = None
) -> bytes:
    """A whole blob: header followed by the stored payload."""
    header, stored = encode_blob(namespace_digest, key, payload, codec)
    return header + bytes(stored)


def decode(blob: Buffer, *, namespace_digest: bytes, key: bytes) -> memoryview:
    """Verify a whole blob and return its payload: a zero-copy view when it is stored as
    it is, else a new decoded buffer."""
    view = memoryview(blob).cast("B")
    header = decode_header(view, namespace_digest=namespace_digest, key=key)
    stored = view[HEADER_BYTES:]
    if header.codec == CODEC_NONE:
        verify_payload(header, stored)
        return stored
    if stored.nbytes != header.stored_bytes:
        raise CorruptChunkError(
            "payload length", f"{stored.nbytes} stored bytes, header says {header.stored_bytes}"
        )
    dest = memoryview(bytearray(header.payload_bytes))
    dest[: stored.nbytes] = stored
    finish_load(header, dest, stored.nbytes, Scratch())
    return dest
