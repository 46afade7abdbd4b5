"""Package faces that import a name's module only when the name is first used.

The root package and ``graph`` name things whose modules pull in torch and transformers; the
planning packages (schedules, costmodel, plan, partitioners) must import without either, so a
face may not load them just to be imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that imports ``homes[name]`` (a module path) on first use of ``name``."""

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    return __getattr__
