"""The namespace summary: no false negative, the false-positive rate it documents, a
format that refuses damage, and the tools that read it (``inspect``, ``has``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtiers.cli import main
from kvtiers.core.keys import make_offload_key
from kvtiers.errors import SummaryError
from kvtiers.filemapper.summary import (
    FALSE_POSITIVE_RATE,
    HEADER_BYTES,
    SUMMARY_NAME,
    NamespaceSummary,
)
from kvtiers.testing.conformance import conformance_key
from tests.test_file_support import IDENTITY, open_tier

DIGEST = bytes(range(32))


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(xxhash.xxh3_128_digest(b"summary:%d" % i), group)


# -- what it answers ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.sets(st.binary(min_size=5, max_size=40), max_size=300))
def test_every_key_it_was_built_from_is_present(keys: set[bytes]) -> None:
    summary = NamespaceSummary.build(keys, namespace_digest=DIGEST)
    assert all(k in summary for k in keys)
    assert summary.keys == len(keys)


def test_absent_keys_read_present_at_about_the_documented_rate() -> None:
    listed = [key(i) for i in range(20_000)]
    summary = NamespaceSummary.build(listed, namespace_digest=DIGEST)
    others = [key(i) for i in range(20_000, 220_000)]
    rate = sum(k in summary for k in others) / len(others)
    # 0.82 % in theory (10 bits and 7 probes per key); 200,000 trials put the measured
    # rate within 0.1 point of it far beyond chance.
    assert abs(FALSE_POSITIVE_RATE - 0.0082) < 5e-5
    assert summary.false_positive_rate == pytest.approx(FALSE_POSITIVE_RATE, rel=1e-3)
    assert abs(rate - FALSE_POSITIVE_RATE) < 0.001, rate


def test_leading_counts_a_prefixs_chunks_up_to_the_first_absent_one() -> None:
    prefix = [key(i) for i in range(6)]
    summary = NamespaceSummary.build(prefix[:3] + prefix[4:], namespace_digest=DIGEST)
    assert summary.leading(prefix) == 3
    assert summary.leading(prefix[:3]) == 3
    assert summary.leading([]) == 0


def test_an_empty_namespace_has_a_summary_that_holds_nothing() -> None:
    summary = NamespaceSummary.decode(NamespaceSummary.build([], namespace_digest=DIGEST).encode())
    assert summary.keys == 0 and summary.bits == 64
    assert key(1) not in summary and "not bytes" not in summary


# -- the format -----------------------------------------------------------------------------
def encoded() -> bytes:
    return NamespaceSummary.build([key(i) for i in range(50)], namespace_digest=DIGEST,
                                  listed_at_ns=1_700_000_000 * 10**9).encode()


def test_it_round_trips_and_keeps_its_fields() -> None:
    data = encoded()
    summary = NamespaceSummary.decode(data, namespace_digest=DIGEST)
    assert summary.encode() == data
    assert (summary.keys, summary.probes, summary.listed_at_ns) == (50, 7, 1_700_000_000 * 10**9)
    assert len(data) == HEADER_BYTES + summary.bits // 8
    assert data[:8] == b"KVTSUMRY" and struct.unpack_from("<HH", data, 8) == (1, HEADER_BYTES)


def _flip(data: bytes, offset: int) -> bytes:
    damaged = bytearray(data)
    damaged[offset] ^= 0x01
    return bytes(damaged)


@pytest.mark.parametrize(
    ("damage", "check"),
    [
        (lambda d: d[:100], "size"),
        (lambda d: b"NOTASUMM" + d[8:], "magic"),
        (lambda d: d[:8] + struct.pack("<H", 2) + d[10:], "format version"),
        (lambda d: _flip(d, 24), "header checksum"),
        (lambda d: _flip(d, HEADER_BYTES + 3), "payload checksum"),
        (lambda d: d + bytes(8), "length"),
    ],
    ids=["truncated", "magic", "version", "header", "payload", "length"],
)
def test_damage_is_refused_naming_the_check(damage: object, check: str) -> None:
    with pytest.raises(SummaryError) as caught:
        NamespaceSummary.decode(damage(encoded()))  # type: ignore[operator]
    assert caught.value.check == check


def test_a_summary_of_another_namespace_is_refused() -> None:
    with pytest.raises(SummaryError, match="namespace check failed"):
        NamespaceSummary.decode(encoded(), namespace_digest=bytes(32))


# -- the tools ------------------------------------------------------------------------------
@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A file root whose namespace holds chunks 0..4 and a summary of them."""
    tier = open_tier(tmp_path)
    tier.store(range(5))
    tier.close()
    summary = NamespaceSummary.build([conformance_key(i) for i in range(5)],
                                     namespace_digest=IDENTITY.digest)
    (tmp_path / IDENTITY.namespace / SUMMARY_NAME).write_bytes(summary.encode())
    return tmp_path


def chunk_name(i: int) -> str:
    return f"{conformance_key(i)[:-4].hex()}_g0"


def test_has_answers_from_the_summary(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["has", str(root), IDENTITY.namespace, chunk_name(0), chunk_name(1)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"present {chunk_name(0)}", f"present {chunk_name(1)}"]
    assert out[2].startswith(f"2 of 2 leading chunk(s) present in {IDENTITY.namespace}")
    # A key the namespace never held (hex of the key's bytes works too): exit status 1.
    absent = conformance_key(99).hex()
    assert main(["has", "--json", str(root), IDENTITY.namespace, chunk_name(2), absent]) == 1
    document = json.loads(capsys.readouterr().out)
    assert [k["present"] for k in document["keys"]] == [True, False]
    assert document["leading"] == 1


def test_has_without_a_summary_or_with_a_bad_key_says_what_to_do(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["has", str(root), IDENTITY.namespace, "not-a-key"]) == 2
    assert "is not a chunk key" in capsys.readouterr().err
    (root / IDENTITY.namespace / SUMMARY_NAME).unlink()
    # No summary is no answer: exit status 3, not the 1 of an absent key.
    assert main(["has", str(root), IDENTITY.namespace, chunk_name(0)]) == 3
    err = capsys.readouterr().err
    assert "has no summary" in err and "summary_interval_s" in err
    assert main(["has", "--json", str(root), IDENTITY.namespace, chunk_name(0)]) == 3
    document = json.loads(capsys.readouterr().out)
    assert document["keys"] is None and document["leading"] is None
    assert "has no summary" in document["error"]


def test_has_refuses_a_key_of_the_wrong_length(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A sha256-length hash in a namespace of xxh3_128 keys: refused (2), not "absent".
    long_key = "ab" * 32 + "_g0"
    assert main(["has", str(root), IDENTITY.namespace, long_key]) == 2
    err = capsys.readouterr().err
    assert f"{long_key!r} is not a chunk key of {IDENTITY.namespace}" in err
    assert "its keys are of 20 bytes (a xxh3_128 hash and a 4-byte group)" in err
    assert err.rstrip().endswith("this one is 36 bytes")
    # A group the namespace does not have: refused too.
    other_group = f"{conformance_key(0)[:-4].hex()}_g7"
    assert main(["has", str(root), IDENTITY.namespace, other_group]) == 2
    assert "in another group" in capsys.readouterr().err


def test_inspect_shows_the_summary_and_gc_leaves_it(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(root)]) == 0
    text = capsys.readouterr().out
    assert "  summary: 5 chunk keys in 8 B (7 probes, 0.24% false positives), listed" in text
    assert main(["inspect", "--json", str(root)]) == 0
    [namespace] = json.loads(capsys.readouterr().out)["namespaces"]
    assert namespace["summary"]["keys"] == 5 and namespace["summary"]["readable"]
    assert namespace["other_files"] == 0  # the summary is not an unknown file
    assert main(["gc", str(root), "--older-than-days", "0"]) == 0
    capsys.readouterr()
    assert (root / IDENTITY.namespace / SUMMARY_NAME).exists()


def test_inspect_reports_a_damaged_summary_in_one_line(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = root / IDENTITY.namespace / SUMMARY_NAME
    path.write_bytes(_flip(path.read_bytes(), HEADER_BYTES + 1))
    assert main(["inspect", str(root)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("summary: unreadable (payload checksum check failed); the next complete "
            "listing rewrites it") in text


#: docs/sharing.md's Python example's root and namespace, replaced to run it here.
DOC_ROOT, DOC_NAMESPACE = "/var/cache/kvtiers", "Qwen__Qwen3-8B-1a2b3c4d5e6f7a8b"


def test_read_summary_takes_a_path_or_url_as_the_docs_show_it(root: Path) -> None:
    from kvtiers.tools.summary import read_summary

    keys = [conformance_key(i) for i in (0, 1, 99)]
    assert read_summary(str(root), IDENTITY.namespace).leading(keys) == 2
    text = (Path(__file__).resolve().parent.parent / "docs" / "sharing.md").read_text()
    (block,) = [b.split("\n", 1)[1] for b in text.split("```")[1::2]
                if b.startswith("python") and "read_summary" in b]
    assert DOC_ROOT in block and DOC_NAMESPACE in block
    scope: dict[str, object] = {"keys": keys}
    exec(block.replace(DOC_ROOT, str(root)).replace(DOC_NAMESPACE, IDENTITY.namespace), scope)
    assert scope["held"] == 2
