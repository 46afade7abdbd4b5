"""Byte units and the one way hf_ftpipe writes a size for people: ``"11.00 GiB"``.

Plain Python (no torch), so the planning packages, the hub and the command line share it.
"""

from __future__ import annotations

import math

GiB = 2**30
MiB = 2**20


def format_bytes(num_bytes: float) -> str:
    """``"11.00 GiB"``, ``"512.0 MiB"``, or exact ``"48 bytes"`` below a MiB (toy graphs)."""
    if num_bytes >= GiB:
        return f"{num_bytes / GiB:.2f} GiB"
    if num_bytes >= MiB:
        return f"{num_bytes / MiB:.1f} MiB"
    return f"{math.ceil(num_bytes)} bytes"
