"""PipeTrainer: Hugging Face `Trainer`, with the model run as a pipeline across the launched processes.

Swap ``Trainer`` for ``PipeTrainer`` and ``TrainingArguments`` for ``PipeTrainingArguments``;
launch with ``accelerate launch`` (or ``torchrun``). On the first batch every rank traces the
model, rank 0 makes (or loads) the partition and shares it, and each rank keeps only its stages.

Stock `Trainer` goes quietly wrong when each rank holds a slice of the model: it would wrap the
slice in DDP, shard the batches across ranks, count the ranks as data-parallel replicas, clip by
a local gradient norm and save rank 0's slice only. Each override undoes one of those: here the
pipeline's building and saving; in mixins, one job each, each ``train()``'s new model and search
trial under ``model_init`` (`model_init`), tracing and planning, ``auto_find_batch_size`` included
(`pipeline_planning`), the training step and gradient accumulation (`training_steps`), data loading
(`data_loading`), logs and counts (`reporting`), evaluation (`evaluation`) and checkpoints
(`checkpoint_hooks`).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.peft_models import check_peft_model, is_peft_model
from hf_ftpipe.graph.token_slices import SlicedModel
from hf_ftpipe.plan import Partition
from hf_ftpipe.runtime import PipelineEngine, Watchdog
from hf_ftpipe.runtime.weights import release_foreign_weights
from hf_ftpipe.trainer.arguments import PipeTrainingArguments
from hf_ftpipe.trainer.auto_order import engine_schedule
from hf_ftpipe.trainer.checkpoint_folders import check_output_dir
from hf_ftpipe.trainer.checkpoint_hooks import PipeCheckpointing
from hf_ftpipe.trainer.compilation import stage_compile_options
from hf_ftpipe.trainer.data_loading import PipeDataLoading
from hf_ftpipe.trainer.data_randomness import DataRandomness
from hf_ftpipe.trainer.evaluation import PipeEvaluation
from hf_ftpipe.trainer.float16 import Float16Training
from hf_ftpipe.trainer.launch import check_one_writer
from hf_ftpipe.trainer.model_init import PipeModelInit
from hf_ftpipe.trainer.output_loss import computes_loss_from_outputs, method_name, outputs_read
from hf_ftpipe.trainer.per_shape import per_shape_options
from hf_ftpipe.trainer.pipeline_planning import PipePlanning
from hf_ftpipe.trainer.preflight import agree_before_training
from hf_ftpipe.trainer.replicas import Replicas, global_batch_size, launched_pipeline_size
from hf_ftpipe.trainer.reporting import PipeReporting
from hf_ftpipe.trainer.run_log import get_logger
from hf_ftpipe.trainer.training_steps import PipeTrainingSteps

__all__ = ["PipeTrainer"]

logger = get_logger(__name__)

_trainer_counter = itertools.count()
"""Names each PipeTrainer's keys in the rendezvous store alike on every rank (made in the same order)."""

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _fails_together(doing: str) -> Callable[[_Method], _Method]:
    """A `PipeTrainer` method whose exceptions every other rank learns of (see `PipeTrainer.failing_together`)."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def run(self: PipeTrainer, *args: Any, **kwargs: Any) -> Any:
            with self.failing_together(doing):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap


class _StagesModule(nn.Module):
    """What `Trainer` sees as the model being trained: this rank's stages, unwrapped."""

    def __init__(self, engine: PipelineEngine) -> None:
        super().__init__()
        self.stages = engine.module


class PipeTrainer(
    PipeModelInit,
    PipePlanning,
    PipeTrainingSteps,
    PipeEvaluation,
    PipeCheckpointing,
    PipeDataLoading,
    PipeReporting,
    Trainer,
):
    """`Trainer` that trains and evaluates ``model`` as a pipeline (see `PipeTrainingArguments`).

    ``self.model`` stays the user's model object: `Trainer` reads its config and signature, and
    `save_model()` writes it with the pipeline's trained weights. Batches may have any shape (dynamic
    padding, a short last batch); the plan is made for the largest (`hf_ftpipe.trainer.planned_shapes`).
    """

    args: PipeTrainingArguments

    def __init__(
        self, model: nn.Module | None = None, args: PipeTrainingArguments | None = None, **kwargs: Any
    ) -> None:
        if args is not None and not isinstance(args, PipeTrainingArguments):
            raise TypeError(
                f"PipeTrainer needs `PipeTrainingArguments`, got {type(args).__name__}; "
                "replace TrainingArguments(...) with PipeTrainingArguments(...)"
            )
        if args is None:  # Trainer would make plain TrainingArguments, which lack the pipeline's fields
            args = PipeTrainingArguments(output_dir="trainer_output")
        self._run_id = f"trainer-{next(_trainer_counter)}"
        self._timeout_s = args.pipeline_timeout_s
        self._watchdog: Watchdog | None = None
        if args.output_dir:  # Trainer creates it on rank 0 only, with a bare OSError if it cannot
            check_output_dir(args.output_dir)
        if is_peft_model(model):  # before any rank builds anything: a method we do not train is refused
            check_peft_model(model)
        with self.failing_together("setting up PipeTrainer"):
            super().__init__(model=model, args=args, **kwargs)
        # Every rank loads the global batch, for every replica (`hf_ftpipe.trainer.replicas`): what Trainer's
        # loader, epochs, steps and samples/s count.
        self._train_batch_size = global_batch_size(self.args.train_batch_size, self.args)
        self.engine: PipelineEngine | None = None
        self.partition: Partition | None = None
        self.replicas: Replicas | None = None
        """The replicas running the pipeline, once built (``data_parallel_size="auto"``: the planner's choice)."""
        self._resume_from: str | None = None
        self._built_from: str | None = None
        """The checkpoint the pipeline read its weights from (a model built with empty weights)."""
        if self.args.token_slices is not None and computes_loss_from_outputs(self):
            raise PipelineError(
                f"`token_slices` with a loss computed from the model's outputs ({method_name(self)}): each token "
                "slice computes its share of the loss inside the traced graph; drop `token_slices`, or the loss option"
            )
        self.float16 = Float16Training() if self.args.fp16 else None
        """``fp16=True``: the loss scale all ranks agree on (``trainer.float16.scaler``)."""
        if self.float16 is not None:
            self.accelerator.scaler = None  # accelerate's decides per process; see hf_ftpipe/float16.py
        self.partition_source: str | None = None
        """Rank 0: where the plan came from: 'file', 'cache', 'hub' or 'computed'."""
        self.data_randomness = DataRandomness(self.args.seed)
        """What data loading and collation draw from, on every rank alike (see `hf_ftpipe.trainer.data_randomness`)."""
        self.batch_digest: str | None = None
        """The digest of the last training batch, equal on every rank (see `hf_ftpipe.trainer.batch_check`)."""

    # -- building the pipeline ----------------------------------------------------------------

    def _ensure_engine(self, inputs: dict[str, Any]) -> PipelineEngine:
        if self.engine is not None:
            return self.engine
        if not dist.is_initialized():
            raise PipelineError(
                "PipeTrainer runs one process per pipeline device; start the script with "
                "`accelerate launch --num_processes N script.py` (CPU: `accelerate launch --multi_gpu "
                "--num_processes N script.py` with use_cpu=True) or `torchrun --nproc_per_node N script.py`"
            )
        if dist.get_world_size() < 2:
            raise PipelineError(
                "PipeTrainer found a single process: a pipeline needs one process per stage device. Launch "
                "`accelerate launch --multi_gpu --num_processes N script.py` (on a CPU-only machine add "
                "use_cpu=True to the arguments; `accelerate launch --cpu` starts one process) or "
                "`torchrun --nproc_per_node N script.py`, with N >= 2"
            )
        check_one_writer(self.args)
        if self.args.data_parallel_size != "auto":  # the world divides into data_parallel_size pipelines
            launched_pipeline_size(self.args.data_parallel_size)
        traced, shared = self._plan_pipeline(inputs)
        whole = traced.full if isinstance(traced, SlicedModel) else traced
        self.partition, self.partition_source, self.replicas = shared.partition, shared.source, shared.replicas
        self._built_from = self._weights_path()
        self.engine = PipelineEngine(
            traced,
            self.partition,
            num_microbatches=self.replicas.num_microbatches,  # one replica's (`hf_ftpipe.trainer.replicas`)
            data_parallel_size=self.replicas.data_parallel_size,
            schedule=engine_schedule(
                self.args, self.partition, whole.cost_graph, self.replicas.microbatches_per_step(self.args)
            ),
            gradient_accumulation_steps=self.args.async_update_interval,
            batches_per_step=self.args.gradient_accumulation_steps,
            recompute=bool(self.args.activation_checkpointing),
            weight_prediction=self.args.async_weight_prediction,
            device=self.args.device,
            timeout_s=self.args.pipeline_timeout_s,
            weights_path=self._built_from,
            autocast_dtype=torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else None,
            watchdog=self.watchdog,
            per_shape=per_shape_options(self.data_collator, self.processing_class, self.model),
            compile=stage_compile_options(self.args),
            loss_reads=outputs_read(self, whole.cost_graph.output_names),
        )
        if self.args.release_unused_weights:
            freed = release_foreign_weights(self.model, self.engine.parameters())
            logger.info("rank %d released %.1f MB of weights other ranks run", self.engine.rank, freed / 2**20)
        stages = self.partition.stages_on(self.engine.position)
        params = sum(p.numel() for p in self.engine.parameters())
        logger.info(
            "rank %d (replica %d) runs stages %s (%d parameters) of %d",
            self.engine.rank,
            self.engine.replica,
            stages,
            params,
            self.partition.num_stages,
        )
        return self.engine

    @property
    def watchdog(self) -> Watchdog:
        """Bounds every wait of this rank by ``pipeline_timeout_s``: the pipeline's transfers and the
        trainer's own collectives (partition, batch check, checkpoint barriers). Made on first use,
        once the process group exists."""
        if self._watchdog is None:
            self._watchdog = Watchdog(dist.get_rank(), dist.get_world_size(), self._timeout_s, run_id=self._run_id)
        return self._watchdog

    @contextmanager
    def failing_together(self, doing: str) -> Iterator[None]:
        """An exception leaving the body is published first (`Watchdog.report_exception`), so that every other
        rank stops, within ``pipeline_timeout_s``, with ``[rank r] failed while {doing}: ...``
        instead of waiting for this rank or dying on gloo's ``Connection closed by peer``. Wraps
        `train`, `evaluate`, `predict`, `save_model` and the checkpoint hooks (the innermost names
        what failed); the pipeline's own failures are published by the engine."""
        try:
            yield
        except BaseException as error:
            if dist.is_initialized() and dist.get_world_size() > 1:
                self.watchdog.report_exception(doing, error)
            raise

    def barrier(self, what: str) -> None:
        """`dist.barrier`, bounded: a rank that never arrives stops every other one, named."""
        if dist.is_initialized():
            with self.watchdog.waiting(what, collective=True):
                dist.barrier()

    def _weights_path(self) -> str | None:
        """Where a model built with empty weights reads them from (None: the model has its weights)."""
        if not any(p.is_meta for p in self.model.parameters()):
            return None
        if is_peft_model(self.model):
            raise PipelineError(
                "the PeftModel has empty (meta) weights: its checkpoints hold the adapter alone, not the base "
                "model's weights under the PeftModel's names; load the base model with its weights, then apply "
                "peft (`release_unused_weights` frees, on each rank, the weights of stages other ranks run)"
            )
        if self.args.weights_path:
            return self.args.weights_path
        if self._resume_from:  # the checkpoint being resumed holds the whole model
            return self._resume_from
        name = getattr(getattr(self.model, "config", None), "_name_or_path", "")
        if name and os.path.isdir(name):
            return name
        raise PipelineError(
            "the model has empty (meta) weights and no checkpoint to read them from; pass "
            "`weights_path` (a folder written by save_pretrained) in PipeTrainingArguments, or "
            "`resume_from_checkpoint` to train()"
        )

    # -- training -----------------------------------------------------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # Never `self.model`, so Trainer neither DDP-wraps nor prepares it.
        if self.engine is None:
            return _Placeholder()
        return _StagesModule(self.engine)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # each rank moves only its own stages

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.engine is None:
            raise PipelineError("internal: the optimizer is created before the pipeline is built")
        optimizer = super().create_optimizer(self.engine.module)
        if self.engine.streaming:  # async / 2bw update inside the pipeline, stage by stage
            self.engine.attach_optimizer(optimizer, max_grad_norm=self.args.max_grad_norm or None)
        if self.float16 is not None:
            self.float16.guard_optimizer(optimizer)
        return optimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        # True (Trainer's "the last checkpoint in output_dir") is resolved here, to the newest
        # complete one: a model built with empty weights reads them from it. Every rank checks the
        # checkpoint's files and output_dir before any rank builds anything, and all raise the same
        # error if one finds a problem (`hf_ftpipe.trainer.preflight`): nothing to publish.
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        watchdog = self.watchdog if distributed else None
        resume_from_checkpoint = agree_before_training(self.args.output_dir, resume_from_checkpoint, rank, watchdog)
        with self.failing_together("training"):
            self._resume_from = resume_from_checkpoint
            self._model_for_training(kwargs.get("trial", args[0] if args else None))
            if resume_from_checkpoint is not None:
                self._load_data_randomness(resume_from_checkpoint)
            if self.engine is None:
                self._check_enough_training_data()
                self._ensure_engine(self._first_batch(self.get_train_dataloader()))
            output = super().train(resume_from_checkpoint, *args, **kwargs)
            self.sync_model()
        self._end_pruned_trial()
        return output

    @_fails_together("evaluating")
    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        return super().evaluate(*args, **kwargs)

    @_fails_together("predicting")
    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return super().predict(*args, **kwargs)

    def sync_model(self, trainable_only: bool = False) -> None:
        """Put the pipeline's current weights into ``self.model`` on rank 0 (all ranks must call it).

        `train()` does it at its end and `save_model()` before writing, so rank 0's ``trainer.model``
        is the trained model, usable as any transformers model. On other ranks it keeps only the
        weights of their own stages. ``trainable_only``: the weights that train alone (what a
        ``PeftModel`` saves); others' frozen weights may stay empty on rank 0.
        """
        if self.engine is None:
            return
        state = self.engine.gather_state_dict(dst=0, trainable_only=trainable_only)
        if state is None:
            return
        missing, unexpected = self.model.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise PipelineError(f"gathered weights unknown to the model: {unexpected[:5]}")
        if hasattr(self.model, "tie_weights"):
            self.model.tie_weights()  # assign=True put new tensors in; re-tie the shared ones
        still_empty = [] if trainable_only else [name for name, p in self.model.named_parameters() if p.is_meta]
        if still_empty:
            raise PipelineError(f"weights missing after gathering the stages: {still_empty[:5]}")

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self._pipeline_grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self._pipeline_grad_norm(float("inf"))

    def _pipeline_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The step's global gradient norm, clipped to ``max_norm`` (fp16: unscaled first)."""
        if self.engine.streaming:  # clipped per stage update inside the step
            return self.engine.step_grad_norm()
        if self.float16 is not None:
            self.float16.unscale(self.engine, self.optimizer)
        return self.engine.clip_grad_norm_(max_norm)

    # -- saving -------------------------------------------------------------------------------

    @_fails_together("writing the model")
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write one standard checkpoint (rank 0) holding every stage's trained weights; all ranks must call it."""
        # A PeftModel writes its adapter alone (hf_ftpipe.trainer.peft_checkpoints): only the trained weights travel.
        self.sync_model(trainable_only=is_peft_model(self.model))
        super().save_model(output_dir, _internal_call=_internal_call)
        self.barrier("waiting for rank 0 to write the model")


class _Placeholder(nn.Module):
    """Stands in for the model before the pipeline exists (Trainer wraps early, then re-wraps)."""
