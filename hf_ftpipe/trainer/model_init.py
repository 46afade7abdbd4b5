"""``model_init`` and ``hyperparameter_search``: each ``train()`` plans and builds a pipeline for a new model.

`Trainer` made with ``model_init`` makes the model again at every ``train()`` (seeded with
``args.seed``), and only then applies a search trial's arguments (``_hp_search_setup``). A pipeline
must be planned for the batch size and pipeline arguments it will run with, and built from the
model it will train, so PipeTrainer does both before `Trainer.train` starts: it makes the model as
`Trainer` would (the same seed, the same call with the same trial), applies the trial, plans and
builds; then, when `Trainer.train` asks ``model_init`` for its model, it is handed that very model,
with the random generators put where constructing it left them. So a ``train()`` constructs one
model, as plain `Trainer`'s does, and everything `Trainer` draws after it draws alike; data loading
too, whose own generator states (`DataRandomness`) start there at every ``train()``, where `Trainer`'s
collator (masked-LM masking) draws from the global generators right after making the model.

A trial's arguments are checked as `PipeTrainingArguments` checks its own
(`PipeTrainingArguments.check_pipeline_fields`): a trial that gives ``per_device_train_batch_size=6``
with ``num_microbatches=4`` stops the search with the error the arguments would give. Under several
processes `Trainer`'s optuna search runs the study on process 0 and hands every other process the
trial's parameters (`optuna.trial.FixedTrial`), which each applies the same way. Pruning is decided
on process 0 too (only its trial belongs to the study), so the decision is shared: every process
stops the trial's training after the same evaluation, process 0 then tells optuna the trial was
pruned and the others go on to the next trial, where `Trainer` alone would stop process 0 only and
leave the others waiting in the pipeline. Its other backends (Ray Tune, W&B sweeps) run trials in
processes of their own, which cannot be the pipeline's: they are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import enable_full_determinism, set_seed
from transformers.hyperparameter_search import HPSearchBackend, default_hp_search_backend

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.trainer.data_randomness import DataRandomness, global_states, set_global_states
from hf_ftpipe.trainer.replicas import global_batch_size

__all__ = ["PipeModelInit"]


@dataclass
class _BuiltModel:
    """A model made for a ``train()`` before `Trainer.train` asks for it."""

    model: nn.Module
    trial: Any
    states: tuple[Any, ...]
    """The random generators' states right after constructing it (CPU, numpy, Python; then each GPU's)."""


class PipeModelInit:
    """The `PipeTrainer` mixin that makes each ``train()``'s model, and applies its trial, before planning.

    Reads ``model_init``, ``args``, ``engine``, ``float16``, ``watchdog`` and `Trainer`'s search state; sets
    ``model``, ``engine`` and ``data_randomness``.
    """

    def _model_for_training(self, trial: Any) -> None:
        """With ``model_init``: make the model this ``train()`` trains, as `Trainer.train` would, having closed
        the last pipeline and let go of the last model, optimizer and scheduler (`Trainer.train` drops them
        too, but after making the new model). Then apply ``trial``'s arguments."""
        if self.model_init is not None:
            if self.engine is not None:
                self.engine.close()
            self.model = self.model_wrapped = self.engine = self.optimizer = self.lr_scheduler = None
            enable_full_determinism(self.args.seed) if self.args.full_determinism else set_seed(self.args.seed)
            model = super().call_model_init(trial)
            self._built_model = _BuiltModel(model, trial, _generator_states())
            self.data_randomness = DataRandomness.following_global_states()
            self.model = model
        self._hp_search_setup(trial)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """`Trainer.train`'s call gets the model `_model_for_training` made for the same trial, and the
        generators where constructing it left them; any other call constructs one."""
        built = getattr(self, "_built_model", None)  # Trainer.__init__ calls this before our __init__ runs
        if built is None or built.trial is not trial:
            return super().call_model_init(trial)
        self._built_model = None
        _set_generator_states(built.states)
        return built.model

    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.hyperparameter_search`, with optuna: the backend that runs under `torch.distributed`."""
        backend = kwargs.get("backend", args[4] if len(args) > 4 else None)  # its fifth parameter
        backend = HPSearchBackend(backend) if backend is not None else default_hp_search_backend()
        if backend != HPSearchBackend.OPTUNA:
            raise PipelineError(
                f"hyperparameter_search(backend={backend.value!r}) runs each trial in processes of its own, "
                "which cannot be the pipeline's; use backend='optuna' (`pip install optuna`), which runs the "
                "study on process 0 and hands each trial to the others"
            )
        return super().hyperparameter_search(*args, **kwargs)

    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None:
        """`Trainer`'s, with optuna's pruning decision, made on process 0, shared: a pruned trial's training
        stops on every process after this evaluation (`_end_pruned_trial` then tells optuna)."""
        if self.hp_search_backend != HPSearchBackend.OPTUNA or trial is None:
            return super()._report_to_hp_search(trial, step, metrics)
        self.objective = self.compute_objective(metrics.copy())
        prune = [False]
        if hasattr(trial, "study") and not trial.study._is_multi_objective():  # process 0's: the others' are fixed
            trial.report(self.objective, step)
            prune = [trial.should_prune()]
        self.watchdog.broadcast_from_rank0(prune, "agreeing whether optuna prunes the trial")
        if prune[0]:
            self._trial_pruned = True
            self.control.should_training_stop = True

    def _end_pruned_trial(self) -> None:
        """After a ``train()`` that optuna pruned: process 0 raises ``optuna.TrialPruned`` (outside the pipeline's
        failure reporting: the other processes are not failing, they go on to the next trial)."""
        if not getattr(self, "_trial_pruned", False):
            return
        self._trial_pruned = False
        if self.args.process_index == 0:
            import optuna

            raise optuna.TrialPruned()

    def _hp_search_setup(self, trial: Any) -> None:
        """`Trainer`'s, which sets a trial's arguments on ``args`` and makes a new accelerator, then what
        the pipeline adds: the trial's arguments checked, the global batch size (`Trainer` resets it to
        one replica's) and float16's loss scaling kept out of the new accelerator."""
        super()._hp_search_setup(trial)
        if trial is None or self.hp_search_backend is None:
            return
        try:
            self.args.check_pipeline_fields()
        except ValueError as error:
            raise ValueError(
                f"a hyperparameter_search trial set arguments PipeTrainer cannot run: {error}; keep `hp_space` to "
                "values the pipeline's other arguments allow"
            ) from error
        self._train_batch_size = global_batch_size(self.args.train_batch_size, self.args)
        if self.float16 is not None:
            self.accelerator.scaler = None


def _generator_states() -> tuple[Any, ...]:
    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return (*global_states(), devices)


def _set_generator_states(states: tuple[Any, ...]) -> None:
    *cpu, devices = states
    set_global_states(*cpu)
    if devices:
        torch.cuda.set_rng_state_all(devices)
