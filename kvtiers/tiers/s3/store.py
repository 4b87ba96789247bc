"""The S3 adapter of the object-store interface, on boto3.

One ``boto3`` session per store; each I/O thread gets its own client (clients are made
under a lock, since making them from one session is not thread-safe), so requests never
share a client across threads. botocore's own retries are off (``standard`` mode with one
attempt): the tier's :class:`~kvtiers.tiers.object.retry.Retrier` is the only retry loop,
so ``max_attempts`` means what it says. Checksums of request and response bodies are left
to the chunk format (xxh3_128 in every header) rather than computed again per request.

Time: a request made inside :meth:`Retrier.call <kvtiers.tiers.object.retry.Retrier.call>`
waits on its socket at most the time left to that call's deadline
(:func:`~kvtiers.tiers.object.retry.remaining_s`, passed to botocore as the request's
``read_timeout``), and a body read stops once it has passed; so a server that accepts a
request and never answers, or answers too slowly, fails the operation within its deadline.
``timeout_s`` caps every socket wait (connecting included) on its own.

Credentials come from the standard AWS chain (environment, profile, instance role) unless
given explicitly (the embedded test server's dummy keys); they are never logged.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from kvtiers.errors import ConfigError
from kvtiers.tiers.object.retry import remaining_s
from kvtiers.tiers.object.store import Buffer, ObjectInfo, ObjectMissing, ObjectStore

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "ConditionalRequestConflict", "BadDigest", "IncompleteBody",
})
# 501 Not Implemented is an answer, not a hiccup: a store without conditional writes gives
# it to every put, so retrying it only delays the failure.
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,  # refused, connect timeouts
    botocore.exceptions.HTTPClientError,  # closed or reset mid-request, read timeouts
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    # Raised by a body read straight from the socket (see get_into).
    TimeoutError,
    ConnectionError,
    http.client.HTTPException,
)

#: The shortest socket wait a request is given, even with its deadline all but spent.
_MIN_WAIT_S = 0.001

#: ``(event name, handler)`` pairs registered on every client this store makes.
EventHook = tuple[str, Callable[..., Any]]


def _error_code(exc: BaseException) -> tuple[str, int]:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return "", 0
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def lacks_conditional_writes(exc: BaseException) -> bool:
    """Whether ``exc`` is an endpoint's 501 Not Implemented to a put: it does not support
    the ``If-None-Match`` condition every put of this store carries."""
    return (
        isinstance(exc, botocore.exceptions.ClientError)
        and exc.operation_name == "PutObject"
        and _error_code(exc)[1] == 501
    )


class S3Store(ObjectStore):
    """Objects in one S3 bucket (names are object keys)."""

    def __init__(
        self,
        bucket: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        timeout_s: float = 30.0,
        max_connections: int = 16,
        credentials: tuple[str, str] | None = None,
        event_hooks: Sequence[EventHook] = (),
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s
        key_id, secret = credentials if credentials is not None else (None, None)
        self._session = boto3.session.Session(
            aws_access_key_id=key_id, aws_secret_access_key=secret, region_name=region
        )
        self._config = botocore.config.Config(
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            max_pool_connections=max_connections,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._event_hooks = tuple(event_hooks)
        self._local = threading.local()
        self._make_lock = threading.Lock()

    def client(self) -> Any:
        """This thread's S3 client."""
        client = getattr(self._local, "client", None)
        if client is None:
            with self._make_lock:
                client = self._session.client(
                    "s3", endpoint_url=self.endpoint_url, config=self._config
                )
            client.meta.events.register("before-send.s3", self._cap_read_timeout)
            for event, handler in self._event_hooks:
                client.meta.events.register(event, handler)
            self._local.client = client
        return client

    def _cap_read_timeout(self, request: Any, **_: Any) -> None:
        """botocore ``before-send`` hook: this request's socket waits end by the calling
        operation's deadline."""
        left = remaining_s()
        context = getattr(request, "context", None)
        if left is not None and left < self.timeout_s and isinstance(context, dict):
            context["read_timeout"] = max(_MIN_WAIT_S, left)

    def describe(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{name}"

    # -- start-up checks ------------------------------------------------------------
    def check_bucket(self, *, where: str = "bucket") -> None:
        """Raise :class:`~kvtiers.errors.ConfigError` unless the bucket is reachable
        with the credentials at hand; the message says what to do."""
        try:
            self.client().head_bucket(Bucket=self.bucket)
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(
                f"no AWS credentials found for bucket {self.bucket!r}; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or run where an "
                "instance role is available",
                path=where,
            ) from None
        except botocore.exceptions.ClientError as exc:
            code, status = _error_code(exc)
            if status == 404 or code in _NOT_FOUND_CODES or code == "NoSuchBucket":
                raise ConfigError(
                    f"bucket {self.bucket!r} does not exist at {self._where()}; create it "
                    "or fix the bucket name",
                    path=where,
                ) from None
            if status == 403:
                raise ConfigError(
                    f"access to bucket {self.bucket!r} at {self._where()} is denied; check "
                    "the credentials and the bucket policy (list, get, put and delete are needed)",
                    path=where,
                ) from None
            raise ConfigError(
                f"bucket {self.bucket!r} at {self._where()} cannot be used: {code or status}",
                path=where,
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise ConfigError(
                f"cannot reach {self._where()} for bucket {self.bucket!r} "
                f"({type(exc).__name__}); check endpoint_url and the network",
                path=where,
            ) from None

    def _where(self) -> str:
        return self.endpoint_url or "AWS S3"

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for the embedded test server)."""
        client = self.client()
        try:
            client.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError:
            client.create_bucket(Bucket=self.bucket)

    # -- the interface --------------------------------------------------------------
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                yield ObjectInfo(item["Key"], int(item["Size"]), item["LastModified"].timestamp())

    def head(self, name: str) -> int | None:
        try:
            response = self.client().head_object(Bucket=self.bucket, Key=name)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc)[0] in _NOT_FOUND_CODES:
                return None
            raise
        return int(response["ContentLength"])

    def get_into(self, name: str, buffers: Sequence[memoryview]) -> int:
        try:
            response = self.client().get_object(Bucket=self.bucket, Key=name)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc)[0] in _NOT_FOUND_CODES:
                raise ObjectMissing(name) from None
            raise
        size = int(response["ContentLength"])
        body = response["Body"]
        if size != sum(len(b) for b in buffers):
            body.close()
            return size
        raw: Any = getattr(body, "_raw_stream", None)
        fp: Any = getattr(raw, "_fp", None)
        # Straight from the socket into the caller's buffers: urllib3's readinto reads into
        # a temporary bytes object and copies (twice, measured ~20% slower on 16 MiB). The
        # length is checked here and the bytes by the chunk checksum, so botocore's own
        # content-length check is not needed. Any other body takes the public path.
        direct = (
            isinstance(fp, http.client.HTTPResponse)
            and raw is not None
            and not raw.headers.get("content-encoding")
        )
        readinto = fp.readinto if direct else body.readinto
        try:
            for buffer in buffers:
                filled = 0
                while filled < len(buffer):
                    if remaining_s() == 0.0:
                        raise TimeoutError(f"{self.describe(name)}: the operation deadline "
                                           "passed while the body was being read")
                    n = readinto(buffer[filled:])
                    if not n:
                        raise botocore.exceptions.IncompleteReadError(
                            actual_bytes=filled, expected_bytes=len(buffer)
                        )
                    filled += n
        except BaseException:
            body.close()
            raise
        if direct:
            raw.release_conn()  # the body is fully read: the connection can be reused
        else:
            body.close()
        return size

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            self.client().put_object(Bucket=self.bucket, Key=name, Body=body, IfNoneMatch="*")
        except botocore.exceptions.ClientError as exc:
            code, status = _error_code(exc)
            if status == 412 or code == "PreconditionFailed":
                return False
            raise
        return True

    def delete(self, name: str) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=name)

    def is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, _TRANSIENT_ERRORS):
            return True
        code, status = _error_code(exc)
        return code in _TRANSIENT_CODES or status in _TRANSIENT_STATUSES

    def close(self) -> None:
        self._local = threading.local()
