"""Retention: per-prefix priority, pins until a deadline and TTLs, and the policy that
honours them.

A request asks for retention through a ``kv_hints`` envelope (vLLM's ``KvHintsEnvelope``,
handed to the offloading manager as ``ReqContext.kv_hints``, or the same envelope as plain
JSON under ``kv_transfer_params["kv_hints"]``); an operator through the admin endpoint of
the metrics server (:mod:`kvtiers.stack.admin`). Both land in one :class:`RetentionBook`,
which the stack's primary consults through :class:`RetainingPolicy`:

* **priority** (an integer, default 0): a tier evicts every evictable chunk of a lower
  priority before any of a higher one; within one priority the tier's own policy orders.
* **pin** until a deadline: a pinned chunk is evicted only when nothing else can make the
  room a store or promotion needs (a pin never makes a store fail), and pinned bytes are
  capped (:attr:`RetentionBook.max_pinned_bytes`, per scope): a pin past the cap is
  refused whole, counted, with a rate-limited warning.
* **TTL**: past its expiry a chunk is evicted before anything else and never served
  again (the composite answers ``MISS`` for it); a later store of it with no hint starts
  it afresh.

Entries are per block hash (a key without its group index): one hint covers the chunk of
every KV-cache group at that position. A malformed or unknown hint is ignored, never a
failed request: one warning per :data:`WARN_INTERVAL_S`, the rest counted.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtiers.core.keys import GROUP_INDEX_BYTES
from kvtiers.core.manager import ReqContext
from kvtiers.policies.base import EvictionPolicy

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(method: _F) -> _F:
    """``method`` run holding its book's lock."""

    @functools.wraps(method)
    def run(self: RetentionBook, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]

#: The ``action_type`` of a retention action in a ``kv_hints`` envelope, and the versions
#: of its payload this release reads.
ACTION_TYPE = "retention"
ACTION_VERSIONS = ("1",)
#: The ``kv_transfer_params`` key of an envelope given as plain JSON.
PARAMS_KEY = "kv_hints"
#: Payload keys of a retention action: ``priority`` (int), ``pin_s`` (seconds from now),
#: ``ttl_s`` (seconds from now).
PAYLOAD_KEYS = ("priority", "pin_s", "ttl_s")
#: Priorities outside this range are malformed.
PRIORITY_RANGE = (-1000, 1000)
#: At most one warning per this many seconds per kind; the rest are counted.
WARN_INTERVAL_S = 60.0
#: Entries the book keeps at most; beyond it the oldest entry is forgotten.
MAX_ENTRIES = 1_000_000


class RateLimitedWarning:
    """Logs at most one warning per ``interval_s`` (by ``clock``); counts the others and
    says how many were held back in the next one it logs."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.count = 0
        self._last = -math.inf
        self._held = 0

    def warn(self, message: str, *args: object) -> None:
        self.count += 1
        now = self.clock()
        if now - self._last < self.interval_s:
            self._held += 1
            return
        self._last = now
        if self._held:
            message += f" ({self._held} more such warnings held back)"
            self._held = 0
        log.warning(message, *args)


@dataclass(frozen=True)
class RetentionHint:
    """What one request asks for its prefix: seconds are relative to when it is stored."""

    priority: int = 0
    pin_s: float | None = None
    ttl_s: float | None = None


@dataclass
class _Entry:
    priority: int = 0
    pinned_until: float | None = None
    expires_at: float | None = None
    scope: str | None = None


def block_hash(key: bytes) -> bytes:
    """The block hash of ``key``: the key without its group index."""
    return key[:-GROUP_INDEX_BYTES]


class RetentionBook:
    """Retention per block hash: priorities, pins, expiries (see the module docstring).

    ``clock`` is wall-clock seconds (deadlines and expiries are absolute, as an operator
    gives them). ``max_pinned_bytes`` caps the bytes pinned in one scope; a block hash
    counts ``hash_bytes`` (a chunk of each group). ``cap_for`` overrides the cap per
    scope (a tenant's, say); scope ``None`` is the stack's own. The scheduler thread
    and the admin endpoint's threads share it: every method that changes entries or
    walks a set holds a lock; the per-key reads are single dictionary lookups."""

    def __init__(
        self,
        *,
        hash_bytes: int,
        max_pinned_bytes: int,
        max_pin_s: float = 86400.0,
        max_ttl_s: float = 30 * 86400.0,
        clock: Callable[[], float] = time.time,
        cap_for: Callable[[str | None], int] | None = None,
        max_entries: int = MAX_ENTRIES,
        warn_interval_s: float = WARN_INTERVAL_S,
    ) -> None:
        if hash_bytes <= 0:
            raise ValueError(f"hash_bytes must be positive, got {hash_bytes}")
        self.hash_bytes = hash_bytes
        self.max_pinned_bytes = max_pinned_bytes
        self.max_pin_s = max_pin_s
        self.max_ttl_s = max_ttl_s
        self.clock = clock
        self._cap_for = cap_for
        self._max_entries = max_entries
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # How many entries have an expiry (none: is_expired need not look a key up).
        self._expiring = 0
        self._pinned: dict[str | None, set[bytes]] = {}
        self.bad_hints = RateLimitedWarning(warn_interval_s, clock)
        self.refused_pins = RateLimitedWarning(warn_interval_s, clock)
        self.stats: dict[str, float] = {
            "retention_hints": 0, "retention_pins": 0, "retention_pins_refused": 0,
            "retention_pins_overridden": 0, "retention_expired_misses": 0,
        }
        self._lock = threading.RLock()
        # One heap per reader of expiries (expiry_feed): (expiry, block hash) of every
        # expiry set since the reader came, a stale one included, popped oldest first;
        # rebuilt when stale entries outnumber. The first is pop_expired's.
        self._feeds: list[list[tuple[float, bytes]]] = [[]]

    # -- reading ---------------------------------------------------------------------

    def hinted(self) -> bool:
        """Whether any block hash has an entry (none: every key has the defaults, which
        a reader may assume without looking the key up)."""
        return bool(self._entries)

    def priority(self, key: bytes) -> int:
        entry = self._entries.get(block_hash(key))
        return 0 if entry is None else entry.priority

    def is_pinned(self, key: bytes) -> bool:
        entry = self._entries.get(block_hash(key))
        return (entry is not None and entry.pinned_until is not None
                and entry.pinned_until > self.clock())

    def expires_at(self, key: bytes) -> float | None:
        entry = self._entries.get(block_hash(key))
        return None if entry is None else entry.expires_at

    def is_expired(self, key: bytes) -> bool:
        """Whether ``key``'s expiry passed. The composite asks it at every lookup: while
        no entry has an expiry it answers without looking ``key`` up."""
        if not self._expiring:
            return False
        expires = self.expires_at(key)
        return expires is not None and expires <= self.clock()

    @_locked
    def pinned_bytes(self, scope: str | None = None) -> int:
        return len(self._live_pins(scope)) * self.hash_bytes

    @_locked
    def pinned_bytes_by_scope(self) -> dict[str | None, int]:
        """The bytes pinned now in each scope that ever pinned (0 once its pins ran out)."""
        return {scope: len(self._live_pins(scope)) * self.hash_bytes
                for scope in list(self._pinned)}

    @_locked
    def pinned_hashes(self) -> set[bytes]:
        """Every live pin's block hash, all scopes (at most the caps' worth)."""
        live: set[bytes] = set()
        for scope in list(self._pinned):
            live |= self._live_pins(scope)
        return live

    def cap(self, scope: str | None) -> int:
        """The most bytes ``scope`` may pin."""
        return self.max_pinned_bytes if self._cap_for is None else self._cap_for(scope)

    # -- writing ---------------------------------------------------------------------

    @_locked
    def record(self, keys: Iterable[bytes], hint: RetentionHint | None,
               scope: str | None = None) -> None:
        """A request with ``hint`` (``None``: none) stores ``keys``. Without a hint an
        expired entry is forgotten (the chunk is stored afresh); with one, priority and
        expiry are set and the pin is asked for (refused whole past the cap)."""
        if hint is None and not self._expiring:
            return  # nothing expires, so nothing to forget: no key is looked at
        hashes = list(dict.fromkeys(block_hash(k) for k in keys))
        if hint is None:
            for h in hashes:
                entry = self._entries.get(h)
                if entry is not None and entry.expires_at is not None and (
                        entry.expires_at <= self.clock()):
                    self._forget(h)
            return
        self.stats["retention_hints"] += 1
        now = self.clock()
        expires = None if hint.ttl_s is None else now + hint.ttl_s
        for h in hashes:
            entry = self._entry(h)
            entry.priority = hint.priority
            self._set_expiry(h, entry, expires)
        if hint.pin_s is not None:
            self.pin_hashes(hashes, now + hint.pin_s, scope)

    @_locked
    def pin_hashes(self, hashes: Collection[bytes], until: float,
                   scope: str | None = None) -> bool:
        """Pin ``hashes`` (block hashes) until ``until`` (wall-clock seconds). Refused whole,
        counted and warned about (rate-limited) when the scope's pinned bytes would pass
        its cap; ``True`` when pinned."""
        live = self._live_pins(scope)
        new = [h for h in dict.fromkeys(hashes) if h not in live]
        cap = self.cap(scope)
        if (len(live) + len(new)) * self.hash_bytes > cap:
            self.stats["retention_pins_refused"] += 1
            self.refused_pins.warn(
                "retention: a pin of %d chunk(s) is refused: %s would have %d bytes pinned, "
                "over its cap of %d bytes (retention.max_pinned_bytes)",
                len(new), "the stack" if scope is None else f"scope {scope!r}",
                (len(live) + len(new)) * self.hash_bytes, cap)
            return False
        for h in hashes:
            entry = self._entry(h)
            entry.pinned_until = until
            entry.scope = scope
            live.add(h)
        self.stats["retention_pins"] += 1
        return True

    @_locked
    def unpin_hashes(self, hashes: Iterable[bytes]) -> int:
        """Drop the pins of ``hashes``; how many were pinned."""
        dropped = 0
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry.pinned_until is None:
                continue
            self._pinned.get(entry.scope, set()).discard(h)
            entry.pinned_until = None
            dropped += 1
        return dropped

    @_locked
    def expire_hashes(self, hashes: Iterable[bytes], at: float | None = None) -> int:
        """Expire ``hashes`` at ``at`` (default: now) and drop their pins; how many."""
        when = self.clock() if at is None else at
        count = 0
        for h in hashes:
            self.unpin_hashes((h,))
            self._set_expiry(h, self._entry(h), when)
            count += 1
        return count

    def pop_expired(self) -> list[bytes]:
        """The block hashes whose expiry passed since the last call (each once, unless
        its expiry is set again). One reader's: another uses its own
        :meth:`expiry_feed`."""
        return self._pop(self._feeds[0])

    @_locked
    def expiry_feed(self) -> Callable[[], list[bytes]]:
        """A new reader of expiries, for a tier that evicts expired chunks first beside
        another that does (each tier sees every expiry): each call answers as
        :meth:`pop_expired` does, for this reader. It starts with every expiry set now."""
        feed = [(e.expires_at, h) for h, e in self._entries.items()
                if e.expires_at is not None]
        heapq.heapify(feed)
        self._feeds.append(feed)
        return functools.partial(self._pop, feed)

    @_locked
    def _pop(self, feed: list[tuple[float, bytes]]) -> list[bytes]:
        now = self.clock()
        found = []
        while feed and feed[0][0] <= now:
            at, h = heapq.heappop(feed)
            entry = self._entries.get(h)
            if entry is not None and entry.expires_at == at:
                found.append(h)
        return found

    @_locked
    def next_expiry(self) -> float | None:
        """The earliest expiry set and not handed out by :meth:`pop_expired` yet (a stale
        one may come first: a wake-up at it finds nothing), or ``None``."""
        feed = self._feeds[0]
        return feed[0][0] if feed else None

    @_locked
    def expiries(self) -> dict[bytes, float]:
        """Block hash → expiry of every entry that has one."""
        return {h: e.expires_at for h, e in self._entries.items() if e.expires_at is not None}

    @_locked
    def get_stats(self) -> dict[str, float]:
        """The counters, the ignored hints and the bytes pinned now (all scopes)."""
        return {**self.stats, "retention_hints_ignored": self.bad_hints.count,
                "retention_pinned_bytes": len(self.pinned_hashes()) * self.hash_bytes}

    def count_expired_miss(self) -> None:
        self.stats["retention_expired_misses"] += 1

    def count_overridden(self, pins: int) -> None:
        self.stats["retention_pins_overridden"] += pins

    # -- internals -------------------------------------------------------------------

    def _set_expiry(self, h: bytes, entry: _Entry, at: float | None) -> None:
        self._expiring += (at is not None) - (entry.expires_at is not None)
        entry.expires_at = at
        if at is None:
            return
        for feed in self._feeds:
            heapq.heappush(feed, (at, h))
            if len(feed) > 2 * len(self._entries) + 1024:
                # Rebuilt in place: its reader holds this list.
                feed[:] = [(e.expires_at, k) for k, e in self._entries.items()
                           if e.expires_at is not None]
                heapq.heapify(feed)

    def _live_pins(self, scope: str | None) -> set[bytes]:
        """The scope's pinned hashes, expired pins swept out (bounded by the cap)."""
        pinned = self._pinned.setdefault(scope, set())
        now = self.clock()
        for h in [h for h in pinned if not self._pin_live(h, now)]:
            pinned.discard(h)
            entry = self._entries.get(h)
            if entry is not None:
                entry.pinned_until = None
        return pinned

    def _pin_live(self, h: bytes, now: float) -> bool:
        entry = self._entries.get(h)
        return entry is not None and entry.pinned_until is not None and entry.pinned_until > now

    def _entry(self, h: bytes) -> _Entry:
        entry = self._entries.get(h)
        if entry is None:
            entry = self._entries[h] = _Entry()
            if len(self._entries) > self._max_entries:
                self._forget(next(iter(self._entries)))
        else:
            self._entries.move_to_end(h)
        return entry

    def _forget(self, h: bytes) -> None:
        entry = self._entries.pop(h, None)
        if entry is not None and entry.expires_at is not None:
            self._expiring -= 1
        if entry is not None and entry.pinned_until is not None:
            self._pinned.get(entry.scope, set()).discard(h)


def _field(obj: Any, name: str) -> Any:
    """``obj[name]`` of a mapping, ``obj.name`` of a struct; ``None`` when absent."""
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _seconds(value: object, limit: float) -> float | None:
    """A number of seconds in [0, ``limit``], else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    seconds = float(value)
    return seconds if 0 <= seconds <= limit else None


def parse_hint(ctx: ReqContext, book: RetentionBook) -> RetentionHint | None:
    """The retention the request ``ctx`` asks for, or ``None``. Reads ``ctx.kv_hints``,
    else ``kv_transfer_params["kv_hints"]``; a malformed envelope or action, an unknown
    action type, version or payload key is ignored with a rate-limited warning naming
    the request (book.bad_hints)."""
    envelope = getattr(ctx, "kv_hints", None)
    if envelope is None and ctx.kv_transfer_params:
        envelope = ctx.kv_transfer_params.get(PARAMS_KEY)
    if envelope is None:
        return None
    actions = _field(envelope, "actions")
    if not isinstance(actions, list | tuple):
        book.bad_hints.warn("request %s: kv_hints has no list of actions; ignored", ctx.req_id)
        return None
    found: RetentionHint | None = None
    for action in actions:
        kind = _field(action, "action_type")
        if kind != ACTION_TYPE:
            book.bad_hints.warn("request %s: kv_hints action type %r is not one kvtiers "
                                "reads (%r); ignored", ctx.req_id, kind, ACTION_TYPE)
            continue
        version = _field(action, "action_version")
        if version not in ACTION_VERSIONS:
            book.bad_hints.warn("request %s: kv_hints retention version %r is unknown "
                                "(this release reads %s); ignored", ctx.req_id, version,
                                ", ".join(ACTION_VERSIONS))
            continue
        hint = _payload(_field(action, "payload"), book)
        if isinstance(hint, str):
            book.bad_hints.warn("request %s: kv_hints retention payload %s; ignored",
                                ctx.req_id, hint)
            continue
        found = hint
    return found


def _payload(payload: object, book: RetentionBook) -> RetentionHint | str:
    """The hint a retention payload gives, or why it is malformed."""
    if not isinstance(payload, Mapping):
        return "is not a mapping"
    unknown = sorted(str(k) for k in payload if k not in PAYLOAD_KEYS)
    if unknown:
        return f"has unknown key(s) {', '.join(unknown)} (known: {', '.join(PAYLOAD_KEYS)})"
    priority = payload.get("priority", 0)
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
            low <= priority <= high):
        return f"priority must be an integer in [{low}, {high}]"
    pin = payload.get("pin_s")
    pin_s = None if pin is None else _seconds(pin, book.max_pin_s)
    if pin is not None and pin_s is None:
        return f"pin_s must be a number of seconds in [0, {book.max_pin_s:g}]"
    ttl = payload.get("ttl_s")
    ttl_s = None if ttl is None else _seconds(ttl, book.max_ttl_s)
    if ttl is not None and ttl_s is None:
        return f"ttl_s must be a number of seconds in [0, {book.max_ttl_s:g}]"
    return RetentionHint(priority=priority, pin_s=pin_s, ttl_s=ttl_s)


class RetainingPolicy(EvictionPolicy):
    """A tier's policy (``inner``) run once per priority, with a :class:`RetentionBook`'s
    pins and expiries on top. Victims come in this order: expired chunks; then unpinned
    chunks, lowest priority first, each priority in ``inner``'s order; then, only when a
    store still lacks room, pinned chunks in the same order (counted as overridden pins).
    A key takes its priority when inserted and again when touched."""

    def __init__(self, inner: type[EvictionPolicy], capacity: int, book: RetentionBook) -> None:
        super().__init__(capacity)
        self._inner = inner
        self.book = book
        self.recency = inner.recency
        self.shields_request_head = inner.shields_request_head
        self._levels: dict[int, EvictionPolicy] = {}
        self._level_of: dict[Hashable, int] = {}
        # Block hashes past their expiry that may have keys here: evicted first.
        self._expired: set[bytes] = set()
        # The group indexes of the keys seen: a pinned block hash names these keys.
        self._groups: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, key: object) -> bool:
        return key in self._level_of

    def _level(self, priority: int) -> EvictionPolicy:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = self._inner(self.capacity)
        return level

    def insert(self, key: Hashable) -> None:
        priority = self.book.priority(key)  # type: ignore[arg-type]
        self._level(priority).insert(key)
        self._level_of[key] = priority
        self._groups.add(key[-GROUP_INDEX_BYTES:])  # type: ignore[index]
        if self.book.is_expired(key):  # type: ignore[arg-type]
            self._expired.add(block_hash(key))  # type: ignore[arg-type]

    def touch(self, key: Hashable) -> None:
        level = self._level_of.get(key)
        if level is None:
            return
        if self.book.priority(key) != level:  # type: ignore[arg-type]
            self.remove(key)
            self.insert(key)
        self._levels[self._level_of[key]].touch(key)

    def refresh(self, key: Hashable) -> None:
        level = self._level_of.get(key)
        if level is not None:
            self._levels[level].refresh(key)

    def remove(self, key: Hashable) -> None:
        level = self._level_of.pop(key, None)
        if level is not None:
            self._levels[level].remove(key)

    def evictable(self, protected: Collection[Any] = (), shielded: Collection[Any] = ()) -> int:
        return sum(level.evictable(protected, shielded) for level in self._levels.values())

    def evict(
        self, n: int, protected: Collection[Any] = (), shielded: Collection[Any] = ()
    ) -> list[Any] | None:
        if n <= 0:
            return []
        if self.evictable(protected, shielded) < n:
            return None
        guard = set(protected)
        victims: list[Any] = []
        book = self.book
        for key in self._expired_keys(guard):
            if len(victims) == n:
                break
            self.remove(key)
            victims.append(key)
        pinned = self._pinned_keys() if len(victims) < n else set()
        overridden = 0
        for guarded in (guard | pinned, guard):
            for priority in sorted(self._levels):
                want = n - len(victims)
                if want == 0:
                    break
                level = self._levels[priority]
                take = min(want, level.evictable(guarded, shielded))
                if take <= 0:
                    continue
                taken = level.evict(take, guarded, shielded)
                assert taken is not None, "a level refused what it said it could evict"
                for key in taken:
                    del self._level_of[key]
                    overridden += key in pinned
                victims.extend(taken)
        assert len(victims) == n, f"retention evicted {len(victims)} of {n}"
        if overridden:
            book.count_overridden(overridden)
        return victims

    def _expired_keys(self, guard: set[Any]) -> list[Any]:
        """The tracked, unguarded keys past their expiry. A hash none of whose keys is
        tracked, or whose expiry was renewed, is forgotten."""
        book = self.book
        self._expired.update(book.pop_expired())
        found: list[Any] = []
        for h in list(self._expired):
            keys = [h + g for g in self._groups if h + g in self._level_of]
            if not keys or not book.is_expired(keys[0]):
                self._expired.discard(h)
                continue
            found.extend(k for k in keys if k not in guard)
        return found

    def _pinned_keys(self) -> set[Any]:
        """The tracked keys of the book's live pins."""
        return {h + g for h in self.book.pinned_hashes() for g in self._groups
                if h + g in self._level_of}

    def _evict(self, n: int, protected: Collection[Any]) -> list[Any]:
        raise AssertionError("RetainingPolicy overrides evict itself")
