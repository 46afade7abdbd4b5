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
Evaluation (no gradients) is one more graph per stage. The micro-batches' inputs (views of the
batch, `tensor_split`) compile no more graphs than tensors of their own would (checked on tiny
GPT-2: 4 graphs per stage either way).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


def _frames_compiled() -> int:
    """Graphs dynamo has compiled in this process (its own counter; 0 where a release lacks it)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))
