"""The namespace summary: a Bloom filter of the chunk keys a namespace holds.

A router asks "does the shared store hold this prefix?" without listing it: the summary
beside a namespace's ``manifest.json`` (:data:`SUMMARY_NAME`) answers for each chunk key
*present* or *absent*. It is built from a complete listing of the namespace by the
tier's background listing (:mod:`kvtiers.tiers.listing`) and republished whole, through
the atomic publish on a file root and with one put on an object store, so a reader sees
one summary or the next, never a mix.

Promises: every chunk present for the whole listing a summary was built from (it began
at ``listed_at``) is *present* — no false negative; a key never stored is *present* with
a probability of about :data:`FALSE_POSITIVE_RATE` (0.82 % in theory with
:data:`BITS_PER_KEY` bits and :data:`PROBES` probes per listed key; measured in
``tests/test_summary.py``). Chunks stored or removed since ``listed_at`` are not
reflected until the next refresh: a removed chunk may still read present, a newer one
absent.

Layout (little-endian, ``docs/on-disk-format.md``)::

    offset size  field
         0    8  magic  b"KVTSUMRY"
         8    2  format version (1)
        10    2  header size (128)
        12    1  hash (1 = xxh3_128 of the key, double hashing)
        13    1  probes per key (k)
        14    2  zero
        16    8  bits (m, a multiple of 64)
        24    8  keys (n)
        32    8  listed_at: start of the listing, nanoseconds since the epoch
        40    8  payload checksum: xxh3_64 of the bit array
        48   32  namespace digest (raw sha256)
        80   40  zero
       120    8  header checksum: xxh3_64 of the header with these 8 bytes zeroed
       128  m/8  the bit array: bit j is bit (j mod 8) of byte j // 8

Key ``key`` (block hash + 4-byte big-endian group, as in chunk names) sets bits
``(h1 + i * h2) mod 2**64 mod m`` for ``i`` in ``0 … k-1``, where ``h1`` is the low and
``h2`` the high 64 bits of ``xxh3_128(key)`` (``h2`` with its lowest bit set).
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtiers.errors import SummaryError

SUMMARY_NAME = "summary.kvsum"
MAGIC = b"KVTSUMRY"
FORMAT_VERSION = 1
HEADER_BYTES = 128
HASH_XXH3_128 = 1
#: Bits per listed key and probes per key: about 0.82 % false positives.
BITS_PER_KEY = 10
PROBES = 7
#: The false-positive rate the sizing gives at the listed count: (1 - e^(-k/b))^k.
FALSE_POSITIVE_RATE = (1.0 - math.exp(-PROBES / BITS_PER_KEY)) ** PROBES
#: A summary larger than this is refused unread (about 200 million keys).
MAX_SUMMARY_BYTES = 256 << 20

_FIXED = struct.Struct("<8sHHBB2xQQQQ32s40xQ")
_HEADER_CHECKSUM_OFFSET = 120
_MASK64 = (1 << 64) - 1
assert _FIXED.size == HEADER_BYTES


def _hashes(key: bytes) -> tuple[int, int]:
    value = xxhash.xxh3_128_intdigest(key)
    return value & _MASK64, (value >> 64) | 1


@dataclass(frozen=True)
class NamespaceSummary:
    """A decoded (or just built) summary; see the module docstring."""

    bits: int
    probes: int
    keys: int
    listed_at_ns: int
    namespace_digest: bytes
    bitmap: bytes

    # -- building -------------------------------------------------------------------
    @classmethod
    def build(
        cls, keys: Iterable[bytes], *, namespace_digest: bytes, listed_at_ns: int | None = None
    ) -> NamespaceSummary:
        """The summary of ``keys`` (each counted once), sized at :data:`BITS_PER_KEY`
        bits per key; ``listed_at_ns`` defaults to now."""
        if len(namespace_digest) != 32:
            raise ValueError(f"a namespace digest is 32 bytes, got {len(namespace_digest)}")
        unique = set(keys)
        bits = max(64, -(-len(unique) * BITS_PER_KEY // 64) * 64)
        mask = np.zeros(bits, dtype=np.bool_)
        if unique:
            pairs = np.array([_hashes(key) for key in unique], dtype=np.uint64)
            steps = np.arange(PROBES, dtype=np.uint64)
            with np.errstate(over="ignore"):  # the sums wrap modulo 2**64, as specified
                positions = (pairs[:, :1] + steps * pairs[:, 1:]) % np.uint64(bits)
            mask[positions.ravel()] = True
        return cls(
            bits=bits,
            probes=PROBES,
            keys=len(unique),
            listed_at_ns=time.time_ns() if listed_at_ns is None else listed_at_ns,
            namespace_digest=bytes(namespace_digest),
            bitmap=np.packbits(mask, bitorder="little").tobytes(),
        )

    # -- asking ---------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        """Whether the namespace held ``key`` (a chunk key, ``bytes``) at the listing:
        never False for a chunk that was there, True by chance for about
        :data:`FALSE_POSITIVE_RATE` of the others."""
        if not isinstance(key, bytes):
            return False
        h1, h2 = _hashes(key)
        bitmap, bits = self.bitmap, self.bits
        for i in range(self.probes):
            position = ((h1 + i * h2) & _MASK64) % bits
            if not bitmap[position >> 3] >> (position & 7) & 1:
                return False
        return True

    def leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prefix's chunk keys in token order) are present
        before the first absent one: the chunks of the prefix the store may serve."""
        for count, key in enumerate(keys):
            if key not in self:
                return count
        return len(keys)

    @property
    def false_positive_rate(self) -> float:
        """The rate expected for this filter's fill: ``(1 - e^(-k n / m))^k``."""
        return (1.0 - math.exp(-self.probes * self.keys / self.bits)) ** self.probes

    # -- the format -----------------------------------------------------------------
    def encode(self) -> bytes:
        """The summary's bytes (header then bit array)."""
        header = bytearray(
            _FIXED.pack(
                MAGIC, FORMAT_VERSION, HEADER_BYTES, HASH_XXH3_128, self.probes, self.bits,
                self.keys, self.listed_at_ns, xxhash.xxh3_64_intdigest(self.bitmap),
                self.namespace_digest, 0,
            )
        )
        struct.pack_into("<Q", header, _HEADER_CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(header))
        return bytes(header) + self.bitmap

    @classmethod
    def decode(cls, data: bytes, *, namespace_digest: bytes | None = None) -> NamespaceSummary:
        """Check and decode ``data``; :class:`~kvtiers.errors.SummaryError` names the
        first check that fails (``namespace_digest``, when given, must match)."""
        if len(data) > MAX_SUMMARY_BYTES:
            raise SummaryError("size", f"over {MAX_SUMMARY_BYTES} bytes")
        if len(data) < HEADER_BYTES:
            raise SummaryError("size", f"{len(data)} bytes, shorter than its header")
        (magic, version, header_bytes, hash_id, probes, bits, keys, listed_at_ns, checksum,
         digest, header_checksum) = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise SummaryError("magic", f"{magic!r}")
        if version != FORMAT_VERSION:
            raise SummaryError("format version", f"{version}, this kvtiers reads {FORMAT_VERSION}")
        if header_bytes != HEADER_BYTES:
            raise SummaryError("header size", f"{header_bytes}")
        blank = bytearray(data[:HEADER_BYTES])
        blank[_HEADER_CHECKSUM_OFFSET:HEADER_BYTES] = bytes(8)
        if xxhash.xxh3_64_intdigest(blank) != header_checksum:
            raise SummaryError("header checksum")
        if hash_id != HASH_XXH3_128 or not 1 <= probes <= 64:
            raise SummaryError("hash", f"hash {hash_id} with {probes} probes")
        if bits < 64 or bits % 64 or len(data) != HEADER_BYTES + bits // 8:
            raise SummaryError("length", f"{bits} bits in {len(data) - HEADER_BYTES} bytes")
        bitmap = bytes(data[HEADER_BYTES:])
        if xxhash.xxh3_64_intdigest(bitmap) != checksum:
            raise SummaryError("payload checksum")
        if namespace_digest is not None and digest != namespace_digest:
            raise SummaryError("namespace", "written for another namespace")
        return cls(bits, probes, keys, listed_at_ns, digest, bitmap)
