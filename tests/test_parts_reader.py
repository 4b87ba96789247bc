"""The put body of the object tiers: a read-only, seekable view over header + payload."""

from __future__ import annotations

import io

import pytest

from kvtiers.core.buffers import Buffer
from kvtiers.tiers.object.store import PartsReader

PARTS: list[Buffer] = [b"head", bytearray(b"-middle-"), memoryview(b"tail")]
WHOLE = b"head-middle-tail"


def test_reads_in_any_block_size_give_the_concatenation() -> None:
    for block in (1, 3, 4, 5, 16, 100):
        reader = PartsReader(PARTS)
        got = b""
        while piece := reader.read(block):
            got += piece
        assert got == WHOLE
    assert PartsReader(PARTS).read() == WHOLE
    assert len(PartsReader(PARTS)) == len(WHOLE)


def test_seek_and_tell_serve_a_client_that_hashes_then_sends() -> None:
    reader = PartsReader(PARTS)
    assert reader.read(6) == b"head-m"
    assert reader.tell() == 6
    assert reader.seek(0) == 0
    assert reader.read() == WHOLE
    assert reader.seek(-4, io.SEEK_END) == len(WHOLE) - 4
    assert reader.read() == b"tail"
    assert reader.read(10) == b""
    reader.seek(2)
    reader.seek(3, io.SEEK_CUR)
    out = bytearray(7)
    assert reader.readinto(out) == 7
    assert bytes(out) == WHOLE[5:12]
    with pytest.raises(ValueError):
        reader.seek(-1)
