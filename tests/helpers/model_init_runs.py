"""Trainers made with ``model_init``: plain `Trainer` makes a new model at each ``train()`` (two calls
in a row, also of a masked LM whose masking draws from the global generators; ``hyperparameter_search``'s
trials, one of which changes the batch size), and so must PipeTrainer. Run by
tests/trainer/surface_job.py (PipeTrainer, 2 ranks) and in tests/trainer/test_trainer_surface.py (plain
`Trainer`, one process)."""

from __future__ import annotations

import os
from typing import Any

from datasets import Dataset

import mlm_runs
from models import tiny_batch, tiny_model
from trainer_comparison import short_run_arguments

ROWS, BATCH, STEPS = 8, 4, 2
TRIALS = [(1e-2, 4), (3e-2, 2), (1e-2, 3)]
"""(learning_rate, per_device_train_batch_size) of each search setting: the arguments' own; another batch
size (the pipeline must be planned for it); one that ``num_microbatches=2`` does not divide."""


def _trainer(output_dir: str, pipe: bool, model_init: Any, eval_dataset: Any = None, **arguments: Any) -> Any:
    from transformers import Trainer

    from hf_ftpipe import PipeTrainer

    args = short_run_arguments(output_dir, pipe, BATCH, STEPS, **arguments)
    data = tiny_batch("gpt2", ROWS, seed=3)
    dataset = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    trainer_class = PipeTrainer if pipe else Trainer
    return trainer_class(model_init=model_init, args=args, train_dataset=dataset, eval_dataset=eval_dataset)


def train_twice(output_dir: str, pipe: bool) -> dict[str, Any]:
    """Every logged loss of each of the two ``train()`` calls, how many models ``model_init`` made, and
    how many files the process had open after each call (a pipeline's process groups hold sockets)."""
    made = []
    trainer = _trainer(output_dir, pipe, lambda: made.append(1) or tiny_model("gpt2", seed=7))
    losses, open_files = [], []
    for _ in range(2):
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
        open_files.append(len(os.listdir("/proc/self/fd")))
    return {"losses": losses, "models_made": len(made), "open_files": open_files}


def masked_lm_twice(output_dir: str, pipe: bool) -> list[list[float]]:
    """Every logged loss of two ``train()`` calls of a masked LM made with ``model_init``, masked by a collator
    that draws from the global generators: `Trainer` masks from where making each new model left them."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    from hf_ftpipe import PipeTrainer

    args = short_run_arguments(output_dir, pipe, 8, STEPS)
    collator = DataCollatorForLanguageModeling(mlm_runs.tokenizer(), mlm_probability=0.3)
    trainer = (PipeTrainer if pipe else Trainer)(
        model_init=lambda: mlm_runs.model(0.0), args=args, train_dataset=mlm_runs.dataset(), data_collator=collator
    )
    losses = []
    for _ in range(2):
        trainer.train()
        losses.append([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    return losses


def search(output_dir: str, pipe: bool, settings: list[int]) -> dict[str, Any]:
    """``hyperparameter_search`` (optuna) trying each of ``settings`` (indices into `TRIALS`) once, in the
    seeded grid's order, evaluating after every step, with a pruner that prunes the first trial at
    its first evaluation: every evaluation loss, the best run and how many models ``model_init``
    made; or the error that stopped the search."""
    import optuna

    class PruneFirst(optuna.pruners.BasePruner):
        def prune(self, study: Any, trial: Any) -> bool:
            return trial.number == 0

    made: list[int] = []
    data = tiny_batch("gpt2", ROWS, seed=4)
    evaluation = Dataset.from_dict({k: v.tolist() for k, v in data.items()})
    model_init = lambda trial: made.append(1) or tiny_model("gpt2", seed=7)  # noqa: E731
    trainer = _trainer(output_dir, pipe, model_init, evaluation, eval_strategy="steps", eval_steps=1)
    losses: list[float] = []

    def hp_space(trial: Any) -> dict[str, Any]:
        learning_rate, batch_size = TRIALS[trial.suggest_categorical("setting", settings)]
        return {"learning_rate": learning_rate, "per_device_train_batch_size": batch_size}

    def objective(metrics: dict[str, float]) -> float:
        losses.append(metrics["eval_loss"])
        return metrics["eval_loss"]

    try:
        best = trainer.hyperparameter_search(
            hp_space=hp_space,
            compute_objective=objective,
            n_trials=len(settings),
            backend="optuna",
            sampler=optuna.samplers.GridSampler({"setting": settings}, seed=0),
            pruner=PruneFirst(),
        )
    except ValueError as error:
        return {"error": str(error)}
    best_run = None if best is None else {"objective": best.objective, "setting": best.hyperparameters["setting"]}
    return {"eval_losses": losses, "best": best_run, "models_made": len(made)}
