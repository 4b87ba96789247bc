"""Shared fixtures: one moto S3 server per test session, and fault injection for S3 clients.

- ``moto_server`` (session): a ``ThreadedMotoServer`` on 127.0.0.1 with an ephemeral
  port, started once; ``s3_endpoint`` (per test) resets its state (``POST
  /moto-api/reset``) and sets dummy credentials, a region and
  ``AWS_EC2_METADATA_DISABLED=true`` for the test only, so nothing can reach AWS.
- ``faults``: a fresh :class:`~kvtiers.testing.s3.FaultInjector`.

Helper classes live in :mod:`kvtiers.testing` (shipped); test modules import them from
there, never from this file.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtiers.testing.s3 import BUCKET, FaultInjector, MotoServer


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
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    moto_server.reset()
    import boto3

    boto3.client("s3", endpoint_url=moto_server.endpoint_url).create_bucket(Bucket=BUCKET)
    return moto_server


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector()
