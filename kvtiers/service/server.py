"""The service process's core: one thread, one non-blocking selector loop.

The loop owns the pool's bookkeeping (which slot holds which namespace's key, the LRU
order of ready slots, pins and reservations per connection) and answers each request
frame at once; nothing in it blocks on a client. Per connection the input held is at
most one frame (``max_frame``) and the output queue at most ``max_output`` bytes: a
client that sends more than a frame's bound, or stops reading until its queue is over
the bound, is closed. A request that does not decode, or names a namespace the
connection did not attach, a slot it did not reserve or a pin it does not hold, gets an
:class:`~kvtiers.service.protocol.Error` reply and the connection is closed; the others
are not affected. Closing a connection drops its pins and frees its reservations.

With tiers below the pool (``lower``: the service's stack file) each namespace gets its
own :class:`~kvtiers.service.lower.LowerTiers`, built at the service's start for the
namespaces whose identity the pool's :class:`~kvtiers.service.pool.IdentityRecords` keep
(written at each namespace's first attach) and at the first attach for the others: the
loop hands them each commit (cascaded, write-behind), answers :class:`~kvtiers.service.
protocol.Probe` from them (a lower-tier hit is promoted into the pool), lends them
slots held out of the pool's free list and LRU (a ``write: back`` tier's demotion copies
an evicted chunk from its held slot, :meth:`Service.evict_held`), and polls their movers
while copies are in flight (every ``POLL_S``; it waits for sockets only when none is).

With a ``tenants:`` section (the service's stack file, :mod:`kvtiers.config.tenants`) the
pool's chunks are counted per tenant, the tenant read from each key's tag
(:meth:`~kvtiers.stack.tenants.TenantKeys.owner`: engines scope their tenants' keys before
the service sees them), and eviction respects the tenants' pool quotas and protected
shares (:meth:`Service._take_slot`, :meth:`Service._trim`).

With a ``retention:`` section (``retention``: its book, :mod:`kvtiers.service.retention`)
the pool honours the hints engines send with their commits (:class:`~kvtiers.service.
protocol.Retain`) and the pins of the admin endpoint (:mod:`kvtiers.service.metrics`):
an expired chunk is evicted when its expiry passes (the loop wakes for it; a chunk a load
holds goes when the load lets go), eviction takes a tenant's lower priorities first and
spares pinned chunks while anything else can make the room (:meth:`Service._evict_first`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import selectors
import socket
import stat
import struct
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtiers.core.keys import OffloadKey
from kvtiers.errors import UnknownKeyError
from kvtiers.service import protocol as p
from kvtiers.service.pool import MAX_KEY, Adoption, IdentityRecords, Pool, RecordDamaged

if TYPE_CHECKING:
    from kvtiers.config import StackConfig
    from kvtiers.config.tenants import TenantsConfig
    from kvtiers.policies.retention import RetentionBook
    from kvtiers.service.lower import LowerTiers
    from kvtiers.service.retention import PoolRetention
    from kvtiers.stack.tenants import TenantKeys

log = logging.getLogger("kvtiers.service")

#: Bound of one connection's queued replies.
MAX_OUTPUT = 4 << 20
_RECV = 1 << 16
_PEERCRED = struct.Struct("3i")
#: A reservation's or pin's slot in a reply when the key is present or being written
#: (``PRESENT``) or when no slot could be freed (``NO_ROOM``).
PRESENT = -1
NO_ROOM = -2
#: How often the loop takes in the lower tiers' finished copies while some are in
#: flight, seconds (the movers' threads do not wake the loop).
POLL_S = 0.002
#: While copies to a namespace's lower tiers are in flight, how often at most its
#: tenants' quotas there are kept (a walk of each capped tier's index), seconds; once
#: none is in flight they are kept at once.
LOWER_QUOTA_S = 1.0


class Refused(Exception):
    """A request this connection may not make; the reply is an error and a close."""


def peer_groups(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (from ``/proc``; empty if gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def peer_allowed(uid: int, gid: int, groups: set[int], *, owner: int,
                 group: int | None) -> bool:
    """Whether a peer of ``uid``/``gid`` (supplementary ``groups``) may attach to a
    service run by ``owner`` that admits ``group`` (``None``: its own uid only)."""
    if uid == owner:
        return True
    return group is not None and (gid == group or group in groups)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


@dataclass
class _Namespace:
    index: int
    digest: bytes
    name: str
    ready: dict[bytes, int] = field(default_factory=dict)
    writing: dict[bytes, int] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    stored: int = 0
    adopted: int = 0


@dataclass
class _Conn:
    sock: socket.socket
    pid: int
    uid: int
    engine: str = ""
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    attached: set[int] = field(default_factory=set)
    reserved: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    leased: set[int] = field(default_factory=set)
    pins: Counter[int] = field(default_factory=Counter)
    #: The engine's own lookups and hits (its Report: it reads the mirror, not us).
    lookups: int = 0
    hits: int = 0
    #: Chunks (and their bytes) this connection stored into the pool.
    stored: int = 0
    stored_bytes: int = 0
    closing: bool = False


def _namespace_name(identity: bytes) -> str:
    """A readable name for a namespace: its identity's model name and digest head."""
    import json

    try:
        model = str(json.loads(identity).get("model_name", "?"))
    except (ValueError, AttributeError):
        model = "?"
    return f"{model}-{hashlib.sha256(identity).hexdigest()[:16]}"


class Service:
    """The pool's bookkeeping behind a listening Unix socket; see the module docstring.

    ``serve`` runs the loop until :meth:`stop` (thread- and signal-safe) is called.
    """

    def __init__(
        self,
        pool: Pool,
        socket_path: Path,
        *,
        group: int | None = None,
        max_frame: int = p.MAX_FRAME,
        max_output: int = MAX_OUTPUT,
        max_lease: int = 4096,
        lower: StackConfig | None = None,
        tenants: TenantsConfig | None = None,
        pool_tier: str = "cpu",
        retention: RetentionBook | None = None,
    ) -> None:
        self.pool = pool
        self.socket_path = socket_path
        self.group = group
        self.max_frame = max_frame
        self.max_output = max_output
        #: The most slots one Lease may ask for.
        self.max_lease = max_lease
        #: The most slots one connection holds reserved or leased (empty, not chunks).
        self._per_conn = max(1, pool.num_slots // 8)
        self.epoch = time.time_ns()
        self.started = time.time()
        num_slots = pool.num_slots
        self._owner: list[tuple[int, bytes] | None] = [None] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: Counter[int] = Counter()
        #: Slots held for the lower tiers (a demotion's copy of an evicted chunk, a
        #: second hop's staging, an abandoned promotion), each with its namespace: never
        #: free, never reused, until released.
        self._demoting: dict[int, int] = {}
        self._namespaces: dict[int, _Namespace] = {}
        self.counters: Counter[str] = Counter()
        self._init_tenants(tenants, pool_tier)
        #: Re-adopted keys per namespace, handed to its lower tiers once they are built.
        self._adopted_keys: dict[int, list[bytes]] = {}
        self._retention: PoolRetention | None = None
        #: Whether engines' hints are read (``retention.hints``; the admin's pins are).
        self.retention_hints = True
        if retention is not None:
            from kvtiers.service.retention import PoolRetention

            self._retention = PoolRetention(retention, self._tenant_of, pool.slot_bytes)
        self.adoption = self._adopt() if not pool.created else Adoption()
        taken = {s for slots in self.adoption.adopted.values() for s in slots}
        # First in, first out: a freed slot is reused after every slot freed before it,
        # and the slots being written at the last stop after all the others (a worker's
        # copy started before may still land; see docs/service.md, "Restart").
        unsettled = set(self.adoption.unsettled)
        self._free = deque([
            *(s for s in range(num_slots) if s not in taken and s not in unsettled),
            *self.adoption.unsettled,
        ])
        self._conns: dict[int, _Conn] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        # Snapshots asked for by other threads (metrics): answered on the loop's thread.
        self._asked: list[tuple[threading.Event, list[dict[str, Any]]]] = []
        self._listener = self._listen(socket_path)
        #: The stack file whose tiers below the first run under the pool (``None``: none).
        self.lower = lower if lower is not None and len(lower.tiers) > 1 else None
        self._lowers: dict[int, LowerTiers] = {}
        #: Namespaces whose lower tiers could not be built: why.
        self._lower_refused: dict[int, str] = {}
        #: Builds under way (namespace → thread), and what they handed over (the loop
        #: takes it in when woken): the lower tiers, or why they could not be built.
        self._building: dict[int, threading.Thread] = {}
        self._built: deque[tuple[int, LowerTiers | str]] = deque()
        #: Keys committed while their namespace's build was under way: cascaded once it
        #: ends (those still in the pool then).
        self._uncascaded: dict[int, dict[bytes, None]] = {}
        #: Each namespace's identity, kept beside the pool (with lower tiers only: the
        #: next start builds them from it), and the digests whose record is known whole.
        self._records = IdentityRecords(pool.path) if self.lower is not None else None
        self._recorded: set[bytes] = set()
        self._build_recorded()

    # -- set-up ---------------------------------------------------------------------
    def _init_tenants(self, tenants: TenantsConfig | None, pool_tier: str) -> None:
        """Tenants' pool quotas and protected shares in slots (tier ``pool_tier`` of
        their section: the stack's first), and one least-recently-used order of ready
        slots per tenant (``None`` without a ``tenants:`` section)."""
        self._tenants: TenantKeys | None = None
        #: Ready slots per tenant, least recently used first (mirrors ``_lru``).
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._quota: dict[str, int] = {}
        self._protected: dict[str, int] = {}
        #: Quotas on the tiers below the pool: tier name → tenant → bytes, kept in each
        #: namespace's instance of the tier (:meth:`_keep_lower_quotas`); the namespaces
        #: with commits since their last pass, when that was, and what it counted.
        self._lower_quota: dict[str, dict[str, int]] = {}
        self._quota_due: set[int] = set()
        self._quota_at: dict[int, float] = {}
        self._lower_usage: dict[int, dict[str, Counter[str]]] = {}
        if tenants is None:
            return
        from kvtiers.stack.tenants import TenantKeys

        self._tenants = TenantKeys(tenants)
        self._held = {name: OrderedDict() for name in self._tenants.names}
        size = self.pool.slot_bytes
        for tenant in tenants.members:
            quota = tenant.quota_bytes().get(pool_tier)
            if quota is not None:
                self._quota[tenant.name] = quota // size
            share = tenant.protected_bytes().get(pool_tier)
            if share is not None:
                self._protected[tenant.name] = -(-share // size)
            for tier, bytes_ in tenant.quota_bytes().items():
                if tier != pool_tier:
                    self._lower_quota.setdefault(tier, {})[tenant.name] = bytes_

    def _held_add(self, slot: int, key: bytes) -> None:
        if self._tenants is not None:
            self._held[self._tenants.owner(OffloadKey(key))][slot] = None
        if self._retention is not None:
            self._retention.added(slot, key)

    def _held_touch(self, slot: int, key: bytes) -> None:
        if self._tenants is not None:
            self._held[self._tenants.owner(OffloadKey(key))].move_to_end(slot)
        if self._retention is not None:
            self._retention.touched(slot)

    def _adopt(self) -> Adoption:
        found = self.pool.adopt()
        for index, digest in self.pool.namespaces():
            self._namespaces[index] = _Namespace(index, digest, digest.hex()[:16])
        for index, slots in found.adopted.items():
            ns = self._namespaces[index]
            keys = self._adopted_keys[index] = []
            for slot in slots:
                _, _, _, length, _, _, _, key = self.pool.header(slot)
                keys.append(key)
                ns.ready[key] = slot
                ns.lengths[slot] = length
                self._owner[slot] = (index, key)
                self._lru[slot] = None
                self._held_add(slot, key)
            ns.adopted = len(slots)
        self.counters["adopted"] = found.total
        self.counters["adopt_torn"] = found.torn
        self.counters["adopt_corrupt"] = found.corrupt
        self.counters["adopt_foreign"] = found.foreign
        log.info(
            "kvtiers serve: re-adopted %d chunks from %s (%d torn, %d corrupt, %d foreign "
            "freed)", found.total, self.pool.path, found.torn, found.corrupt, found.foreign,
        )
        return found

    def _build_recorded(self) -> None:
        """At start, with lower tiers: start the build of each namespace in the pool's
        table whose identity record reads back whole. A namespace without a record, or
        with a damaged one (counted, logged), has its lower tiers built at its first
        attach, which writes the record anew. Records of namespaces not in the table
        (a pool made anew) are removed."""
        records = self._records
        if records is None:
            return
        records.prune([ns.digest for ns in self._namespaces.values()])
        for ns in list(self._namespaces.values()):
            try:
                identity = records.read(ns.digest)
            except RecordDamaged as exc:
                self.counters["identity_records_damaged"] += 1
                log.warning("kvtiers serve: namespace %s: %s; its lower tiers are built "
                            "at its first attach", ns.name, exc)
                continue
            if identity is None:
                self.counters["identity_records_missing"] += 1
                continue
            self._recorded.add(ns.digest)
            ns.name = _namespace_name(identity)
            self._start_build(ns.index, ns.name, identity)

    def _listen(self, path: Path) -> socket.socket:
        if path.exists() or path.is_symlink():
            info = path.lstat()
            if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
                raise OSError(f"{path} exists and is not this user's socket; remove it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # a stale socket of a service that died
            else:
                raise OSError(f"another service listens on {path}")
            finally:
                probe.close()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117 if self.group is not None else 0o177)
        try:
            listener.bind(str(path))
        finally:
            os.umask(old)
        if self.group is not None:
            os.chown(path, -1, self.group)
        listener.listen(64)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        return listener

    # -- the loop -------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to drain and return; safe from a signal handler or a thread."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def snapshot(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """:meth:`state`, taken by the loop's thread, for another thread; ``None`` if
        the loop did not answer within ``timeout_s`` (or is stopped)."""
        done = threading.Event()
        box: list[dict[str, Any]] = []
        self._asked.append((done, box))
        try:
            self._wake_w.send(b"s")
        except OSError:
            return None
        return box[0] if done.wait(timeout_s) and box else None

    def serve(self) -> None:
        """Run until :meth:`stop`: then stop accepting, send what is queued (each
        connection gets what a non-blocking send takes), close every connection and the
        socket. The pool file stays for the next start to re-adopt."""
        log.info("kvtiers serve: listening on %s, pool %s (%d slots of %d bytes)",
                 self.socket_path, self.pool.path, self.pool.num_slots, self.pool.slot_bytes)
        try:
            while not self._stopping:
                busy = self._step_lowers()
                timeout = POLL_S if busy else None
                wake = self._expire()
                if wake is not None:
                    timeout = wake if timeout is None else min(timeout, wake)
                for key, events in self._selector.select(timeout):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._drain_wake()
                    else:
                        conn = key.data
                        if events & selectors.EVENT_READ:
                            self._read(conn)
                        if events & selectors.EVENT_WRITE and not conn.closing:
                            self._flush(conn)
        finally:
            self._shutdown()

    def _step_lowers(self) -> bool:
        """Take in the lower tiers' finished copies and submit held promotions; whether
        any copy is in flight. A namespace whose tiers fail here loses them (logged; its
        pool is served on), never the loop."""
        busy = False
        for index, lowers in list(self._lowers.items()):
            try:
                lowers.step()
                busy = busy or lowers.busy
                if index in self._quota_due:
                    self._keep_lower_quotas(index, lowers)
            except Exception as exc:
                log.exception("kvtiers serve: the lower tiers of namespace %d failed; "
                              "it keeps the pool alone", index)
                self.counters["internal_errors"] += 1
                del self._lowers[index]
                self._lower_refused[index] = f"failed: {type(exc).__name__}: {exc}"
                with contextlib.suppress(Exception):
                    lowers.shutdown()
                # Its movers are stopped: the slots held for its copies are free again.
                self.release_held([s for s, of in self._demoting.items() if of == index])
        return busy

    def _keep_lower_quotas(self, index: int, lowers: LowerTiers) -> None:
        """Evict, in each of namespace ``index``'s lower tiers with quotas, every tenant's
        own chunks past its quota there (:func:`~kvtiers.stack.tenants.trim_to_quotas`):
        at once when no copy is in flight, else at most every ``LOWER_QUOTA_S``; the
        namespace stays due until a pass found no copy in flight."""
        from kvtiers.stack.tenants import AccountedTier, trim_to_quotas

        assert self._tenants is not None
        now = time.monotonic()
        busy = lowers.busy
        if busy and now - self._quota_at.get(index, -LOWER_QUOTA_S) < LOWER_QUOTA_S:
            return
        self._quota_at[index] = now
        if not busy:
            self._quota_due.discard(index)
        owner = self._tenants.owner
        for tier in lowers.tiers[1:]:
            quotas = self._lower_quota.get(tier.name)
            if quotas and isinstance(tier.manager, AccountedTier):
                usage, evicted = trim_to_quotas(tier.manager, quotas, owner)
                self._lower_usage.setdefault(index, {})[tier.name] = usage
                self.counters["tenant_lower_quota_evictions"] += evicted

    def _lower_bytes(self, tier: str, tenant: str) -> int:
        """``tenant``'s bytes in lower tier ``tier``, summed over the namespaces, as their
        last quota passes counted them."""
        empty: Counter[str] = Counter()
        return sum(usage.get(tier, empty)[tenant] for usage in self._lower_usage.values())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass
        # An admin call changed the book: what it expired goes before its snapshot.
        self._expire()
        while self._asked:
            done, box = self._asked.pop()
            box.append(self.state())
            done.set()
        while self._built:
            self._take_built(*self._built.popleft())

    def _shutdown(self) -> None:
        for thread in list(self._building.values()):
            thread.join()
        while self._built:
            self._take_built(*self._built.popleft())
        for index, lowers in self._lowers.items():
            try:
                lowers.wait_idle()
                lowers.shutdown()
            except Exception:  # one namespace's tiers must not keep the others open
                log.exception("kvtiers serve: stopping the lower tiers of namespace %d",
                              index)
        for conn in list(self._conns.values()):
            if conn.outbuf:
                with contextlib.suppress(OSError):
                    conn.sock.send(conn.outbuf)
            self._close(conn, "service stopping")
        self._selector.unregister(self._listener)
        self._listener.close()
        self.socket_path.unlink(missing_ok=True)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        log.info("kvtiers serve: stopped; %d chunks stay in %s", len(self._lru), self.pool.path)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            pid, uid, gid = peer_credentials(sock)
            if not peer_allowed(uid, gid, peer_groups(pid) if self.group is not None else set(),
                                owner=os.geteuid(), group=self.group):
                self.counters["refused_peers"] += 1
                log.warning("kvtiers serve: refused pid %d uid %d (not this user or group)",
                            pid, uid)
                try:
                    sock.setblocking(False)
                    sock.send(p.frame(p.Error(0, "peer credentials refused")))
                except OSError:
                    pass
                sock.close()
                continue
            sock.setblocking(False)
            conn = _Conn(sock, pid, uid)
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self.counters["connections"] += 1

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn, "peer closed")
            return
        conn.inbuf += data
        buf = conn.inbuf
        while len(buf) >= 4 and not conn.closing:
            (size,) = p.FRAME.unpack_from(buf)
            if size > self.max_frame:
                self.counters["bad_messages"] += 1
                self._refuse(conn, 0, f"frame of {size} bytes over the bound {self.max_frame}")
                return
            if len(buf) < 4 + size:
                break
            payload = bytes(buf[4 : 4 + size])
            del buf[: 4 + size]
            self._handle(conn, payload)
        if not conn.closing:
            self._flush(conn)

    def _handle(self, conn: _Conn, payload: bytes) -> None:
        try:
            request = p.decode_request(payload)
        except p.ProtocolError as exc:
            self.counters["bad_messages"] += 1
            self._refuse(conn, 0, f"malformed request: {exc}")
            return
        try:
            reply = self._answer(conn, request)
        except Refused as exc:
            self.counters["bad_messages"] += 1
            self._refuse(conn, request.seq, str(exc))
            return
        except Exception as exc:  # a defect here must cost one connection, not the node
            log.exception("kvtiers serve: internal error answering pid %d", conn.pid)
            self.counters["internal_errors"] += 1
            self._refuse(conn, request.seq, f"internal error: {type(exc).__name__}")
            return
        conn.outbuf += p.frame(reply)
        if len(conn.outbuf) > self.max_output:
            self.counters["slow_clients"] += 1
            self._close(conn, "output queue over its bound (the client does not read)")

    def _refuse(self, conn: _Conn, seq: int, message: str) -> None:
        """Send ``message`` as an error (as far as a non-blocking send takes it) and close."""
        log.warning("kvtiers serve: closing pid %d: %s", conn.pid, message)
        conn.outbuf += p.frame(p.Error(seq, message[:500]))
        with contextlib.suppress(OSError):
            conn.sock.send(conn.outbuf)
        self._close(conn, message)

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close(conn, "send failed")
                return
            del conn.outbuf[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self._selector.modify(conn.sock, events, conn)

    def _close(self, conn: _Conn, why: str) -> None:
        if conn.closing:
            return
        conn.closing = True
        if conn.attached:
            log.info("kvtiers serve: detached pid %d (%s)", conn.pid, why)
            self.counters["detaches"] += 1
        for slot, count in conn.pins.items():
            self._pins[slot] -= count
            if self._pins[slot] <= 0:
                del self._pins[slot]
        for slot, (index, key) in conn.reserved.items():
            self._namespaces[index].writing.pop(key, None)
            self._release(slot)
        for slot in conn.leased:
            self._release(slot)
        conn.pins.clear()
        conn.reserved.clear()
        conn.leased.clear()
        self._conns.pop(conn.sock.fileno(), None)
        self._selector.unregister(conn.sock)
        conn.sock.close()

    # -- requests -------------------------------------------------------------------
    def _answer(self, conn: _Conn, request: p.Request) -> p.Reply:
        if isinstance(request, p.Attach):
            return self._attach(conn, request)
        if isinstance(request, p.Status):
            return p.StatusReply(request.seq, self.state())
        if request.ns not in conn.attached:
            raise Refused(f"namespace {request.ns} is not attached by this connection")
        ns = self._namespaces[request.ns]
        if isinstance(request, p.Lease):
            return p.Slots(request.seq, self._lease(conn, request.count))
        if isinstance(request, p.Unpin):
            self._unpin(conn, request.slots)
            return p.Done(request.seq)
        if isinstance(request, p.Report):
            if not 0 <= request.hits <= request.lookups:
                raise Refused(f"a report of {request.hits} hits in {request.lookups} "
                              "lookups")
            conn.lookups, conn.hits = request.lookups, request.hits
            return p.Done(request.seq)
        for key in request.keys:
            if not 0 < len(key) <= MAX_KEY:
                raise Refused(f"a key of {len(key)} bytes (1 to {MAX_KEY} expected)")
        lowers = self._lowers.get(ns.index)
        if lowers is not None and isinstance(request, (p.Commit, p.Probe)):
            # Keys the lower tiers are handed must be this cache's, checked before the
            # pool changes.
            try:
                lowers.manager.key_format.check_all(request.keys, type(request).__name__)
            except ValueError as exc:
                raise Refused(str(exc)) from None
        if isinstance(request, p.Reserve):
            return p.Slots(request.seq, self._reserve(conn, ns, request.keys))
        if isinstance(request, p.Commit):
            return p.Slots(request.seq, self._commit(conn, ns, request))
        if isinstance(request, p.Pin):
            return p.Slots(request.seq, self._pin(conn, ns, request.keys, request.slots))
        if isinstance(request, p.Probe):
            return p.Slots(request.seq, self._probe(ns, request.keys))
        if isinstance(request, p.Retain):
            self._retain(request)
            return p.Done(request.seq)
        assert isinstance(request, p.Lookup)
        return p.Slots(request.seq, [ns.ready.get(key, PRESENT) for key in request.keys])

    def _attach(self, conn: _Conn, request: p.Attach) -> p.Reply:
        if request.protocol != p.PROTOCOL:
            raise Refused(
                f"the engine speaks the service's wire protocol {request.protocol}, this "
                f"service {p.PROTOCOL}: run the same kvtiers release in the engines and "
                "the service"
            )
        if request.chunk_bytes > self.pool.slot_bytes or request.chunk_bytes < 1:
            raise Refused(
                f"chunks of {request.chunk_bytes} bytes do not fit the pool's slots of "
                f"{self.pool.slot_bytes} bytes: start the service with a larger slot size"
            )
        digest = hashlib.sha256(request.identity).digest()
        try:
            index = self.pool.add_namespace(digest)
        except Exception as exc:  # the table is full: this engine cannot attach
            raise Refused(str(exc)) from None
        ns = self._namespaces.get(index)
        name = _namespace_name(request.identity)
        if ns is None:
            ns = self._namespaces[index] = _Namespace(index, digest, name)
        ns.name = name
        if self._records is not None and digest not in self._recorded:
            try:
                self._records.write(request.identity)
                self._recorded.add(digest)
            except OSError as exc:  # the next start builds this namespace at attach
                self.counters["identity_record_failures"] += 1
                log.warning("kvtiers serve: namespace %s: its identity record could not "
                            "be written: %s", name, exc)
        conn.attached.add(index)
        self.counters["attaches"] += 1
        if self._retention is not None:
            self._retention.attached(request.identity)
        conn.engine = request.engine[:200]
        log.info("kvtiers serve: pid %d (%s) attached namespace %s", conn.pid, conn.engine,
                 ns.name)
        return p.Attached(request.seq, index, str(self.pool.path), self.pool.num_slots,
                          self.pool.slot_bytes, self.epoch, self._lower_count(ns, request))

    def _lower_count(self, ns: _Namespace, request: p.Attach) -> int:
        """How many tiers run below the pool for ``ns``; at its first attach their build
        starts on a thread of its own (a tier's medium may be slow to open: the loop does
        not wait for it, and probes meanwhile are answered "ask again")."""
        if self.lower is None or ns.index in self._lower_refused:
            return 0
        if ns.index not in self._lowers and ns.index not in self._building:
            self._start_build(ns.index, ns.name, request.identity)
        return len(self.lower.tiers) - 1

    def _start_build(self, index: int, name: str, identity: bytes) -> None:
        thread = threading.Thread(target=self._build_lowers, args=(index, name, identity),
                                  name=f"kvtiers-serve-lower-{index}", daemon=True)
        self._building[index] = thread
        self._uncascaded[index] = {}
        thread.start()

    def _build_lowers(self, index: int, name: str, identity: bytes) -> None:
        """On its own thread: build namespace ``index``'s lower tiers and hand them (or
        why not) to the loop."""
        from kvtiers.service.lower import LowerTiers, identity_config

        assert self.lower is not None
        built: LowerTiers | str
        try:
            built = LowerTiers(self.lower, identity_config(identity), self.pool, self, index,
                               headroom=self._per_conn)
        except Exception as exc:  # this namespace goes without; the others are served
            built = f"{type(exc).__name__}: {exc}"
            log.warning("kvtiers serve: no lower tiers for namespace %s: %s", name, exc)
        self._built.append((index, built))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"l")

    def _take_built(self, index: int, built: LowerTiers | str) -> None:
        """On the loop: a build ended (see :meth:`_build_lowers`)."""
        self._building.pop(index, None)
        waiting = self._uncascaded.pop(index, {})
        if isinstance(built, str):
            self._lower_refused[index] = built
            self._adopted_keys.pop(index, None)
            return
        self._lowers[index] = built
        ready = self._namespaces[index].ready
        try:
            # Committed before the door below the pool existed: keys it refuses stay out.
            built.committed(built.valid(key for key in waiting if key in ready))
            built.readopted(key for key in self._adopted_keys.pop(index, ())
                            if key not in waiting)
            if self._lower_quota and waiting:
                self._quota_due.add(index)
        except Exception:  # a defect below the pool must not stop the loop
            log.exception("kvtiers serve: cascading the chunks committed during the build "
                          "of namespace %d", index)
            self.counters["internal_errors"] += 1
        log.info("kvtiers serve: namespace %s: %d lower tiers (%s)",
                 self._namespaces[index].name, len(built.tiers) - 1,
                 ", ".join(t.name for t in built.tiers[1:]))

    def _probe(self, ns: _Namespace, keys: list[bytes]) -> list[int]:
        """Answer a :class:`~kvtiers.service.protocol.Probe` (see there)."""
        lowers = self._lowers.get(ns.index)
        retention = self._retention
        if lowers is not None and retention is not None:
            # Past its TTL a chunk is held nowhere: never promoted back into the pool.
            live = [key for key in keys if not retention.book.is_expired(key)]
            self.counters["probes"] += len(live)
            found = dict(zip(live, lowers.probe(live), strict=True))
            return [found.get(key, p.PROBE_MISS) for key in keys]
        if lowers is not None:
            self.counters["probes"] += len(keys)
            return lowers.probe(keys)
        # Without lower tiers (yet: a build under way is asked again).
        absent = p.PROBE_RETRY if ns.index in self._building else p.PROBE_MISS
        return [p.PROBE_HIT if key in ns.ready else p.PROBE_PENDING if key in ns.writing
                else absent for key in keys]

    # -- the pool as the lower tiers' primary (kvtiers.service.lower.PoolKeeper) -----
    def ready_slot(self, ns: int, key: bytes) -> int | None:
        return self._namespaces[ns].ready.get(key)

    def writing_slot(self, ns: int, key: bytes) -> int | None:
        return self._namespaces[ns].writing.get(key)

    def reserve_promotion(self, ns: int, key: bytes) -> int | None:
        slot = self._take_slot({key}, self._tenant_of(key))
        if slot < 0:
            return None
        namespace = self._namespaces[ns]
        self.pool.set_writing(slot)
        namespace.writing[key] = slot
        self._owner[slot] = (ns, key)
        return slot

    def end_promotion(self, ns: int, key: bytes, slot: int, length: int) -> None:
        namespace = self._namespaces[ns]
        del namespace.writing[key]
        if length:
            self._publish(namespace, key, slot, length)
            self._trim([key])
            self.counters["promoted"] += 1
        else:
            self._release(slot)
            self.counters["promotions_failed"] += 1

    def pin_slot(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin_slot(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] <= 0:
            del self._pins[slot]

    def free_slot_count(self) -> int:
        return len(self._free)

    def eviction_count(self) -> int:
        return self.counters["evictions"]

    def evict_held(self, ns: int, count: int, protected: Container[bytes]) -> dict[bytes, int]:
        picked: list[tuple[int, tuple[int, bytes]]] = []
        tenants = self._tenants
        for slot in self._lru:
            if len(picked) >= count:
                break
            owner = self._owner[slot]
            if owner is None or owner[0] != ns or slot in self._pins or owner[1] in protected:
                continue
            if tenants is not None:
                who = tenants.owner(OffloadKey(owner[1]))
                if len(self._held[who]) <= self._protected.get(who, 0):
                    continue  # within its tenant's protected share
            picked.append((slot, owner))
        held = {}
        for slot, owner in picked:
            # Gone from the tables and the mirror; the header and bytes stay as they are
            # (a load planned before reads the chunk it planned for) until released.
            self._evict(slot, owner)
            self._demoting[slot] = ns
            held[owner[1]] = slot
        return held

    def hold_free(self, ns: int, count: int) -> list[int]:
        slots: list[int] = []
        while self._free and len(slots) < count:
            slot = self._free.popleft()
            self.pool.set_writing(slot)
            self._demoting[slot] = ns
            slots.append(slot)
        return slots

    def detach_promotion(self, ns: int, key: bytes, slot: int) -> None:
        del self._namespaces[ns].writing[key]
        self._owner[slot] = None
        self._demoting[slot] = ns

    def release_held(self, slots: Iterable[int]) -> None:
        slots = list(dict.fromkeys(slots))
        unknown = [slot for slot in slots if slot not in self._demoting]
        if unknown:
            raise UnknownKeyError(f"release_held: slots {unknown} are not held")
        for slot in slots:
            del self._demoting[slot]
            self._release(slot)

    def _take_slot(self, batch: set[bytes], tenant: str | None = None) -> int:
        """A slot for a chunk of ``tenant`` (``None``: not known, as for a lease).

        With tenants, a tenant at its pool quota gets the slot of its own least recently
        used unpinned ready chunk not in ``batch`` (evicted), or -1 if it has none.
        Otherwise: the free slot freed longest ago, or else the slot of the least
        recently used unpinned ready chunk not in ``batch`` whose tenant is ``tenant``
        or holds more than its protected share (evicted; an unknown tenant spares every
        share); -1 if none can be freed. The scan passes over pinned and shielded chunks:
        O(those) per slot taken from a full pool."""
        if self._tenants is not None and tenant is not None:
            quota = self._quota.get(tenant)
            if quota is not None and len(self._held[tenant]) >= quota:
                slot = self._evict_first(self._held[tenant], batch, tenant)
                self.counters["tenant_quota_evictions"] += slot >= 0
                return slot
        if not self._free and self._retention is not None:
            self._expire()  # an expiry passed since the loop last looked: those go first
        if self._free:
            return self._free.popleft()
        return self._evict_first(self._lru, batch, tenant)

    def _evict_first(self, order: OrderedDict[int, None], batch: set[bytes],
                     tenant: str | None) -> int:
        """Evict the first chunk of ``order`` that :meth:`_take_slot` may take. With
        retention, a chunk pinned by it is passed over while any other may be taken, and
        the chunk found gives way to the least recently used one of the lowest priority
        below its own of the same tenant (:meth:`PoolRetention.lowest`)."""
        tenants = self._tenants
        retention = self._retention

        def may_take(slot: int, spare_pins: bool) -> bool:
            owner = self._owner[slot]
            if slot in self._pins or owner is None or owner[1] in batch:
                return False
            return not (spare_pins and retention is not None
                        and retention.is_pinned(owner[1]))

        for spare_pins in (True, False) if retention is not None else (False,):
            for slot in order:
                owner = self._owner[slot]
                if owner is None or not may_take(slot, spare_pins):
                    continue
                if tenants is not None:
                    who = tenants.owner(OffloadKey(owner[1]))
                    if who != tenant and len(self._held[who]) <= self._protected.get(who, 0):
                        continue  # within another tenant's protected share
                if retention is not None:
                    slot = retention.lowest(slot, functools.partial(may_take,
                                                                    spare_pins=spare_pins))
                    owner = self._owner[slot]
                    assert owner is not None
                    if not spare_pins and retention.is_pinned(owner[1]):
                        retention.book.count_overridden(1)  # no other chunk could go
                lowers = self._lowers.get(owner[0])
                if lowers is not None and lowers.evicted_by_pool(owner[1]):
                    # Evicted for room before a demotion took it: the back tier never
                    # gets it.
                    self.counters["demotions_dropped"] += 1
                self._evict(slot, owner)
                return slot
        return -1

    def _expire(self) -> float | None:
        """Evict the chunks past their expiry (one a load holds when it lets go); seconds
        until the next expiry, ``None`` when none is set (or without retention)."""
        retention = self._retention
        if retention is None:
            return None
        for slot in retention.due():
            owner = self._owner[slot]
            if owner is None or self._namespaces[owner[0]].ready.get(owner[1]) != slot:
                continue
            if slot in self._pins:
                retention.wait(slot)
                continue
            self._evict(slot, owner)
            self._release(slot)
            self.counters["retention_expired_evictions"] += 1
        return retention.next_wake(retention.book.clock())

    def _retain(self, request: p.Retain) -> None:
        """Take in an engine's retention hint (a bad one is ignored, never refused); keys
        it expires at once go now."""
        retention = self._retention
        if retention is None or not self.retention_hints:
            self.counters["retention_hints_unread"] += 1
            return
        if retention.hint(request):
            self._expire()  # a TTL of 0: gone before the reply

    def _tenant_of(self, key: bytes) -> str | None:
        return None if self._tenants is None else self._tenants.owner(OffloadKey(key))

    def _trim(self, keys: list[bytes]) -> None:
        """Bring each tenant of ``keys`` that is over its pool quota back to it: its own
        least recently used unpinned ready chunks other than ``keys`` are evicted and
        their slots freed (a step's reservations and leases may overshoot until their
        commit)."""
        if self._tenants is None or not self._quota:
            return
        spared = set(keys)
        for tenant in {self._tenants.owner(OffloadKey(key)) for key in keys}:
            quota = self._quota.get(tenant)
            held = self._held[tenant]
            while quota is not None and len(held) > quota:
                slot = self._evict_first(held, spared, tenant)
                if slot < 0:
                    break
                self._release(slot)
                self.counters["tenant_quota_evictions"] += 1

    def _evict(self, slot: int, owner: tuple[int, bytes]) -> None:
        """Drop the ready chunk in ``slot`` from every table (the slot is the caller's)."""
        index, key = owner
        ns = self._namespaces[index]
        del ns.ready[key]
        ns.lengths.pop(slot, None)
        del self._lru[slot]
        if self._tenants is not None:
            del self._held[self._tenants.owner(OffloadKey(key))][slot]
        if self._retention is not None:
            self._retention.removed(slot)
        self._owner[slot] = None
        self.pool.mirror_remove(self.pool.header(slot)[5], slot)
        self.counters["evictions"] += 1

    def _reserve(self, conn: _Conn, ns: _Namespace, keys: list[bytes]) -> list[int]:
        slots = []
        batch = set(keys)
        full = False
        for key in keys:
            ready = ns.ready.get(key)
            if ready is not None:
                self._lru.move_to_end(ready)
                self._held_touch(ready, key)
                slots.append(PRESENT)
                continue
            if full or key in ns.writing:
                slots.append(NO_ROOM if full else PRESENT)
                continue
            # One connection holds an eighth of the pool at most, reserved or leased.
            held = len(conn.reserved) + len(conn.leased)
            slot = (self._take_slot(batch, self._tenant_of(key)) if held < self._per_conn
                    else -1)
            if slot < 0:
                full = True
                slots.append(NO_ROOM)
                continue
            self.pool.set_writing(slot)
            ns.writing[key] = slot
            self._owner[slot] = (ns.index, key)
            conn.reserved[slot] = (ns.index, key)
            slots.append(slot)
        return slots

    def _lease(self, conn: _Conn, count: int) -> list[int]:
        """Up to ``count`` slots for ``conn`` to fill (evicting as reservations do)."""
        if not 0 <= count <= self.max_lease:
            raise Refused(f"lease: {count} slots (0 to {self.max_lease} expected)")
        # One connection holds an eighth of the pool at most: leased slots hold nothing.
        count = min(count, self._per_conn - len(conn.leased) - len(conn.reserved))
        slots = []
        for _ in range(count):
            slot = self._take_slot(set())
            if slot < 0:
                break
            self.pool.set_writing(slot)
            self._owner[slot] = None
            conn.leased.add(slot)
            slots.append(slot)
        return slots

    def _commit(self, conn: _Conn, ns: _Namespace, request: p.Commit) -> list[int]:
        if not len(request.keys) == len(request.slots) == len(request.lengths):
            raise Refused("commit: keys, slots and lengths differ in length")
        for key, slot, length in zip(request.keys, request.slots, request.lengths,
                                     strict=True):
            if slot not in conn.leased and conn.reserved.get(slot) != (ns.index, key):
                raise Refused(f"commit: slot {slot} is neither leased by this connection "
                              "nor reserved for that key by it")
            if not 0 < length <= self.pool.slot_bytes:
                raise Refused(f"commit: length {length} outside the slot")
        if len(set(request.slots)) != len(request.slots):
            raise Refused("commit: a slot named twice")
        outcome = []
        for key, slot, length in zip(request.keys, request.slots, request.lengths,
                                     strict=True):
            if slot in conn.leased:
                if not request.ok or key in ns.ready or key in ns.writing:
                    # Stored by another engine meanwhile: held once; the slot stays leased.
                    self.counters["duplicate_stores"] += request.ok
                    outcome.append(0)
                    continue
                conn.leased.discard(slot)
                self._owner[slot] = (ns.index, key)
            else:
                del conn.reserved[slot]
                del ns.writing[key]
                if not request.ok:
                    self._release(slot)
                    outcome.append(-1)
                    continue
            self._publish(ns, key, slot, length)
            ns.stored += 1
            conn.stored += 1
            conn.stored_bytes += length
            outcome.append(1)
        stored = [key for key, done in zip(request.keys, outcome, strict=True) if done == 1]
        self._trim(stored)
        lowers = self._lowers.get(ns.index)
        if lowers is not None:
            # Write-behind: the lower tiers' movers copy them on their background threads.
            lowers.committed(stored)
            if self._lower_quota and stored:
                self._quota_due.add(ns.index)
        elif ns.index in self._uncascaded:
            waiting = self._uncascaded[ns.index]
            waiting.update(dict.fromkeys(stored))
            if len(waiting) > self.pool.num_slots:
                # Bounded by the pool: only the chunks still in it are cascaded anyway.
                self._uncascaded[ns.index] = {k: None for k in waiting if k in ns.ready}
        return outcome

    def _publish(self, ns: _Namespace, key: bytes, slot: int, length: int) -> None:
        """Checksum ``slot`` and make it ``key``'s ready chunk (header, mirror, LRU)."""
        tag = self.pool.set_ready(slot, ns.index, ns.digest, key, length)
        if not self.pool.mirror_add(tag, slot):
            self.counters["mirror_full"] += 1
        ns.ready[key] = slot
        ns.lengths[slot] = length
        self._lru[slot] = None
        self._held_add(slot, key)

    def _release(self, slot: int) -> None:
        self._owner[slot] = None
        self.pool.set_free(slot)
        self._free.append(slot)

    def _pin(self, conn: _Conn, ns: _Namespace, keys: list[bytes], slots: list[int]
             ) -> list[int]:
        if len(keys) != len(slots):
            raise Refused("pin: keys and slots differ in length")
        pinned = []
        for key, slot in zip(keys, slots, strict=True):
            if ns.ready.get(key) != slot:
                ns.misses += 1
                pinned.append(PRESENT)
                continue
            ns.hits += 1
            self._pins[slot] += 1
            conn.pins[slot] += 1
            self._lru.move_to_end(slot)
            self._held_touch(slot, key)
            pinned.append(slot)
        return pinned

    def _unpin(self, conn: _Conn, slots: list[int]) -> None:
        num_slots = self.pool.num_slots
        for slot in slots:
            if not 0 <= slot < num_slots:
                raise Refused(f"unpin: slot {slot} outside [0, {num_slots})")
        for slot in slots:
            if not conn.pins[slot]:
                continue  # its Pin found the key gone: nothing was pinned
            conn.pins[slot] -= 1
            if not conn.pins[slot]:
                del conn.pins[slot]
            self._pins[slot] -= 1
            if self._pins[slot] <= 0:
                del self._pins[slot]

    # -- status ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What ``kvtiers status`` shows; plain JSON types only."""
        used = self.pool.num_slots - len(self._free)
        return {
            "socket": str(self.socket_path),
            "pool": str(self.pool.path),
            "epoch": self.epoch,
            "uptime_s": round(time.time() - self.started, 3),
            "num_slots": self.pool.num_slots,
            "slot_bytes": self.pool.slot_bytes,
            "used_slots": used,
            "ready_slots": len(self._lru),
            "pinned_slots": len(self._pins),
            "held_slots": len(self._demoting),
            "leased_slots": sum(len(c.leased) for c in self._conns.values()),
            "counters": dict(self.counters),
            "namespaces": [
                {
                    "index": ns.index,
                    "name": ns.name,
                    "chunks": len(ns.ready),
                    "bytes": sum(ns.lengths.values()),
                    "writing": len(ns.writing),
                    "hits": ns.hits,
                    "misses": ns.misses,
                    "stored": ns.stored,
                    "adopted": ns.adopted,
                }
                for ns in self._namespaces.values()
            ],
            "engines": [
                {
                    "pid": conn.pid,
                    "uid": conn.uid,
                    "engine": conn.engine,
                    "namespaces": sorted(conn.attached),
                    "pins": sum(conn.pins.values()),
                    "lookups": conn.lookups,
                    "hits": conn.hits,
                    "stored": conn.stored,
                    "stored_bytes": conn.stored_bytes,
                    "reserved": len(conn.reserved),
                    "leased": len(conn.leased),
                }
                for conn in self._conns.values()
                if conn.attached
            ],
            "lower_tiers": [
                {"namespace": index, "tiers": lowers.state(), **lowers.counters()}
                for index, lowers in self._lowers.items()
            ],
            "lower_tiers_refused": {str(k): v for k, v in self._lower_refused.items()},
            "tenants": [
                {
                    "name": name,
                    "chunks": len(held),
                    "bytes": len(held) * self.pool.slot_bytes,
                    "quota_bytes": (None if name not in self._quota
                                    else self._quota[name] * self.pool.slot_bytes),
                    "protected_bytes": self._protected.get(name, 0) * self.pool.slot_bytes,
                    # Counted at the last quota pass of each namespace (summed).
                    "lower_bytes": {tier: self._lower_bytes(tier, name)
                                    for tier in self._lower_quota},
                    "lower_quota_bytes": {tier: quotas.get(name)
                                          for tier, quotas in self._lower_quota.items()},
                }
                for name, held in self._held.items()
            ],
            "retention": None if self._retention is None else self._retention.state(
                None if self._tenants is None else self._tenants.names),
        }
