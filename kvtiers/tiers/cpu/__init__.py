"""The CPU tier: the primary tier, in host memory (see docs/architecture.md).

``region`` holds the bytes (one mmap of fixed-size slots, optionally in ``/dev/shm`` and
pinned for CUDA), ``manager`` the bookkeeping (slot states, pins, the eviction policy),
``worker`` the GPU ⇄ CPU copies and ``factory`` builds all three from the YAML config.
Importing this package does not import torch.
"""

from kvtiers.tiers.cpu.factory import build_tier
from kvtiers.tiers.cpu.manager import CpuTierManager, SlotState
from kvtiers.tiers.cpu.region import SlotRegion

__all__ = ["CpuTierManager", "SlotRegion", "SlotState", "build_tier"]
