"""Offload keys: raw bytes of a chained block hash followed by a 4-byte group index.

Keys are bytes rather than tuples so millions of them stay cheap to hash and hold. Managers
treat them as opaque; only workers and movers decode the group to size a chunk.
:class:`KeyFormat` is the door the public API checks keys at (type, length, group range),
so a bad key is refused with its name before any tier's state changes.
"""

from __future__ import annotations

from typing import NewType

from kvtiers.errors import InvalidKeyError

OffloadKey = NewType("OffloadKey", bytes)

GROUP_INDEX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an :data:`OffloadKey`."""
    if not 0 <= group_idx < 2**32:
        raise ValueError(f"group index must be in [0, 2**32), got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(GROUP_INDEX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of a key."""
    return key[:-GROUP_INDEX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of a key."""
    return int.from_bytes(key[-GROUP_INDEX_BYTES:], "big")


#: Digest bytes of the hash algorithms kvtiers implements (``OffloadingConfig.hash_algorithm``).
DIGEST_BYTES = {"xxh3_128": 16, "sha256": 32}


class KeyFormat:
    """The keys one cache accepts: ``bytes`` of one length whose group is in range.

    ``hash_bytes`` is the block-hash length; ``None`` (an engine's own hash, whose length
    kvtiers does not know) takes it from the first key checked, as all keys of one engine
    share it. :meth:`check` is the public API's door: it is on the scheduler's hot path, so
    it does only a type test, a length test and one 4-byte comparison per key.
    """

    __slots__ = ("group_limit", "key_bytes", "num_groups")

    def __init__(self, num_groups: int, hash_bytes: int | None = None) -> None:
        if not 0 < num_groups <= 2**32:
            raise ValueError(f"num_groups must be in [1, 2**32], got {num_groups}")
        if hash_bytes is not None and hash_bytes <= 0:
            raise ValueError(f"hash_bytes must be positive, got {hash_bytes}")
        self.num_groups = num_groups
        self.key_bytes = None if hash_bytes is None else hash_bytes + GROUP_INDEX_BYTES
        #: The first 4-byte group suffix out of range (``None``: any group is), big-endian,
        #: so comparing a key's suffix with it as bytes compares the numbers.
        self.group_limit = (
            None if num_groups == 2**32 else num_groups.to_bytes(GROUP_INDEX_BYTES, "big")
        )

    @classmethod
    def for_algorithm(cls, num_groups: int, algorithm: str) -> KeyFormat:
        """The format of keys hashed with ``algorithm`` (an engine's own ``"<engine>:..."``
        algorithm learns its length from the first key)."""
        return cls(num_groups, DIGEST_BYTES.get(algorithm))

    def check(self, key: object, where: str) -> None:
        """Raise :class:`~kvtiers.errors.InvalidKeyError` naming ``key`` and ``where``
        unless ``key`` is one of this cache's keys."""
        if type(key) is bytes and len(key) == self.key_bytes and (
            self.group_limit is None or key[-GROUP_INDEX_BYTES:] < self.group_limit
        ):
            return
        self._reject(key, where)

    def check_all(self, keys: object, where: str) -> None:
        """:meth:`check` every key of the collection ``keys``, before anything uses one."""
        # A list (the usual batch) skips the two slower tests.
        if type(keys) is not list and (
            isinstance(keys, (bytes, str)) or not hasattr(keys, "__iter__")
        ):
            raise InvalidKeyError(
                f"{where}: expected a collection of keys, got {type(keys).__name__}"
            )
        size = self.key_bytes
        limit = self.group_limit
        for key in keys:
            if type(key) is not bytes or len(key) != size or (
                limit is not None and key[-GROUP_INDEX_BYTES:] >= limit
            ):
                self._reject(key, where)
                size = self.key_bytes

    def _reject(self, key: object, where: str) -> None:
        if type(key) is not bytes:
            shown = repr(key) if len(repr(key)) <= 80 else repr(key)[:77] + "..."
            raise InvalidKeyError(
                f"{where}: a key must be bytes (block hash + 4-byte group index), got "
                f"{type(key).__name__} {shown}"
            )
        if self.key_bytes is None:
            if len(key) <= GROUP_INDEX_BYTES:
                raise InvalidKeyError(
                    f"{where}: key {key.hex()} is {len(key)} bytes, too short for a block "
                    "hash + 4-byte group index"
                )
            self.key_bytes = len(key)
        if len(key) != self.key_bytes:
            raise InvalidKeyError(
                f"{where}: key {key[:48].hex()}{'...' if len(key) > 48 else ''} is "
                f"{len(key)} bytes; this cache's keys are {self.key_bytes} (a "
                f"{(self.key_bytes or 0) - GROUP_INDEX_BYTES}-byte block hash + 4-byte group)"
            )
        if self.group_limit is None or key[-GROUP_INDEX_BYTES:] < self.group_limit:
            return  # one of ours: the first key, which set the length
        group = get_offload_group_idx(OffloadKey(key))
        raise InvalidKeyError(
            f"{where}: key {key.hex()} names KV-cache group {group}; "
            f"this cache has groups 0..{self.num_groups - 1}"
        )
