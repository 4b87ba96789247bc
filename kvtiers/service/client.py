"""An engine's connection to ``kvtiers serve``: bounded round trips, down-detection, reattach.

:class:`ServiceClient` never waits longer than ``timeout_s`` for a reply. Any failure (a
refused connection, an error reply, a reply that does not decode, a timeout, the peer
gone) marks the client *down*: its socket is closed and :meth:`call` raises
:class:`ServiceDown` until a reattach succeeds. A reattach is tried at a call at most
once every ``retry_s`` (the clock is read, nothing sleeps). Each attach is a new
*session*: whatever the caller keeps about an older session (reservations, pins) is no
longer the service's and must be dropped (:attr:`session` tells them apart).

:meth:`ServiceClient.send` and :meth:`ServiceClient.receive_ready` never wait on the
service: what the socket does not take at once is kept (up to ``max_pending`` bytes,
past which ``send`` waits for the service to read, within ``timeout_s``) and written at
the next call; replies are taken as far as they have arrived. A round trip writes
everything kept first, so the service answers in the order the calls were made.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvtiers.service import protocol as p
from kvtiers.service.pool import PoolView

log = logging.getLogger("kvtiers.service")
#: How a :class:`ServiceDown` from an error reply begins.
REFUSED = "the service refused a request"

#: Bytes of calls an engine keeps unsent while the service is behind before it waits.
MAX_PENDING = 4 << 20
_RECV = 1 << 16


class ServiceDown(Exception):
    """The service did not answer (or refused); the call was not made."""


class ServiceClient:
    """One engine's attachment: a socket and the mapped pool.

    ``identity`` is the namespace identity's canonical JSON, ``chunk_bytes`` the largest
    chunk this engine stores. Construction attaches and maps the pool, raising
    :class:`ServiceDown` if the service is not there (an engine cannot build its worker
    without the pool).
    """

    def __init__(self, socket_path: str | Path, identity: bytes, chunk_bytes: int, *,
                 engine: str = "", timeout_s: float = 0.5, retry_s: float = 1.0,
                 max_frame: int = p.MAX_FRAME, max_pending: int = MAX_PENDING) -> None:
        self.socket_path = str(socket_path)
        self.identity = identity
        self.digest = hashlib.sha256(identity).digest()
        self.chunk_bytes = chunk_bytes
        self.engine = engine
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_frame = max_frame
        self.max_pending = max_pending
        self.sock: socket.socket | None = None
        # Frames sent that the socket has not taken yet, and bytes read not yet parsed.
        self._out = bytearray()
        self._in = bytearray()
        self.ns = -1
        self.epoch = 0
        self.lower = 0
        #: One more at each successful attach.
        self.session = 0
        self.pool: PoolView | None = None
        self._seq = 0
        self._next_try = 0.0
        self.downs = 0
        self.reattaches = 0
        #: Why the service last refused an attach ("" when it did not).
        self.refusal = ""
        if not self._attach():
            raise ServiceDown(f"the kvtiers service on {self.socket_path}: {self.refusal}"
                              if self.refusal else
                              f"no kvtiers service answers on {self.socket_path}")

    @property
    def up(self) -> bool:
        return self.sock is not None

    def _attach(self) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        self._out.clear()
        self._in.clear()
        try:
            sock.connect(self.socket_path)
            self.sock = sock
            reply = self._round_trip(
                [p.Attach(0, self.identity, self.chunk_bytes, self.engine, p.PROTOCOL)]
            )[0]
        except (OSError, ServiceDown) as exc:
            sock.close()
            self.sock = None
            self._next_try = time.monotonic() + self.retry_s
            refused = isinstance(exc, ServiceDown) and str(exc).startswith(REFUSED)
            if refused and str(exc) != self.refusal:
                # A service that answers and says no (another release, a pool's slots
                # too small): once per reason, not at every retry.
                log.warning("kvtiers: the service at %s: %s", self.socket_path, exc)
            self.refusal = str(exc) if refused else ""
            log.debug("kvtiers: attach to %s failed: %s", self.socket_path, exc)
            return False
        assert isinstance(reply, p.Attached)
        if self.pool is None:
            self.pool = PoolView(Path(reply.pool))
        elif not self._same_pool(reply):
            # The workers copy through the mapping made at the first attach: a service
            # over another pool (or one re-made under the same name, --fresh) cannot be
            # used by this engine; its writes would land in the old file.
            log.error("kvtiers: the service at %s now has another pool; staying detached "
                      "(restart the engine to attach to it)", self.socket_path)
            self._down()
            return False
        self.ns = reply.ns
        self.epoch = reply.epoch
        #: Tiers the service runs below the pool for this namespace (0: none to probe).
        self.lower = reply.lower
        self.session += 1
        if self.session > 1:
            self.reattaches += 1
            log.info("kvtiers: reattached to %s", self.socket_path)
        return True

    def _same_pool(self, reply: p.Attached) -> bool:
        assert self.pool is not None
        if (self.pool.num_slots, self.pool.slot_bytes, str(self.pool.path)) != (
            reply.num_slots, reply.slot_bytes, reply.pool
        ):
            return False
        try:
            info = os.stat(reply.pool)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.pool.file_id

    def _down(self) -> None:
        self._out.clear()
        self._in.clear()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.downs += 1
            log.warning("kvtiers: the service at %s is down; lookups miss until it is back",
                        self.socket_path)
        self._next_try = time.monotonic() + self.retry_s

    def available(self) -> bool:
        """Whether the service can be called now: attached and its socket not closed by
        the peer (a zero-timeout poll), or reattached when it is time to try."""
        sock = self.sock
        if sock is not None:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return True
            # Readable: replies not read yet (sent without waiting), or the peer closed.
            try:
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return True
            except BlockingIOError:
                return True
            except OSError:
                pass
            self._down()
        if time.monotonic() >= self._next_try:
            return self._attach()
        return False

    def call(self, requests: Sequence[p.Request]) -> list[p.Reply]:
        """Send ``requests`` (pipelined, one write) and read their replies: one round trip.
        Raises :class:`ServiceDown` (and marks the client down) on any failure."""
        if self.sock is None and not self.available():
            raise ServiceDown("the service is down")
        return self._round_trip(requests)

    def send(self, requests: Sequence[p.Request]) -> None:
        """Send ``requests`` without reading their replies (:meth:`receive` or
        :meth:`receive_ready` reads them, in order, before any later reply) and without
        waiting, unless more than ``max_pending`` bytes are still unsent. Raises
        :class:`ServiceDown` as :meth:`call`."""
        if self.sock is None:
            raise ServiceDown("the service is down")
        self._out += b"".join(p.frame(r) for r in requests)
        try:
            self._push(wait=len(self._out) > self.max_pending)
        except OSError as exc:
            self._down()
            raise ServiceDown(str(exc)) from None

    def _push(self, *, wait: bool) -> None:
        """Write the kept frames: all of them (``wait``), or what the socket takes now."""
        sock = self.sock
        assert sock is not None
        out = self._out
        if wait:
            if out:
                sock.sendall(out)
                out.clear()
            return
        while out and select.select([], [sock], [], 0)[1]:
            del out[: sock.send(out)]

    def receive_ready(self, requests: Sequence[p.Request]) -> list[p.Reply]:
        """The replies to the first of ``requests`` (sent earlier, in order) that have
        arrived, without waiting; kept frames are written as far as the socket takes
        them. Raises :class:`ServiceDown` as :meth:`call`."""
        sock = self.sock
        if sock is None:
            raise ServiceDown("the service is down")
        replies: list[p.Reply] = []
        buffer = self._in
        try:
            self._push(wait=False)
            while select.select([sock], [], [], 0)[0]:
                chunk = sock.recv(_RECV)
                if not chunk:
                    raise ConnectionResetError("the service closed the connection")
                buffer += chunk
            while len(replies) < len(requests) and len(buffer) >= 4:
                (size,) = p.FRAME.unpack_from(buffer)
                if size > self.max_frame:
                    raise p.ProtocolError(f"a reply of {size} bytes")
                if len(buffer) < 4 + size:
                    break
                replies.append(p.decode_reply(bytes(buffer[4 : 4 + size])))
                del buffer[: 4 + size]
        except (OSError, p.ProtocolError, msgspec.MsgspecError) as exc:
            self._down()
            raise ServiceDown(str(exc)) from None
        self._check(requests[: len(replies)], replies)
        return replies

    def receive(self, requests: Sequence[p.Request]) -> list[p.Reply]:
        """The replies to ``requests``, sent earlier by :meth:`send`, in order."""
        if self.sock is None:
            raise ServiceDown("the service is down")
        return self._round_trip(requests, send=False)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _round_trip(self, requests: Sequence[p.Request], *, send: bool = True) -> list[p.Reply]:
        """Send ``requests`` (unless ``send`` is false: :meth:`send` did) and read and
        check their replies; any failure marks the client down and raises
        :class:`ServiceDown`. The socket must be attached."""
        sock = self.sock
        assert sock is not None
        try:
            if send:
                self._out += b"".join(p.frame(r) for r in requests)
            self._push(wait=True)  # the replies come after those to every kept frame
            replies = [self._read_reply(sock) for _ in requests]
        except (OSError, p.ProtocolError, msgspec.MsgspecError) as exc:
            self._down()
            raise ServiceDown(str(exc)) from None
        self._check(requests, replies)
        return replies

    def _check(self, requests: Sequence[p.Request], replies: list[p.Reply]) -> None:
        for request, reply in zip(requests, replies, strict=True):
            if isinstance(reply, p.Error):
                self._down()
                raise ServiceDown(f"{REFUSED}: {reply.message}")
            if reply.seq != request.seq:
                self._down()
                raise ServiceDown("a reply out of order")

    def _read_reply(self, sock: socket.socket) -> p.Reply:
        (size,) = p.FRAME.unpack(self._take(sock, 4))
        if size > self.max_frame:
            raise p.ProtocolError(f"a reply of {size} bytes")
        return p.decode_reply(self._take(sock, size))

    def _take(self, sock: socket.socket, size: int) -> bytes:
        """``size`` bytes: those read already first, then from the socket (waiting)."""
        buffer = self._in
        while len(buffer) < size:
            chunk = sock.recv(max(_RECV, size - len(buffer)))
            if not chunk:
                raise ConnectionResetError("the service closed the connection")
            buffer += chunk
        data = bytes(buffer[:size])
        del buffer[:size]
        return data

    @staticmethod
    def _read_exactly(sock: socket.socket, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise ConnectionResetError("the service closed the connection")
            data += chunk
        return bytes(data)

    def status(self) -> dict[str, Any]:
        reply = self.call([p.Status(self.next_seq())])[0]
        assert isinstance(reply, p.StatusReply)
        return reply.state

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def read_status(socket_path: str | Path, timeout_s: float = 2.0) -> dict[str, Any]:
    """The service's state, asked without attaching a namespace (``kvtiers status``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(socket_path))
        sock.sendall(p.frame(p.Status(1)))
        (size,) = p.FRAME.unpack(ServiceClient._read_exactly(sock, 4))
        reply = p.decode_reply(ServiceClient._read_exactly(sock, size))
    finally:
        sock.close()
    if isinstance(reply, p.Error):
        raise ServiceDown(reply.message)
    assert isinstance(reply, p.StatusReply)
    return reply.state
