"""Checks of the plain numbers a hardware description holds (GPU profiles, links, topologies).

One home for both `profiles` and `topology`: each raises `ProfileError` naming the field, the value
and what a valid one looks like.
"""

from __future__ import annotations

import math

from hf_ftpipe.errors import ProfileError

__all__ = ["check_float", "check_int", "check_str"]


def check_str(name: str, value: object) -> None:
    """``value`` is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ProfileError(f"`{name}` must be a non-empty string, got {value!r}")


def check_int(name: str, value: object) -> None:
    """``value`` is a positive integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"`{name}` must be an integer, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ProfileError(f"`{name}` must be positive, got {value!r}; give a count or size > 0")


def check_float(name: str, value: object, allow_zero: bool = False) -> None:
    """``value`` is a finite number > 0 (>= 0 with ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProfileError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ProfileError(f"`{name}` must be a finite number {bound}, got {value!r}")
