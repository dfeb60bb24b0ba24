"""What /proc/cpuinfo says of this CPU (Linux), for the product kernels' choices (parallel.py, mkl_product.py)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache  # the CPU does not change
def cpuinfo_field(name: str) -> str:
    """The value of the first `name : value` line ("" where there is none, or no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""
