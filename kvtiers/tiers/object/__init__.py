"""The logic shared by the object tiers (``s3``, ``fsspec``): a small object-store
interface, the namespace backend, the manager, the mover and the retry policy. Each
object tier only adds an :class:`ObjectStore` adapter and a factory."""

from kvtiers.tiers.object.backend import ObjectBackend
from kvtiers.tiers.object.manager import ObjectTierManager
from kvtiers.tiers.object.mover import ObjectMover
from kvtiers.tiers.object.retry import Retrier
from kvtiers.tiers.object.store import ObjectInfo, ObjectMissing, ObjectStore

__all__ = [
    "ObjectBackend",
    "ObjectInfo",
    "ObjectMissing",
    "ObjectMover",
    "ObjectStore",
    "ObjectTierManager",
    "Retrier",
]
