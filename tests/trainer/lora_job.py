"""PipeTrainer (2 ranks) on LoRA models, for the comparison with plain `Trainer` in test_lora.py.

Every case of `lora_runs.CASES` in one launch. Per case, each rank writes ``OUTPUT/<case>/rank{r}.pt``:
the logged history, its parameters that had a gradient before an optimizer step and those the
optimizer holds (names, and how many have optimizer state), the largest change of any of its
frozen weights, its adapter weights and `evaluate()`'s metrics; rank 0 writes the folder
`save_model()` wrote into ``OUTPUT/<case>/model``.
``lora_runs.RESUMED`` is then trained again from its ``checkpoint-2`` into ``OUTPUT/<case>-resumed``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from lora_runs import CASES, RESUMED, setup


class GradientBuffers(TrainerCallback):
    """The names of this rank's parameters that hold a gradient before any optimizer step."""

    def __init__(self) -> None:
        self.trainer = None
        self.names: set[str] = set()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        params = self.trainer.engine.named_parameters()
        self.names |= {name for name, param in params if param.grad is not None}


def record(trainer, initial: dict[str, torch.Tensor], gradients: GradientBuffers) -> dict:
    """What this rank holds after training (see the module docstring)."""
    engine = trainer.engine
    params = dict(engine.named_parameters())
    frozen = [name for name, p in params.items() if not p.requires_grad]
    state = trainer.optimizer.state
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    return {
        "history": trainer.state.log_history,
        "with_grad": sorted(gradients.names),
        "in_optimizer": sorted(name for name, p in params.items() if id(p) in held),
        "with_state": sum(1 for p in params.values() if state.get(p)),
        "frozen": len(frozen),
        "frozen_change": max((params[n].detach() - initial[n]).abs().max().item() for n in frozen),
        "adapter": {name: p.detach().clone() for name, p in params.items() if p.requires_grad},
    }


def train(case: str, output: Path, resume: str | None = None) -> None:
    from hf_ftpipe import PipeTrainer

    parts = setup(case, str(output), pipe=True)
    initial = {name: p.detach().clone() for name, p in parts["model"].named_parameters()}
    gradients = GradientBuffers()
    trainer = PipeTrainer(**parts, callbacks=[gradients])
    gradients.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    result = record(trainer, initial, gradients)
    result["evaluate"] = trainer.evaluate()
    trainer.save_model(str(output / "model"))
    torch.save(result, output / f"rank{trainer.engine.rank}.pt")


def main(output_dir: str) -> None:
    for case in CASES:
        train(case, Path(output_dir) / case)
    resumed = Path(output_dir) / RESUMED
    train(RESUMED, Path(output_dir) / f"{RESUMED}-resumed", resume=str(resumed / "checkpoint-2"))


if __name__ == "__main__":
    main(*sys.argv[1:])
