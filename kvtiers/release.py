"""The kvtiers release: a leaf every floor may import (the package's top level re-exports
it as ``kvtiers.__version__``; a module below the top reads it here, never from the top,
which imports every floor)."""

__version__ = "0.1.0"
