"""Every error kvtiers raises on purpose.

One base class, :class:`KVTiersError`, so callers can catch everything kvtiers means to
raise; typed subclasses say what went wrong. Messages follow one rule: what was wrong,
where (a YAML path, a key, a file), and what to do about it.

This module is a leaf: it imports nothing from kvtiers, so every layer may use it.
"""

from __future__ import annotations


class KVTiersError(Exception):
    """Base class of every error kvtiers raises on purpose."""


class ConfigError(KVTiersError, ValueError):
    """A configuration value is invalid.

    ``path`` is where the bad value sits (``tiers[1].capacity``), ``source`` the file it
    came from when known. ``str()`` gives the one-line message the CLI prints.
    """

    def __init__(self, message: str, *, path: str = "", source: str = "") -> None:
        self.message = message
        self.path = path
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        where = ": ".join(part for part in (self.source, self.path) if part)
        return f"{where}: {self.message}" if where else self.message

    def with_source(self, source: str) -> ConfigError:
        """The same error, located in ``source`` (a file name)."""
        return ConfigError(self.message, path=self.path, source=source)


class NamespaceMismatchError(KVTiersError):
    """An existing namespace's manifest disagrees with the identity it was opened with.

    ``differences`` maps each differing field (dotted path) to ``(on_disk, expected)``.
    Kvtiers fails closed here rather than reuse KV computed under another identity.
    """

    def __init__(self, where: str, differences: dict[str, tuple[object, object]]) -> None:
        self.where = where
        self.differences = dict(differences)
        fields = "; ".join(
            f"{name}: stored {stored!r}, expected {expected!r}"
            for name, (stored, expected) in sorted(self.differences.items())
        )
        super().__init__(
            f"{where}: the namespace manifest does not match this cache identity ({fields}). "
            "Its chunks were computed under another identity and will not be used; "
            "point the tier at another root or remove the namespace with `kvtiers gc`."
        )


class _CheckFailed(KVTiersError):
    """Some stored bytes failed verification; ``check`` names the check that failed and
    ``detail`` (may be empty) says more. Each subclass names what was checked in
    ``_subject``, the start of its message."""

    _subject = ""

    def __init__(self, check: str, detail: str = "") -> None:
        self.check = check
        self.detail = detail
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"{self._subject}: {check} check failed{suffix}")


class CorruptChunkError(_CheckFailed):
    """A stored chunk failed verification; ``check`` names the check that failed."""

    _subject = "corrupt chunk"


class SummaryError(_CheckFailed):
    """A namespace summary failed verification; ``check`` names the check that failed."""

    _subject = "unreadable namespace summary"


class UnknownKeyError(KVTiersError, KeyError):
    """A key is not in the state an operation needs (e.g. ``get_spec`` of an unpinned key)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown key"


class CapacityError(KVTiersError):
    """A requested size cannot be provided (e.g. ``/dev/shm`` too small for the CPU tier)."""


class BackendUnavailableError(KVTiersError):
    """An explicitly requested I/O backend or service cannot be used on this machine."""


class LocationError(KVTiersError):
    """A location given to the offline tools holds no kvtiers store, or not the namespace
    named: the path, bucket or prefix is probably wrong."""


class TransferError(KVTiersError):
    """A transfer between two media failed; the job is reported as failed."""


class SymlinkEscapeError(KVTiersError, OSError):
    """A symbolic link inside a store's root, where kvtiers would have to follow it to
    read, write or delete; it may lead out of the root, so kvtiers refuses."""


class UnsupportedVersionError(KVTiersError, ImportError):
    """An installed package kvtiers integrates with is outside the supported versions.

    An ``ImportError``: the integration module refuses to load, before any raw failure
    deep inside the other package could happen.
    """


class InvalidKeyError(KVTiersError, ValueError):
    """A key handed to the public API is not one of this cache's keys (not ``bytes``, the
    wrong length, or a KV-cache group out of range); the call changed nothing."""


class ClosedError(KVTiersError, RuntimeError):
    """A manager was used after ``shutdown()``; the call changed nothing."""
