"""A benchmark's checks against its targets: each a (name, verdict) pair, printed the same way by
every benchmark, and its exit status (1 when a check failed)."""

from __future__ import annotations

import time
from collections.abc import Sequence

Check = tuple[str, str]
"""(what is checked, verdict): ``PASS (figures)``, ``FAIL (figures)`` or ``n/a ...``."""


def verdict(ok: bool, figures: str) -> str:
    return f"{'PASS' if ok else 'FAIL'} ({figures})"


def failed(checks: Sequence[Check]) -> int:
    """How many of ``checks`` failed."""
    return sum(v.startswith("FAIL") for _, v in checks)


def print_checks(checks: Sequence[Check], started: float | None = None, indent: str = "") -> None:
    """Each check on a line, then (given the ``time.perf_counter()`` the run started at) its wall time."""
    for name, v in checks:
        print(f"{indent}check {name}: {v}")
    if started is not None:
        print(f"wall time {time.perf_counter() - started:.0f} s")
