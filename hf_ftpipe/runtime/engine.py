"""The pipeline engine: one rank's stages, driven through a schedule, one mini-batch at a time.

Every rank builds the same traced graph and stage plan, then keeps only its own stages (any
set, adjacent or not). A step splits the rank's own copy of the mini-batch into micro-batches,
stores them with their shapes (`StepInputs`), lowers the schedule's order into this rank's program
(its actions with their SENDs and RECVs, `RankPrograms`) and runs it (`Executor`); an evaluation
gathers the model's outputs onto every rank (`ModelOutputs`).

Flushing schedules (``gpipe``, ``1f1b``) leave the gradients in the local parameters for the
caller's optimizer; weights shared by several ranks (tied embeddings) get the sum of their
copies' gradients first. Streaming schedules update inside the step with the optimizer given to
`attach_optimizer`, keep the weight versions in-flight micro-batches need (`StreamingWeights`),
and carry micro-batches from one step into the next; `drain` empties the pipeline.

With ``data_parallel_size`` D > 1 the job runs D replicas of the pipeline (`hf_ftpipe.runtime.replicas`):
each trains its share of the global mini-batch, and the gradients are summed over the replicas
(`hf_ftpipe.runtime.replica_gradients`) before the step's tied-weight sum.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from hf_ftpipe.errors import PartitionError, PipelineError
from hf_ftpipe.graph.token_slices import SlicedModel
from hf_ftpipe.runtime.autocast import autocast_dtypes
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.compiled_stages import CompileOptions, StageCompiler
from hf_ftpipe.runtime.executor import Executor
from hf_ftpipe.runtime.executor_context import ExecutorContext, ExecutorSetting, LossFunction
from hf_ftpipe.runtime.messages import dataflow, plan_transfers
from hf_ftpipe.runtime.model_outputs import ModelOutputs
from hf_ftpipe.runtime.per_shape import PerShapeOptions, PerShapeStages
from hf_ftpipe.runtime.rank_schedule import rank_schedule
from hf_ftpipe.runtime.rank_stages import build_rank_stages
from hf_ftpipe.runtime.rank_weights import RankWeights
from hf_ftpipe.runtime.replica_batches import ReplicaBatches
from hf_ftpipe.runtime.replica_gradients import ReplicaGradients
from hf_ftpipe.runtime.replicas import ReplicaGroups, ReplicaLayout
from hf_ftpipe.runtime.slicing import WholeSequences
from hf_ftpipe.runtime.stage import StagePlacement, plan_stages
from hf_ftpipe.runtime.step_inputs import StepInputs
from hf_ftpipe.runtime.streaming import StreamingWeights
from hf_ftpipe.runtime.token_slicing import TokenSlicing
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.runtime.weight_sync import WeightSync
from hf_ftpipe.schedules.orders import StreamingSchedule
from hf_ftpipe.schedules.programs import RankPrograms

if TYPE_CHECKING:
    from hf_ftpipe.graph.trace import TracedModel

__all__ = ["PipelineEngine", "StagePlacement"]

_run_counter = itertools.count()


class PipelineEngine(RankWeights):
    """Runs one rank's share of a pipeline: builds the rank's stages once, runs each step's program with its `executor`.

    Args:
        traced (`TracedModel` or `SlicedModel`): the model captured on a micro-batch (every rank
            captures the same); a `SlicedModel` (`hf_ftpipe.graph.capture_token_slices`) trains
            each micro-batch as token slices (TeraPipe), ``gpipe`` or ``1f1b`` only.
        placement (`StagePlacement`): the partition; ``stage_device[s]`` is the rank (the position in each
            replica's pipeline) running stage ``s``.
        num_microbatches (`int`): micro-batches per mini-batch.
        schedule (`str`, defaults to ``"gpipe"``): a name of `hf_ftpipe.schedules.registry.SCHEDULES`
            (``gpipe``, ``1f1b``, ``zb-h1``, ``zbv``...) or a schedule file (`hf_ftpipe.schedules.from_file`).
        gradient_accumulation_steps (`int`, defaults to 1): ``async`` only: backwards per update.
        batches_per_step (`int`, defaults to 1): ``gpipe``, ``1f1b``: the mini-batches a step may take
            (gradient accumulation), run as one flush of their micro-batches (see `train_step`).
        recompute (`bool`, defaults to `False`): a stage keeps only its inputs from forward to backward
            and runs its forward again before the backward (random state preserved, so dropout repeats).
        weight_prediction (`bool`, defaults to `False`): ``async`` with a momentum optimizer: run each micro-batch
            on the weights its gradient will be applied to, predicted from the optimizer's momentum
            (`hf_ftpipe.runtime.prediction`); costs one copy of a stage's weights per micro-batch in flight.
        device (`torch.device`): where this rank's stages run.
        timeout_s (`float`, defaults to 300): the longest wait for any transfer before the step fails.
        weights_path (`str`, *optional*): a checkpoint folder (safetensors) to read this rank's
            weights from, for a model built with empty weights (``accelerate.init_empty_weights``).
        autocast_dtype (`torch.dtype`, *optional*): run every stage's forward (and recomputation) under
            ``torch.autocast`` to this dtype (float16: `loss_scale` set per step by the caller), as accelerate
            does; values cross ranks in autocast's dtype (`hf_ftpipe.runtime.autocast`), as in one process.
        watchdog (`Watchdog`, *optional*): bounds every wait of this rank (``timeout_s`` is then
            the watchdog's); PipeTrainer passes the one that also bounds its own collectives.
        per_shape (`PerShapeOptions`, *optional*): for a model whose export fixes a size batches vary,
            how batches of other shapes are bucketed onto graphs traced per shape (`hf_ftpipe.runtime.per_shape`).
        compile (`CompileOptions`, *optional*): ``torch.compile`` every stage module this rank runs, in
            place, names unchanged (`hf_ftpipe.runtime.compiled_stages`); `compiler` keeps the time it took.
        loss_reads (`Collection[str]`, *optional*): the model outputs `loss_function` will read (``logits``):
            each is also sent to the loss stage wherever the plan produces it (`plan_stages`).
        data_parallel_size (`int`, defaults to 1): D replicas of the pipeline on ``P × D`` processes; a step
            takes the global mini-batch, ``D × num_microbatches`` micro-batches, and sums the gradients over
            the replicas (``gpipe``, ``1f1b``, zero-bubble schedules, ``2bw``; not ``async``).
    """

    def __init__(
        self,
        traced: TracedModel | SlicedModel,
        placement: StagePlacement,
        *,
        num_microbatches: int,
        schedule: str = "gpipe",
        gradient_accumulation_steps: int = 1,
        batches_per_step: int = 1,
        recompute: bool = False,
        weight_prediction: bool = False,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        weights_path: str | os.PathLike | None = None,
        autocast_dtype: torch.dtype | None = None,
        watchdog: Watchdog | None = None,
        per_shape: PerShapeOptions | None = None,
        compile: CompileOptions | None = None,
        loss_reads: Collection[str] = (),
        data_parallel_size: int = 1,
    ) -> None:
        if not dist.is_initialized():
            raise PipelineError(
                "torch.distributed is not initialised; start the job with `accelerate launch` or `torchrun`"
            )
        sliced = traced if isinstance(traced, SlicedModel) else None
        traced, num_slices = (traced, None) if sliced is None else (sliced.full, len(sliced.slice_lengths))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device)
        if self.device.type == "cpu":  # CPU tensors report no index; 'cpu:0' baked into a graph fails torch.compile
            self.device = torch.device("cpu")
        self.graph = traced.cost_graph
        self.num_microbatches = num_microbatches
        self.stage_rank = list(placement.stage_device)  # positions in this rank's pipeline
        self.layout = ReplicaLayout.of_world(max(self.stage_rank) + 1, data_parallel_size, self.world_size)
        self.replica, self.position = self.layout.replica_of(self.rank), self.layout.position_of(self.rank)
        self.microbatches_per_batch = data_parallel_size * num_microbatches
        self.specs = plan_stages(self.graph, placement.node_stage, loss_reads)
        if len(self.specs) != len(self.stage_rank):
            raise PartitionError(f"the partition has {len(self.specs)} stages but places {len(self.stage_rank)}")
        self.local_stages = [s for s, r in enumerate(self.stage_rank) if r == self.position]
        self.batches_per_step = batches_per_step
        self.schedule, limits = rank_schedule(
            schedule,
            self.specs,
            self.stage_rank,
            num_microbatches,
            batches_per_step=batches_per_step,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_slices=num_slices,
            weight_prediction=weight_prediction,
            layout=self.layout,
        )
        self.traits = self.schedule.traits
        self.streaming = not self.traits.flushes
        self.weight_prediction = weight_prediction
        self.autocast_dtype = autocast_dtype
        dtypes = autocast_dtypes(traced.graph_module, self.device, autocast_dtype) if autocast_dtype is not None else {}
        self._autocast_dtypes = dtypes
        loss_stage = next((s.stage_index for s in self.specs if "loss" in s.model_outputs), None)
        loss_value = None if loss_stage is None else self.specs[loss_stage].model_outputs["loss"]
        self.transfers = plan_transfers(
            self.graph, self.specs, self.stage_rank, self.layout.pipeline_size, loss_value, self._autocast_dtypes
        )
        self.groups = groups = ReplicaGroups.create(self.layout, self.rank)  # this rank's pipeline and data groups
        self.messenger = Messenger(
            self.rank,
            timeout_s,
            run_id=f"engine-{next(_run_counter)}",
            p2p_group=groups.p2p,
            watchdog=watchdog,
            pipeline_ranks=self.layout.pipeline_ranks(self.replica),
            pipeline_group=groups.pipeline,
        )
        # Collective set-up first: a rank that fails below must not leave the others in new_group.
        self.weight_sync = WeightSync(self.graph, self.specs, self.stage_rank, self.messenger, self.device, self.layout)
        try:
            self.modules = build_rank_stages(traced, self.specs, self.local_stages, weights_path, self.device)
        except Exception as error:
            message = f"[rank {self.rank}, stages {self.local_stages}] could not build its stages: {error}"
            self.messenger.report_failure(message)
            raise PipelineError(message) from error
        self.module = nn.ModuleDict({str(s): m for s, m in self.modules.items()})
        self.token_slicing = (
            None
            if sliced is None
            else TokenSlicing(sliced, self.specs, placement.node_stage, self.modules, self.device)
        )
        slicing = self.token_slicing or WholeSequences()
        varies = any(info.varying for info in self.graph.inputs.values())
        self.compiler = None if compile is None else StageCompiler(compile, dynamic=varies)
        self._update_norms: list[torch.Tensor] = []
        self.version_log: list[tuple[int, ...]] = []
        """Streaming schedules: ``(stage, micro-batch, weights version)`` of every forward run here
        (with weight prediction also the number of updates predicted ahead)."""
        self.streaming_weights = (
            StreamingWeights(
                self.modules,
                self.traits,
                num_microbatches,
                gradient_accumulation_steps,
                weight_prediction,
                self.version_log,
            )
            if self.streaming
            else None
        )
        values = [*self.transfers, *(v for spec in self.specs for v in spec.model_outputs.values())]
        self.per_shape: PerShapeStages | None = None  # a sliced model's capture never has one (token_slices.py)
        if traced.per_shape is not None:
            self.per_shape = PerShapeStages(
                traced, self.specs, placement.node_stage, self.modules, self.device, values, num_microbatches, per_shape
            )
        self.inputs = StepInputs(
            self.graph,
            traced.shapes,
            values=values,
            sizes=[size for s in self.local_stages for size in self.specs[s].size_inputs],
            num_microbatches=num_microbatches,
            device=self.device,
            slicing=slicing,
            per_shape=self.per_shape,
        )
        self.formulas, self.shape_book = self.inputs.formulas, self.inputs.shape_book
        self.model_outputs = ModelOutputs(
            self.graph, self.specs, self.stage_rank, self._autocast_dtypes, self.messenger, self.device
        )
        self.programs = RankPrograms(self.schedule, dataflow(self.specs, self.transfers), self.position)
        self.replica_gradients = ReplicaGradients.of(self.modules, groups, self.messenger, self.traits)
        self.replica_batches = ReplicaBatches(
            self.layout, self.rank, groups.data, self.messenger, self.inputs, self.model_outputs
        )
        context = ExecutorContext(
            rank=self.rank,
            position=self.position,
            device=self.device,
            graph=self.graph,
            specs=self.specs,
            stage_rank=self.stage_rank,
            local_stages=self.local_stages,
            modules=self.modules,
            transfers=self.transfers,
            messenger=self.messenger,
            traits=self.traits,
            scheduled_microbatches=self.schedule.num_microbatches,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
            recompute=recompute,
            autocast_dtype=autocast_dtype,
            loss_value=loss_value,
            slicing=slicing,
            limits=limits,
            compiler=self.compiler,
            streaming_weights=self.streaming_weights,
            replica_gradients=self.replica_gradients,
        )
        self.executor = Executor(context, self._update_norms)
        """Runs each step's program on this rank's stages (it holds the per-micro-batch state)."""

    loss_scale: ExecutorSetting[float] = ExecutorSetting()
    """Multiplies the loss's gradient at the start of the backward (float16 loss scaling,
    `hf_ftpipe.trainer.loss_scale`); the gradients come out scaled by it, the loss returned is not."""
    loss_function: ExecutorSetting[LossFunction | None] = ExecutorSetting()
    """Training's loss from the model's outputs on the loss stage, in place of the traced one."""
    optimizer: ExecutorSetting[torch.optim.Optimizer | None] = ExecutorSetting()
    max_grad_norm: ExecutorSetting[float | None] = ExecutorSetting()

    def _reset_state(self) -> None:
        """Per-micro-batch state; streaming schedules carry it from one step to the next."""
        self.programs.reset()
        self.executor.reset()

    # -- public API -------------------------------------------------------------------------

    def train_step(
        self, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]], loss_weights: Sequence[float] | None = None
    ) -> torch.Tensor:
        """Forward and backward of one mini-batch; returns, on every rank, the loss of the
        micro-batches whose forward finished during this step.

        A list of up to ``batches_per_step`` mini-batches runs as one flush of all their micro-batches,
        in order, any shapes: one weight per micro-batch of them all, one loss per mini-batch returned.
        ``loss_weights`` (one per micro-batch, default ``1 / num_microbatches`` each) make the step's
        loss ``sum(w[m] * loss[m])``: the weights a micro-batch's mean loss takes in the mean over the
        whole mini-batch, e.g. its share of the label tokens (what `Trainer` computes with
        ``num_items_in_batch``). The backward is scaled the same way; a micro-batch of weight 0 (no
        label to learn from, whose mean loss is NaN) adds no gradient. ``async`` scales each
        micro-batch by ``w[m] * num_microbatches / gradient_accumulation_steps``. When the micro-batches
        that finished in a step are not one whole mini-batch (``async``, ``2bw``), the loss returned is
        the mean of ``w[m] * num_microbatches * loss[m]`` over them.

        ``gpipe`` and ``1f1b`` run exactly the mini-batch's micro-batches and leave their
        gradients (of the weighted loss) in the local parameters for the caller's optimizer
        step (call ``zero_grad`` between steps). ``async`` and ``2bw`` update inside the step (see
        `attach_optimizer`); micro-batches still in flight at the end finish in the next step,
        and their gradients wait outside ``param.grad``, so a caller's own ``optimizer.step()`` and
        ``zero_grad()`` between steps (`Trainer`'s) change nothing.

        With replicas (``data_parallel_size`` D > 1) ``batch`` is the global mini-batch (every rank passes
        the same), cut into D × ``num_microbatches`` micro-batches (`hf_ftpipe.runtime.replica_batches`),
        ``loss_weights`` has one weight per micro-batch of it, the gradients are summed over the replicas,
        and the loss returned is the global batch's.
        """
        if self.streaming and self.optimizer is None:
            raise PipelineError(
                f"the {self.schedule.name!r} schedule updates weights inside the pipeline; call "
                "`attach_optimizer(optimizer)` before the first train_step"
            )
        streaming = self.schedule.name if self.streaming else None
        pieces, weights = self.replica_batches.training(batch, loss_weights, self.batches_per_step, streaming)
        microbatches = [microbatch for piece in pieces for microbatch in piece]
        self._update_norms.clear()
        if isinstance(self.schedule, StreamingSchedule):
            first = self.schedule.given
            program = self.programs.streaming(self.schedule.next_step())
        else:
            first = 0
            num_slices = self.inputs.begin_slices(microbatches) if microbatches else None  # per the step's length
            program = self.programs.flushing(training=True, microbatches=len(microbatches), num_slices=num_slices)
            if self.replica_gradients is not None:
                self.replica_gradients.begin_step(program)
        units = self.inputs.store(self.executor.state, microbatches, first, weights)
        self.module.train(True)
        losses = self.executor.run(program, training=True)
        if not self.streaming:
            self.executor.flush()
            if self.replica_gradients is not None:
                self.replica_gradients.finish()
            self.weight_sync.sum_tied_gradients(dict(self.named_parameters()))
        else:  # this step's sends may be received in the next step; the previous step's are done
            self.executor.flush(older_than=self.messenger.generation)
            self.messenger.generation += 1
        per_batch = [len(piece) * units // max(len(microbatches), 1) for piece in pieces]  # units: token slices too
        whole = isinstance(batch, Mapping)
        return self.replica_batches.step_loss(
            losses, self.executor.state.loss_weight, units, per_batch, whole, self.device
        )

    def drain(self) -> None:
        """Finish every micro-batch still in flight (``async``, ``2bw``) and apply their updates;
        then tied copies on different ranks are made equal again (see `WeightSync.reconcile_tied`).
        Every rank must call it. A no-op for flushing schedules or an empty pipeline."""
        if not isinstance(self.schedule, StreamingSchedule) or self.schedule.given == 0:
            return
        order = self.schedule.drain()
        self.module.train(True)
        self.executor.run(self.programs.streaming(order), training=True)
        self.executor.flush()
        assert self.streaming_weights is not None
        self.streaming_weights.settle()
        self.weight_sync.reconcile_tied(dict(self.named_parameters()))
        self._reset_state()

    @torch.no_grad()
    def eval_step(
        self,
        batch: Mapping[str, Any],
        output_names: tuple[str, ...] = ("loss", "logits"),
        position: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Forward only; returns the requested model outputs, concatenated over micro-batches, on every rank.

        A streaming pipeline is drained first, so evaluation sees the latest weights. With ``position``,
        only that position of each per-token output (its dimension 1) crosses between ranks, kept as a
        length of 1: a decoder step reads one position of logits that are sequence × vocabulary large.
        With replicas each evaluates its share of the batch (cut as in training) and the outputs are
        gathered over them, in order.
        """
        self.drain()
        microbatches = self.replica_batches.evaluation(batch)  # with replicas, this replica's share
        self.inputs.store_for_evaluation(self.executor.state, microbatches)
        self.module.train(False)
        program = self.programs.flushing(training=False, microbatches=len(microbatches))
        losses = [loss for _, loss in self.executor.run(program, training=False)]
        self.executor.flush()
        outputs = {}
        if microbatches:
            outputs = self.model_outputs.gather(output_names, self.executor.state, losses, len(microbatches), position)
        if position is None:  # one position is already the batch's own: padding follows it
            outputs = self.inputs.unpad(outputs)
        self._reset_state()
        return self.replica_batches.gather_outputs(outputs, output_names, self.device)

    def close(self) -> None:
        """Release this rank's process groups; every rank at once, nothing in flight. A trainer that builds a
        pipeline per ``train()`` (``model_init``, a search's trials) would otherwise keep every one's sockets."""
        self.executor.flush()  # the last step's sends, received but not waited for
        self.groups.destroy()
        self.weight_sync.close()

    def train(self, mode: bool = True) -> PipelineEngine:
        self.module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)
