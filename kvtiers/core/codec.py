"""Lossless codecs for the payloads the lower tiers store (``codec:`` of a file, s3 or
fsspec tier).

A codec is a storage detail: the cache identity does not name it, so chunks written with
and without one are the same cache, and every reader decodes whatever a chunk's header
says (:mod:`kvtiers.core.chunkformat` records the codec in the header's spare room).

The one codec family is `Blosc2 <https://www.blosc.org>`_ (package ``blosc2``, the
``codec`` extra): a byte shuffle with the KV dtype's element size as type size, so that
each byte of every element lands in a stream of its own (for bf16: the sign-and-exponent
bytes apart from the mantissa bytes), then a compressor per stream. Blosc2 releases the
GIL while it works (set here) and records its own settings in each frame, so one header
code, :data:`CODEC_BLOSC2`, decodes every setting:

* ``blosc2-zstd``: shuffle, each byte stream compressed on its own by zstd level 1 (its
  entropy coder is what shrinks the exponent bytes; the mantissa bytes, near random, are
  stored as they are);
* ``blosc2-lz4``: bit shuffle + LZ4: faster, smaller gains (LZ4 has no entropy coder).

Rules: a payload is stored encoded only when that makes it smaller (else it is stored as
it is, codec ``none``, and reads like any chunk); a reader decodes into the destination
buffer, and a frame that would not decode to exactly the expected size is refused before
it is decoded. The package is imported on first use; a reader that lacks it raises
:class:`CodecUnavailableError` (a miss, never wrong bytes).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass
from typing import Any

from kvtiers.core.buffers import Buffer
from kvtiers.errors import CorruptChunkError, KVTiersError
from kvtiers.optional import hint_for

#: Header codes (one byte of the chunk header): how the stored payload is encoded.
CODEC_NONE = 0
CODEC_BLOSC2 = 1
#: Header code → the name messages use.
FORMAT_NAMES: dict[int, str] = {CODEC_NONE: "none", CODEC_BLOSC2: "blosc2"}
#: The settings a tier's ``codec:`` key takes.
CODEC_NAMES: tuple[str, ...] = ("none", "blosc2-zstd", "blosc2-lz4")
#: The package the blosc2 codecs need (the ``codec`` extra installs it).
_PACKAGE = "blosc2"


class CodecUnavailableError(KVTiersError):
    """A chunk is stored with a codec this reader cannot decode: its package is not
    installed, or the header names a codec this build does not know. The chunk is not
    damaged; the load is a miss (counted as a failed load), the chunk is left in place."""


def codec_problem(name: str) -> str | None:
    """Why a tier cannot use the codec ``name`` on this machine (an unknown name, or its
    package is missing), or ``None``. Imports nothing."""
    if name not in CODEC_NAMES:
        return f"unknown codec {name!r}; use one of: {', '.join(CODEC_NAMES)}"
    if name != "none" and importlib.util.find_spec(_PACKAGE) is None:
        return hint_for(_PACKAGE, f"codec: {name}") + ", or set codec: none"
    return None


@functools.cache
def _blosc2() -> Any:
    """The ``blosc2`` module, with the GIL released during its calls and one internal
    thread per call (the movers' I/O threads already run chunks in parallel)."""
    try:
        import blosc2
    except ImportError as exc:
        raise CodecUnavailableError(
            hint_for(_PACKAGE, "the chunk is stored with codec blosc2")
        ) from exc
    blosc2.set_releasegil(True)
    blosc2.set_nthreads(1)
    return blosc2


#: KV dtype names (as the identity records them) by element size, for the shuffle.
_TWO_BYTES = frozenset({"bfloat16", "bf16", "float16", "fp16", "half"})
_FOUR_BYTES = frozenset({"float32", "fp32", "float"})


def typesize_of(kv_dtype: str) -> int:
    """The element size of the KV dtype ``kv_dtype`` in bytes (1 for fp8 and int8 kinds,
    and for names it does not know: shuffling by 1 changes nothing)."""
    name = kv_dtype.lower().removeprefix("torch.")
    if name in _TWO_BYTES:
        return 2
    if name in _FOUR_BYTES:
        return 4
    return 1


@dataclass(frozen=True)
class Codec:
    """One ``codec:`` setting, ready to encode payloads of elements of ``typesize``
    bytes. Thread-safe."""

    name: str
    typesize: int
    format_id: int = CODEC_BLOSC2

    def encode(self, payload: Buffer) -> bytes | None:
        """``payload`` encoded, or ``None`` when encoding would not make it smaller (the
        chunk is then stored as it is)."""
        view = memoryview(payload).cast("B")
        blosc2 = _blosc2()
        typesize = self.typesize if view.nbytes % self.typesize == 0 else 1
        if self.name == "blosc2-zstd":
            params = {"codec": blosc2.Codec.ZSTD, "clevel": 1, "filters": [blosc2.Filter.SHUFFLE],
                      "splitmode": blosc2.SplitMode.ALWAYS_SPLIT}
        else:
            params = {"codec": blosc2.Codec.LZ4, "clevel": 5,
                      "filters": [blosc2.Filter.BITSHUFFLE]}
        encoded: bytes = blosc2.compress2(view, typesize=typesize, nthreads=1, **params)
        return encoded if len(encoded) < view.nbytes else None


def make_codec(name: str, *, kv_dtype: str) -> Codec | None:
    """The encoder of the ``codec:`` setting ``name`` for chunks of ``kv_dtype``
    elements; ``None`` for ``none``. Raises :class:`CodecUnavailableError` when the
    package is missing (the config check says so first)."""
    if name == "none":
        return None
    if name not in CODEC_NAMES:
        raise ValueError(f"unknown codec {name!r}")
    _blosc2()
    return Codec(name, typesize_of(kv_dtype))


def decode_into(format_id: int, stored: Buffer, dest: memoryview) -> None:
    """Decode ``stored`` (encoded with header code ``format_id``) into exactly all of
    ``dest``. A frame that does not declare ``len(dest)`` bytes, or does not decode, is a
    :class:`~kvtiers.errors.CorruptChunkError`; a code or package this reader lacks is a
    :class:`CodecUnavailableError`."""
    if format_id != CODEC_BLOSC2:
        raise CodecUnavailableError(
            f"the chunk is stored with codec {format_id}, which this kvtiers build does "
            "not know (written by a newer version); upgrade kvtiers to read it"
        )
    blosc2 = _blosc2()
    source = memoryview(stored).cast("B")
    try:
        declared, framed, _block = blosc2.get_cbuffer_sizes(source)
    except Exception as exc:  # blosc2 raises RuntimeError/ValueError for a bad frame
        raise CorruptChunkError("codec frame", str(exc)) from None
    if declared != dest.nbytes or framed != source.nbytes:
        raise CorruptChunkError(
            "codec frame", f"a frame of {framed} bytes decoding to {declared}, stored "
            f"{source.nbytes} bytes of a {dest.nbytes}-byte chunk"
        )
    try:
        blosc2.decompress2(source, dst=dest)
    except Exception as exc:
        raise CorruptChunkError("codec frame", str(exc)) from None


class Scratch(threading.local):
    """One growable buffer per thread, for encoded bytes read ahead of decoding."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def view(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes of this thread's buffer."""
        if len(self.buffer) < size:
            self.buffer = bytearray(size)
        return memoryview(self.buffer)[:size]
