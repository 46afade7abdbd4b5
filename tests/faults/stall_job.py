"""A PipeTrainer job on a tiny GPT-2 in which one rank stops dead (SIGSTOP), or fails, at a chosen moment.

``stall_job.py OUTPUT WHERE RANK TIMEOUT_S``: rank RANK stops itself at WHERE: ``step`` (the end of step 2),
``eval`` (after the first evaluation batch), ``save`` (inside the first checkpoint save, before
writing its optimizer state) or ``tied`` (in step 2, as it joins the reduction of the tied
weight's gradients). Or it raises, with ``fail-save`` (no space left on the disk while it writes
its optimizer state into the first checkpoint), and then lingers as a process that caught the
error would. Each rank writes its pid to ``OUTPUT/pid{rank}``; the stopping rank writes
``OUTPUT/stopped`` just before it stops or once it failed. The other rank must stop on its own,
within ``pipeline_timeout_s`` (TIMEOUT_S), naming rank RANK (see `test_stalled_rank.py`, which picks
both).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import TrainerCallback

from hf_ftpipe import PipeTrainer, PipeTrainingArguments

from models import tiny_batch, tiny_model


def stop(output_dir: str) -> None:
    (Path(output_dir) / "stopped").write_text("")
    os.kill(os.getpid(), signal.SIGSTOP)


class StopAtStepEnd(TrainerCallback):
    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            stop(self.output_dir)


class StopDuringEvaluation(TrainerCallback):
    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stop(self.output_dir)


class StopDuringSave(PipeTrainer):
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        stop(self.args.output_dir)
        super()._save_optimizer_and_scheduler(output_dir)


class StopInTiedReduction(PipeTrainer):
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.state.global_step == 1:  # the pipeline exists: the step's reduction is the next one
            sync = self.engine.weight_sync
            reduce = sync.sum_tied_gradients

            def stopping(params: Any) -> None:
                stop(self.args.output_dir)
                reduce(params)

            sync.sum_tied_gradients = stopping
        return super().training_step(*args, **kwargs)


class DiskFullDuringSave(PipeTrainer):
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{output_dir}/optimizer/rank{self.engine.rank}.json")


FAULTS = {
    "save": StopDuringSave,
    "tied": StopInTiedReduction,
    "fail-save": DiskFullDuringSave,
}


def main(output_dir: str, where: str, stalling_rank: int, timeout_s: int) -> None:
    args = PipeTrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_microbatches=2,
        max_steps=4,
        logging_steps=1,
        eval_strategy="steps" if where == "eval" else "no",
        eval_steps=2,
        save_strategy="steps" if where in ("save", "fail-save") else "no",
        save_steps=2,
        report_to="none",
        pipeline_timeout_s=timeout_s,
    )
    rank = args.process_index
    (Path(output_dir) / f"pid{rank}").write_text(str(os.getpid()))
    data = tiny_batch("gpt2", 24, seed=1)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    stalls = rank == stalling_rank
    trainer_class = FAULTS.get(where, PipeTrainer) if stalls else PipeTrainer
    callbacks = []
    if stalls and where == "step":
        callbacks.append(StopAtStepEnd(output_dir))
    if stalls and where == "eval":
        callbacks.append(StopDuringEvaluation(output_dir))
    trainer = trainer_class(
        model=tiny_model("gpt2"), args=args, train_dataset=dataset, eval_dataset=dataset, callbacks=callbacks
    )
    try:
        trainer.train()
    except OSError:
        if not stalls:
            raise
        (Path(output_dir) / "stopped").write_text("")
        time.sleep(120)  # a process that caught the error and goes on: the other rank must not wait for it


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
