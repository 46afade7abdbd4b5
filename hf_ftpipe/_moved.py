"""Import paths of hf_ftpipe 0.1 that moved when the code took its package layout.

They keep working for this release: importing one gives a module that hands on the names of its
new home, with a ``FutureWarning`` naming that home. One table, so the next release drops them in
one place.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, tuple[str, ...]] = {
    "hf_ftpipe.partition": ("hf_ftpipe.partitioners", "hf_ftpipe.plan", "hf_ftpipe.costmodel", "hf_ftpipe.schedules"),
    "hf_ftpipe.partition.plan": ("hf_ftpipe.plan.partition", "hf_ftpipe.costmodel.prediction"),
    "hf_ftpipe.partition.validate": ("hf_ftpipe.plan.validate",),
    "hf_ftpipe.partition.estimate": ("hf_ftpipe.costmodel.estimate",),
    "hf_ftpipe.partition.memory_rules": ("hf_ftpipe.costmodel.memory_rules", "hf_ftpipe.schedules"),
    "hf_ftpipe.partition.registry": ("hf_ftpipe.partitioners.registry",),
    "hf_ftpipe.partition.auto": ("hf_ftpipe.partitioners.auto",),
    "hf_ftpipe.partition.baselines": ("hf_ftpipe.partitioners.baselines",),
    "hf_ftpipe.partition.seq_greedy": ("hf_ftpipe.partitioners.seq_greedy",),
    "hf_ftpipe.partition.seq_dp": ("hf_ftpipe.partitioners.seq_dp",),
    "hf_ftpipe.partition.mixed": ("hf_ftpipe.partitioners.mixed",),
    "hf_ftpipe.partition.catalog": ("hf_ftpipe.hub.catalog",),
    "hf_ftpipe.partition.setups": ("hf_ftpipe.hub.setups",),
    "hf_ftpipe.partition.report": ("hf_ftpipe.cli.format",),
    "hf_ftpipe.profile": ("hf_ftpipe.costmodel",),
    "hf_ftpipe.profile.gpu": ("hf_ftpipe.costmodel.profiles",),
    "hf_ftpipe.profile.cost": ("hf_ftpipe.costmodel.op_time",),
    "hf_ftpipe.runtime.schedule": ("hf_ftpipe.schedules",),
    "hf_ftpipe.training_args": ("hf_ftpipe.trainer.arguments",),
    "hf_ftpipe.checkpoint": ("hf_ftpipe.trainer.checkpoint_format", "hf_ftpipe.trainer.checkpoint_check"),
}
"""Old module → the modules whose names it hands on, searched in this order."""

_PACKAGES = {"hf_ftpipe.partition", "hf_ftpipe.partition.mixed", "hf_ftpipe.profile"}


class _Forwarder(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        homes = MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} moved to {' and '.join(homes)}; the old path goes away in the next release",
            FutureWarning,
            stacklevel=2,
        )
        targets = [importlib.import_module(home) for home in homes]

        def forward(name: str) -> object:
            for target in targets:
                if hasattr(target, name):
                    return getattr(target, name)
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

        module.__getattr__ = forward  # type: ignore[method-assign]


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Forwarder(), is_package=fullname in _PACKAGES)


def install() -> None:
    """Let the old paths resolve (idempotent)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
