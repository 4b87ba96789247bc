"""What an S3 put signs (kvtiers/tiers/s3/store.py): its headers, never a SHA-256 of its
body (``UNSIGNED-PAYLOAD``), over https and plain http alike. No server: a ``before-send``
hook records the signed request and answers it, so nothing leaves the process."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

pytest.importorskip("boto3")

from botocore.awsrequest import AWSResponse

from kvtiers.tiers.s3.store import S3Store


class _Raw:
    def stream(self, **_: Any) -> Any:
        return iter(())

    def read(self, *_: Any) -> bytes:
        return b""


def _signed_body_hash(endpoint: str, body: bytes) -> str:
    seen: dict[str, str] = {}

    def answer(request: Any, **_: Any) -> AWSResponse:
        value = request.headers["X-Amz-Content-SHA256"]
        seen["sha"] = value.decode() if isinstance(value, bytes) else value
        return AWSResponse(request.url, 200, {"ETag": '"x"'}, _Raw())

    store = S3Store("bucket", endpoint_url=endpoint, region="us-east-1",
                    credentials=("testing", "testing"),
                    event_hooks=[("before-send.s3.PutObject", answer)])
    try:
        assert store.put_if_absent("ns/chunk", [body[:4096], body[4096:]])
    finally:
        store.close()
    return seen["sha"]


BODY = bytes(range(256)) * 64


def test_a_put_over_https_does_not_hash_its_body_for_the_signature() -> None:
    assert _signed_body_hash("https://s3.example.test", BODY) == "UNSIGNED-PAYLOAD"


def test_a_put_over_plain_http_does_not_hash_its_body_either() -> None:
    sent = _signed_body_hash("http://127.0.0.1:9", BODY)
    assert sent == "UNSIGNED-PAYLOAD"
    assert sent != hashlib.sha256(BODY).hexdigest()
