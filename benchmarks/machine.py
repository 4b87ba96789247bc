"""The machine note every benchmark records beside its results."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cores() -> str:
    return str(os.cpu_count())


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``"a, b, c"``."""
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())
