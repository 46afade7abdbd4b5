"""``torch_compile=True``: the options each rank compiles its stages with, and the one log line of their cost.

`Trainer` compiles the whole model (accelerate's ``torch.compile(model)``); a pipeline never calls
the whole model, so each rank compiles the stage modules it runs instead
(`hf_ftpipe.runtime.compiled_stages`), with the same ``torch_compile_backend`` and
``torch_compile_mode``. Compilation happens in the first step's forwards; rank 0 then logs, once,
how long its stages took to compile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_ftpipe.runtime.compiled_stages import CompileOptions
from hf_ftpipe.trainer.run_log import get_logger

if TYPE_CHECKING:
    from transformers import TrainingArguments

    from hf_ftpipe.runtime.engine import PipelineEngine

__all__ = ["report_compilation", "stage_compile_options"]

logger = get_logger(__name__)


def stage_compile_options(args: TrainingArguments) -> CompileOptions | None:
    """The stages' ``torch.compile`` options from ``args`` (`TrainingArguments` fills in the backend,
    ``inductor`` by default, whenever ``torch_compile`` is set); ``None`` without ``torch_compile``."""
    if not args.torch_compile:
        return None
    return CompileOptions(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)


def report_compilation(engine: PipelineEngine) -> None:
    """After a training step: rank 0 logs, the first time only, what compiling its stages cost."""
    compiler = engine.compiler
    if compiler is None or compiler.reported:
        return
    compiler.reported = True
    if engine.rank == 0:
        logger.info("%s (rank 0; the first step's forwards)", compiler.summary())
