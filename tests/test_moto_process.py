"""The kit's moto server in a process of its own (:class:`kvtiers.testing.s3.MotoProcess`):
it answers S3 requests, ``reset`` empties it, and ``stop`` ends the child process."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from kvtiers.testing.s3 import AWS_TEST_ENV, MotoProcess  # noqa: E402


def test_serves_s3_out_of_process_and_stops() -> None:
    moto = MotoProcess()
    server = moto.start()
    try:
        pid = moto.pid
        assert pid is not None and pid != os.getpid()
        os.kill(pid, 0)  # a live process of its own
        client = boto3.client(
            "s3", endpoint_url=server.endpoint_url, region_name="us-east-1",
            aws_access_key_id=AWS_TEST_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        )
        client.create_bucket(Bucket="kvtiers-moto-process")
        client.put_object(Bucket="kvtiers-moto-process", Key="a/b", Body=b"payload")
        body = client.get_object(Bucket="kvtiers-moto-process", Key="a/b")["Body"].read()
        assert body == b"payload"
        server.reset()
        assert client.list_buckets()["Buckets"] == []
        with pytest.raises(RuntimeError, match="already running"):
            moto.start()
    finally:
        moto.stop()
    assert moto.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended and reaped
    moto.stop()  # idempotent
