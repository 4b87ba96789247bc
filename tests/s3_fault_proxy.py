"""A fault-injecting HTTP proxy on loopback, between S3 clients and a real S3 server.

Unlike a botocore hook, it damages what goes over the wire, so the client's whole HTTP
stack sees the fault: a 503 SlowDown, a connection reset before any answer, a GET body cut
half-way, a 200 cut inside its headers, or one bit flipped in a body. Each knob arms the
next ``n`` requests of an HTTP method (optionally only those whose path contains a
string); requests pass through untouched otherwise. ``delay_s`` holds every answer that
long before it is sent (a slow server; each connection waits on its own, so concurrent
requests overlap as they would). One thread per client connection, keep-alive kept; every
thread is a daemon and :meth:`FaultProxy.close` stops listening.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from dataclasses import dataclass

_SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


@dataclass
class _Armed:
    kind: str
    method: str
    path_part: str


class FaultProxy:
    """Listens on 127.0.0.1 (ephemeral port) and forwards to ``upstream`` host:port."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._armed: list[_Armed] = []
        self.injected = 0
        self.requests: list[str] = []
        #: Seconds every answer is held before it is sent (0: none); set at any time.
        self.delay_s = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    # -- knobs ----------------------------------------------------------------------
    def arm(self, kind: str, n: int, method: str, path_part: str = "") -> None:
        """``kind``: ``slowdown``, ``reset``, ``cut_body``, ``cut_headers`` or ``flip``."""
        if kind not in ("slowdown", "reset", "cut_body", "cut_headers", "flip"):
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._armed.extend(_Armed(kind, method, path_part) for _ in range(n))

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def count(self, method: str, path_part: str = "") -> int:
        """Requests seen so far of ``method`` whose path contains ``path_part``."""
        with self._lock:
            return sum(1 for r in self.requests
                       if r.startswith(method + " ") and path_part in r.partition(" ")[2])

    def close(self) -> None:
        self._listener.close()

    def _take(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests.append(f"{method} {path}")
            for i, armed in enumerate(self._armed):
                if armed.method == method and armed.path_part in path:
                    del self._armed[i]
                    self.injected += 1
                    return armed.kind
        return None

    # -- serving --------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
        reader = client.makefile("rb")
        try:
            while self._relay_one(client, reader, upstream):
                pass
        except OSError:
            pass
        finally:
            upstream.close()
            reader.close()
            client.close()

    def _relay_one(
        self, client: socket.socket, reader: object, upstream: http.client.HTTPConnection
    ) -> bool:
        """Relay one request; False when the connection is over."""
        readline = reader.readline  # type: ignore[attr-defined]
        line = readline(65537)
        if not line:
            return False
        method, path, _ = line.decode("latin-1").split(" ", 2)
        headers: list[tuple[str, str]] = []
        while True:
            header = readline(65537)
            if header in (b"\r\n", b"\n", b""):
                break
            name, _, value = header.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
        if any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in headers):
            # The client holds the body back until told to go on (for up to a second).
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            headers = [(k, v) for k, v in headers if k.lower() != "expect"]
        body = reader.read(length) if length else b""  # type: ignore[attr-defined]
        fault = self._take(method, path)
        delay = self.delay_s
        if delay > 0:
            time.sleep(delay)  # the slow server this proxy stands for
        if fault == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if fault == "slowdown":
            client.sendall(
                b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                + f"Content-Length: {len(_SLOWDOWN)}\r\n\r\n".encode() + _SLOWDOWN
            )
            return True
        upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in headers:
            if name.lower() not in ("connection", "keep-alive"):
                upstream.putheader(name, value)
        upstream.endheaders(body or None)
        response = upstream.getresponse()
        data = response.read()
        head = f"HTTP/1.1 {response.status} {response.reason}\r\n".encode()
        for name, value in response.getheaders():
            if name.lower() not in _HOP_HEADERS:
                head += f"{name}: {value}\r\n".encode("latin-1")
        if method == "HEAD":
            length_header = response.getheader("Content-Length", "0")
        else:
            length_header = str(len(data))
        if fault == "cut_headers":
            client.sendall(head.split(b"\r\n", 1)[0] + b"\r\n")
            client.shutdown(socket.SHUT_WR)
            return False
        head += f"Content-Length: {length_header}\r\n\r\n".encode()
        if fault == "cut_body" and method != "HEAD":
            client.sendall(head + data[: len(data) // 2])
            client.shutdown(socket.SHUT_WR)
            return False
        if fault == "flip" and data:
            data = data[:-1] + bytes([data[-1] ^ 0x01])
        client.sendall(head + (b"" if method == "HEAD" else data))
        return True
