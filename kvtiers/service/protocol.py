"""The service's wire format: msgspec msgpack messages framed by a 4-byte length.

Every request carries a ``seq`` the reply echoes. A request is one of the ``Request``
structs (a tagged union: ``["Reserve", seq, ...]`` on the wire); a reply is one of the
``Reply`` structs. Decoding checks shape and types, so a message of the wrong shape is
a :class:`ProtocolError`, never a half-applied call. msgspec is imported here, and this
module only by the service and its client (the ``service`` extra).
"""

from __future__ import annotations

import struct
from typing import Any, Union

import msgspec

#: A frame's length prefix.
FRAME = struct.Struct("<I")
#: The default bound of one frame's payload (the service's ``max_frame``).
MAX_FRAME = 1 << 20


class ProtocolError(Exception):
    """A message that is not a well-formed request or reply."""


class _Msg(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    seq: int


#: The wire format's version: an engine attaches only to a service that speaks the same
#: one (1: the format before it was versioned, whose Attach had no ``protocol``).
#: Raised with every change of a message's shape or a new message.
PROTOCOL = 2


class Attach(_Msg):
    """Attach a namespace: ``identity`` is the cache identity's canonical JSON (the
    service takes its sha256 itself); ``chunk_bytes`` the engine's largest chunk;
    ``protocol`` the engine's :data:`PROTOCOL`."""

    identity: bytes
    chunk_bytes: int
    engine: str = ""
    protocol: int = 1


class Reserve(_Msg):
    """Slots for ``keys`` of namespace ``ns``; keys present or being written get none."""

    ns: int
    keys: list[bytes]


class Lease(_Msg):
    """``count`` slots for this connection to store into without a round trip per store
    (their keys are named at :class:`Commit`)."""

    ns: int
    count: int


class Commit(_Msg):
    """Finish stores: ``slots[i]`` (reserved for ``keys[i]`` or leased by this
    connection) holds ``keys[i]``, ``lengths[i]`` bytes long, when ``ok``; else reserved
    slots are dropped and leased ones stay leased. The reply's ``slots[i]``: 1 stored,
    0 not stored and still leased (the key was stored meanwhile: held once), -1 dropped."""

    ns: int
    keys: list[bytes]
    slots: list[int]
    lengths: list[int]
    ok: bool = True


class Pin(_Msg):
    """Pin ``slots[i]`` if it still holds ``keys[i]`` (advisory: eviction skips a pinned
    slot; a load's correctness comes from its worker's header check). The reply names
    each slot pinned, or -1 where the key is no longer in that slot."""

    ns: int
    keys: list[bytes]
    slots: list[int]


class Unpin(_Msg):
    """Drop one of this connection's pins of each of ``slots``; a slot it holds no pin
    of (its :class:`Pin` found the key gone) is skipped."""

    ns: int
    slots: list[int]


class Lookup(_Msg):
    """Which of ``keys`` are held: each key's slot, or -1."""

    ns: int
    keys: list[bytes]


class Probe(_Msg):
    """Ask the tiers below the pool for ``keys`` that missed the pool's mirror; the
    reply's ``slots[i]``: :data:`PROBE_HIT` (in the pool now), :data:`PROBE_PENDING`
    (being promoted or written into it), :data:`PROBE_RETRY` (ask again: a lower tier is
    still indexing or being built), :data:`PROBE_MISS` (held nowhere). A lower-tier hit
    starts its promotion into the pool."""

    ns: int
    keys: list[bytes]


class Report(_Msg):
    """The engine's own counts for namespace ``ns`` since the engine started:
    ``lookups`` it answered from the pool's mirror (no round trip reaches the service
    for them) and ``hits`` among them. Totals, not increments, so a write lost with a
    restarted service loses nothing."""

    ns: int
    lookups: int
    hits: int


#: A :class:`Probe`'s answer per key (its reply's ``slots[i]``).
PROBE_MISS, PROBE_PENDING, PROBE_RETRY, PROBE_HIT = 0, 1, 2, 3


class Retain(_Msg):
    """Retention hints for ``keys`` (docs/retention.md): each takes ``priority``, is
    pinned for ``pin_s`` seconds and expires ``ttl_s`` seconds from when the service
    takes the message in (``None``: no pin, no expiry). The hint fields are checked by
    the service, not by decoding: a value of the wrong type or out of its bounds, or
    more than :data:`MAX_RETAIN_KEYS` keys, has the hint ignored (counted, with a
    rate-limited warning), never the connection refused. The reply is :class:`Done`.
    An engine sends it only to a service whose status has a ``retention`` entry (a
    service of an earlier release would refuse the message)."""

    ns: int
    keys: list[bytes]
    priority: Any = 0
    pin_s: Any = None
    ttl_s: Any = None


#: The most keys one :class:`Retain` names (more: the hint is ignored).
MAX_RETAIN_KEYS = 4096


class Status(_Msg):
    """The service's state (as ``kvtiers status`` shows it)."""


Request = Union[  # noqa: UP007
    Attach, Reserve, Lease, Commit, Pin, Unpin, Lookup, Probe, Report, Retain, Status,
]


class Attached(_Msg):
    """Reply to :class:`Attach`: the namespace handle and where the pool is."""

    ns: int
    pool: str
    num_slots: int
    slot_bytes: int
    epoch: int
    #: How many tiers the service runs below the pool for this namespace (0: a lookup
    #: that misses the pool is a miss; else the engine probes them, :class:`Probe`).
    lower: int = 0


class Slots(_Msg):
    """Reply to :class:`Reserve`, :class:`Lease`, :class:`Pin`, :class:`Lookup`: one slot
    per key (-1: none); to :class:`Commit`: one outcome per key; to :class:`Probe`: one
    answer per key."""

    slots: list[int]


class Done(_Msg):
    """Reply to :class:`Unpin` and :class:`Retain`."""


class StatusReply(_Msg):
    state: dict[str, Any]


class Error(_Msg):
    """The request was refused; the service closes the connection after sending it."""

    message: str


Reply = Union[Attached, Slots, Done, StatusReply, Error]  # noqa: UP007

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


def frame(message: msgspec.Struct) -> bytes:
    """``message`` encoded, with its length prefix."""
    payload = _encoder.encode(message)
    return FRAME.pack(len(payload)) + payload


def decode_request(payload: bytes | memoryview) -> Request:
    try:
        return _requests.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)) from None


def decode_reply(payload: bytes | memoryview) -> Reply:
    try:
        return _replies.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)) from None
