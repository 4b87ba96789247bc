"""Start-up and index memory of the persistent tiers at millions of chunks.

For each size N, the file tier opens a namespace of N chunk files (empty files with chunk
names, as ``bench_file.py``'s rebuild case makes them) with ``background_index``, in a
process of its own, and a scheduler loop (one step every 10 ms) looks up a sample of keys
that are there (spread over the whole namespace, so most lie beyond the walk's position)
and keys that are not, until the index is complete. Recorded:

- ``first_s``: from the start of the constructor to the first lookup answered ``HIT`` or
  ``MISS`` (``RETRY`` answers come before it: the probe's round trip);
- ``usable_s``: to the index usable (the walk merged: lookups answered by the index, no
  probe); a walk without a snapshot lists names only (no ``stat``), so this comes first;
- ``full_s``: to the index complete (the names-only walk's stat pass taken in: sizes and
  mtime order the files'); from a snapshot, and for the object tier, the same as
  ``usable_s``;
- ``wrong``: answers that disagreed with the disk (``HIT`` for an absent key, ``MISS``
  for a present one) and ``answers``: the definitive answers checked; ``max_call_ms``:
  the longest single lookup call during the build;
- ``index_bytes``: the packed arrays' allocation a chunk
  (:meth:`~kvtiers.tiers.compact.CompactChunkIndex.resident_bytes`), and ``rss_bytes``:
  the process's resident set growth a chunk from before the constructor to after the
  merge (announcement taken, the next step ended, garbage collected), ``anon_bytes``:
  the same for the resident anonymous memory (``RssAnon``: without the pages of mapped
  files, the library code the build touches first), and ``peak_rss_bytes``: the peak
  resident set's growth a chunk over the same span (the walk runs in a child process
  unless ``--walk-processes 0``);
- ``hit_ns`` / ``miss_ns``: the manager's ``lookup`` per call once the index is complete.

The index alone (``ChunkIndex`` against ``CompactChunkIndex``, N keys added, in a process
each) gives bytes a chunk and ``lookup`` per call side by side. SeaweedFS (``weed mini``)
opens a bucket namespace of ``--s3-objects`` objects the same way (listings by prefix),
beside the blocking start (one listing, as before); the objects are created through the
filer's HTTP API (:func:`create_objects`) and, with ``--data``, kept under
``DIR/seaweed-<N>`` (``seaweed-1m``) for the next run.

Run: ``.venv/bin/python benchmarks/bench_scale.py [--data DIR] [--sizes 100000,1000000]
[--s3-objects 100000,1000000]``. Chunk trees are made under ``--data`` once and reused (delete
them afterwards). Writes ``benchmarks/results/scale.{md,json,png}`` unless
``--no-write``.
"""

from __future__ import annotations

import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from harness import (
    bench_parser,
    finish_note,
    from_document,
    kept_section,
    machine_note,
    machine_sentence,
    markdown_table,
    read_result,
    to_document,
    write_result,
)

from kvtiers.core.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
)
from kvtiers.core.geometry import ChunkGeometry
from kvtiers.core.keys import OffloadKey, make_offload_key
from kvtiers.core.manager import LookupResult, Medium, ReqContext, ScheduleEndContext
from kvtiers.filemapper import FileMapper, NamespaceIdentity, open_namespace
from kvtiers.tiers.file.manager import FileTierManager
from kvtiers.tiers.file.walk import DEFAULT_WALK_PROCESSES

#: How this bench's flat results dict maps onto the result schema's sections
#: (``harness.to_document``; ``convert_results.py`` reads it for the older files).
LAYOUT: dict[str, tuple[str, ...]] = {
    "parameters": ("command",),
    "tables": ("file", "index"),
}
CTX = ReqContext(req_id="bench-scale")
END = ScheduleEndContext()
SAMPLE = 200
STEP_S = 0.01
TARGET_FIRST_S = 1.0
#: The dict-based index's columns when its row was not measured.
_NO_ROW = {"rss_bytes": float("nan"), "hit_ns": float("nan"), "miss_ns": float("nan")}
TARGET_FULL_3M_S = 15.0
TARGET_SNAPSHOT_3M_S = 3.0
TARGET_BYTES = 100


def _config() -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers",), 4096),),
        model=OffloadingModelConfig(name="bench/scale"),
        cache=OffloadingCacheConfig(tokens_per_hash=16),
    )


def key_of(i: int) -> OffloadKey:
    return make_offload_key(xxhash.xxh3_128_digest(f"scale:{i}".encode()), 0)


def absent_key(i: int) -> OffloadKey:
    return make_offload_key(xxhash.xxh3_128_digest(f"absent:{i}".encode()), 0)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_tree(root: Path, n: int) -> None:
    """``n`` empty chunk files under ``root``'s namespace (skipped when complete)."""
    marker = root / f".complete-{n}"
    if marker.exists():
        return
    identity = NamespaceIdentity.from_config(_config())
    mapper = FileMapper(root, identity)
    open_namespace(root, identity)
    made: set[Path] = set()
    for i in range(n):
        path = mapper.path(key_of(i))
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    marker.touch()


def serve_during_build(
    lookup: Callable[[OffloadKey], LookupResult], end_step: Callable[[], None],
    complete: Callable[[], bool], present: list[OffloadKey], absent: list[OffloadKey],
    start: float, usable: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """The scheduler loop: one lookup per sampled key a step until the index is complete
    (``usable``: when it became usable, if that comes before)."""
    first_s = usable_s = None
    answers = wrong = retries = 0
    max_call = 0.0
    pending = [(key, True) for key in present] + [(key, False) for key in absent]
    random.Random(1).shuffle(pending)
    while True:
        for key, there in pending[:64]:
            t = time.perf_counter()
            result = lookup(key)
            max_call = max(max_call, time.perf_counter() - t)
            if result is LookupResult.RETRY:
                retries += 1
                continue
            if first_s is None:
                first_s = time.perf_counter() - start
            answers += 1
            wrong += (result is LookupResult.HIT) != there
        pending = pending[64:] + pending[:64]
        end_step()
        # Without a ``usable`` (the object tier), usable is complete.
        if usable_s is None and (complete() if usable is None else usable()):
            usable_s = time.perf_counter() - start
        if complete():
            break
        time.sleep(STEP_S)
    return {"first_s": first_s, "usable_s": usable_s,
            "full_s": time.perf_counter() - start, "answers": answers,
            "wrong": wrong, "retries": retries, "max_call_ms": max_call * 1e3}


def settle(end_step: Callable[[], None]) -> None:
    """The scheduler's next step after the merge's announcement was taken (the tier hands
    the build's freed memory back then, on a thread of its own, waited for here), then a
    garbage collection: what stays is what the index keeps."""
    end_step()
    for thread in threading.enumerate():
        if thread.name == "kvtiers-release-memory":
            thread.join()
    gc.collect()


def per_call_ns(lookup: Callable[[OffloadKey], LookupResult], keys: list[OffloadKey],
                rounds: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        for key in keys:
            lookup(key)
    return (time.perf_counter() - start) / (rounds * len(keys)) * 1e9


def anon_rss() -> int:
    """The process's resident anonymous memory, in bytes (``RssAnon``): its resident set
    less the pages of mapped files (the libraries' code the build touches first, shared
    with every process that maps them and dropped by the kernel at need)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_rss() -> int:
    """The process's peak resident set so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_s(who: int) -> float:
    """User and system CPU seconds so far of ``who`` (``resource.RUSAGE_*``): what a
    start costs however loaded the machine is."""
    used = resource.getrusage(who)
    return used.ru_utime + used.ru_stime


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One start's fields over ``runs``: the answers checked, wrong answers and retries
    summed, every other number the median (the rest from the first); ``rounds`` and
    each round's ``full_s`` kept."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if key in ("answers", "wrong", "retries"):
            out[key] = sum(run[key] for run in runs)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(run[key] for run in runs)
    out["rounds"] = len(runs)
    out["full_s_rounds"] = [run["full_s"] for run in runs]
    return out


def one_file(root: Path, n: int, walk_processes: int) -> dict[str, Any]:
    """One start of the file tier over ``root`` (a subprocess's work)."""
    rng = random.Random(n)
    present = [key_of(rng.randrange(n)) for _ in range(SAMPLE)]
    absent = [absent_key(i) for i in range(SAMPLE)]
    identity = NamespaceIdentity.from_config(_config())
    mapper = FileMapper(root, identity)
    geometry = ChunkGeometry.from_config(_config())
    gc.collect()
    before, anon_before = rss(), anon_rss()
    cpu_before = cpu_s(resource.RUSAGE_SELF), cpu_s(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    manager = FileTierManager(mapper, geometry, background_index=True,
                              walk_processes=walk_processes)
    ctor_s = time.perf_counter() - start
    out = serve_during_build(
        lambda key: manager.lookup(key, CTX), lambda: manager.on_schedule_end(END),
        lambda: manager.index_stat_done, present, absent, start,
        usable=lambda: manager.index_complete,
    )
    out["stat_pass_s"] = manager.stat_pass_s
    out["cpu_s"] = cpu_s(resource.RUSAGE_SELF) - cpu_before[0]
    out["child_cpu_s"] = cpu_s(resource.RUSAGE_CHILDREN) - cpu_before[1]
    out["ctor_s"] = ctor_s
    out["source"] = manager.index_source
    out["chunks"] = int(manager.get_stats()["chunks"])
    manager.take_events()
    settle(lambda: manager.on_schedule_end(END))
    out["index_bytes"] = manager.index.resident_bytes() / n
    out["rss_bytes"] = (rss() - before) / n
    out["anon_bytes"] = (anon_rss() - anon_before) / n
    out["peak_rss_bytes"] = (peak_rss() - before) / n
    out["walk_processes"] = walk_processes
    out["hit_ns"] = per_call_ns(lambda key: manager.lookup(key, CTX), present)
    out["miss_ns"] = per_call_ns(lambda key: manager.lookup(key, CTX), absent)
    start = time.perf_counter()
    manager.shutdown()
    out["shutdown_s"] = time.perf_counter() - start
    return out


def one_before(root: Path, n: int) -> dict[str, Any]:
    """The blocking start of a kvtiers checkout from before the background index (the
    ``--baseline`` checkout): constructor time, RSS growth, lookups per call."""
    rng = random.Random(n)
    present = [key_of(rng.randrange(n)) for _ in range(SAMPLE)]
    absent = [absent_key(i) for i in range(SAMPLE)]
    mapper = FileMapper(root, NamespaceIdentity.from_config(_config()))
    gc.collect()
    before = rss()
    start = time.perf_counter()
    manager = FileTierManager(mapper, ChunkGeometry.from_config(_config()))
    ctor_s = time.perf_counter() - start
    manager.take_events()
    gc.collect()
    out = {"ctor_s": ctor_s, "rss_bytes": (rss() - before) / n,
           "chunks": int(manager.get_stats()["chunks"]),
           "hit_ns": per_call_ns(lambda key: manager.lookup(key, CTX), present),
           "miss_ns": per_call_ns(lambda key: manager.lookup(key, CTX), absent)}
    manager.shutdown()
    return out


def one_index(kind: str, n: int) -> dict[str, Any]:
    """The index alone: ``n`` keys added, bytes a chunk and lookups per call."""
    import importlib

    # "dict": a --baseline checkout from before the dict-based ChunkIndex left the package.
    module, name = (("kvtiers.tiers.compact", "CompactChunkIndex") if kind == "compact"
                    else ("kvtiers.tiers.index", "ChunkIndex"))
    cls = getattr(importlib.import_module(module), name)
    gc.collect()
    before = rss()
    index = cls(None, tier="bench", medium=Medium.STORAGE)
    index.add_ready((key_of(i), 4096) for i in range(n))
    index.take_events()
    gc.collect()
    grown = rss() - before
    rng = random.Random(n)
    present = [key_of(rng.randrange(n)) for _ in range(SAMPLE)]
    absent = [absent_key(i) for i in range(SAMPLE)]
    return {"rss_bytes": grown / n, "hit_ns": per_call_ns(index.lookup, present),
            "miss_ns": per_call_ns(index.lookup, absent)}


def subprocess_json(*args: str, env: Path | None = None) -> dict[str, Any]:
    """This script's ``args`` in a process of its own (with ``env``: importing kvtiers
    from that checkout), its last output line as JSON."""
    environ = dict(os.environ)
    if env is not None:
        environ["PYTHONPATH"] = str(env)
    run = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         check=False, env=environ)
    if run.returncode:
        raise SystemExit(f"bench_scale {' '.join(args)} failed:\n{run.stderr}")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def bench_file(data: Path, n: int, baseline: Path | None, walk_processes: int,
               rounds: int = 1) -> dict[str, Any]:
    root = data / f"n{n}"
    made = time.perf_counter()
    make_tree(root, n)
    made_s = time.perf_counter() - made
    from kvtiers.tiers.file.snapshot import SNAPSHOT_NAME

    namespace_dir = FileMapper(root, NamespaceIdentity.from_config(_config())).namespace_dir
    row: dict[str, Any] = {"n": n, "make_s": made_s}
    if baseline is not None:
        row["before"] = subprocess_json("--one-before", str(root), str(n), env=baseline)
    processes = ("--walk-processes", str(walk_processes))
    walks, snapshots = [], []
    for _ in range(rounds):
        # A walk (no snapshot), whose clean shutdown writes the snapshot the next reads.
        (namespace_dir / SNAPSHOT_NAME).unlink(missing_ok=True)
        walks.append(subprocess_json("--one-file", str(root), str(n), *processes))
        snapshots.append(subprocess_json("--one-file", str(root), str(n), *processes))
    row["walk"], row["snapshot"] = median_run(walks), median_run(snapshots)
    return row


#: Processes and connections each creating the SeaweedFS objects through the filer.
CREATE_PROCESSES = 4
CREATE_CONNECTIONS = 8


def _put_through_filer(job: tuple[int, str, list[str]]) -> int:
    """One creating process: ``names`` written under the filer's directory ``base`` on
    :data:`CREATE_CONNECTIONS` kept-alive connections (threads); how many."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    port, base, names = job
    body = b"c" * 64

    def run(share: list[str]) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for name in share:
            connection.request("PUT", f"{base}/{name}", body=body)
            response = connection.getresponse()
            response.read()
            if response.status not in (200, 201):
                raise RuntimeError(f"PUT {name}: HTTP {response.status}")
        connection.close()
        return len(share)

    with ThreadPoolExecutor(CREATE_CONNECTIONS) as pool:
        return sum(pool.map(run, [names[i::CREATE_CONNECTIONS]
                                  for i in range(CREATE_CONNECTIONS)]))


def create_objects(filer_port: int, bucket: str, names: list[str]) -> None:
    """Write 64-byte objects ``names`` into ``bucket`` through SeaweedFS's filer HTTP API
    (an S3 bucket is the filer's directory ``/buckets/<bucket>``; a plain ``PUT`` of the
    body, no request signing), :data:`CREATE_PROCESSES` processes of
    :data:`CREATE_CONNECTIONS` connections each: the signed boto3 requests this replaced
    were bound by the client's CPU (100,000 objects in 275 s)."""
    from concurrent.futures import ProcessPoolExecutor

    base = f"/buckets/{bucket}"
    shares = [(filer_port, base, names[i::CREATE_PROCESSES]) for i in range(CREATE_PROCESSES)]
    with ProcessPoolExecutor(CREATE_PROCESSES) as pool:
        created = sum(pool.map(_put_through_filer, shares))
    if created != len(names):
        raise RuntimeError(f"created {created} of {len(names)} objects")


def _short(n: int) -> str:
    """``1000000`` as ``1m``, ``100000`` as ``100k`` (a directory's name)."""
    for unit, size in (("m", 1_000_000), ("k", 1_000)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def bench_s3(objects: int, data: Path | None = None, blocking: bool = True) -> dict[str, Any]:
    """SeaweedFS: ``objects`` objects, a background start against the blocking one. With
    ``data`` the server's directory is ``data/seaweed-<objects>`` and kept: a run that
    finds its objects there (``created.json``) does not create them again (the tiers only
    list them: a start changes nothing there but the namespace's manifest). ``blocking``:
    the blocking start with one lister is measured too."""
    from bench_s3 import BUCKET, Server

    from kvtiers.tiers.object.backend import ObjectBackend
    from kvtiers.tiers.object.manager import ObjectTierManager

    if data is None:
        scratch = Path(tempfile.mkdtemp(prefix="kvtiers-scale-s3-"))
    else:
        scratch = data / f"seaweed-{_short(objects)}"
    marker = scratch / "created.json"
    server = Server("seaweedfs", scratch)
    try:
        identity = NamespaceIdentity.from_config(_config())
        store = server.store(8)
        created = json.loads(marker.read_text()) if marker.exists() else None
        if created is None or created.get("objects") != objects:
            server.reset()
            namer = ObjectBackend(store, identity, prefix="scale", threads=1)
            namer.open_namespace()
            names = [namer.object_key(key_of(i)) for i in range(objects)]
            namer.stop_threads()
            start = time.perf_counter()
            create_objects(server.seaweed._ports[6], BUCKET, names)
            created = {"objects": objects, "create_s": time.perf_counter() - start,
                       "how": f"filer PUTs, {CREATE_PROCESSES} processes x "
                              f"{CREATE_CONNECTIONS} connections"}
            del names
            if data is not None:
                marker.write_text(json.dumps(created))
        rng = random.Random(objects)
        present = [key_of(rng.randrange(objects)) for _ in range(SAMPLE)]
        absent = [absent_key(i) for i in range(SAMPLE)]
        # A start over an empty namespace first: the S3 clients of the I/O threads and
        # their service models are loaded once a process (tens of MB), not a chunk's cost.
        warm_backend = ObjectBackend(store, identity, prefix="scale-warm", threads=8)
        warm = ObjectTierManager(warm_backend, max_chunk_bytes=4096, background_index=True)
        warm.wait_index()
        warm_backend.stop_threads()
        warm.shutdown()

        # The measured tier's backend is made first and each of its I/O threads has its
        # S3 client (made at a thread's first request: the probes during the build would
        # make them): what a backend costs is not the index's.
        backend = ObjectBackend(store, identity, prefix="scale", threads=8)
        clients = threading.Barrier(backend.threads, timeout=60)
        for done in [backend.submit(lambda: (store.client(), clients.wait()))
                     for _ in range(backend.threads)]:
            done.result()
        gc.collect()
        before, anon_before = rss(), anon_rss()
        start = time.perf_counter()
        manager = ObjectTierManager(backend, max_chunk_bytes=4096, background_index=True)
        ctor_s = time.perf_counter() - start
        out = serve_during_build(
            lambda key: manager.lookup(key, CTX), lambda: manager.on_schedule_end(END),
            lambda: manager.index_complete, present, absent, start,
        )
        out["ctor_s"] = ctor_s
        out["chunks"] = int(manager.get_stats()["chunks"])
        manager.take_events()
        settle(lambda: manager.on_schedule_end(END))
        out["index_bytes"] = manager.index.resident_bytes() / objects
        out["rss_bytes"] = (rss() - before) / objects
        out["anon_bytes"] = (anon_rss() - anon_before) / objects
        out["hit_ns"] = per_call_ns(lambda key: manager.lookup(key, CTX), present)
        out["miss_ns"] = per_call_ns(lambda key: manager.lookup(key, CTX), absent)
        backend.stop_threads()
        manager.shutdown()
        if blocking:
            start = time.perf_counter()
            backend = ObjectBackend(store, identity, prefix="scale", threads=8)
            one_lister = ObjectTierManager(backend, max_chunk_bytes=4096, list_threads=1)
            out["blocking_one_lister_s"] = time.perf_counter() - start
            backend.stop_threads()
            one_lister.shutdown()
        out["objects"] = objects
        out["create_s"] = created["create_s"]
        out["create_how"] = created.get("how", "boto3 put_object, 16 threads")
        out["bucket"] = BUCKET
        return out
    finally:
        server.stop()


def keep_file_rows(earlier: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add to ``rows`` (in place, then ordered by size) ``earlier``'s file rows, their
    rounds with them, for the sizes ``rows`` lacks, and return those kept. Each kept row
    gets a ``run``: the date, loads and command of the run that measured it (a row carried
    a second time keeps the one it has)."""
    measured = {row["n"] for row in rows}
    run = run_of(earlier)
    kept = [{"run": run, **row} for row in earlier["file"]
            if row["n"] not in measured and "walk" in row]
    rows += kept
    rows.sort(key=lambda row: int(row["n"]))
    return kept


def run_of(earlier: dict[str, Any]) -> dict[str, str]:
    """The date, loads and command of the run that wrote ``earlier``."""
    machine = earlier["machine"]
    return {"date": machine.get("date", "unknown"), "load": machine.get("load", "unknown"),
            "load_end": machine.get("load_end", "unknown"),
            "command": earlier.get("command", "unknown")}


def reused_sentence(kept: list[dict[str, Any]]) -> str:
    """The page's account of which rows ``--reuse`` carried over, and from which run
    (file rows by ``n``, SeaweedFS rows by ``objects``)."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in kept:
        by_run.setdefault(json.dumps(row["run"], sort_keys=True), []).append(row)
    sentence = ""
    for rows in by_run.values():
        run = rows[0]["run"]
        what = "; ".join(
            f"the {kind} rows at {' and '.join(f'{r[field]:,}' for r in group)}"
            for kind, field in (("file", "n"), ("SeaweedFS", "objects"))
            for group in [[r for r in rows if field in r]] if group)
        sentence += (f"Carried over, marked with their run: {what}, from the run of "
                     f"{run['date']} (load {run['load']}, at its end {run['load_end']}; "
                     f"`{run['command']}`). ")
    return (sentence + "The before rows (the blocking start before the background index) "
            "are carried over from the earliest runs of this page (09:12 UTC and before). "
            "This run (the machine line above) measured the rest.")


def _index_cells(r: dict[str, Any]) -> list[str]:
    """The measured cells of one start that builds an index in the background."""
    usable = r.get("usable_s", r["full_s"])
    return [f"{r['ctor_s']:.3f} s", f"{r['first_s']:.3f} s", f"{usable:.2f} s",
            f"{r['full_s']:.2f} s",
            f"{r['answers']} ({r['wrong']})", f"{r['max_call_ms']:.1f} ms",
            f"{r['index_bytes']:.0f}", f"{r['rss_bytes']:.0f}",
            f"{r['anon_bytes']:.0f}" if "anon_bytes" in r else "n/a",
            f"{r['peak_rss_bytes']:.0f}" if "peak_rss_bytes" in r else "n/a",
            f"{r['cpu_s']:.1f} + {r['child_cpu_s']:.1f} s" if "cpu_s" in r else "n/a",
            f"{r['hit_ns'] / 1e3:.1f} / {r['miss_ns'] / 1e3:.1f} µs"]


def s3_list(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The SeaweedFS rows, by object count (an older report holds one row, not a list)."""
    s3 = report.get("s3") or []
    return sorted(s3 if isinstance(s3, list) else [s3], key=lambda row: int(row["objects"]))


def render(report: dict[str, Any]) -> str:
    lines = [
        "# Start-up and index memory at scale",
        "",
        f"Machine: {machine_sentence(report['machine'])}",
        "",
        f"Command: `{report['command']}`. Each file-tier start runs in a process of its own; "
        "a scheduler loop looks up 200 present keys (random over the namespace) and 200 "
        "absent ones, one step every 10 ms, until the index is complete. A walk lists "
        "names only (usable index: lookups answered by the index), then stats every chunk "
        "in the background (full index: sizes and mtime order the files'). Targets: first "
        f"lookup <= {TARGET_FIRST_S:g} s at every N; full index of 3M file chunks <= "
        f"{TARGET_FULL_3M_S:g} s (<= {TARGET_SNAPSHOT_3M_S:g} s from a snapshot); <= "
        f"{TARGET_BYTES} B a chunk; no wrong answer. Each file row is the median of "
        "its rounds (a walk, then a start from the snapshot its shutdown wrote, in turn; "
        "the rounds' full-index times in the JSON). CPU: user and system seconds of the "
        "tier's process and of its walk's child processes, constructor to merge (what "
        "the start costs however loaded the machine is); RSS: the process's resident "
        "growth from before the constructor to the step after the merge; anonymous RSS: "
        "the same without the pages of mapped files (library code the build touches "
        "first, shared and reclaimable); peak RSS: the process's peak resident growth "
        "over the same span.",
        "",
    ]
    cells: list[list[object]] = []
    for row in report["file"]:
        if "before" in row:
            b = row["before"]
            cells.append(["file, before", f"{row['n']:,}", "walk, blocking",
                          *[f"{b['ctor_s']:.2f} s"] * 4, "n/a", f"{b['ctor_s'] * 1e3:.0f} ms",
                          "n/a", f"{b['rss_bytes']:.0f}", "n/a", "n/a", "n/a",
                          f"{b['hit_ns'] / 1e3:.1f} / {b['miss_ns'] / 1e3:.1f} µs"])
        # A row --reuse kept from an earlier run says so (the note below names the run).
        tier = f"file (run {row['run']['date']})" if "run" in row else "file"
        cells += [[tier, f"{row['n']:,}", row[phase]["source"], *_index_cells(row[phase])]
                  for phase in ("walk", "snapshot")]
    s3_rows = s3_list(report)
    for s3 in s3_rows:
        tier = f"s3 (SeaweedFS, run {s3['run']['date']})" if "run" in s3 else "s3 (SeaweedFS)"
        cells.append([tier, f"{s3['objects']:,}", "listings by prefix",
                      *_index_cells(s3)])
    lines += markdown_table(
        ["tier", "chunks", "start", "constructor", "first lookup", "usable index",
         "full index",
         "answers (wrong)", "longest call", "index B/chunk", "RSS B/chunk",
         "anonymous RSS B/chunk", "peak RSS B/chunk", "CPU (tier + walk)",
         "hit / miss per call"], cells,
        align="lrlrrrrrrrrrrrr")
    lines += ["", "The index alone (N keys added; RSS growth a chunk; `lookup` per call):", "",
              *markdown_table(
                  ["keys", "ChunkIndex B/chunk", "CompactChunkIndex B/chunk",
                   "ChunkIndex hit / miss", "CompactChunkIndex hit / miss"],
                  ([f"{row['n']:,}", f"{old['rss_bytes']:.0f}",
                    f"{row['compact']['rss_bytes']:.0f}",
                    f"{old['hit_ns']:.0f} / {old['miss_ns']:.0f} ns",
                    f"{row['compact']['hit_ns']:.0f} / {row['compact']['miss_ns']:.0f} ns"]
                   for row in report["index"]
                   # The dict-based index's row is there only from a --baseline or --reuse.
                   for old in [row.get("dict", _NO_ROW)]),
                  align="rrrrr")]
    for s3 in s3_rows:
        how = s3.get("create_how", "boto3 put_object, 16 threads")
        blocking = (f"took {s3['blocking_one_lister_s']:.2f} s"
                    if "blocking_one_lister_s" in s3 else "was not measured")
        lines += ["", f"SeaweedFS: {s3['objects']:,} objects created in {s3['create_s']:.0f} s "
                  f"({how}); the blocking start with one lister at a time {blocking}."]
    if "reused" in report:
        lines += ["", report["reused"]]
    lines += ["", "![start-up against N](scale.png)", ""]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["file"]
    ns = [row["n"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ns, [r["walk"]["first_s"] for r in rows], "o-", label="first lookup (walk)")
    left.plot(ns, [r["walk"].get("usable_s", r["walk"]["full_s"]) for r in rows], "d-",
              label="usable index (walk, names only)")
    left.plot(ns, [r["walk"]["full_s"] for r in rows], "s-", label="full index (walk)")
    left.plot(ns, [r["snapshot"]["full_s"] for r in rows], "^-",
              label="full index (snapshot)")
    left.axhline(TARGET_FIRST_S, color="grey", linestyle=":", label="first-lookup target")
    left.set_xscale("log")
    left.set_xlabel("chunks")
    left.set_ylabel("seconds from start")
    left.legend(fontsize=8)
    right.plot(ns, [r["walk"]["index_bytes"] for r in rows], "o-", label="index arrays")
    right.plot(ns, [r["walk"]["rss_bytes"] for r in rows], "s-", label="RSS growth")
    right.plot(ns, [r["walk"].get("anon_bytes", float("nan")) for r in rows], "d-",
               label="anonymous RSS growth")
    right.axhline(TARGET_BYTES, color="grey", linestyle=":", label="target")
    right.set_xscale("log")
    right.set_xlabel("chunks")
    right.set_ylabel("bytes a chunk")
    right.legend(fontsize=8)
    fig.suptitle("file tier start-up (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = bench_parser(__doc__, quick="20,000 file chunks, an index of 100,000")
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--sizes", default=None, help="file chunks per start, comma-separated "
                        "(default 100000,1000000,3000000)")
    parser.add_argument("--index-sizes", default=None, help="index sizes (default 1000000)")
    parser.add_argument("--s3-objects", default="",
                        help="SeaweedFS object counts, comma-separated (with --data, each "
                             "server's directory is kept there and its objects reused)")
    parser.add_argument("--s3-blocking-max", type=int, default=100_000,
                        help="the blocking start (one lister) is measured up to this count")
    parser.add_argument("--one-file", nargs=2, metavar=("ROOT", "N"))
    parser.add_argument("--one-index", nargs=2, metavar=("KIND", "N"))
    parser.add_argument("--one-before", nargs=2, metavar=("ROOT", "N"))
    parser.add_argument("--walk-processes", type=int, default=DEFAULT_WALK_PROCESSES,
                        help="the file tier's walk_processes (0: the walk in its process)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a checkout from before the background index, measured too")
    parser.add_argument("--rounds", type=int, default=1,
                        help="walk and snapshot starts a size, in turn (medians kept)")
    parser.add_argument("--reuse", type=Path, default=None,
                        help="an earlier scale.json whose before, file and SeaweedFS rows "
                             "are kept where this run does not measure them")
    args = parser.parse_args()
    if args.one_file:
        print(json.dumps(one_file(Path(args.one_file[0]), int(args.one_file[1]),
                                  args.walk_processes)))
        return 0
    if args.one_before:
        print(json.dumps(one_before(Path(args.one_before[0]), int(args.one_before[1]))))
        return 0
    if args.one_index:
        print(json.dumps(one_index(args.one_index[0], int(args.one_index[1]))))
        return 0
    # An empty list ("") measures no size of its kind.
    sizes = args.sizes if args.sizes is not None else (
        "20000" if args.quick else "100000,1000000,3000000")
    index_sizes = args.index_sizes if args.index_sizes is not None else (
        "100000" if args.quick else "1000000")
    note = machine_note()
    data = args.data or Path(tempfile.mkdtemp(prefix="kvtiers-scale-"))
    report: dict[str, Any] = {"file": [], "index": []}
    earlier = from_document(read_result(args.reuse)) if args.reuse else None
    for n in (int(s) for s in sizes.split(",") if s):
        row = bench_file(data, n, args.baseline, args.walk_processes, args.rounds)
        if earlier is not None and "before" not in row:
            old = [r["before"] for r in earlier["file"] if r["n"] == n and "before" in r]
            if old:
                row["before"] = old[0]
        print(json.dumps(row), flush=True)
        report["file"].append(row)
    for n in (int(s) for s in index_sizes.split(",") if s):
        # The dict-based ChunkIndex left the package: it is measured in a --baseline
        # checkout that has it, or kept from --reuse.
        row = {"n": n, "compact": subprocess_json("--one-index", "compact", str(n))}
        if args.baseline is not None:
            row["dict"] = subprocess_json("--one-index", "dict", str(n), env=args.baseline)
        elif earlier is not None:
            row.update(("dict", r["dict"]) for r in earlier["index"] if r["n"] == n)
        print(json.dumps(row), flush=True)
        report["index"].append(row)
    s3_rows = []
    s3_kept: list[dict[str, Any]] = []
    for n in (int(s) for s in args.s3_objects.split(",") if s):
        s3_rows.append(bench_s3(n, args.data, blocking=n <= args.s3_blocking_max))
        print(json.dumps(s3_rows[-1]), flush=True)
    if earlier is not None:
        # The SeaweedFS rows this run did not measure are kept, marked with their run.
        measured = {row["objects"] for row in s3_rows}
        s3_kept = [{"run": run_of(earlier), **row} for row in s3_list(earlier)
                   if row["objects"] not in measured]
        s3_rows += s3_kept
    if s3_rows:
        report["s3"] = sorted(s3_rows, key=lambda row: int(row["objects"]))
    if earlier is not None:
        kept = keep_file_rows(earlier, report["file"])
        report["reused"] = reused_sentence(kept + s3_kept)
    report["machine"] = finish_note(note)
    report["command"] = "benchmarks/bench_scale.py " + " ".join(sys.argv[1:])
    if not (args.quick or args.no_write):
        # The hand-written reading of the numbers below the page survives a rerun.
        notes = kept_section(args.out / "scale.md", "## Reading the numbers")
        write_result(to_document("scale", report, **LAYOUT), args.out, "scale",
                     render(report) + notes)
        plot(report, args.out / "scale.png")
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
