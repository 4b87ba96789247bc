"""Test helpers for ``kvtiers serve``: a service in its own process, and a peer engine.

:class:`ServiceProcess` starts ``python -m kvtiers serve`` and returns once the service
printed its ready line (the socket accepts from then on), so tests synchronise on the
service itself, never on a sleep. :func:`peer_main` is a second engine process
(``python -m kvtiers.testing.service SOCKET IDENTITY store|read KEYHEX...``) that stores
or reads chunks through its own connection and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtiers.core.keys import OffloadKey
from kvtiers.core.manager import LookupResult, ReqContext


def chunk_bytes_of(key: bytes, size: int) -> bytes:
    """The deterministic test payload of ``key`` (``size`` bytes)."""
    import xxhash

    seed = xxhash.xxh3_64_intdigest(key)
    return (seed.to_bytes(8, "little") * (size // 8 + 1))[:size]


def remove_pool(name: str) -> None:
    """Remove the pool ``/dev/shm/<name>`` and the identity records kept beside it."""
    import shutil

    path = Path("/dev/shm", name)
    path.unlink(missing_ok=True)
    shutil.rmtree(path.with_name(name + ".identities"), ignore_errors=True)


class ServiceProcess:
    """``kvtiers serve`` over ``config`` on ``socket``; :meth:`start` waits for ready."""

    def __init__(self, config: Path, socket: Path, *, slot_bytes: int = 4096,
                 metrics_port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.config = config
        #: Added to this process's environment for the service's (S3 credentials, ...).
        self.env = env or {}
        self.metrics_port = metrics_port
        self.socket = socket
        self.slot_bytes = slot_bytes
        self.proc: subprocess.Popen[str] | None = None
        self.ready_line = ""

    def start(self, *, fresh: bool = False) -> str:
        command = [sys.executable, "-m", "kvtiers", "serve", "--config", str(self.config),
                   "--socket", str(self.socket), "--slot-bytes", str(self.slot_bytes)]
        if fresh:
            command.append("--fresh")
        if self.metrics_port is not None:
            command += ["--metrics-port", str(self.metrics_port)]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **self.env,
                                          "PYTHONPATH": os.pathsep.join(sys.path)})
        assert self.proc.stdout is not None
        # Blocks until the service prints it (or exits: an empty line).
        self.ready_line = self.proc.stdout.readline()
        if not self.ready_line.startswith("kvtiers serve: ready"):
            code = self.proc.wait(timeout=30)
            raise RuntimeError(f"kvtiers serve did not start (exit {code})")
        return self.ready_line

    def kill(self) -> None:
        """``kill -9``, then reap it: when this returns the service is gone."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        """SIGTERM (graceful drain) and its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


def run_peer(socket: Path, identity: bytes, op: str, keys: Sequence[bytes]) -> dict[str, object]:
    """Run :func:`peer_main` in a new process and return its JSON result."""
    done = subprocess.run(
        [sys.executable, "-m", "kvtiers.testing.service", str(socket), identity.decode(), op,
         *(k.hex() for k in keys)],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def peer_main(argv: list[str]) -> None:
    """A peer engine: ``store`` writes each key's test payload through the service and
    commits it; ``read`` looks the keys up, pins them and reports whether each slot's
    bytes equal the payload."""
    from kvtiers.service.client import ServiceClient
    from kvtiers.service.tier import ServiceTierManager

    socket, identity, op, *hexkeys = argv
    keys = [OffloadKey(bytes.fromhex(h)) for h in hexkeys]
    manager = ServiceTierManager(ServiceClient(socket, identity.encode(), 4096))
    ctx = ReqContext("peer")
    result: dict[str, object] = {"op": op}
    if op == "store":
        accepted = manager.prepare_store(keys, ctx) or []
        slots = manager.get_spec(accepted).block_ids
        for key, slot in zip(accepted, slots, strict=True):
            manager.region.view(int(slot))[:4096] = chunk_bytes_of(key, 4096)
        manager.complete_store(accepted, ctx)
        result["stored"] = len(accepted)
    else:
        hits = [k for k in keys if manager.lookup(k, ctx) is LookupResult.HIT]
        manager.prepare_load(hits, ctx)
        slots = manager.get_spec(hits).block_ids
        result["hits"] = len(hits)
        result["exact"] = all(
            bytes(manager.region.view(int(s))[:4096]) == chunk_bytes_of(k, 4096)
            for k, s in zip(hits, slots, strict=True)
        )
        manager.complete_load(hits, ctx)
    manager.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    peer_main(sys.argv[1:])
