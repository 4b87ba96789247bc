"""The one type of bytes-like arguments in kvtiers: :data:`Buffer`.

Anything that exposes contiguous bytes the way ``bytes``, ``bytearray`` and
``memoryview`` do; code that writes into one takes ``bytearray`` or ``memoryview``.
"""

from __future__ import annotations

from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview
