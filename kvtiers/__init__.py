"""kvtiers: tiered KV-cache storage for LLM serving engines.

Importing this package stays light: numpy, xxhash and the standard library at most.
torch, boto3, kvikio, moto and matplotlib are imported only by the modules that use them.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
