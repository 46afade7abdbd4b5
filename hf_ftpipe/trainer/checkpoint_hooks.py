"""`PipeTrainer`'s checkpoint hooks: what each rank writes into and reads from a `Trainer` checkpoint.

`Trainer` saves and loads one process's model and optimizer; here every rank saves its own stages'
optimizer state by parameter name and reads back whatever any partition wrote (the formats are in
`hf_ftpipe.trainer.checkpoint_format`), rank 0 adds the scheduler and the partition, and all ranks meet before
``trainer_state.json`` marks the folder complete.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from transformers.trainer import SCHEDULER_NAME

from hf_ftpipe.errors import CheckpointError, PipelineError
from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.trainer import checkpoint_format as checkpoint

__all__ = ["PipeCheckpointing"]

logger = logging.getLogger(__name__)

_PARTITION = "partition.json"
_DATA_RNG_STATE = "data_rng_state.pth"
"""The data loader's random state (`hf_ftpipe.trainer.data_randomness`), the same on every rank."""


class PipeCheckpointing:
    """`PipeTrainer`'s checkpoint hooks, as a mixin placed before `Trainer` (it needs `PipeTrainer`'s
    ``engine``, ``partition``, ``float16``, ``data_randomness``, ``barrier`` and ``_built_from``)."""

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
        # Every rank's files are written before rank 0 writes trainer_state.json, the last file of
        # a checkpoint: a folder with it is complete.
        self.barrier(f"waiting for every rank to write its share of {os.path.basename(output_dir)}")

    def _load_rng_state(self, checkpoint_dir: str | None) -> None:
        super()._load_rng_state(checkpoint_dir)
        path = os.path.join(checkpoint_dir or "", _DATA_RNG_STATE)
        if checkpoint_dir is not None and os.path.isfile(path):
            self.data_randomness.load_state_dict(torch.load(path, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Each rank reads its own stages' weights from the checkpoint, by name (any partition wrote it)."""
        engine = self._engine_for("resuming from a checkpoint")
        if self._built_from == resume_from_checkpoint:
            return  # the pipeline was built from this checkpoint's weights
        count = checkpoint.load_engine_weights(engine, resume_from_checkpoint)
        logger.info("rank %d read %d weights from %s", engine.rank, count, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
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
        checkpoint.load_engine_weights(self._engine_for("loading the best model"), best)

    def _engine_for(self, doing: str) -> PipelineEngine:
        if self.engine is None:
            raise PipelineError(f"internal: {doing} before the pipeline is built")
        return self.engine
