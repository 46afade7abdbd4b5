"""`PipeTrainer`'s checkpoint hooks: what each rank writes into and reads from a `Trainer` checkpoint.

`Trainer` saves and loads one process's model and optimizer; here every rank saves its own stages'
optimizer state by parameter name and reads back whatever any partition wrote (the formats are in
`hf_ftpipe.trainer.checkpoint_format`; a LoRA model's weights are its adapter,
`hf_ftpipe.trainer.peft_checkpoints`), rank 0 adds the scheduler and the partition. A checkpoint
is written under a temporary name and renamed by rank 0 once every rank has written its share
(`hf_ftpipe.trainer.checkpoint_folders`), so ``checkpoint-N`` only ever names a whole one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_ftpipe.errors import CheckpointError, PipelineError
from hf_ftpipe.graph.peft_models import is_peft_model
from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.trainer import checkpoint_format as checkpoint
from hf_ftpipe.trainer.checkpoint_folders import TRAINER_STATE, StagedCheckpoint, rotate_complete
from hf_ftpipe.trainer.peft_checkpoints import load_adapter_weights
from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["PipeCheckpointing"]

logger = get_logger(__name__)

_PARTITION = "partition.json"
_DATA_RNG_STATE = "data_rng_state.pth"
"""The data loader's random state (`hf_ftpipe.trainer.data_randomness`), the same on every rank."""


class PipeCheckpointing:
    """`PipeTrainer`'s checkpoint hooks, as a mixin placed before `Trainer` (it needs `PipeTrainer`'s
    ``engine``, ``partition``, ``float16``, ``data_randomness``, ``barrier``, ``failing_together`` and
    ``_built_from``)."""

    _staged: StagedCheckpoint | None = None
    """The checkpoint being saved: `Trainer` writes it into ``_staged.root``."""
    _push_staged = False
    """`Trainer` asked to push the checkpoint being saved: pushed once it is published."""

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """`Trainer`'s save, into ``_tmp-checkpoint-N/``; once every rank has written its share, rank 0
        renames it to ``checkpoint-N``, then rotates and pushes as `Trainer` would have."""
        run_dir = Path(super()._get_output_dir(trial=trial))
        staged = StagedCheckpoint(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        with self.failing_together(f"writing {staged.final}"):
            self._staged = staged
            try:
                super()._save_checkpoint(model, trial)  # rotation and push: after publishing, below
            finally:
                self._staged = None
            best = self.state.best_model_checkpoint
            if best is not None and Path(best).parent == staged.root:  # the checkpoint just saved is the best
                self.state.best_model_checkpoint = str(run_dir / Path(best).name)
            if self.args.should_save:
                if best != self.state.best_model_checkpoint:
                    self.state.save_to_json(str(staged.folder / TRAINER_STATE))
                staged.publish()
                rotate_complete(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
                if self._push_staged:
                    self._push_staged = False
                    super()._push_from_checkpoint(str(staged.final))
            self.barrier(f"waiting for rank 0 to publish {staged.name}")

    def _get_output_dir(self, trial: Any) -> str:
        return str(self._staged.root) if self._staged is not None else super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self._staged is not None:
            self._push_staged = True  # an upload reading the folder while it is renamed would break
        else:
            super()._push_from_checkpoint(checkpoint_folder)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Each rank writes its stages' optimizer state by parameter name (`hf_ftpipe.trainer.checkpoint_format`);
        rank 0 the scheduler, as Trainer does, and the partition that wrote the checkpoint."""
        engine = self._engine_for("saving a checkpoint")
        engine.drain()  # save_model drained already; a checkpoint never holds micro-batches in flight
        checkpoint.save_optimizer_state(engine, self.optimizer, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            if self.partition is not None:
                self.partition.to_json(os.path.join(output_dir, _PARTITION))

    def _save_scaler(self, output_dir: str) -> None:
        if self.float16 is not None:
            self.float16.save(output_dir, self.args.should_save)

    def _load_scaler(self, checkpoint_dir: str | None) -> None:
        if self.float16 is not None:
            self.float16.load(checkpoint_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        if self.args.should_save:
            torch.save(self.data_randomness.state_dict(), os.path.join(output_dir, _DATA_RNG_STATE))
        # Every rank's files are written before rank 0 writes trainer_state.json and publishes the
        # checkpoint; a rank that does not come is named.
        self.barrier(f"waiting for every rank to write its share of {os.path.basename(output_dir)}")

    def _load_data_randomness(self, checkpoint_dir: str) -> None:
        """Before the first batch of a resumed run is loaded (`Trainer` restores its own random
        states only after loading it): data loading continues exactly where it stopped."""
        path = os.path.join(checkpoint_dir, _DATA_RNG_STATE)
        if os.path.isfile(path):
            self.data_randomness.load_state_dict(torch.load(path, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Each rank reads its own stages' weights from the checkpoint, by name (any partition wrote it)."""
        engine = self._engine_for("resuming from a checkpoint")
        if self._built_from == resume_from_checkpoint:
            return  # the pipeline was built from this checkpoint's weights
        with self.failing_together(f"reading its stages' weights from {resume_from_checkpoint}"):
            count = self._load_weights(engine, resume_from_checkpoint)
        logger.info("rank %d read %d weights from %s", engine.rank, count, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        with self.failing_together(f"reading its optimizer state from {checkpoint_dir}"):
            self._read_optimizer_and_scheduler(checkpoint_dir)

    def _read_optimizer_and_scheduler(self, checkpoint_dir: str) -> None:
        engine = self._engine_for("resuming from a checkpoint")
        if not os.path.isdir(os.path.join(checkpoint_dir, checkpoint.OPTIMIZER_FOLDER)):
            # Trainer resumes a checkpoint without optimizer state (save_only_model=True) too.
            logger.warning(
                "%s holds no pipeline optimizer state (saved with save_only_model=True, or not by PipeTrainer): "
                "resuming its weights, with a fresh optimizer and learning-rate schedule",
                checkpoint_dir,
            )
            return
        checkpoint.load_optimizer_state(engine, self.optimizer, checkpoint_dir)
        path = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if not os.path.isfile(path):
            raise CheckpointError(f"{checkpoint_dir} has no {SCHEDULER_NAME}; is it a complete PipeTrainer checkpoint?")
        state = torch.load(path, weights_only=True)  # our own file, written by _save_optimizer_and_scheduler
        groups = len(self.optimizer.param_groups)
        if len(state.get("base_lrs", [])) != groups:
            raise CheckpointError(
                f"{path} schedules {len(state.get('base_lrs', []))} parameter groups but this rank's optimizer "
                f"has {groups}; resume with the optimizer settings of the run that wrote the checkpoint"
            )
        self.lr_scheduler.load_state_dict(state)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: every rank reloads its own stages from the best checkpoint."""
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        with self.failing_together(f"loading the best model from {best}"):
            self._load_weights(self._engine_for("loading the best model"), best)

    def _load_weights(self, engine: PipelineEngine, folder: str) -> int:
        """This rank's weights from a checkpoint: the whole model's, or a LoRA model's adapter."""
        if is_peft_model(self.model):
            return load_adapter_weights(engine, self.model, folder)
        return checkpoint.load_engine_weights(engine, folder)

    def _engine_for(self, doing: str) -> PipelineEngine:
        if self.engine is None:
            raise PipelineError(f"internal: {doing} before the pipeline is built")
        return self.engine
