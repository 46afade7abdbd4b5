"""Masked-LM training with a random collator, under `accelerate launch` (2 ranks), for `test_same_batch.py`.

Three runs in one launch, each a fresh PipeTrainer on a tiny BERT with Hugging Face's
`DataCollatorForLanguageModeling` (masks drawn from torch's global generator):

- ``digests``: dropout 0.1, 100 steps; every rank records the digest of every batch it trained on.
- ``workers``: the same with two data loader workers, which collate in their own processes.
- ``losses``: dropout 0 (the model draws nothing random): the logged losses, for the comparison
  with plain `Trainer` in the test process; it saves a checkpoint every 4 steps.
- ``resumed``: the same run resumed from its ``checkpoint-4`` (mid-epoch: the data loader had
  collated batch 5 already), for the comparison with the uninterrupted run.
- ``seeds``: each rank shuffles with its own ``data_seed``; the error each rank raised.
- ``small_eval``: an evaluation set of one sample, fewer than a micro-batch: `evaluate()` before
  `train()` (the pipeline is traced on it), then after.
- ``seeded``: run_mlm.py's collator with ``seed=`` (a generator of its own), `evaluate()`, `train()`,
  `evaluate()`, `predict()`, with eval batches of 3 rows against 4 micro-batches.

Each rank writes ``OUTPUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.errors import PipelineError

from mlm_runs import (
    DIGEST_STEPS,
    LOSS_STEPS,
    SEEDED_EVAL_ROWS,
    SEEDED_OVERRIDES,
    arguments,
    dataset,
    evaluate_train_evaluate,
    evaluate_train_predict,
    model,
    seeded_collator,
    tokenizer,
)


class RecordingTrainer(PipeTrainer):
    """Records the digest of each batch this rank trained on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.digests: list[str] = []

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.digests.append(self.batch_digest)
        return loss


def make_trainer(
    output_dir: str, dropout: float, steps: int, collator: Any = None, eval_rows: int = 1, **overrides: Any
) -> RecordingTrainer:
    return RecordingTrainer(
        model=model(dropout),
        args=PipeTrainingArguments(**arguments(output_dir, steps, **overrides)),
        train_dataset=dataset(),
        eval_dataset=dataset(rows=eval_rows),
        data_collator=collator or DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.25),
    )


def train(output_dir: str, dropout: float, steps: int, **overrides: Any) -> RecordingTrainer:
    trainer = make_trainer(output_dir, dropout, steps, **overrides)
    trainer.train()
    return trainer


def main(output_dir: str) -> None:
    digests = train(output_dir, dropout=0.1, steps=DIGEST_STEPS).digests
    worker_digests = train(output_dir, dropout=0.1, steps=LOSS_STEPS, dataloader_num_workers=2).digests
    rank = torch.distributed.get_rank()
    saving = {"save_strategy": "steps", "save_steps": 4}
    losses = train(output_dir, dropout=0.0, steps=LOSS_STEPS, **saving).state.log_history
    resumed = make_trainer(output_dir, dropout=0.0, steps=LOSS_STEPS, **saving)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-4")
    try:
        train(output_dir, dropout=0.0, steps=LOSS_STEPS, data_seed=100 + rank)
        seeds_error = None
    except PipelineError as error:
        seeds_error = str(error)
    small_eval = evaluate_train_evaluate(make_trainer(output_dir, dropout=0.0, steps=LOSS_STEPS))
    seeded = make_trainer(
        output_dir, 0.0, LOSS_STEPS, collator=seeded_collator(), eval_rows=SEEDED_EVAL_ROWS, **SEEDED_OVERRIDES
    )
    seeded_run = evaluate_train_predict(seeded)
    record = {
        "digests": digests,
        "worker_digests": worker_digests,
        "log_history": losses,
        "resumed_log_history": resumed.state.log_history,
        "seeds_error": seeds_error,
        "small_eval": small_eval,
        "seeded": seeded_run,
    }
    (Path(output_dir) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
