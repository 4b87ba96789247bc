"""The retention ledger: the expiries an engine's retention book holds, written to a JSON
file (``retention.ledger``) that ``kvtiers gc --expired LEDGER`` reads to remove the
chunks of a persistent tier whose TTL ran out (docs/retention.md, "TTLs and gc").

The file is replaced atomically (written beside it, then renamed) every
``retention.ledger_interval_s`` seconds by a daemon thread, and once more when the stack
shuts down. It holds ``{"version": 1, "written_at": <epoch s>, "expires": {<block hash
hex>: <epoch s>}}``: only entries with an expiry, a pinned one included (an expiry drops
its pin).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvtiers.errors import ConfigError
from kvtiers.policies.retention import RetentionBook

LEDGER_VERSION = 1


def write_ledger(path: Path, book: RetentionBook) -> None:
    """Replace the ledger at ``path`` with ``book``'s expiries now."""
    expires = {h.hex(): at for h, at in book.expiries().items()}
    body = json.dumps({"version": LEDGER_VERSION, "written_at": book.clock(),
                       "expires": expires})
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(body)
    os.replace(temp, path)


def read_ledgers(paths: Iterable[str | Path]) -> dict[bytes, float]:
    """Block hash → expiry over every ledger at ``paths``; a hash several ledgers name
    expires at the latest of their expiries (an engine that renewed it keeps it). A
    ledger that cannot be read or is not one is a :class:`ConfigError` naming it."""
    merged: dict[bytes, float] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the retention ledger {path}: {exc}") from None
        expires = data.get("expires") if isinstance(data, Mapping) else None
        if not isinstance(data, Mapping) or data.get("version") != LEDGER_VERSION or not (
                isinstance(expires, Mapping)):
            raise ConfigError(f"{path} is not a version {LEDGER_VERSION} retention ledger "
                              "(retention.ledger)")
        for name, at in expires.items():
            try:
                block = bytes.fromhex(name)
            except ValueError:
                raise ConfigError(f"{path}: {name!r} is not a hex block hash") from None
            if isinstance(at, bool) or not isinstance(at, int | float):
                raise ConfigError(f"{path}: the expiry of {name} is not a number")
            merged[block] = max(float(at), merged.get(block, float(at)))
    return merged


class LedgerWriter:
    """Writes ``book``'s ledger to ``path`` every ``interval_s`` seconds from a daemon
    thread, and at :meth:`close`. A failed write is logged by the thread and retried at
    the next interval."""

    def __init__(self, book: RetentionBook, path: Path, interval_s: float) -> None:
        self.book = book
        self.path = path
        self.interval_s = interval_s
        self._stop = threading.Event()
        try:
            write_ledger(path, book)  # a path that cannot be written stops the start
        except OSError as exc:
            raise ConfigError(f"cannot write the retention ledger {path}: {exc}",
                              path="retention.ledger") from None
        self._thread = threading.Thread(target=self._run, name="kvtiers-ledger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import logging

        log = logging.getLogger(__name__)
        while not self._stop.wait(self.interval_s):
            try:
                write_ledger(self.path, self.book)
            except OSError as exc:
                log.warning("retention: cannot write the ledger %s: %s", self.path, exc)

    def close(self) -> None:
        """Stop the thread and write the ledger one last time."""
        self._stop.set()
        self._thread.join()
        write_ledger(self.path, self.book)
