"""The eviction-policy interface and the resolver that loads a policy by name or dotted path.

A policy orders the *evictable* keys of one tier and nothing else: the tier inserts a key
when its chunk becomes ready, touches it on use, refreshes it (recency without a use)
when the request that stored it ends, removes it when the chunk is dropped for
another reason, and asks for victims when it needs room. Invariants every policy keeps:

- a key is tracked once between :meth:`EvictionPolicy.insert` and its removal (by
  :meth:`~EvictionPolicy.remove` or by being returned from :meth:`~EvictionPolicy.evict`);
- :meth:`EvictionPolicy.evict` is atomic: it returns exactly ``n`` tracked, unprotected keys
  (and stops tracking them), or ``None`` and changes nothing;
- :meth:`EvictionPolicy.evictable` is the largest ``n`` for which ``evict`` succeeds with
  the same arguments.

Atomicity is enforced here, once: :meth:`EvictionPolicy.evict` checks that enough unprotected
keys exist before it calls the policy's own :meth:`EvictionPolicy._evict`, which may then
assume it will succeed.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable
from types import ModuleType
from typing import Any, ClassVar

from kvtiers.errors import ConfigError

BUILTIN_POLICIES = {
    "lru": "kvtiers.policies.lru:LRUPolicy",
    "arc": "kvtiers.policies.arc:ARCPolicy",
    "s3fifo": "kvtiers.policies.s3fifo:S3FIFOPolicy",
}
_DOTTED_CLASS = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class EvictionPolicy(ABC):
    """Orders a tier's evictable keys. ``capacity`` is the most keys the tier can hold.

    ``recency`` declares whether victims always come in least-recently-used order (what
    the conformance suite's LRU-order test expects). ``shields_request_head`` asks the tier
    to keep a running request's earlier keys (nearer its prompt's head) from that request's
    own later stores: a prompt longer than the room left keeps its head, which later
    prompts can reuse, instead of its tail, which none can without the head.
    """

    recency: bool = False
    shields_request_head: bool = False
    #: A built-in policy's slot-indexed twin (a ``kvtiers.policies.slots.SlotOrder``
    #: subclass, in the policy's own module), which a slot tier runs instead of an instance
    #: of exactly this class; ``None``: the tier runs the policy itself.
    slot_twin: ClassVar[type | None] = None

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a policy needs a positive capacity, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked (evictable) keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is tracked."""

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """Start tracking ``key`` (not tracked yet)."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """``key`` was used. Untracked keys are ignored."""

    def refresh(self, key: Hashable) -> None:
        """Make ``key`` the most recent of the keys it ranks with, without counting a use
        (a chunk a request stored and did not reuse). Untracked keys are ignored. The
        default does nothing: a policy without a recency order has nothing to move."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Stop tracking ``key`` without counting it as evicted. Untracked keys are ignored."""

    def evict(
        self, n: int, protected: Collection[Any] = (), shielded: Collection[Any] = ()
    ) -> list[Any] | None:
        """Exactly ``n`` victims, none of them in ``protected``, or ``None`` (no change).

        ``shielded`` names those of ``protected`` that the storing request itself holds (its
        prompt's head, see ``shields_request_head``): a policy may refuse to make room past
        them (ARC: it takes no ``T2`` key while ``T1`` is over its target and holds them).
        The default ignores it."""
        if n <= 0:
            return []
        # len(protected) bounds the protected keys tracked here: count them only when the
        # bound leaves the answer open.
        if len(self) - len(protected) < n:
            evictable = len(self) - sum(1 for key in set(protected) if key in self)
            if evictable < n:
                return None
        victims = self._evict(n, protected)
        assert len(victims) == n, f"{type(self).__name__} returned {len(victims)} of {n}"
        return victims

    def evictable(self, protected: Collection[Any] = (), shielded: Collection[Any] = ()) -> int:
        """The most victims one :meth:`evict` call with these arguments could take (how much
        of a batch fits when not all of it does). The default: every tracked key that is
        not protected."""
        return len(self) - sum(1 for key in set(protected) if key in self)

    @abstractmethod
    def _evict(self, n: int, protected: Collection[Any]) -> list[Any]:
        """Pick and stop tracking ``n`` unprotected keys; at least ``n`` exist."""


def policy_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a policy (neither builtin nor ``package.module:Class``),
    or ``None``. Imports nothing."""
    if name in BUILTIN_POLICIES or _DOTTED_CLASS.fullmatch(name):
        return None
    return (
        f"unknown eviction policy {name!r}; use one of {', '.join(BUILTIN_POLICIES)} "
        "or name a policy class as 'package.module:ClassName'"
    )


def load_policy(name: str) -> type[EvictionPolicy]:
    """The policy class called ``name``: ``lru``, ``arc``, ``s3fifo``, or
    ``"package.module:ClassName"`` for a policy defined elsewhere."""
    try:
        module, class_name = _import_module(name)
    except _PolicyImportError as exc:
        raise ConfigError(str(exc), path="policy") from exc.__cause__
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ConfigError(
            f"module {module.__name__!r} has no class {class_name!r}; name a policy class as "
            "'package.module:ClassName'",
            path="policy",
        )
    if not issubclass(cls, EvictionPolicy):
        raise ConfigError(
            f"{BUILTIN_POLICIES.get(name, name)!r} is not an EvictionPolicy subclass; a "
            "policy must subclass kvtiers.policies.EvictionPolicy",
            path="policy",
        )
    return cls


class _PolicyImportError(Exception):
    """A policy name that does not lead to a class (the message says why)."""


def _import_module(name: str) -> tuple[ModuleType, str]:
    """The module a policy name points into and the class name it gives."""
    problem = policy_name_problem(name)
    if problem is not None:
        raise _PolicyImportError(problem)
    module_name, _, class_name = BUILTIN_POLICIES.get(name, name).partition(":")
    try:
        return importlib.import_module(module_name), class_name
    except Exception as exc:  # a user's module may raise anything while it is imported
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise _PolicyImportError(
            f"cannot import module {module_name!r} for eviction policy {name!r} ({detail}); "
            "install it or fix the path"
        ) from exc
