"""The service's pool: one named shared-memory file of fixed-size slots with checked headers.

Layout (all integers little-endian, every part 4 KiB aligned)::

    superblock   4 KiB: magic, layout version, num_slots, slot_bytes, sizes of the parts
    namespaces   MAX_NAMESPACES entries of (state u32, pad u32, sha256 digest 32 bytes)
    mirror       buckets of WAYS entries of (slot i32 + 1, pad u32, tag 16 bytes)
    headers      one SLOT_HEADER-byte header per slot
    slots        num_slots * slot_bytes

A slot header is ``generation u64 | state u32 | namespace u32 | length u64 |
checksum 16 | tag 16 | digest 32 | key_len u32 | pad u32 | key (≤ MAX_KEY)``. Only the
service writes headers and the mirror (one thread); engines read them. A header is made
``READY`` last and made ``FREE`` or ``WRITING`` first, and its generation is bumped at
each change, so a reader that sees the same generation before and after reading state
and tag saw one consistent header.

Invariants the restart check (:meth:`Pool.adopt`) relies on: a ``READY`` header's
checksum is xxh3-128 over digest, key, length and the slot's first ``length`` bytes,
computed by the service when the store was committed; its tag is xxh3-128 over digest
and key; its digest is in the namespace table. Anything else is freed, never served.

Beside the pool file, :class:`IdentityRecords` keeps each namespace's identity (the table
holds digests only), for a restarted service to build its lower tiers at start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from kvtiers.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvtiers.service")

MAGIC = b"KVTPOOL\x01"
LAYOUT_VERSION = 1
PAGE = 4096
MAX_NAMESPACES = 256
NAMESPACE_ENTRY = 40
WAYS = 8
MIRROR_ENTRY = 24
SLOT_HEADER = 192
MAX_KEY = 96
DIGEST_BYTES = 32
#: The largest namespace identity record read back (an identity is a few KiB).
MAX_IDENTITY = 1 << 20

_SUPER = struct.Struct("<8sIIQQQQQ")
_NS = struct.Struct("<II32s")
_MIRROR = struct.Struct("<iI16s")
# generation, state, namespace, length, checksum, tag, digest, key_len, pad
_HEAD = struct.Struct("<QIIQ16s16s32sII")
_GEN = struct.Struct("<Q")
_STATE_TAG = struct.Struct("<QI12x16s16s")  # generation, state, (ns+length), checksum, tag
_KEY_AT = _HEAD.size
_STAMP = struct.Struct("<QI")


class SlotState(IntEnum):
    """A slot header's state."""

    FREE = 0
    WRITING = 1
    READY = 2


def _align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def tag_of(digest: bytes, key: bytes) -> bytes:
    """The 16-byte tag of ``key`` in the namespace of ``digest``: mirror entries and slot
    headers carry it, so a reader compares one field."""
    return xxhash.xxh3_128_digest(digest + key)


def checksum_of(digest: bytes, key: bytes, data: memoryview) -> bytes:
    """The checksum a ``READY`` header carries for ``data`` (the chunk's bytes)."""
    hasher = xxhash.xxh3_128()
    hasher.update(digest)
    hasher.update(key)
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)
    return hasher.digest()


@dataclass(frozen=True)
class Layout:
    """Where each part of a pool of ``num_slots`` slots of ``slot_bytes`` lies."""

    num_slots: int
    slot_bytes: int
    buckets: int = field(init=False)
    namespaces_at: int = field(init=False)
    mirror_at: int = field(init=False)
    headers_at: int = field(init=False)
    slots_at: int = field(init=False)
    total: int = field(init=False)

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.slot_bytes < 1 or self.slot_bytes % PAGE:
            raise ConfigError(
                f"a pool needs at least one slot of a multiple of {PAGE} bytes, got "
                f"{self.num_slots} slots of {self.slot_bytes}",
                path="capacity",
            )
        buckets = 1
        while buckets * WAYS < 2 * self.num_slots:
            buckets *= 2
        object.__setattr__(self, "buckets", buckets)
        namespaces_at = PAGE
        mirror_at = namespaces_at + _align(MAX_NAMESPACES * NAMESPACE_ENTRY)
        headers_at = mirror_at + _align(buckets * WAYS * MIRROR_ENTRY)
        slots_at = headers_at + _align(self.num_slots * SLOT_HEADER)
        object.__setattr__(self, "namespaces_at", namespaces_at)
        object.__setattr__(self, "mirror_at", mirror_at)
        object.__setattr__(self, "headers_at", headers_at)
        object.__setattr__(self, "slots_at", slots_at)
        object.__setattr__(self, "total", slots_at + self.num_slots * self.slot_bytes)

    def superblock(self) -> bytes:
        return _SUPER.pack(
            MAGIC, LAYOUT_VERSION, self.num_slots, self.slot_bytes, self.buckets,
            self.mirror_at, self.headers_at, self.slots_at,
        )

    @classmethod
    def read(cls, raw: bytes | memoryview) -> Layout:
        """The layout a superblock describes; :class:`ConfigError` if it is not one."""
        magic, version, num_slots, slot_bytes, buckets, mirror_at, headers_at, slots_at = (
            _SUPER.unpack_from(raw)
        )
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise ConfigError("not a kvtiers pool of this layout version", path="pool")
        layout = cls(num_slots, slot_bytes)
        if (layout.buckets, layout.mirror_at, layout.headers_at, layout.slots_at) != (
            buckets, mirror_at, headers_at, slots_at
        ):
            raise ConfigError("the pool's superblock is inconsistent", path="pool")
        return layout


@dataclass
class Adoption:
    """What :meth:`Pool.adopt` found: chunks kept per namespace index, and slots freed."""

    adopted: dict[int, list[int]] = field(default_factory=dict)
    #: Slots that were being written (or leased) when the last service stopped: a worker
    #: of an engine may still be copying into one, so they are reused last.
    unsettled: list[int] = field(default_factory=list)
    torn: int = 0
    corrupt: int = 0
    foreign: int = 0

    @property
    def total(self) -> int:
        return sum(map(len, self.adopted.values()))


def _refuse(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} {why}; the service maps only a regular file of this user (uid "
        f"{os.geteuid()}) without access for others. Remove it or choose another pool name",
        path="pool",
    )


class PoolView:
    """A mapping of a pool file: what engines read (mirror, headers) and copy (slots).

    Engines open it read-write (their workers write slots) but never write headers or
    the mirror. ``close`` unmaps; the file stays.
    """

    def __init__(self, path: Path, *, fd: int | None = None) -> None:
        self.path = path
        own_fd = fd is None
        if fd is None:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            #: The mapped file's identity: a pool re-made under the same name is another.
            self.file_id = (info.st_dev, info.st_ino)
            if not stat.S_ISREG(info.st_mode):
                raise _refuse(path, "is not a regular file")
            # An engine of the service's group maps the service's file (mode 0660).
            if info.st_uid != os.geteuid() and own_fd and not info.st_mode & stat.S_IRWXG:
                raise _refuse(path, f"is owned by uid {info.st_uid}")
            if stat.S_IMODE(info.st_mode) & 0o007:
                raise _refuse(path, f"has mode {stat.S_IMODE(info.st_mode):04o}")
            if info.st_size < PAGE:
                raise _refuse(path, "is too short to be a pool")
            head = os.pread(fd, PAGE, 0)
            self.layout = Layout.read(head)
            if info.st_size < self.layout.total:
                raise _refuse(path, "is shorter than its superblock says")
            self._mmap = mmap.mmap(fd, self.layout.total, mmap.MAP_SHARED)
        finally:
            if own_fd:
                os.close(fd)
        self.buffer = memoryview(self._mmap)
        layout = self.layout
        self._data = self.buffer[layout.slots_at : layout.total]
        self._tensor: torch.Tensor | None = None

    # -- HostRegion -----------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.layout.slot_bytes

    def view(self, slot_id: int) -> memoryview:
        """A writable, zero-copy view of slot ``slot_id`` (``slot_bytes`` long)."""
        if not 0 <= slot_id < self.layout.num_slots:
            raise IndexError(f"slot {slot_id} outside [0, {self.layout.num_slots})")
        start = slot_id * self.layout.slot_bytes
        return self._data[start : start + self.layout.slot_bytes]

    def tensor(self) -> torch.Tensor:
        """The slots as one flat ``torch.uint8`` tensor (zero-copy), slot 0 first: what
        the CPU tier's worker copies through."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self._data, dtype=torch.uint8)
        return self._tensor

    # -- reading --------------------------------------------------------------------
    def header_at(self, slot: int) -> int:
        return self.layout.headers_at + slot * SLOT_HEADER

    def find(self, tag: bytes) -> int:
        """The slot holding the chunk tagged ``tag`` in a consistent ``READY`` header, or
        -1. Reads only: the mirror is a hint checked against the header."""
        return self.locate(tag)[0]

    def locate(self, tag: bytes) -> tuple[int, int]:
        """``(slot, generation)`` of the chunk tagged ``tag`` as :meth:`find` finds it, or
        ``(-1, 0)``. The generation is the one a reader of the slot must see unchanged
        around its copy for the bytes to be that chunk's (the service bumps it at every
        change of the header, before the slot is handed to anyone else)."""
        layout = self.layout
        bucket = int.from_bytes(tag[:8], "little") & (layout.buckets - 1)
        start = layout.mirror_at + bucket * WAYS * MIRROR_ENTRY
        row = bytes(self.buffer[start : start + WAYS * MIRROR_ENTRY])
        at = row.find(tag)
        while at >= 0:
            if at % MIRROR_ENTRY == 8:
                slot = _MIRROR.unpack_from(row, at - 8)[0] - 1
                if 0 <= slot < layout.num_slots:
                    generation = self._ready_with(slot, tag)
                    if generation >= 0:
                        return slot, generation
            at = row.find(tag, at + 1)
        return -1, 0

    def _ready_with(self, slot: int, tag: bytes) -> int:
        """The header's generation if it is a consistent ``READY`` header tagged ``tag``,
        else -1."""
        at = self.header_at(slot)
        buffer = self.buffer
        generation, state, _, header_tag = _STATE_TAG.unpack_from(buffer, at)
        if (
            state == SlotState.READY
            and header_tag == tag
            and _GEN.unpack_from(buffer, at)[0] == generation
        ):
            return int(generation)
        return -1

    def generation(self, slot: int) -> int:
        return int(_GEN.unpack_from(self.buffer, self.header_at(slot))[0])

    def stamp(self, slot: int) -> tuple[int, int]:
        """``(generation, state)`` of ``slot``'s header. A reader that finds the
        generation it saw earlier, before its copy and again after it, knows the header
        (and the slot's owner) did not change in between."""
        generation, state = _STAMP.unpack_from(self.buffer, self.header_at(slot))
        return int(generation), int(state)

    def close(self) -> None:
        """Unmap (views handed out keep the mapping until they are collected)."""
        self._tensor = None
        self._data.release()
        self.buffer.release()
        with contextlib.suppress(BufferError):
            self._mmap.close()


class Pool(PoolView):
    """The service's read-write pool: creates or re-opens the file and writes headers,
    namespaces and the mirror. One thread only."""

    def __init__(self, path: Path, layout: Layout, *, group_access: bool = False,
                 fresh: bool = False) -> None:
        self.created = False
        mode = 0o660 if group_access else 0o600
        if fresh:
            path.unlink(missing_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = self._create(path, layout, mode)
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid():
                raise _refuse(path, f"is owned by uid {info.st_uid}")
            if stat.S_IMODE(info.st_mode) & ~mode & 0o777:
                raise _refuse(path, f"has mode {stat.S_IMODE(info.st_mode):04o}")
            super().__init__(path, fd=fd)
        finally:
            os.close(fd)
        if self.layout != layout:
            found = self.layout
            self.close()
            raise ConfigError(
                f"{path} holds a pool of {found.num_slots} slots of {found.slot_bytes} "
                f"bytes, not {layout.num_slots} of {layout.slot_bytes}: remove it or "
                "start with --fresh",
                path="pool",
            )

    def _create(self, path: Path, layout: Layout, mode: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode)
        try:
            os.fchmod(fd, mode)  # the umask may have cut the group bits
            os.ftruncate(fd, layout.total)
            # The superblock last: a file cut short by a crash here is refused, not read.
            os.pwrite(fd, layout.superblock(), 0)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self.created = True
        return fd

    # -- namespaces -----------------------------------------------------------------
    def namespaces(self) -> Iterator[tuple[int, bytes]]:
        """``(index, digest)`` of every namespace in the table."""
        base = self.layout.namespaces_at
        for index in range(MAX_NAMESPACES):
            state, _, digest = _NS.unpack_from(self.buffer, base + index * NAMESPACE_ENTRY)
            if state == 1:
                yield index, bytes(digest)

    def add_namespace(self, digest: bytes) -> int:
        """The table index of ``digest``, added if new; :class:`ConfigError` when full."""
        free = -1
        for index, known in self.namespaces():
            if known == digest:
                return index
        base = self.layout.namespaces_at
        for index in range(MAX_NAMESPACES):
            if _NS.unpack_from(self.buffer, base + index * NAMESPACE_ENTRY)[0] != 1:
                free = index
                break
        if free < 0:
            raise ConfigError(f"the pool holds {MAX_NAMESPACES} namespaces already",
                              path="pool")
        _NS.pack_into(self.buffer, base + free * NAMESPACE_ENTRY, 1, 0, digest)
        return free

    # -- headers --------------------------------------------------------------------
    def set_writing(self, slot: int) -> None:
        """Mark ``slot`` as being written (its previous chunk, if any, is gone)."""
        at = self.header_at(slot)
        generation = _GEN.unpack_from(self.buffer, at)[0] + 1
        struct.pack_into("<QI", self.buffer, at, generation, SlotState.WRITING)

    def set_free(self, slot: int) -> None:
        at = self.header_at(slot)
        generation = _GEN.unpack_from(self.buffer, at)[0] + 1
        struct.pack_into("<QI", self.buffer, at, generation, SlotState.FREE)

    def set_ready(self, slot: int, namespace: int, digest: bytes, key: bytes,
                  length: int) -> bytes:
        """Checksum ``length`` bytes of ``slot`` and publish it as ``key``'s chunk; returns
        the tag. The state is written last, so a crash before it leaves a non-ready slot."""
        at = self.header_at(slot)
        buffer = self.buffer
        checksum = checksum_of(digest, key, self.view(slot)[:length])
        tag = tag_of(digest, key)
        generation = _GEN.unpack_from(buffer, at)[0]
        _HEAD.pack_into(buffer, at, generation, SlotState.WRITING, namespace, length,
                        checksum, tag, digest, len(key), 0)
        buffer[at + _KEY_AT : at + _KEY_AT + len(key)] = key
        struct.pack_into("<QI", buffer, at, generation + 1, SlotState.READY)
        return tag

    def header(self, slot: int) -> tuple[int, int, int, int, bytes, bytes, bytes, bytes]:
        """``(generation, state, namespace, length, checksum, tag, digest, key)``."""
        at = self.header_at(slot)
        generation, state, namespace, length, checksum, tag, digest, key_len, _ = (
            _HEAD.unpack_from(self.buffer, at)
        )
        key_len = min(key_len, MAX_KEY)
        key = bytes(self.buffer[at + _KEY_AT : at + _KEY_AT + key_len])
        return generation, state, namespace, length, checksum, tag, digest, key

    # -- mirror ---------------------------------------------------------------------
    def _row(self, tag: bytes) -> int:
        bucket = int.from_bytes(tag[:8], "little") & (self.layout.buckets - 1)
        return self.layout.mirror_at + bucket * WAYS * MIRROR_ENTRY

    def mirror_add(self, tag: bytes, slot: int) -> bool:
        """Enter ``tag`` → ``slot``; ``False`` when the bucket is full (lookups then miss
        the chunk: the mirror is a hint)."""
        start = self._row(tag)
        for way in range(WAYS):
            at = start + way * MIRROR_ENTRY
            if _MIRROR.unpack_from(self.buffer, at)[0] == 0:
                # The tag first, the slot last: a reader sees no slot or the whole entry.
                self.buffer[at + 8 : at + 24] = tag
                struct.pack_into("<i", self.buffer, at, slot + 1)
                return True
        return False

    def mirror_remove(self, tag: bytes, slot: int) -> None:
        start = self._row(tag)
        for way in range(WAYS):
            at = start + way * MIRROR_ENTRY
            if _MIRROR.unpack_from(self.buffer, at)[0] == slot + 1:
                struct.pack_into("<i", self.buffer, at, 0)
                return

    def clear_mirror(self) -> None:
        layout = self.layout
        size = layout.buckets * WAYS * MIRROR_ENTRY
        self.buffer[layout.mirror_at : layout.mirror_at + size] = bytes(size)

    # -- restart --------------------------------------------------------------------
    def adopt(self) -> Adoption:
        """Check every slot of a re-opened pool and keep the completely stored chunks of
        known namespaces: ``READY`` header, key length in range, digest in the namespace
        table at the header's index, tag and checksum as recomputed. Every other slot is
        made ``FREE`` and counted (``torn``: not ready or no key; ``foreign``: namespace
        not in the table; ``corrupt``: tag or checksum differs). Rebuilds the mirror."""
        found = Adoption()
        table = dict(self.namespaces())
        self.clear_mirror()
        for slot in range(self.layout.num_slots):
            generation, state, namespace, length, checksum, tag, digest, key = (
                self.header(slot)
            )
            if state == SlotState.FREE and generation == 0:
                continue
            if state != SlotState.READY or not key:
                if state != SlotState.FREE:
                    found.torn += 1
                    found.unsettled.append(slot)
                self.set_free(slot)
                continue
            if table.get(namespace) != digest:
                found.foreign += 1
                self.set_free(slot)
                continue
            if (
                length > self.layout.slot_bytes
                or tag_of(digest, key) != tag
                or checksum_of(digest, key, self.view(slot)[:length]) != checksum
            ):
                found.corrupt += 1
                self.set_free(slot)
                continue
            self.mirror_add(tag, slot)
            found.adopted.setdefault(namespace, []).append(slot)
        return found


class RecordDamaged(Exception):
    """A namespace's identity record that cannot be used (unreadable, not a regular file
    of this user, over the bound, or not the identity of its digest)."""


class IdentityRecords:
    """Each namespace's identity (the canonical JSON an engine attached with), kept in a
    directory beside the pool: ``<pool file>.identities/<sha256 hex>.json``.

    The pool's namespace table keeps only digests; the lower tiers' factories need the
    identity itself. A record is written whole or not at all (a temporary file renamed
    over it) and read back only if it is a regular file of this user whose sha256 is the
    digest it is filed under: anything else is :class:`RecordDamaged`, and that
    namespace's lower tiers wait for its next attach (which writes the record anew).
    The directory is the service's alone (mode 0700); engines never read it."""

    def __init__(self, pool_path: Path) -> None:
        self.directory = pool_path.with_name(pool_path.name + ".identities")

    def _path(self, digest: bytes) -> Path:
        return self.directory / f"{digest.hex()}.json"

    def _ensure_directory(self) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        info = self.directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise OSError(f"{self.directory} is not a directory of this user")

    def write(self, identity: bytes) -> None:
        """Keep ``identity`` under its digest (replacing any record there); ``OSError``
        when the directory cannot be used."""
        self._ensure_directory()
        path = self._path(hashlib.sha256(identity).digest())
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(identity)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def read(self, digest: bytes) -> bytes | None:
        """The identity filed under ``digest``; ``None`` when there is no record,
        :class:`RecordDamaged` when there is one that cannot be used."""
        path = self._path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RecordDamaged(f"{path}: {exc}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise RecordDamaged(f"{path} is not a regular file of this user")
            if info.st_size > MAX_IDENTITY:
                raise RecordDamaged(f"{path} is over {MAX_IDENTITY} bytes")
            identity = os.read(fd, MAX_IDENTITY + 1)
        except OSError as exc:
            raise RecordDamaged(f"{path}: {exc}") from None
        finally:
            os.close(fd)
        if hashlib.sha256(identity).digest() != digest:
            raise RecordDamaged(f"{path} does not hold the identity of its digest")
        return identity

    def prune(self, keep: Collection[bytes]) -> None:
        """Remove the records of namespaces not in ``keep`` (digests): a pool made anew
        (``--fresh``) starts with an empty table."""
        names = {f"{digest.hex()}.json" for digest in keep}
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return
        for entry in entries:
            if entry.name not in names:
                try:
                    entry.unlink()
                except OSError as exc:
                    log.warning("kvtiers serve: could not remove %s: %s", entry, exc)
