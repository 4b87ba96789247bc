"""kvtiers: tiered KV-cache storage for LLM serving engines.

Importing this package stays light: numpy, xxhash and the standard library at most.
torch, boto3, kvikio, moto and matplotlib are imported only by the modules that use them.
``kvtiers.load_stack`` is resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__", "load_stack"]

if TYPE_CHECKING:
    from kvtiers.stack.builder import load_stack


def __getattr__(name: str) -> Any:
    if name == "load_stack":
        from kvtiers.stack.builder import load_stack

        return load_stack
    raise AttributeError(f"module 'kvtiers' has no attribute {name!r}")
