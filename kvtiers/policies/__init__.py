"""Eviction policies: ``lru``, ``arc`` and ``s3fifo`` behind one small interface.

A tier picks its policy by name from the YAML (``policy: arc``); a policy defined outside
kvtiers is loaded by dotted path (``policy: mypkg.policies:MyPolicy``). See
:mod:`kvtiers.policies.base` for the contract every policy keeps: a policy defined elsewhere
implements that key-based API. The CPU tier runs the three built-ins as their slot-indexed
twins (:mod:`kvtiers.policies.slots`, same victims, one hash table per chunk fewer) and any
other policy, a subclass of a built-in included, through its key-based methods.
"""

from kvtiers.policies.arc import ARCPolicy
from kvtiers.policies.base import BUILTIN_POLICIES, EvictionPolicy, load_policy
from kvtiers.policies.lru import LRUPolicy
from kvtiers.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "BUILTIN_POLICIES",
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "load_policy",
]
