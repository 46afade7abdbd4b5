"""Two ``train()`` calls of one trainer made with ``model_init``: plain `Trainer` makes a new model for each
(``hyperparameter_search``'s trials), and so must PipeTrainer. Run by tests/trainer/surface_job.py
(PipeTrainer, 2 ranks) and in tests/trainer/test_trainer_surface.py (plain `Trainer`, one process)."""

from __future__ import annotations

from datasets import Dataset

from models import tiny_batch, tiny_model

ROWS, BATCH, STEPS = 8, 4, 2


def train_twice(output_dir: str, pipe: bool) -> list[list[float]]:
    """Every logged loss of each of the two ``train()`` calls."""
    from transformers import Trainer, TrainingArguments

    from hf_ftpipe import PipeTrainer, PipeTrainingArguments

    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    args = PipeTrainingArguments(num_microbatches=2, **common) if pipe else TrainingArguments(**common)
    data = tiny_batch("gpt2", ROWS, seed=3)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    trainer = (PipeTrainer if pipe else Trainer)(
        model_init=lambda: tiny_model("gpt2", seed=7), args=args, train_dataset=dataset
    )
    losses = []
    for _ in range(2):
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    return losses
