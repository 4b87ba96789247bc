"""The fault matrix of docs/architecture.md, "Liveness": each fault a lower tier meets, on
the file, S3 (moto) and fsspec tiers, through the composite and the scheduler glue (the
simulated engine). Each case asserts that the request's match resolves within the bound,
that no wrong byte is loaded, that a failed load is not retried every step, and that
after the fault ends the tier serves the prefix again.

A stack stores a prompt's chunks and is shut down; a fresh stack over the same root or
bucket (so the chunks live in the lower tier only) meets the fault. Back-offs run on a
fake clock the test advances, so nothing waits on time.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext
from kvtiers.engine.scheduler import OffloadScheduler
from kvtiers.engine.simulator import SimulatedEngine
from kvtiers.stack.builder import Stack, load_stack
from kvtiers.testing.s3 import BUCKET, MotoServer

TOKENS_PER_CHUNK = 16
MODEL = {
    "name": "test/faults",
    "tokens_per_hash": TOKENS_PER_CHUNK,
    "blocks_per_chunk": 1,
    "groups": [{"tokens_per_block": TOKENS_PER_CHUNK, "num_layers": 1, "page_bytes": "1KiB"}],
}
CHUNKS = 6
BAD = 2  # the chunk the fault hits
PROMPT = list(range(1000, 1000 + CHUNKS * TOKENS_PER_CHUNK + 1))
#: Engine steps within which a request's match must resolve under a fault: one step for
#: the promotions to run and fail, then the failed key is a miss.
BOUND_STEPS = 2
CTX = ReqContext("faults")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Bench:
    """Builds stacks of one lower-tier kind over the same medium."""

    kind: str
    tier: dict[str, Any]
    tmp: Path
    stacks: list[Stack] = field(default_factory=list)
    clock: FakeClock = field(default_factory=FakeClock)

    def stack(self, **changes: Any) -> Stack:
        description = {
            "tiers": [{"kind": "cpu", "capacity": "1MiB"}, {**self.tier, **changes}],
            "model": MODEL,
        }
        built = load_stack(description)
        self.stacks.append(built)
        built.wait_index()  # a warm restart's chunks are indexed before the fault starts
        built.tiers[1].manager.backoff.clock = self.clock
        return built

    def chunk_path(self, stack: Stack, key: OffloadKey) -> Path:
        """Where ``key``'s chunk lies on the local filesystem (file and fsspec tiers)."""
        lower = stack.tiers[1]
        if self.kind == "file":
            return Path(lower.manager.mapper.path(key))
        backend = lower.mover.backend  # type: ignore[union-attr]
        return Path(backend.store._path(backend.object_key(key)))


def prompt_keys(stack: Stack, tokens: list[int]) -> list[OffloadKey]:
    glue = OffloadScheduler(stack.manager, stack.offloading)
    glue.add_request("keys", tokens)
    keys = glue.chunk_keys("keys", 0)
    glue.finish_request("keys")
    return keys


@pytest.fixture
def bench(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bench]:
    kind: str = request.param
    if kind == "file":
        tier: dict[str, Any] = {"kind": "file", "root": str(tmp_path / "root"), "threads": 2}
    elif kind == "fsspec":
        tier = {"kind": "fsspec", "url": f"file://{tmp_path / 'fs'}", "threads": 2}
    else:
        moto: MotoServer = request.getfixturevalue("s3_endpoint")
        tier = {"kind": "s3", "bucket": BUCKET, "prefix": "faults", "threads": 2,
                "endpoint_url": moto.endpoint_url, "max_attempts": 2,
                "backoff_base_s": 0.001, "backoff_max_s": 0.002}
    made = Bench(kind, tier, tmp_path)
    yield made
    for stack in made.stacks:
        stack.shutdown()


def publish(bench: Bench) -> list[OffloadKey]:
    """Store the prompt's chunks into the lower tier through a stack that then stops."""
    stack = bench.stack()
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    engine.run_request("publish", PROMPT)
    engine.shutdown()
    stack.manager.wait_idle()
    assert stack.tiers[1].manager.get_stats()["chunks"] == CHUNKS
    keys = prompt_keys(stack, PROMPT)
    stack.shutdown()
    return keys


# -- the faults -----------------------------------------------------------------------
@dataclass
class Fault:
    """One fault on the chunk ``key`` of ``stack``'s lower tier: ``start`` it, ``end`` it.

    ``lasting``: the chunk itself is unreadable (it is forgotten after repeated failures);
    ``whole_tier``: every load of the tier fails, not just this chunk's."""

    start: Callable[[], None]
    end: Callable[[], None]
    lasting: bool
    whole_tier: bool = False


def _path_fault(bench: Bench, stack: Stack, key: OffloadKey, kind: str) -> Fault:
    path = bench.chunk_path(stack, key)
    saved = path.with_name(path.name + ".saved")

    def start() -> None:
        os.replace(path, saved)
        if kind == "directory":
            path.mkdir()
        else:
            path.symlink_to(path)

    def end() -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        os.replace(saved, path)

    return Fault(start, end, lasting=True)


def _patch(target: Any, name: str, failing: Callable[..., Any]) -> Fault:
    original = getattr(target, name)

    def start() -> None:
        setattr(target, name, failing)

    def end() -> None:
        setattr(target, name, original)

    return Fault(start, end, lasting=False)


def _eio(bench: Bench, stack: Stack, key: OffloadKey) -> Fault:
    mover: Any = stack.tiers[1].mover
    if bench.kind == "file":
        backend = mover.backend
        bad = str(bench.chunk_path(stack, key))
        read = backend.read

        def failing_read(path: Path, *args: Any) -> Any:
            if str(path) == bad:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
            return read(path, *args)

        return _patch(backend, "read", failing_read)
    store = mover.backend.store
    name = mover.backend.object_key(key)
    get_hashed = store.get_hashed

    def failing_get(object_name: str, *args: Any) -> int:
        if object_name == name:
            raise OSError(errno.EIO, os.strerror(errno.EIO), object_name)
        return int(get_hashed(object_name, *args))

    return _patch(store, "get_hashed", failing_get)


def _server_down(bench: Bench, stack: Stack, key: OffloadKey) -> Fault:
    import botocore.exceptions

    store: Any = stack.tiers[1].mover.backend.store  # type: ignore[union-attr]

    def down(name: str, *args: Any) -> int:
        raise botocore.exceptions.EndpointConnectionError(endpoint_url=bench.tier["endpoint_url"])

    fault = _patch(store, "get_hashed", down)
    fault.whole_tier = True
    return fault


def _access_denied(bench: Bench, stack: Stack, key: OffloadKey) -> Fault:
    import botocore.exceptions

    mover: Any = stack.tiers[1].mover
    store = mover.backend.store
    name = mover.backend.object_key(key)
    get_hashed = store.get_hashed

    def denied(object_name: str, *args: Any) -> int:
        if object_name == name:
            raise botocore.exceptions.ClientError(
                {"Error": {"Code": "AccessDenied", "Message": "injected"},
                 "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
        return int(get_hashed(object_name, *args))

    fault = _patch(store, "get_hashed", denied)
    fault.lasting = True
    return fault


FAULTS: dict[str, tuple[tuple[str, ...], Callable[[Bench, Stack, OffloadKey], Fault]]] = {
    "directory": (("file", "fsspec"), lambda b, s, k: _path_fault(b, s, k, "directory")),
    "symlink loop": (("file", "fsspec"), lambda b, s, k: _path_fault(b, s, k, "loop")),
    "EIO": (("file", "fsspec", "s3"), _eio),
    "server down": (("s3",), _server_down),
    "access denied": (("s3",), _access_denied),
}
MATRIX = [(kind, name) for name, (kinds, _) in FAULTS.items() for kind in kinds]
LASTING = [(kind, name) for kind, name in MATRIX if name in ("directory", "access denied")]


@pytest.mark.parametrize(("bench", "fault_name"), MATRIX, indirect=["bench"])
def test_an_unreadable_chunk_resolves_backs_off_and_is_served_after_the_fault(
    bench: Bench, fault_name: str
) -> None:
    _, make = FAULTS[fault_name]
    keys = publish(bench)
    stack = bench.stack()
    lower = stack.tiers[1].manager
    fault = make(bench, stack, keys[BAD])
    fault.start()
    engine = SimulatedEngine(stack, num_gpu_blocks=64)

    first = engine.run_request("faulted", PROMPT)
    usable = 0 if fault.whole_tier else BAD
    assert first.wait_steps <= BOUND_STEPS
    assert first.reused_tokens == usable * TOKENS_PER_CHUNK
    assert first.verification_failures == 0 and first.load_failures == 0
    failures = lower.get_stats()["load_failures"]
    assert failures == (CHUNKS if fault.whole_tier else 1)

    # Within the back-off the key is a miss at once: no new promotion of it, no failure.
    stack.manager.reset_cache()
    again = engine.run_request("again", PROMPT)
    assert again.reused_tokens == usable * TOKENS_PER_CHUNK
    assert again.wait_steps <= BOUND_STEPS
    assert lower.get_stats()["load_failures"] == failures

    fault.end()
    bench.clock.now += 3600.0  # past every back-off
    stack.manager.reset_cache()
    healed = engine.run_request("healed", PROMPT)
    engine.shutdown()
    assert healed.verification_failures == 0
    assert healed.reused_tokens == CHUNKS * TOKENS_PER_CHUNK
    stats = lower.get_stats()
    assert stats["unreadable_chunks"] == 0
    assert stats["chunks"] == CHUNKS


@pytest.mark.parametrize(("bench", "fault_name"), LASTING, indirect=["bench"])
def test_a_lasting_failure_is_forgotten_after_repeated_tries(
    bench: Bench, fault_name: str
) -> None:
    _, make = FAULTS[fault_name]
    keys = publish(bench)
    stack = bench.stack()
    lower = stack.tiers[1].manager
    make(bench, stack, keys[BAD]).start()
    engine = SimulatedEngine(stack, num_gpu_blocks=64)
    for attempt in range(2):
        bench.clock.now += 3600.0  # past the back-off of the previous try
        stack.manager.reset_cache()
        report = engine.run_request(f"try{attempt}", PROMPT)
        assert report.reused_tokens == BAD * TOKENS_PER_CHUNK
        assert report.verification_failures == 0
    engine.shutdown()
    stats = lower.get_stats()
    assert stats["load_failures"] == 2
    assert stats["unreadable_chunks"] == 1
    # Forgotten: a miss for the longest back-off, even where a new store found the
    # object still there and indexed it again (object stores keep an existing object).
    assert lower.lookup(keys[BAD], CTX) is LookupResult.MISS
    if bench.kind == "file":
        assert stats["chunks"] == CHUNKS - 1  # the store over the directory failed


# -- shared roots and buckets: another engine's prefix ---------------------------------
LONG_CHUNKS = 192
LONG_PROMPT = list(range(5000, 5000 + LONG_CHUNKS * TOKENS_PER_CHUNK + 1))
#: Steps for a published prefix to become loadable: probe, promote, then it is ready.
VISIBLE_STEPS = 3


def _wait_for_background(stack: Stack) -> None:
    """Let the step's probes and promotions finish (an engine's time between steps)."""
    lower: Any = stack.tiers[1].manager
    if hasattr(lower, "wait_probes"):
        lower.wait_probes()
    else:
        lower.wait_background()
    stack.manager.wait_idle()


@pytest.mark.parametrize("bench", ["file", "s3", "fsspec"], indirect=True)
def test_a_prefix_another_engine_published_is_loadable_within_three_steps(
    bench: Bench,
) -> None:
    follower = bench.stack(shared=True)
    publisher = bench.stack()
    engine = SimulatedEngine(publisher, num_gpu_blocks=256)
    engine.run_request("publish", LONG_PROMPT)
    engine.shutdown()
    publisher.manager.wait_idle()
    assert publisher.tiers[1].manager.get_stats()["chunks"] == LONG_CHUNKS

    glue = OffloadScheduler(follower.manager, follower.offloading)
    glue.add_request("follow", LONG_PROMPT)
    steps = 0
    match = glue.match_prefix("follow", max_tokens=len(LONG_PROMPT) - 1)
    while match.pending and steps <= LONG_CHUNKS:
        steps += 1
        glue.end_step()
        _wait_for_background(follower)
        match = glue.match_prefix("follow", max_tokens=len(LONG_PROMPT) - 1)
    glue.finish_request("follow")
    assert steps <= VISIBLE_STEPS
    assert match.tokens == LONG_CHUNKS * TOKENS_PER_CHUNK
    # The promoted prefix holds exactly the publisher's bytes.
    reader = SimulatedEngine(follower, num_gpu_blocks=256)
    report = reader.run_request("verify", LONG_PROMPT)
    reader.shutdown()
    assert report.reused_tokens == LONG_CHUNKS * TOKENS_PER_CHUNK
    assert report.verification_failures == 0
