"""The retention admin endpoint, served beside ``/metrics`` (docs/retention.md, "The admin
endpoint").

``POST /admin/pin``, ``/admin/unpin`` and ``/admin/expire`` take a JSON object::

    {"block_hashes": ["<hex>", ...], "seconds": 3600, "tenant": "team-a"}

``block_hashes`` are the hex digests of chunks' block hashes as vLLM hashes them (the
last block hash of each chunk: the one its offload key carries, which the self-describing
``BlockStored`` events list last); ``seconds`` is how long a pin lasts (required for
``pin``, at most ``retention.max_pin_s``) or, for ``expire``, how long from now the
chunks expire (default 0: now). ``tenant`` (a stack with a ``tenants:`` section only)
names whose chunks the hashes are, and whose pin cap a pin counts against (default: the
default tenant); an unknown tenant is a 400. Token ids are not accepted: vLLM's block hashes depend
on the engine's hash seed, ``cache_salt``, LoRA and multi-modal inputs, which this
endpoint cannot reproduce.

Every call carries ``Authorization: Bearer <token>`` (the token is read from the
environment variable ``retention.admin_token_env`` names): without it, or with another
token, the answer is 401 and nothing changes. Bad input is a 400 whose JSON ``error``
says what is wrong; a pin past the cap is a 409 and pins nothing. A change holds at
once: the book is shared with the scheduler thread under its lock.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvtiers.core.keys import GROUP_INDEX_BYTES, OffloadKey
from kvtiers.policies.retention import RetentionBook

if TYPE_CHECKING:
    from kvtiers.stack.tenants import TenantKeys

#: The paths the endpoint answers, and the action each names.
ACTIONS = ("pin", "unpin", "expire")
#: Hashes one call may name at most.
MAX_HASHES = 100_000
#: Bytes of request body read at most.
MAX_BODY = 16 * 1024 * 1024

_HEX = re.compile(r"[0-9a-fA-F]+")

StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


class AdminError(Exception):
    """A refused call: ``status`` is the HTTP status line, the message the ``error``."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


class RetentionAdmin:
    """The WSGI app of ``/admin/*`` over ``book``; other paths go to ``fallback`` (the
    metrics app). ``hash_bytes`` is the length of a block hash (``None``: any length);
    ``tenants``, a ``tenants:`` section's keys, scopes hashes and pins by tenant."""

    def __init__(self, book: RetentionBook, token: str, fallback: WsgiApp, *,
                 hash_bytes: int | None, tenants: TenantKeys | None = None) -> None:
        if not token:
            raise ValueError("the admin endpoint needs a non-empty token")
        self.book = book
        self._token = token.encode()
        self._fallback = fallback
        self.hash_bytes = hash_bytes
        self.tenants = tenants

    def __call__(self, environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/admin/"):
            return self._fallback(environ, start)
        try:
            self._authorize(environ)
            action = path[len("/admin/"):]
            if action not in ACTIONS:
                raise AdminError("404 Not Found", f"no admin action {action!r}; use "
                                 + ", ".join(f"/admin/{a}" for a in ACTIONS))
            if environ.get("REQUEST_METHOD") != "POST":
                raise AdminError("405 Method Not Allowed", "use POST with a JSON body")
            body = self._body(environ)
            result = self._act(action, body)
        except AdminError as exc:
            return _answer(start, exc.status, {"error": str(exc)},
                           [("WWW-Authenticate", "Bearer")] if exc.status.startswith("401")
                           else [])
        return _answer(start, "200 OK", result)

    def _authorize(self, environ: dict[str, Any]) -> None:
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._token):
            raise AdminError("401 Unauthorized",
                             "give the admin token as 'Authorization: Bearer <token>'")

    def _body(self, environ: dict[str, Any]) -> dict[str, Any]:
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise AdminError("400 Bad Request", "Content-Length is not a number") from None
        if not 0 < length <= MAX_BODY:
            raise AdminError("400 Bad Request",
                             f"the body must be a JSON object of 1 to {MAX_BODY} bytes")
        try:
            data = json.loads(environ["wsgi.input"].read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise AdminError("400 Bad Request", f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise AdminError("400 Bad Request", "the body must be a JSON object")
        return data

    def _hashes(self, data: dict[str, Any]) -> list[bytes]:
        unknown = sorted(set(data) - {"block_hashes", "seconds", "tenant"})
        if unknown:
            raise AdminError("400 Bad Request", f"unknown key(s) {', '.join(unknown)}; "
                             "known: block_hashes, seconds, tenant (token ids are not "
                             "accepted)")
        raw = data.get("block_hashes")
        if not isinstance(raw, list) or not raw or len(raw) > MAX_HASHES:
            raise AdminError("400 Bad Request",
                             f"block_hashes must be a list of 1 to {MAX_HASHES} hex strings")
        hashes = []
        for index, item in enumerate(raw):
            if not isinstance(item, str) or not _HEX.fullmatch(item) or len(item) % 2:
                raise AdminError("400 Bad Request",
                                 f"block_hashes[{index}] is not an even-length hex string")
            value = bytes.fromhex(item)
            if self.hash_bytes is not None and len(value) != self.hash_bytes:
                raise AdminError("400 Bad Request",
                                 f"block_hashes[{index}] has {len(value)} bytes; this "
                                 f"cache's block hashes have {self.hash_bytes}")
            hashes.append(value)
        return hashes

    def _tenant(self, data: dict[str, Any]) -> str | None:
        """The tenant ``data`` names (the default one when none), ``None`` without
        tenants."""
        name = data.get("tenant")
        if self.tenants is None:
            if name is not None:
                raise AdminError("400 Bad Request", "tenant needs a stack with a tenants: "
                                 "section; this one has none")
            return None
        if name is None:
            return self.tenants.default
        if not isinstance(name, str) or name not in self.tenants.names:
            raise AdminError("400 Bad Request", f"no tenant {str(name)[:80]!r}; the "
                             f"tenants: {', '.join(self.tenants.names)}")
        return name

    def _scoped(self, hashes: list[bytes], tenant: str | None) -> list[bytes]:
        """``hashes`` as ``tenant``'s chunks carry them (a tenant's keys are scoped)."""
        if self.tenants is None or tenant is None:
            return hashes
        group = bytes(GROUP_INDEX_BYTES)
        scope = self.tenants.scope
        return [bytes(scope(OffloadKey(h + group), tenant))[:-GROUP_INDEX_BYTES]
                for h in hashes]

    def _seconds(self, data: dict[str, Any], required: bool, limit: float) -> float | None:
        value = data.get("seconds")
        if value is None:
            if required:
                raise AdminError("400 Bad Request", "give seconds: how long the pin lasts")
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                0 <= value <= limit):
            raise AdminError("400 Bad Request",
                             f"seconds must be a number in [0, {limit:g}], got {value!r}")
        return float(value)

    def _act(self, action: str, data: dict[str, Any]) -> dict[str, Any]:
        book = self.book
        tenant = self._tenant(data)
        hashes = self._scoped(self._hashes(data), tenant)
        if action == "unpin":
            if "seconds" in data:
                raise AdminError("400 Bad Request", "unpin takes no seconds")
            return {"unpinned": book.unpin_hashes(hashes)}
        if action == "expire":
            delay = self._seconds(data, False, book.max_ttl_s) or 0.0
            return {"expired": book.expire_hashes(hashes, book.clock() + delay), "in_s": delay}
        seconds = self._seconds(data, True, book.max_pin_s)
        assert seconds is not None
        if not book.pin_hashes(hashes, book.clock() + seconds, tenant):
            whose = "" if tenant is None else f"tenant {tenant!r}'s "
            raise AdminError("409 Conflict", f"pinning {len(hashes)} chunk(s) would pass "
                             f"{whose}pin cap (retention.max_pinned_bytes); nothing was "
                             "pinned")
        return {"pinned": len(hashes), "seconds": seconds}


def _answer(start: StartResponse, status: str, body: dict[str, Any],
            headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    data = json.dumps(body).encode()
    start(status, [("Content-Type", "application/json"),
                   ("Content-Length", str(len(data))), *(headers or [])])
    return [data]
