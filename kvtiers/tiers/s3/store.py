"""The S3 adapter of the object-store interface, on boto3.

One ``boto3`` session per store; each I/O thread gets its own client (clients are made
under a lock, since making them from one session is not thread-safe), so requests never
share a client across threads.

Retries: every request goes through botocore's own ``standard`` or ``adaptive`` retry
mode (``retry_mode``; ``max_attempts`` attempts in all): botocore knows which answers are
throttling, backs off from 1 s on those, honours the server's retry-after hints, keeps a
retry quota, and in ``adaptive`` mode also limits the client's request rate. A listing is
paged by botocore's paginator, each page retried on its own. What botocore never retries
is a GET body that breaks after the response headers came, or a response that arrived
without its length; those surface here as :class:`TransitError`, the only error
:meth:`S3Store.is_transient` admits, so the tier's
:class:`~kvtiers.tiers.object.retry.Retrier` retries exactly those and nothing is tried
``max_attempts``² times. Retries botocore makes are counted in :attr:`S3Store.retries`.

Time: a request made inside :meth:`Retrier.call <kvtiers.tiers.object.retry.Retrier.call>`
waits on its socket at most the time left to that call's deadline
(:func:`~kvtiers.tiers.object.retry.remaining_s`, passed to botocore as the request's
``read_timeout``); botocore's back-off before a retry is capped at ``backoff_max_s``, and a
retry whose back-off would end past the deadline is not made (the request raises
:class:`~kvtiers.tiers.object.retry.OperationDeadlineError`); a body read stops once the
deadline has passed. So a server that accepts a request and never answers, or answers too
slowly, fails the operation within its deadline. In ``adaptive`` mode a request may wait
in botocore's client-side rate limiter before it is sent; that wait counts against the
deadline, and a request whose deadline passed while it waited fails without being sent.
``timeout_s`` caps every socket wait (connecting included) on its own.

Checksums of request and response bodies are left to the chunk format (xxh3_128 in every
header) rather than computed again per request, and so is a put body's integrity: its
SigV4 signature covers the request's headers, not a SHA-256 of the body
(``UNSIGNED-PAYLOAD``), which saves a pass over every payload (about 0.6 ms of CPU per
1 MiB chunk, a fifth of the put's client-side CPU, and the server's check of it;
benchmarks/results/serve.md). Over https TLS protects the body in transit; over plain
http a network attacker could change any GET response anyway (responses are never
signed), so a signed put body would not protect what loads read: an untrusted network
needs https either way. :meth:`S3Store.get_hashed` computes a GET payload's checksum as
the body lands. A put sends a read-only file view over the header and the payload
(:class:`~kvtiers.tiers.object.store.PartsReader`), never a joined copy.
Credentials come from the standard AWS chain (environment, ``profile``, instance role)
unless given explicitly (the embedded test server's dummy keys); they are never logged,
and an endpoint is always shown with any ``user:password@`` in its URL redacted
(:func:`~kvtiers.config.tiers.redact_url`).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import boto3
import botocore.config
import botocore.exceptions
from botocore.retries import standard as botocore_standard

from kvtiers.config.tiers import redact_url
from kvtiers.errors import BackendUnavailableError, ConfigError
from kvtiers.tiers.object.retry import OperationDeadlineError, remaining_s
from kvtiers.tiers.object.store import (
    Buffer,
    Hasher,
    ObjectInfo,
    ObjectMissing,
    ObjectStore,
    PartsReader,
)

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# Raised by a body read, after botocore has handed the response over (see get_into).
_BODY_ERRORS: tuple[type[BaseException], ...] = (
    botocore.exceptions.HTTPClientError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,
    TimeoutError,
    ConnectionError,
    http.client.HTTPException,
)
_THROTTLING_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequests",
})

#: The shortest socket wait a request is given, even with its deadline all but spent.
_MIN_WAIT_S = 0.001
#: Bytes read from a GET body per call: a piece is hashed while it is still in cache.
_PIECE_BYTES = 256 * 1024
#: Where botocore registers its retry handler on an S3 client's events.
_RETRY_EVENT = "needs-retry.s3"
_RETRY_HANDLER_ID = "retry-config-s3"

#: ``(event name, handler)`` pairs registered on every client this store makes.
EventHook = tuple[str, Callable[..., Any]]
RetryMode = Literal["standard", "adaptive"]


class TransitError(ConnectionError):
    """A response broke in transit after botocore handed it over: its body was cut, reset
    or timed out, or it came without a Content-Length. Worth another request."""


def _error_code(exc: BaseException) -> tuple[str, int]:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return "", 0
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status or 0)


def _describe_error(exc: BaseException) -> str:
    code, status = _error_code(exc)
    if code or status:
        return f"{status} {code}".strip()
    return f"{type(exc).__name__}: {exc}"


def lacks_conditional_writes(exc: BaseException) -> bool:
    """Whether ``exc`` is an endpoint's 501 Not Implemented to a put: it does not support
    the ``If-None-Match`` condition every put of this store carries."""
    return (
        isinstance(exc, botocore.exceptions.ClientError)
        and exc.operation_name == "PutObject"
        and _error_code(exc)[1] == 501
    )


def _content_length(response: Any, what: str) -> int:
    length = response.get("ContentLength")
    if length is None:
        # A response cut inside its headers parses as a 200 without them.
        raise TransitError(f"{what}: the response carried no Content-Length")
    return int(length)


class _DeadlineBoundRetries:
    """botocore's retry handler, with its back-off capped at ``max_delay_s`` and no retry
    whose back-off would end past the calling operation's deadline; counts retries."""

    def __init__(self, handler: Any, max_delay_s: float, count: Callable[[], None]) -> None:
        self._handler = handler
        self._max_delay_s = max_delay_s
        self._count = count

    def __call__(self, **kwargs: Any) -> float | None:
        delay = self._handler.needs_retry(**kwargs)
        if delay is None:
            return None
        delay = min(float(delay), self._max_delay_s)
        left = remaining_s()
        if left is not None and delay >= left:
            caught = kwargs.get("caught_exception")
            if caught is None:
                http_response = (kwargs.get("response") or (None, None))[0]
                last = f"HTTP {getattr(http_response, 'status_code', '?')}"
            else:
                last = f"{type(caught).__name__}: {caught}"
            raise OperationDeadlineError(
                f"gave up after {kwargs.get('attempts', '?')} attempt(s): the operation "
                f"deadline (op_deadline_s) had {left:.3g} s left, less than the next "
                f"back-off; last error: {last}"
            )
        self._count()
        return delay


class S3Store(ObjectStore):
    """Objects in one S3 bucket (names are object keys)."""

    def __init__(
        self,
        bucket: str,
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        profile: str | None = None,
        timeout_s: float = 30.0,
        max_connections: int = 16,
        retry_mode: RetryMode = "standard",
        max_attempts: int = 5,
        backoff_max_s: float = 20.0,
        conditional_writes: bool = True,
        list_page_size: int = 1000,
        credentials: tuple[str, str] | None = None,
        event_hooks: Sequence[EventHook] = (),
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_max_s = backoff_max_s
        self.conditional_writes = conditional_writes
        self.list_page_size = list_page_size
        key_id, secret = credentials if credentials is not None else (None, None)
        # AWS_REGION is what the other AWS SDKs and runtimes set; botocore reads only
        # AWS_DEFAULT_REGION and the profile's region, then falls back to its S3 default.
        region = region or os.environ.get("AWS_REGION") or None
        try:
            self._session = boto3.session.Session(
                aws_access_key_id=key_id, aws_secret_access_key=secret, region_name=region,
                profile_name=profile,
            )
        except botocore.exceptions.ProfileNotFound:
            raise ConfigError(
                f"the AWS profile {profile!r} is not defined in the AWS config or "
                "credentials files; fix the name or define the profile",
                path="profile",
            ) from None
        self._config = botocore.config.Config(
            retries={"mode": retry_mode, "total_max_attempts": max_attempts},
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            max_pool_connections=max_connections,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # UNSIGNED-PAYLOAD: see the module docstring.
            s3={"payload_signing_enabled": False},
        )
        self._event_hooks = tuple(event_hooks)
        self._local = threading.local()
        self._make_lock = threading.Lock()
        self._retries_lock = threading.Lock()
        self._retries = 0

    @property
    def retries(self) -> int:
        """Retries botocore made for this store's requests (attempts after the first)."""
        return self._retries

    def _count_retry(self) -> None:
        with self._retries_lock:
            self._retries += 1

    def client(self) -> Any:
        """This thread's S3 client."""
        client = getattr(self._local, "client", None)
        if client is None:
            with self._make_lock:
                client = self._session.client(
                    "s3", endpoint_url=self.endpoint_url, config=self._config
                )
            events = client.meta.events
            # botocore's handler is rebuilt here to wrap it; registering it again under
            # its own id is a no-op, so the original is taken out first.
            events.unregister(_RETRY_EVENT, unique_id=_RETRY_HANDLER_ID)
            handler = botocore_standard.register_retry_handler(client, self.max_attempts)
            events.unregister(_RETRY_EVENT, unique_id=_RETRY_HANDLER_ID)
            events.register(
                _RETRY_EVENT,
                _DeadlineBoundRetries(handler, self.backoff_max_s, self._count_retry),
                unique_id=_RETRY_HANDLER_ID,
            )
            for event, handler in self._event_hooks:
                events.register(event, handler)
            # Last of all before sending: after adaptive mode's rate limiter has waited.
            events.register_last("before-send", self._cap_read_timeout)
            self._local.client = client
        return client

    def _cap_read_timeout(self, request: Any, **_: Any) -> None:
        """botocore ``before-send`` hook: this request's socket waits end by the calling
        operation's deadline; a request whose deadline passed before it could be sent
        (adaptive mode's rate limiter holds requests back) is not sent."""
        left = remaining_s()
        if left == 0.0:
            raise OperationDeadlineError(
                "the operation deadline (op_deadline_s) passed before the request could "
                "be sent (adaptive retry mode limits the request rate while throttled)"
            )
        context = getattr(request, "context", None)
        if left is not None and left < self.timeout_s and isinstance(context, dict):
            context["read_timeout"] = max(_MIN_WAIT_S, left)

    @property
    def where(self) -> str:
        """The endpoint requests really go to (as botocore resolved it), credentials in the
        URL redacted."""
        return redact_url(str(self.client().meta.endpoint_url))

    def describe(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{name}"

    # -- start-up checks ------------------------------------------------------------
    def check_bucket(self, *, where: str = "bucket") -> None:
        """Raise :class:`~kvtiers.errors.ConfigError` unless the bucket is reachable
        with the credentials at hand; the message says what to do. The request is retried
        like any other, so one throttled or dropped answer does not fail start-up."""
        try:
            self.client().head_bucket(Bucket=self.bucket)
        except botocore.exceptions.NoCredentialsError:
            raise ConfigError(
                f"no AWS credentials found for bucket {self.bucket!r}; set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE (or profile:), "
                "or run where an instance role is available",
                path=where,
            ) from None
        except botocore.exceptions.ClientError as exc:
            code, status = _error_code(exc)
            if status == 404 or code in _NOT_FOUND_CODES or code == "NoSuchBucket":
                raise ConfigError(
                    f"bucket {self.bucket!r} does not exist at {self.where}; create it "
                    "or fix the bucket name",
                    path=where,
                ) from None
            if status == 403:
                raise ConfigError(
                    f"access to bucket {self.bucket!r} at {self.where} is denied; check "
                    "the credentials and the bucket policy (list, get, put and delete are needed)",
                    path=where,
                ) from None
            if status in (429, 500, 502, 503, 504) or code in _THROTTLING_CODES:
                raise ConfigError(
                    f"{self.where} answered {status} {code} for bucket {self.bucket!r} "
                    f"{self.max_attempts} time(s) in a row: it is reachable but throttling "
                    "or failing; try again later, or raise max_attempts",
                    path=where,
                ) from None
            raise ConfigError(
                f"bucket {self.bucket!r} at {self.where} cannot be used: {code or status}",
                path=where,
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise ConfigError(
                f"cannot reach {self.where} for bucket {self.bucket!r} after "
                f"{self.max_attempts} attempt(s) ({type(exc).__name__}); check endpoint_url, "
                "region and the network",
                path=where,
            ) from None

    def check_conditional_writes(self, prefix: str, *, where: str = "endpoint_url") -> None:
        """Raise :class:`~kvtiers.errors.ConfigError` unless the endpoint honours
        ``If-None-Match: *``: a sentinel object under ``prefix`` is put twice with the
        condition, and the second put must be refused. The sentinel is deleted after."""
        name = f"{prefix.strip('/')}/.kvtiers-conditional-probe-{uuid.uuid4().hex}".lstrip("/")
        advice = (
            "kvtiers needs them so that racing writers never overwrite each other; use a "
            "store that supports them, or set conditional_writes: false to accept last "
            "writer wins (chunk checksums still keep every read safe)"
        )
        try:
            first = self.put_if_absent(name, [b"kvtiers conditional-write probe"])
            second = self.put_if_absent(name, [b"kvtiers conditional-write probe, again"])
        except botocore.exceptions.ClientError as exc:
            if lacks_conditional_writes(exc):
                raise ConfigError(
                    f"the S3 endpoint {self.where} does not support conditional writes "
                    f"(PutObject with If-None-Match answers 501); {advice}",
                    path=where,
                ) from None
            raise ConfigError(
                f"cannot write a probe object to bucket {self.bucket!r} at {self.where}: "
                f"{_describe_error(exc)} after {self.max_attempts} attempt(s); check the "
                "credentials, the bucket policy (put and delete are needed) and the "
                "endpoint's health",
                path="bucket",
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise ConfigError(
                f"cannot write a probe object to bucket {self.bucket!r} at {self.where} "
                f"after {self.max_attempts} attempt(s) ({type(exc).__name__}); check the "
                "endpoint and the network",
                path="endpoint_url",
            ) from None
        finally:
            with contextlib.suppress(Exception):  # a leftover sentinel is harmless
                self.delete(name)
        if not first or second:
            raise ConfigError(
                f"the S3 endpoint {self.where} ignores conditional writes (a second "
                f"PutObject with If-None-Match: * of {self.describe(name)} was accepted); "
                f"{advice}",
                path=where,
            )

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for the embedded test server)."""
        client = self.client()
        try:
            client.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError:
            client.create_bucket(Bucket=self.bucket)

    # -- the interface --------------------------------------------------------------
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, page by page; each page is retried by botocore
        on its own. A page that still fails raises
        :class:`~kvtiers.errors.BackendUnavailableError` naming the endpoint."""
        paginator = self.client().get_paginator("list_objects_v2")
        pages = 0
        try:
            pagination = {"PageSize": self.list_page_size}
            for page in paginator.paginate(
                Bucket=self.bucket, Prefix=prefix, PaginationConfig=pagination
            ):
                pages += 1
                for item in page.get("Contents", ()):
                    yield ObjectInfo(
                        item["Key"], int(item["Size"]), item["LastModified"].timestamp()
                    )
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            raise BackendUnavailableError(
                f"listing {self.describe(prefix)} at {self.where} failed on page "
                f"{pages + 1} after {self.max_attempts} attempt(s): {_describe_error(exc)}; "
                "the endpoint is unreachable, throttling or failing — try again later or "
                "raise max_attempts"
            ) from exc

    def head(self, name: str) -> int | None:
        try:
            response = self.client().head_object(Bucket=self.bucket, Key=name)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc)[0] in _NOT_FOUND_CODES:
                return None
            raise
        return _content_length(response, self.describe(name))

    def get_into(self, name: str, buffers: Sequence[memoryview]) -> int:
        return self._get(name, buffers, None)

    def get_hashed(self, name: str, buffers: Sequence[memoryview], hasher: Hasher) -> int:
        """Hashes each piece of ``buffers[1:]`` as it lands, while it is still in the CPU's
        cache, instead of in a pass over the payload after the body."""
        return self._get(name, buffers, hasher)

    def _get(self, name: str, buffers: Sequence[memoryview], hasher: Hasher | None) -> int:
        try:
            response = self.client().get_object(Bucket=self.bucket, Key=name)
        except botocore.exceptions.ClientError as exc:
            if _error_code(exc)[0] in _NOT_FOUND_CODES:
                raise ObjectMissing(name) from None
            raise
        body = response["Body"]
        try:
            size = _content_length(response, self.describe(name))
        except TransitError:
            body.close()
            raise
        if size > sum(len(b) for b in buffers):
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
        left = size
        try:
            for index, whole in enumerate(buffers):
                buffer = whole[: min(len(whole), left)]
                left -= len(buffer)
                filled = 0
                while filled < len(buffer):
                    if remaining_s() == 0.0:
                        raise TimeoutError(f"{self.describe(name)}: the operation deadline "
                                           "passed while the body was being read")
                    piece = buffer[filled : filled + _PIECE_BYTES]
                    n = readinto(piece)
                    if not n:
                        raise TransitError(
                            f"{self.describe(name)}: the body ended after {filled} of "
                            f"{len(buffer)} bytes"
                        )
                    if hasher is not None and index:
                        hasher.update(piece[:n])
                    filled += n
        except _BODY_ERRORS as exc:
            body.close()
            if isinstance(exc, TransitError):
                raise
            raise TransitError(
                f"{self.describe(name)}: the body read failed: {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:
            body.close()
            raise
        if direct:
            raw.release_conn()  # the body is fully read: the connection can be reused
        else:
            body.close()
        return size

    def put_if_absent(self, name: str, parts: Sequence[Buffer]) -> bool:
        """With ``conditional_writes`` off the put carries no condition: the last writer
        wins, and True is returned. The body is a read-only file view over ``parts``: no
        joined copy of header and payload is made."""
        condition = {"IfNoneMatch": "*"} if self.conditional_writes else {}
        try:
            self.client().put_object(
                Bucket=self.bucket, Key=name, Body=PartsReader(parts), **condition
            )
        except botocore.exceptions.ClientError as exc:
            code, status = _error_code(exc)
            if status == 412 or code == "PreconditionFailed":
                return False
            raise
        return True

    def put(self, name: str, parts: Sequence[Buffer]) -> None:
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.client().put_object(Bucket=self.bucket, Key=name, Body=body)

    def delete(self, name: str) -> None:
        self.client().delete_object(Bucket=self.bucket, Key=name)

    def is_transient(self, exc: BaseException) -> bool:
        """Only a response broken in transit (:class:`TransitError`): everything else
        botocore has already retried as its retry mode says."""
        return isinstance(exc, TransitError)

    def close(self) -> None:
        self._local = threading.local()
