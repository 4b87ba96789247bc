"""Retention in the service's pool: the hints engines send (:class:`~kvtiers.service.
protocol.Retain`) and the admin endpoint's pins, held in one
:class:`~kvtiers.policies.retention.RetentionBook`, and the pool's ready slots ordered by
them (docs/retention.md, "Through the node service").

:class:`PoolRetention` is the loop's: only the service's thread calls it. The book is
shared with the admin endpoint's HTTP threads (it holds its own lock). What the loop asks
of it:

* :meth:`~PoolRetention.added`, :meth:`~PoolRetention.touched`,
  :meth:`~PoolRetention.removed` as ready slots come, are used and go;
* :meth:`~PoolRetention.lowest`: the slot to evict in place of a candidate, the least
  recently used of the lowest priority of the candidate's tenant (priority orders within a
  tenant, never across tenants: the tenant that loses a chunk is chosen as without hints);
* :meth:`~PoolRetention.due`: the slots whose chunks expired (the service evicts them at
  once, or when the last load holding one ends), and :meth:`~PoolRetention.next_wake`,
  when to look again;
* :meth:`~PoolRetention.hint`: an engine's hint, checked; a bad one is ignored (counted,
  one warning a minute), never a refused request.

A hint or pin names block hashes (a key without its group index): it covers that chunk
in every namespace of the pool holding one of that hash.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvtiers.policies.retention import (
    PRIORITY_RANGE,
    RetentionBook,
    RetentionHint,
    block_hash,
)
from kvtiers.service import protocol as p

if TYPE_CHECKING:
    from kvtiers.config import StackConfig

#: The priority of a key no hint named.
_DEFAULT = 0


def identity_groups(identity: bytes) -> int:
    """How many KV-cache groups the cache identity ``identity`` (canonical JSON) has; 1
    when it does not say."""
    try:
        groups = json.loads(identity).get("groups")
    except (ValueError, AttributeError):
        return 1
    return len(groups) if isinstance(groups, list) and groups else 1


def service_book(config: StackConfig, slot_bytes: int) -> RetentionBook:
    """The book of the service's ``retention:`` section (``config.retention``): pins are
    capped at its ``max_pinned_bytes``, by default half the pool; with a ``tenants:``
    section per tenant as in process (a member's own ``max_pinned_bytes``, at most its
    pool quota). A block hash counts one slot until an engine attaches a namespace of
    more KV-cache groups (:meth:`PoolRetention.attached`)."""
    from kvtiers.stack.builder import tenant_pin_caps

    section = config.retention
    assert section is not None, "only a service with a retention: section has a book"
    if section.max_pinned_bytes is not None:
        cap = int(section.max_pinned_bytes)
    else:
        cap = int(getattr(config.tiers[0], "capacity", 0)) // 2
    return RetentionBook(hash_bytes=slot_bytes, max_pinned_bytes=cap,
                         max_pin_s=section.max_pin_s, max_ttl_s=section.max_ttl_s,
                         cap_for=None if config.tenants is None else tenant_pin_caps(
                             config, cap))


class PoolRetention:
    """The pool's ready slots by tenant and priority, and their expiries (see the
    module docstring). ``owner`` names a key's tenant (``None`` without tenants),
    ``slot_bytes`` the pool's slot."""

    def __init__(self, book: RetentionBook, owner: Callable[[bytes], str | None],
                 slot_bytes: int) -> None:
        self.book = book
        self._owner = owner
        self._slot_bytes = slot_bytes
        #: tenant → priority → its ready slots, least recently used first.
        self._levels: dict[str | None, dict[int, OrderedDict[int, None]]] = {}
        self._key_of: dict[int, bytes] = {}
        self._level_of: dict[int, tuple[str | None, int]] = {}
        self._slots_of: dict[bytes, set[int]] = {}
        #: Expired slots a load still holds: evicted once it lets go.
        self._waiting: set[int] = set()

    # -- slots ----------------------------------------------------------------------
    def added(self, slot: int, key: bytes) -> None:
        """``key`` became ready in ``slot``. A key whose entry had expired is stored
        afresh (the entry is forgotten), as in process."""
        self.book.record((key,), None)
        self._key_of[slot] = key
        self._slots_of.setdefault(block_hash(key), set()).add(slot)
        self._place(slot, key)

    def _place(self, slot: int, key: bytes) -> None:
        where = (self._owner(key), self.book.priority(key))
        self._level_of[slot] = where
        self._levels.setdefault(where[0], {}).setdefault(where[1], OrderedDict())[slot] = None

    def touched(self, slot: int) -> None:
        """``slot`` was used (most recently used of its level now)."""
        where = self._level_of.get(slot)
        if where is not None:
            self._levels[where[0]][where[1]].move_to_end(slot)

    def removed(self, slot: int) -> None:
        """``slot``'s chunk left the pool."""
        key = self._key_of.pop(slot, None)
        if key is None:
            return
        tenant, priority = self._level_of.pop(slot)
        levels = self._levels[tenant]
        del levels[priority][slot]
        if not levels[priority]:
            del levels[priority]
        h = block_hash(key)
        slots = self._slots_of[h]
        slots.discard(slot)
        if not slots:
            del self._slots_of[h]
        self._waiting.discard(slot)

    def _relevel(self, hashes: Iterable[bytes]) -> None:
        """Move the ready slots of ``hashes`` to the level their priority says now."""
        for h in hashes:
            for slot in self._slots_of.get(h, ()):
                key = self._key_of[slot]
                if self._level_of[slot] != (self._owner(key), self.book.priority(key)):
                    tenant, priority = self._level_of[slot]
                    levels = self._levels[tenant]
                    del levels[priority][slot]
                    if not levels[priority]:
                        del levels[priority]
                    self._place(slot, key)

    def is_pinned(self, key: bytes) -> bool:
        return self.book.is_pinned(key)

    def lowest(self, slot: int, may_take: Callable[[int], bool]) -> int:
        """The slot to evict in place of the candidate ``slot``: the least recently used
        slot ``may_take`` accepts among those of the candidate's tenant whose priority is
        the lowest below the candidate's, else the candidate."""
        tenant, priority = self._level_of[slot]
        levels = self._levels[tenant]
        for level in sorted(levels):
            if level >= priority:
                break
            for other in levels[level]:
                if may_take(other):
                    return other
        return slot

    # -- expiry ---------------------------------------------------------------------
    def due(self) -> list[int]:
        """Ready slots whose chunks are past their expiry: those whose expiry passed
        since the last call and those a load held at the last call."""
        found = [slot for slot in self._waiting if self.book.is_expired(self._key_of[slot])]
        self._waiting.clear()
        for h in self.book.pop_expired():
            found.extend(self._slots_of.get(h, ()))
        return found

    def wait(self, slot: int) -> None:
        """``slot`` expired while a load holds it: :meth:`due` hands it out again."""
        self._waiting.add(slot)

    def next_wake(self, now: float) -> float | None:
        """Seconds until the next expiry (0: one is due), ``None`` when none is set."""
        at = self.book.next_expiry()
        return None if at is None else max(0.0, at - now)

    # -- hints ----------------------------------------------------------------------
    def hint(self, request: p.Retain) -> bool:
        """Record ``request``'s hint for its keys, pins in each key's tenant's scope;
        ``False`` (ignored, counted, warned about at most once a minute) when a field is
        of the wrong type or out of bounds or the message names too many keys."""
        book = self.book
        problem = self._problem(request)
        if problem is not None:
            book.bad_hints.warn("kvtiers serve: a retention hint for %d key(s) %s; "
                                "ignored", len(request.keys), problem)
            return False
        hint = RetentionHint(priority=int(request.priority),
                             pin_s=None if request.pin_s is None else float(request.pin_s),
                             ttl_s=None if request.ttl_s is None else float(request.ttl_s))
        by_tenant: dict[str | None, list[bytes]] = {}
        for key in request.keys:
            by_tenant.setdefault(self._owner(key), []).append(key)
        for tenant, keys in by_tenant.items():
            book.record(keys, hint, tenant)
        self._relevel({block_hash(key) for key in request.keys})
        return True

    def _problem(self, request: p.Retain) -> str | None:
        book = self.book
        if len(request.keys) > p.MAX_RETAIN_KEYS:
            return f"names more than {p.MAX_RETAIN_KEYS} keys"
        low, high = PRIORITY_RANGE
        priority = request.priority
        if isinstance(priority, bool) or not isinstance(priority, int) or not (
                low <= priority <= high):
            return f"has priority {_shown(priority)} (an integer in [{low}, {high}])"
        for name, value, limit in (("pin_s", request.pin_s, book.max_pin_s),
                                   ("ttl_s", request.ttl_s, book.max_ttl_s)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    math.isfinite(value) and 0 <= value <= limit):
                return f"has {name} {_shown(value)} (seconds in [0, {limit:g}])"
        return None

    # -- reporting ------------------------------------------------------------------
    def attached(self, identity: bytes) -> None:
        """A namespace of ``identity`` attached: a pinned block hash counts one slot per
        KV-cache group of the namespace with the most groups."""
        book = self.book
        book.hash_bytes = max(book.hash_bytes, self._slot_bytes * identity_groups(identity))

    def state(self, tenants: Iterable[str] | None) -> dict[str, Any]:
        """What ``kvtiers status`` shows: the book's counters, the bytes pinned and the
        cap, per tenant (or for the pool as a whole without tenants)."""
        book = self.book
        scopes: list[str | None] = [None] if tenants is None else list(tenants)
        return {
            **{k: int(v) for k, v in book.get_stats().items()},
            "pins": [{"tenant": scope, "pinned_bytes": book.pinned_bytes(scope),
                      "max_pinned_bytes": book.cap(scope)} for scope in scopes],
        }


def _shown(value: object) -> str:
    """``value`` for a log line, cut short."""
    return repr(value)[:40]


def service_admin(config: StackConfig, book: RetentionBook, token: str,
                  synced: Callable[[], object]) -> Callable[[Any], Any]:
    """The maker of the service's admin app over its metrics app: the stack's admin
    endpoint (:class:`~kvtiers.stack.admin.RetentionAdmin`, the same paths, bearer token
    and tenant scoping) over the service's book. After each admin call ``synced`` (the
    service's :meth:`~kvtiers.service.server.Service.snapshot`) has the loop take the
    change in, so chunks an ``expire`` names are gone from the pool before the answer."""
    from kvtiers.stack.admin import RetentionAdmin

    keys = None
    if config.tenants is not None:
        from kvtiers.stack.tenants import TenantKeys

        keys = TenantKeys(config.tenants)

    def wrap(metrics_app: Any) -> Any:
        admin = RetentionAdmin(book, token, metrics_app, hash_bytes=None, tenants=keys)

        def app(environ: dict[str, Any], start: Any) -> Any:
            answer = admin(environ, start)
            if str(environ.get("PATH_INFO", "")).startswith("/admin/"):
                synced()
            return answer

        return app

    return wrap
