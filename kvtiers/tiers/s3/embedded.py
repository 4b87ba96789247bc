"""A local S3 server for demos: ``endpoint_url: embedded``.

The first tier that asks starts one moto ``ThreadedMotoServer`` on 127.0.0.1 with an
ephemeral port; every later tier of the process shares it. Its data lives in this
process's memory and is gone when the process exits. Dummy credentials are handed to the
tiers that use it (never set in the environment), so they cannot reach a real account.
moto is imported only here, only when asked for.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvtiers.errors import BackendUnavailableError

#: The credentials the embedded server accepts (it accepts any).
EMBEDDED_CREDENTIALS = ("kvtiers-embedded", "kvtiers-embedded")


@dataclass(frozen=True)
class EmbeddedServer:
    """Where the embedded server listens."""

    endpoint_url: str
    credentials: tuple[str, str] = EMBEDDED_CREDENTIALS


_lock = threading.Lock()
_server: EmbeddedServer | None = None


def embedded_server() -> EmbeddedServer:
    """The process's embedded S3 server, started on first use."""
    global _server
    with _lock:
        if _server is None:
            try:
                from moto.server import ThreadedMotoServer
            except ImportError as exc:
                raise BackendUnavailableError(
                    "endpoint_url: embedded needs moto's server; install it with "
                    "`pip install 'moto[server]'` or point endpoint_url at a real S3 endpoint"
                ) from exc
            # The server logs every request through werkzeug; a demo's output is its table.
            logging.getLogger("werkzeug").setLevel(logging.WARNING)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            _server = EmbeddedServer(f"http://{host}:{port}")
        return _server
