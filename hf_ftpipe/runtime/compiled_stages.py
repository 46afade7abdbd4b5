"""`torch.compile` for one rank's stage modules (``torch_compile=True``), their names left as they are.

Each stage module is compiled in place (`nn.Module.compile`), the first time it runs: its
parameters and state dict keep the model's own names (no ``_orig_mod.`` prefix, as wrapping it in
``torch.compile(module)`` would give), so checkpoints, `gather_state_dict` and the streaming
schedules' `functional_call` see exactly the modules they see uncompiled. Every module a step may
run is compiled so, the same way: the rank's stages, the graphs traced per shape and the token
slices' variants.

Shapes: a stage graph traced with a symbolic batch and sequence (`hf_ftpipe.graph.dynamic_shapes`)
is compiled with ``dynamic=True``, so that a new length does not recompile; what still does is
dynamo's own specialisation of a size of 1 (a micro-batch of one row: one more graph per stage).
The inputs a stage takes from its copy of the batch are views of the batch (one micro-batch's
rows, `tensor_split`); they are passed as tensors of their own, since dynamo would otherwise guard
on the view's base, offset and strides and compile again for the next micro-batch. Evaluation
(no gradients) is one more graph per stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["CompileOptions", "StageCompiler"]


@dataclass(frozen=True)
class CompileOptions:
    """What ``torch.compile`` gets for each stage (`TrainingArguments`' ``torch_compile_*`` fields)."""

    backend: str = "inductor"
    """A backend `torch.compile` knows: ``inductor`` (needs a C++ compiler on CPU), ``aot_eager``, ``eager``..."""
    mode: str | None = None
    """``default``, ``reduce-overhead``, ``max-autotune``... (inductor's modes)."""


class StageCompiler:
    """Compiles the stage modules a rank runs, each once, and keeps the time dynamo spent on them.

    Args:
        options (`CompileOptions`): backend and mode.
        dynamic (`bool`): whether the stages were traced with symbolic sizes (``dynamic=True`` then;
            ``None``, dynamo's automatic choice, for a graph traced at fixed shapes).
    """

    def __init__(self, options: CompileOptions, dynamic: bool) -> None:
        self.options = options
        self.dynamic: bool | None = True if dynamic else None
        self.compile_time_s = 0.0
        """Seconds spent inside this rank's stage calls that compiled (dynamo, AOT autograd and the backend)."""
        self.graphs = 0
        """Graphs compiled for this rank's stages (a recompilation counts one more)."""
        self.reported = False
        """Whether the compile time was logged (`hf_ftpipe.trainer.compilation`)."""
        self._compiled: set[int] = set()

    def prepare(self, module: nn.Module) -> None:
        """Compile ``module`` in place unless it already is; its next call compiles its graph."""
        if id(module) in self._compiled:
            return
        module.compile(backend=self.options.backend, mode=self.options.mode, dynamic=self.dynamic)
        compiled = module._compiled_call_impl  # set by nn.Module.compile; __call__ runs it
        module._compiled_call_impl = self._measured(compiled)
        self._compiled.add(id(module))

    def _measured(self, compiled: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_fresh(a) for a in args)
            before = _frames_compiled()
            start = time.perf_counter()
            result = compiled(*args, **kwargs)
            added = _frames_compiled() - before
            if added:  # this call compiled: its time is (nearly all) compilation
                self.graphs += added
                self.compile_time_s += time.perf_counter() - start
            return result

        return call

    def summary(self) -> str:
        """E.g. ``torch.compile (backend 'inductor', mode None): 4 graphs compiled in 12.3 s``."""
        return (
            f"torch.compile (backend {self.options.backend!r}, mode {self.options.mode!r}, dynamic {self.dynamic}): "
            f"{self.graphs} graph{'' if self.graphs == 1 else 's'} of this rank's stages compiled in "
            f"{self.compile_time_s:.1f} s"
        )


def _fresh(value: Any) -> Any:
    """A tensor of its own: a micro-batch's rows are a view of the batch (the first at offset 0, the
    others further on), and dynamo guards on a view's base as on its offset and strides."""
    if isinstance(value, torch.Tensor) and (
        value._base is not None or value.storage_offset() or not value.is_contiguous()
    ):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _frames_compiled() -> int:
    """Graphs dynamo has compiled in this process (its own counter; 0 where a release lacks it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))
