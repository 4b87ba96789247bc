"""The lower tiers' codecs, measured: bytes saved, encode and decode speed, S3 load time.

Run from the repository root (blosc2 installed: ``pip install 'kvtiers[codec]'``)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_codec.py \
        --kv bfloat16=KVDIR/bfloat16 --kv fp8=KVDIR/fp8

``--kv NAME=ROOT`` (repeatable) names a file-tier root whose chunk files hold real KV:
``benchmarks/kv_dump.py`` makes them with a vLLM CPU engine (``bfloat16`` and ``fp8``
KV of the tests' tiny model). Beside them the script makes synthetic bf16 KV with the
structure of a trained model's keys: per channel normal values, a few outlier channels 8-30x
louder (``synthetic-bf16``). For each data set and codec it measures, per chunk as the
tiers encode them:

* *ratio*: payload bytes / stored bytes (a chunk that does not shrink is stored as it is);
* *encode* and *decode* GB/s of payload on one thread (best of ``--repeats`` passes over
  every chunk; decode into a preallocated buffer, checksums left out);

then stores the bf16 chunks (real ones joined into 2 MiB chunks, and the synthetic ones)
into an S3 tier against SeaweedFS in its own process, with ``codec: none`` and with each
codec, and times loading them all back through the tier's mover (``--threads``), best of
the rounds, with the bytes each left in the bucket. Writes ``benchmarks/results/codec.md``
and ``codec.json`` unless ``--no-write``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_s3 import BUCKET, Server, on_every_thread, through_mover
from harness import (
    bench_parser,
    finish_note,
    kept_section,
    machine_note,
    machine_sentence,
    markdown_table,
    to_document,
    write_result,
)

from kvtiers.core import chunkformat
from kvtiers.core.codec import CODEC_NAMES, decode_into, make_codec
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.specs import CPULoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.object import ObjectBackend, ObjectMover, Retrier

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("command", "blosc2"),
    "tables": ("codecs", "s3"),
    "summary": ("median_decode_GBps",),
}
MIB = 1024 * 1024
CODECS = [name for name in CODEC_NAMES if name != "none"]
#: The issue's target: this many times fewer S3 bytes on bf16 KV, decoding this fast.
TARGET_RATIO = 1.3
TARGET_DECODE_GBPS = 2.0


def real_chunks(root: Path) -> list[bytes]:
    """The payloads of every chunk file under ``root`` (headers verified on the way)."""
    payloads = []
    for path in sorted(root.rglob("*.kvc")):
        if "quarantine" in path.parts:
            continue
        blob = path.read_bytes()
        key = blob[96 : 96 + int.from_bytes(blob[72:74], "little")]
        header = chunkformat.decode_header(blob, namespace_digest=blob[40:72], key=key)
        payloads.append(blob[chunkformat.HEADER_BYTES :][: header.payload_bytes])
    return payloads


def synthetic_bf16(chunks: int, chunk_bytes: int, seed: int = 0) -> list[bytes]:
    """bf16 KV shaped like a trained model's: [tokens, heads, 128 channels], each channel
    normal with its own scale, 6 outlier channels per head 8-30x louder (keys); values
    quieter and without outliers. Half of each chunk is keys, half values."""
    import torch

    rng = np.random.default_rng(seed)
    heads, dim = 8, 128
    tokens = chunk_bytes // 2 // 2 // (heads * dim)
    out = []
    scale = rng.lognormal(0.0, 0.3, (heads, dim))
    for h in range(heads):
        scale[h, rng.choice(dim, 6, replace=False)] *= rng.uniform(8, 30, 6)
    for _ in range(chunks):
        keys = rng.standard_normal((tokens, heads, dim)) * scale * 0.4
        values = rng.standard_normal((tokens, heads, dim)) * 0.25
        both = torch.from_numpy(np.stack([keys, values]).astype(np.float32)).to(torch.bfloat16)
        out.append(both.view(torch.int16).numpy().tobytes())
    return out


def join(payloads: list[bytes], chunk_bytes: int) -> list[bytes]:
    """Consecutive payloads joined into chunks of ``chunk_bytes`` (the rest dropped)."""
    whole = b"".join(payloads)
    return [whole[i : i + chunk_bytes] for i in range(0, len(whole) - chunk_bytes + 1,
                                                      chunk_bytes)]


def measure_codec(name: str, kv_dtype: str, payloads: list[bytes], repeats: int
                  ) -> dict[str, Any]:
    codec = make_codec(name, kv_dtype=kv_dtype)
    assert codec is not None
    total = sum(map(len, payloads))
    encode_s, decode_s = [], []
    stored: list[bytes | None] = []
    for _ in range(repeats):
        start = time.perf_counter()
        stored = [codec.encode(p) for p in payloads]
        encode_s.append(time.perf_counter() - start)
    encoded = [(s, len(p)) for s, p in zip(stored, payloads, strict=True) if s is not None]
    dest = memoryview(bytearray(max(map(len, payloads))))
    for _ in range(repeats):
        start = time.perf_counter()
        for frame, size in encoded:
            decode_into(codec.format_id, frame, dest[:size])
        decode_s.append(time.perf_counter() - start)
    for (frame, size), payload in zip(encoded, (p for s, p in zip(stored, payloads,
                                                                  strict=True) if s), strict=True):
        decode_into(codec.format_id, frame, dest[:size])
        assert bytes(dest[:size]) == payload
    stored_bytes = sum(len(s) if s is not None else len(p)
                       for s, p in zip(stored, payloads, strict=True))
    decoded_total = sum(size for _, size in encoded)
    return {
        "ratio": total / stored_bytes,
        "encoded_chunks": len(encoded),
        "chunks": len(payloads),
        "encode_GBps": total / min(encode_s) / 1e9,
        "decode_GBps": decoded_total / min(decode_s) / 1e9 if encoded else float("nan"),
    }


def _offloading(chunk_bytes: int, salt: str) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), chunk_bytes),),
        model=OffloadingModelConfig("bench/codec", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16),
        salt=salt,
    )


def s3_load(server: Server, payloads: list[bytes], threads: int, repeats: int,
            label: str) -> dict[str, Any]:
    """Store ``payloads`` once per codec setting, then time loads through the mover."""
    chunk_bytes = len(payloads[0])
    count = len(payloads)
    config = _offloading(chunk_bytes, label)
    geometry = ChunkGeometry.from_config(config)
    identity = NamespaceIdentity.from_config(config)
    region = BytearrayRegion(count, geometry.slot_bytes)
    keys = [conformance_key(i) for i in range(count)]
    store = server.store(threads)
    out: dict[str, Any] = {"chunk_bytes": chunk_bytes, "chunks": count, "threads": threads}
    settings = ["none", *CODECS]
    movers = {}
    for job, name in enumerate(settings):
        for slot, payload in enumerate(payloads):
            region.view(slot)[:chunk_bytes] = payload
        backend = ObjectBackend(store, identity, prefix=f"codec/{label}/{name}",
                                threads=threads, retrier=Retrier(store.is_transient))
        mover = ObjectMover(backend, region, geometry,
                            codec=make_codec(name, kv_dtype="bfloat16"))
        on_every_thread(backend.submit, threads, store.client)
        spec = ObjectLoadStoreSpec(BUCKET, [backend.object_key(k) for k in keys], keys)
        slots = CPULoadStoreSpec(range(count))
        start = time.perf_counter()
        through_mover(mover, 2 * job, slots, spec)
        out[f"{name}_store_s"] = time.perf_counter() - start
        out[f"{name}_bucket_bytes"] = sum(store.head(n) or 0 for n in spec.object_keys)
        movers[name] = (backend, mover, spec, slots)
    times: dict[str, list[float]] = {name: [] for name in settings}
    for round_ in range(repeats):
        order = settings if round_ % 2 == 0 else settings[::-1]
        for name in order:
            backend, mover, spec, slots = movers[name]
            region.buffer[:] = bytes(len(region.buffer))
            start = time.perf_counter()
            through_mover(mover, 1000 + round_ * 10 + settings.index(name), spec, slots)
            times[name].append(time.perf_counter() - start)
            for slot, payload in enumerate(payloads):
                assert bytes(region.view(slot)[:chunk_bytes]) == payload
    for name, (backend, mover, _spec, _slots) in movers.items():
        out[f"{name}_load_s"] = min(times[name])
        out[f"{name}_load_rounds_s"] = times[name]
        out[f"{name}_load_GBps"] = count * chunk_bytes / min(times[name]) / 1e9
        mover.shutdown()
        backend.stop_threads()
    for name in CODECS:
        out[f"{name}_bytes_ratio"] = out["none_bucket_bytes"] / out[f"{name}_bucket_bytes"]
        out[f"{name}_load_ratio"] = out["none_load_s"] / out[f"{name}_load_s"]
    return out


def render(data: dict[str, Any]) -> str:
    lines = [
        "# Codec benchmarks",
        "",
        f"Machine: {machine_sentence(data['machine'])}.",
        "",
        f"Command: `{data['command']}`. Codecs: `blosc2-zstd` (byte shuffle by the KV "
        "element size, then zstd level 1 on each byte stream), `blosc2-lz4` (bit shuffle, "
        "LZ4 level 5); blosc2 " + data["blosc2"] + ", one thread per call. Targets: "
        f">= {TARGET_RATIO}x fewer S3 bytes on bf16 KV with decode >= {TARGET_DECODE_GBPS} "
        "GB/s per core.",
        "",
        "## Bytes and speed per chunk (one thread)",
        "",
        *markdown_table(
            ["data", "chunks", "chunk", "codec", "ratio", "chunks encoded", "encode GB/s",
             "decode GB/s"],
            ([row["data"], row["chunks"], f"{row['chunk_bytes'] // 1024} KiB", row["codec"],
              f"{row['ratio']:.3f}", row["encoded_chunks"], f"{row['encode_GBps']:.2f}",
              f"{row['decode_GBps']:.2f}"] for row in data["codecs"]),
            align="lrrlrrrr"),
    ]
    lines += [
        "",
        "Order-0 entropy of each byte of an element (bits of 8; what an entropy coder "
        "working byte by byte can reach at best):",
        "",
        *markdown_table(
            ["data", "bytes", "entropy per byte", "bound on the ratio"],
            ([name, len(row["bits"]), " / ".join(f"{b:.2f}" for b in row["bits"]),
              f"{row['bound']:.3f}"] for name, row in data["entropy"].items()),
            align="lllr"),
    ]
    if not data["s3"]:  # --no-s3
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"## S3 load through SeaweedFS, out of process ({data['s3'][0]['threads']} threads)",
        "",
        "Every chunk stored once per setting, then all loaded back through the tier's mover "
        "(verified, decoded into the slots), best of the rounds; bytes are what the bucket "
        "holds (headers included).",
        "",
        *markdown_table(
            ["data", "chunks x size", "setting", "bucket MiB", "bytes ratio", "load s",
             "load ratio", "store s"],
            ([row["data"], f"{row['chunks']} x {row['chunk_bytes'] // MIB} MiB", name,
              f"{row[f'{name}_bucket_bytes'] / MIB:.1f}",
              "" if name == "none" else f"{row[f'{name}_bytes_ratio']:.3f}",
              f"{row[f'{name}_load_s']:.3f}",
              "" if name == "none" else f"{row[f'{name}_load_ratio']:.2f}",
              f"{row[f'{name}_store_s']:.3f}"]
             for row in data["s3"] for name in ["none", *CODECS]),
            align="lllrrrrr"),
    ]
    return "\n".join(lines) + "\n"


NOTES = "## Reading the numbers"


def entropy(payloads: list[bytes], typesize: int) -> dict[str, Any]:
    data = np.frombuffer(b"".join(payloads), dtype=np.uint8)
    data = data[: len(data) // typesize * typesize].reshape(-1, typesize)
    bits = []
    for i in range(typesize):
        counts = np.bincount(data[:, i], minlength=256).astype(float)
        p = counts[counts > 0] / counts.sum()
        bits.append(float(-(p * np.log2(p)).sum()))
    return {"bits": bits, "bound": 8 * typesize / sum(bits)}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="one repeat, 4 S3 chunks")
    parser.add_argument("--kv", action="append", default=[], metavar="NAME=ROOT",
                        help="a file-tier root of real KV chunks (bfloat16=..., fp8=...)")
    parser.add_argument("--repeats", type=int, default=None, help="passes per codec (5)")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--s3-chunks", type=int, default=None, help="chunks per S3 set (16)")
    parser.add_argument("--no-s3", action="store_true", help="leave out the S3 loads")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 5)
    s3_chunks = args.s3_chunks or (4 if args.quick else 16)
    note = machine_note()
    import blosc2

    sets: dict[str, tuple[str, list[bytes]]] = {}
    for item in args.kv:
        name, _, root = item.partition("=")
        sets[f"real {name}"] = ("bfloat16" if name.startswith("b") else name,
                                real_chunks(Path(root)))
    sets["synthetic bf16"] = ("bfloat16", synthetic_bf16(16, 2 * MIB))
    rows, ent = [], {}
    for label, (kv_dtype, payloads) in sets.items():
        ent[label] = entropy(payloads, 2 if kv_dtype == "bfloat16" else 1)
        for name in CODECS:
            row = measure_codec(name, kv_dtype, payloads, repeats)
            row.update(data=label, codec=name, chunk_bytes=len(payloads[0]))
            rows.append(row)
            print(f"{label:16s} {name:12s} ratio {row['ratio']:.3f} "
                  f"encode {row['encode_GBps']:.2f} decode {row['decode_GBps']:.2f} GB/s",
                  flush=True)
    s3_rows = []
    if not args.no_s3:
        bf16 = [(lbl, p) for lbl, (d, p) in sets.items() if d == "bfloat16"]
        with tempfile.TemporaryDirectory(prefix="kvtiers-codec-") as scratch:
            server = Server("seaweedfs", Path(scratch))
            try:
                server.reset()
                for label, payloads in bf16:
                    chunks = join(payloads, 2 * MIB)[:s3_chunks]
                    row = s3_load(server, chunks, args.threads, repeats,
                                  label.replace(" ", "-"))
                    row["data"] = label
                    s3_rows.append(row)
                    print(label, {k: v for k, v in row.items() if k.endswith(("ratio", "_s"))},
                          flush=True)
            finally:
                server.stop()
    data = {
        "machine": finish_note(note),
        "command": "benchmarks/bench_codec.py " + " ".join(sys.argv[1:] if argv is None
                                                           else argv),
        "blosc2": blosc2.__version__,
        "codecs": rows,
        "entropy": ent,
        "s3": s3_rows,
        "median_decode_GBps": statistics.median(r["decode_GBps"] for r in rows),
    }
    text = render(data)
    print(text)
    if not (args.quick or args.no_write):
        # The hand-written reading of the numbers below the tables survives a rerun.
        notes = kept_section(args.out / "codec.md", NOTES)
        page = text + ("\n" + notes if notes else "")
        write_result(to_document("codec", data, **LAYOUT), args.out, "codec", page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
