"""The pipeline engine: one rank's stages, driven through a schedule, one mini-batch at a time.

Every rank builds the same traced graph and stage plan, then keeps only its own stages (any
set, adjacent or not). A step splits the rank's own copy of the mini-batch into micro-batches and
performs the rank's actions in the schedule's global order: forwards and backwards of its stages,
and, for the streaming schedules (``async``, ``2bw``), weight updates. Before each action it posts
the receives of every message its peers send up to that point of the order (`plan_messages`),
in their send order, so a value is usually there by the time it is needed. Activations go
straight from the stage that produces them to every rank with a stage that reads them, adjacent
or not.

Synchronous schedules (``gpipe``, ``1f1b``) leave the gradients in the local parameters for the
caller's optimizer; weights shared by several ranks (tied embeddings) get the sum of their
copies' gradients first. Streaming schedules update inside the step with the optimizer given to
`attach_optimizer`, keep the weight versions in-flight micro-batches need (`StageVersions`), and
carry micro-batches from one step into the next; `drain` empties the pipeline.
"""

from __future__ import annotations

import itertools
import os
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from hf_ftpipe.costmodel.memory_rules import in_flight
from hf_ftpipe.errors import PartitionError, PipelineError
from hf_ftpipe.graph.trace import TracedModel
from hf_ftpipe.runtime.autocast import autocast_dtypes
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.deliveries import Deliveries
from hf_ftpipe.runtime.messages import Message, Transfer, plan_messages, plan_transfers, value_shape
from hf_ftpipe.runtime.prediction import check_predictable, predicted_weights, updates_ahead
from hf_ftpipe.runtime.stage import build_stage_module, plan_stages
from hf_ftpipe.runtime.versions import PendingGradients, StageVersions, move_gradients
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.runtime.weight_sync import WeightSync
from hf_ftpipe.runtime.weights import load_stage_weights
from hf_ftpipe.schedules.orders import Action, Schedule, ScheduleGPipe, StreamingSchedule, make_schedule

__all__ = ["PipelineEngine", "StagePlacement"]

_run_counter = itertools.count()


class StagePlacement(Protocol):
    """What the engine needs of a partition: node → stage and stage → rank."""

    node_stage: dict[str, int]
    stage_device: list[int]


class PipelineEngine:
    """Runs one rank's share of a pipeline.

    Args:
        traced (`TracedModel`): the model captured on a micro-batch (every rank captures the same).
        placement (`StagePlacement`): the partition; ``stage_device[s]`` is the rank running stage ``s``.
        num_microbatches (`int`): micro-batches per mini-batch.
        schedule (`str`, defaults to ``"gpipe"``): ``gpipe``, ``1f1b``, ``async`` or ``2bw`` (see
            `hf_ftpipe.schedules.orders`).
        gradient_accumulation_steps (`int`, defaults to 1): ``async`` only: backwards per update.
        recompute (`bool`, defaults to `False`): activation recomputation: a stage keeps only its
            inputs from forward to backward and runs its forward again just before the backward
            (``torch.utils.checkpoint``, random state preserved so dropout repeats), trading about a
            third more compute for the activations of the micro-batches in flight.
        weight_prediction (`bool`, defaults to `False`): ``async`` with a momentum optimizer: run each
            micro-batch on the weights its gradient will be applied to, predicted from the
            optimizer's momentum (`hf_ftpipe.runtime.prediction`); costs one copy of a stage's
            weights per micro-batch in flight, like weight stashing.
        device (`torch.device`): where this rank's stages run.
        timeout_s (`float`, defaults to 300): the longest wait for any transfer before the step fails.
        weights_path (`str`, *optional*): a checkpoint folder (safetensors) to read this rank's
            weights from, for a model built with empty weights (``accelerate.init_empty_weights``).
        autocast_dtype (`torch.dtype`, *optional*): mixed precision: run every stage's forward (and
            its recomputation) under ``torch.autocast`` with this dtype (``torch.bfloat16``, or
            ``torch.float16`` with `loss_scale` set per step by the caller), as
            accelerate does for a whole model. Weights, gradients and optimizer state stay in their
            own dtype. Values cross ranks in the dtype autocast gives them, found before the first
            step (`hf_ftpipe.runtime.autocast`), so receives can be posted ahead and the pipeline
            computes exactly what one process under autocast computes.
        watchdog (`Watchdog`, *optional*): bounds every wait of this rank (``timeout_s`` is then
            the watchdog's); PipeTrainer passes the one that also bounds its own collectives.
    """

    def __init__(
        self,
        traced: TracedModel,
        placement: StagePlacement,
        *,
        num_microbatches: int,
        schedule: str = "gpipe",
        gradient_accumulation_steps: int = 1,
        recompute: bool = False,
        weight_prediction: bool = False,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        weights_path: str | os.PathLike | None = None,
        autocast_dtype: torch.dtype | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise PipelineError(
                "torch.distributed is not initialised; start the job with `accelerate launch` or `torchrun`"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device)
        self.graph = traced.cost_graph
        self.num_microbatches = num_microbatches
        self.stage_rank = list(placement.stage_device)
        if max(self.stage_rank) + 1 != self.world_size:
            raise PipelineError(
                f"the partition places stages on {max(self.stage_rank) + 1} GPUs but {self.world_size} "
                f"processes were started; launch with --num_processes {max(self.stage_rank) + 1} or "
                "recompute the partition for this number of processes"
            )
        self.specs = plan_stages(self.graph, placement.node_stage)
        if len(self.specs) != len(self.stage_rank):
            raise PartitionError(f"the partition has {len(self.specs)} stages but places {len(self.stage_rank)}")
        self.local_stages = [s for s, r in enumerate(self.stage_rank) if r == self.rank]
        edges = sorted({(spec.stage_index, c) for spec in self.specs for cs in spec.consumers.values() for c in cs})
        try:
            self.schedule: Schedule = make_schedule(
                schedule,
                self.stage_rank,
                num_microbatches,
                edges,
                gradient_accumulation_steps=gradient_accumulation_steps,
            )
        except ValueError as error:
            raise PipelineError(str(error)) from error
        self.streaming = isinstance(self.schedule, StreamingSchedule)
        self._limits = [in_flight(schedule, s, self.stage_rank, num_microbatches) for s in range(len(self.stage_rank))]
        """Micro-batches each stage holds at most between forward and backward (the schedules' rule)."""
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.recompute = recompute
        if weight_prediction and schedule != "async":
            raise PipelineError(
                f"weight prediction is for the 'async' schedule (stale gradients); {schedule!r} has none to predict"
            )
        self.weight_prediction = weight_prediction
        self.autocast_dtype = autocast_dtype
        self.loss_scale = 1.0
        """Multiplies the loss's gradient at the start of the backward (float16 loss scaling,
        `hf_ftpipe.trainer.loss_scale`); the gradients come out scaled by it, the loss returned is not."""
        self._autocast_dtypes = (
            autocast_dtypes(traced.graph_module, self.device, autocast_dtype) if autocast_dtype is not None else {}
        )
        self.loss_stage = next((s.stage_index for s in self.specs if "loss" in s.model_outputs), None)
        self.loss_value = None if self.loss_stage is None else self.specs[self.loss_stage].model_outputs["loss"]
        self.transfers = plan_transfers(
            self.graph, self.specs, self.stage_rank, self.world_size, self.loss_value, self._autocast_dtypes
        )
        p2p_group = dist.new_group(list(range(self.world_size)))
        self.messenger = Messenger(
            self.rank, timeout_s, run_id=f"engine-{next(_run_counter)}", p2p_group=p2p_group, watchdog=watchdog
        )
        # Collective set-up first: a rank that fails below must not leave the others in new_group.
        self.weight_sync = WeightSync(self.graph, self.specs, self.stage_rank, self.messenger, self.device)
        try:
            self.modules = self._build_modules(traced, weights_path)
        except Exception as error:
            message = f"[rank {self.rank}, stages {self.local_stages}] could not build its stages: {error}"
            self.messenger.report_failure(message)
            raise PipelineError(message) from error
        self.module = nn.ModuleDict({str(s): m for s, m in self.modules.items()})
        self.versions = (
            {s: StageVersions(m, keep_previous=schedule == "2bw") for s, m in self.modules.items()}
            if self.streaming
            else {}
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self._pending_grads: PendingGradients = {}
        """Streaming schedules: gradients waiting for their stage's next update (see `_update`)."""
        self.max_grad_norm: float | None = None
        self._update_norms: list[torch.Tensor] = []
        self.version_log: list[tuple[int, ...]] = []
        """Streaming schedules: ``(stage, micro-batch, weights version)`` of every forward run here
        (with weight prediction also the number of updates predicted ahead)."""
        self._orders: dict[bool, list[Action]] = {}
        self._reset_state()

    def _reset_state(self) -> None:
        """Per-micro-batch state; streaming schedules carry it from one step to the next."""
        self._data: dict[int, dict[str, Any]] = {}
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._received: dict[tuple[str, int], torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self._grads: dict[tuple[str, int], torch.Tensor] = {}
        self._grad_parts_left: dict[tuple[str, int], int] = {}
        self._used_version: dict[tuple[int, int], int] = {}
        self._posted: dict[Message, tuple[dist.Work, torch.Tensor]] = {}
        self._unposted: list[Message] = []
        self._consumers_left: dict[tuple[str, int, int], int] = {}
        self._actions_left: dict[int, int] = {}
        self._version_base = {s: v.updates for s, v in self.versions.items()}
        self._predicted: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._backwards = dict.fromkeys(self.local_stages, 0)  # since the pipeline was last empty
        self._loss_weight: dict[int, float] = {}
        """Micro-batch → its weight in its mini-batch's loss, until every rank has read its loss."""
        self._loss_seed: dict[int, float] = {}
        """Micro-batch → the gradient its loss stage seeds the backward with, until that backward."""
        self._deliveries = Deliveries(self.messenger, self._limits)

    def _build_modules(self, traced: TracedModel, weights_path: str | os.PathLike | None) -> dict[int, fx.GraphModule]:
        modules = {
            s: build_stage_module(
                traced.graph_module, self.specs[s], traced.canonical_names, traced.tensors, self.device
            )
            for s in self.local_stages
        }
        if weights_path is not None:
            load_stage_weights(modules, self.graph, weights_path, self.device)
        empty = [name for m in modules.values() for name, t in m.state_dict().items() if t.is_meta]
        if empty:
            raise PipelineError(
                f"{len(empty)} weights of this rank's stages are empty (meta), e.g. {empty[:3]}; the model "
                "was built without weights: pass `weights_path` (a folder written by save_pretrained)"
            )
        return {s: module.to(self.device) for s, module in modules.items()}

    # -- public API -------------------------------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original (canonical) names, each once."""
        seen: set[int] = set()
        for module in self.modules.values():
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights and buffers under the model's own (canonical) names, constants left out."""
        state: dict[str, torch.Tensor] = {}
        for module in self.modules.values():
            for name, tensor in module.state_dict().items():
                info = self.graph.params.get(name)
                if info is not None and info.in_state_dict:
                    state[name] = tensor
        return state

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank ``dst`` (CPU tensors, canonical names); ``None`` elsewhere.

        Every rank must call it. A streaming pipeline is drained first.
        """
        self.drain()
        names = [name for name in self.weight_sync.holders if self.graph.params[name].in_state_dict]
        return self.weight_sync.gather(self.state_dict(), names, dst)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every stage (a tied weight counted once); returns the norm."""
        return self.weight_sync.clip_grad_norm_(dict(self.named_parameters()), max_norm)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None) -> None:
        """The optimizer over `parameters` that ``async`` and ``2bw`` step inside `train_step`.

        Each update steps only the updating stage's parameters. ``max_grad_norm`` clips each update
        by the norm of that stage's gradients: the global norm would need every stage at once,
        which is exactly what a pipeline without flushes never has.
        """
        if self.weight_prediction:
            check_predictable(optimizer)
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        if self.streaming:
            self.weight_sync.remember_tied(dict(self.named_parameters()))

    def step_grad_norm(self) -> torch.Tensor:
        """Streaming schedules: the largest gradient norm of any stage update during the last step,
        over every rank (before clipping); 0 when no update ran."""
        local = torch.stack(self._update_norms).max() if self._update_norms else torch.zeros(())
        norm = local.to(self.device, torch.float32)
        self.messenger.all_reduce(norm, dist.group.WORLD, "update gradient norms", op=dist.ReduceOp.MAX)
        return norm

    def train_step(self, batch: Mapping[str, Any], loss_weights: Sequence[float] | None = None) -> torch.Tensor:
        """Forward and backward of one mini-batch; returns, on every rank, the loss of the
        micro-batches whose forward finished during this step.

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
        """
        if self.streaming and self.optimizer is None:
            raise PipelineError(
                f"the {self.schedule.name!r} schedule updates weights inside the pipeline; call "
                "`attach_optimizer(optimizer)` before the first train_step"
            )
        microbatches = self._split(batch)
        weights = self._check_loss_weights(loss_weights)
        self._update_norms.clear()
        if isinstance(self.schedule, StreamingSchedule):
            first = self.schedule.given
            order = self.schedule.next_step()
        else:
            first = 0
            order = self._order(training=True)
        for offset, microbatch in enumerate(microbatches):
            self._data[first + offset] = microbatch
            self._loss_weight[first + offset] = weights[offset]
        self.module.train(True)
        losses = self._run(order, training=True)
        if not self.streaming:
            self._flush()
            self.weight_sync.sum_tied_gradients(dict(self.named_parameters()))
        else:  # this step's sends may be received in the next step; the previous step's are done
            self._flush(older_than=self.messenger.generation)
            self.messenger.generation += 1
        return self._mean_loss(losses)

    def drain(self) -> None:
        """Finish every micro-batch still in flight (``async``, ``2bw``) and apply their updates;
        then tied copies on different ranks are made equal again (see `WeightSync.reconcile_tied`).
        Every rank must call it. A no-op for flushing schedules or an empty pipeline."""
        if not isinstance(self.schedule, StreamingSchedule) or self.schedule.given == 0:
            return
        order = self.schedule.drain()
        self.module.train(True)
        self._run(order, training=True)
        self._flush()
        for versions in self.versions.values():
            versions.settle()
        self.weight_sync.reconcile_tied(dict(self.named_parameters()))
        self._reset_state()

    @torch.no_grad()
    def eval_step(
        self, batch: Mapping[str, Any], output_names: tuple[str, ...] = ("loss", "logits")
    ) -> dict[str, torch.Tensor]:
        """Forward only; returns the requested model outputs, concatenated over micro-batches, on every rank.

        A streaming pipeline is drained first, so evaluation sees the latest weights.
        """
        self.drain()
        for offset, microbatch in enumerate(self._split(batch)):
            self._data[offset] = microbatch
        self.module.train(False)
        losses = [loss for _, loss in self._run(self._order(training=False), training=False)]
        self._flush()
        outputs: dict[str, torch.Tensor] = {}
        for name in output_names:
            owner = next((s for s in self.specs if name in s.model_outputs), None)
            if owner is None:
                continue
            value = owner.model_outputs[name]
            if value == self.loss_value and len(losses) == self.num_microbatches:  # already on every rank
                outputs[name] = torch.stack(losses)
                continue
            shape, dtype = value_shape(self.graph, value, self._autocast_dtypes)
            pieces = []
            for m in range(self.num_microbatches):
                local = self._outputs.get((value, m)) if self.stage_rank[owner.stage_index] == self.rank else None
                tensor = (
                    local.detach().to(dtype, copy=True)
                    if local is not None
                    else torch.empty(shape, dtype=dtype, device=self.device)
                )
                pieces.append(self.messenger.broadcast(tensor, self.stage_rank[owner.stage_index], name))
            outputs[name] = torch.stack(pieces) if pieces[0].dim() == 0 else torch.cat(pieces)
        self._reset_state()
        return outputs

    def train(self, mode: bool = True) -> PipelineEngine:
        self.module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)

    # -- the step ---------------------------------------------------------------------------

    def _order(self, training: bool) -> list[Action]:
        """The flushing order of one mini-batch (forwards only for evaluation), computed once."""
        if training not in self._orders:
            if training:
                order = self.schedule.global_order()
            else:  # GPipe's forwards: each stage streams its micro-batches on to the next
                gpipe = ScheduleGPipe(self.stage_rank, self.num_microbatches, self.schedule.edges)
                order = [a for a in gpipe.global_order() if a.computation == "F"]
            self._orders[training] = order
        return self._orders[training]

    def _run(self, order: Sequence[Action], training: bool) -> list[tuple[int, torch.Tensor]]:
        """Perform this rank's actions of ``order``; returns ``(micro-batch, loss)`` of every loss
        computed in it, here or on the rank that holds the loss stage."""
        messages = [
            (position, message)
            for position, message in plan_messages(
                order, self.specs, self.stage_rank, self.transfers, self._consumers_left
            )
            if message.dst == self.rank
        ]
        for message in self._unposted:  # sent in an earlier step, read in this one
            self._post(message)
        posted = 0
        losses: list[tuple[int, torch.Tensor]] = []
        for position, action in enumerate(order):
            if self.stage_rank[action.stage_index] != self.rank:
                continue
            while posted < len(messages) and messages[posted][0] < position:
                self._post(messages[posted][1])
                posted += 1
            try:
                if action.computation == "F":
                    loss = self._forward(action, training)
                    if loss is not None:
                        losses.append((action.microbatch_index, loss))
                elif action.computation == "B":
                    self._backward(action)
                else:
                    self._update(action.stage_index)
            except Exception as error:
                doing = {"F": "forward", "B": "backward", "U": "weight update"}[action.computation]
                context = (
                    f"[rank {self.rank}, stage {action.stage_index}] micro-batch {action.microbatch_index}, {doing}"
                )
                if isinstance(error, PipelineError):  # a transfer failed: say what this rank was doing
                    detail = str(error).removeprefix(f"[rank {self.rank}] ")
                    message, report = f"{context}: {detail}", f"{context}: {detail}"
                else:
                    message = f"{context}: {type(error).__name__}: {error}"
                    report = message + "\n" + traceback.format_exc(limit=6)
                self.messenger.report_failure(report)
                raise PipelineError(message) from error
            if action.computation != "U" and training:
                self._action_done(action.microbatch_index)
        # The losses computed elsewhere in this order: post what the owner sends up to the last of
        # them (NCCL matches in send order), then read them.
        loss_at = [i for i, (_, message) in enumerate(messages) if message.value == self.loss_value]
        if loss_at:
            for _, message in messages[posted : loss_at[-1] + 1]:
                self._post(message)
            posted = max(posted, loss_at[-1] + 1)
            for i in loss_at:
                message = messages[i][1]
                losses.append(
                    (message.microbatch, self._take(message, f"the loss of micro-batch {message.microbatch}"))
                )
        self._unposted = [message for _, message in messages[posted:]]
        return losses

    def _action_done(self, m: int) -> None:
        """Forget micro-batch ``m`` once this rank ran all its forwards and backwards of it."""
        left = self._actions_left.get(m, 2 * len(self.local_stages)) - 1
        if left:
            self._actions_left[m] = left
            return
        self._actions_left.pop(m, None)
        self._data.pop(m, None)
        for store in (self._outputs, self._received, self._grads):
            for key in [k for k in store if k[1] == m]:
                del store[key]

    def _split(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The rank's own copy of the mini-batch as micro-batches of the traced shape."""
        microbatches: list[dict[str, Any]] = [{} for _ in range(self.num_microbatches)]
        for name, info in self.graph.inputs.items():
            if info.shape is None:
                for mb in microbatches:
                    mb[name] = info.constant
                continue
            if name not in batch:
                raise PipelineError(
                    f"the batch has no {name!r}, which the traced model reads; batch keys: {sorted(batch)}"
                )
            tensor = torch.as_tensor(batch[name])
            expected = info.shape[0] * self.num_microbatches
            if tensor.shape[0] < self.num_microbatches:
                raise PipelineError(
                    f"the batch has {tensor.shape[0]} samples, fewer than num_microbatches={self.num_microbatches}; "
                    "raise the batch size or lower num_microbatches"
                )
            if tuple(tensor.shape) != (expected, *info.shape[1:]):
                raise PipelineError(
                    f"{name!r} has shape {tuple(tensor.shape)} but the pipeline was traced for "
                    f"{self.num_microbatches} micro-batches of {info.shape} = {(expected, *info.shape[1:])}; "
                    "pad inputs to a fixed length and drop incomplete batches (dataloader_drop_last=True)"
                )
            for m, piece in enumerate(tensor.to(self.device).chunk(self.num_microbatches)):
                microbatches[m][name] = piece
        return microbatches

    def _forward(self, action: Action, training: bool) -> torch.Tensor | None:
        spec = self.specs[action.stage_index]
        m = action.microbatch_index
        leaves = []
        for value in spec.received:
            tensor = self._incoming(value, m)
            leaf = tensor.detach()
            if training and self.graph.node(value)["requires_grad"] and leaf.is_floating_point():
                leaf.requires_grad_(True)
            leaves.append(leaf)
        args = [*[self._data[m][name] for name in spec.batch_inputs], *leaves]
        module = self.modules[spec.stage_index]
        if training and self.streaming:
            version = self._version_for(spec.stage_index, m)
            self._used_version[(spec.stage_index, m)] = version
            if self.weight_prediction:
                assert self.optimizer is not None
                older = sum(1 for stage, _ in self._saved if stage == spec.stage_index)
                ahead = updates_ahead(self._backwards[spec.stage_index], older, self.gradient_accumulation_steps)
                weights = predicted_weights(dict(module.named_parameters()), self.optimizer, ahead)
                self._predicted[(spec.stage_index, m)] = weights
                self.version_log.append((spec.stage_index, m, version, ahead))
            else:
                weights = self.versions[spec.stage_index].acquire(version)
                self.version_log.append((spec.stage_index, m, version))

            def run(*inputs: Any) -> tuple[torch.Tensor, ...]:
                return functional_call(module, weights, inputs, strict=False)
        else:
            run = module
        autocast = torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)
        with torch.set_grad_enabled(training), autocast:
            if training and self.recompute:  # keep the inputs only; run the forward again in backward
                outputs = checkpoint(run, *args, use_reentrant=False)
            else:
                outputs = run(*args)
        if training:
            self._saved[(spec.stage_index, m)] = (leaves, outputs)
        for value, tensor in zip(spec.sent, outputs, strict=True):
            if spec.consumers[value] and any(self.stage_rank[c] == self.rank for c in spec.consumers[value]):
                self._outputs[(value, m)] = tensor
            elif not training:
                self._outputs[(value, m)] = tensor  # model outputs, collected by eval_step
            transfer = self.transfers.get(value)
            if transfer is not None:
                for dst in transfer.target_ranks:
                    send_id = self.messenger.send(
                        tensor.to(transfer.dtype),
                        dst,
                        self._tag(transfer, m, backward=False),
                        f"{value} of micro-batch {m}",
                    )
                    if training and transfer.carries_gradient and dst in transfer.reader_ranks:
                        self._deliveries.activation_sent(value, m, dst, send_id)
        if "loss" in spec.model_outputs:
            if training:
                self._loss_seed[m] = self._seed(m)
            return outputs[spec.sent.index(spec.model_outputs["loss"])].detach()
        return None

    def _version_for(self, stage: int, m: int) -> int:
        """The weights a forward runs on: ``async`` the newest; ``2bw`` those from before the
        previous update (mini-batch b runs on W(b - 1); the first two on the initial weights)."""
        versions = self.versions[stage]
        if self.schedule.name == "async":
            return versions.updates
        return self._version_base[stage] + max(m // self.num_microbatches - 1, 0)

    def _backward(self, action: Action) -> None:
        spec = self.specs[action.stage_index]
        m = action.microbatch_index
        leaves, outputs = self._saved.pop((spec.stage_index, m))
        roots, grads = [], []
        for value, tensor in zip(spec.sent, outputs, strict=True):
            if spec.model_outputs.get("loss") == value:
                seed = self._loss_seed.pop(m, 0.0)
                if seed and tensor.requires_grad:  # weight 0: a NaN loss must not reach the gradients
                    roots.append(tensor)
                    grads.append(torch.full_like(tensor, seed))
            elif spec.consumers.get(value):
                grad = self._output_grad(value, m)
                if grad is not None and tensor.requires_grad:
                    roots.append(tensor)
                    grads.append(grad.to(tensor.dtype))  # autocast may have made a bfloat16 output
        if roots:
            torch.autograd.backward(roots, grads)
        if self.weight_prediction:
            self._used_version.pop((spec.stage_index, m))
            move_gradients(
                self._predicted.pop((spec.stage_index, m)),
                dict(self.modules[spec.stage_index].named_parameters()),
                self._pending_grads,
            )
            self._backwards[spec.stage_index] += 1
        elif self.streaming:
            version = self._used_version.pop((spec.stage_index, m))
            self.versions[spec.stage_index].backward_done(version, self._pending_grads)
        for value, leaf in zip(spec.received, leaves, strict=True):
            if leaf.requires_grad:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._deliver_grad(value, m, grad)

    def _update(self, stage: int) -> None:
        """Step the optimizer on ``stage``'s parameters only, keeping stashed versions intact.

        Only this stage's pending gradients are put in ``param.grad`` for the step and taken out
        after it, so every other parameter has none and the optimizer leaves it alone.
        """
        assert self.optimizer is not None
        params = list(self.modules[stage].parameters())
        for param in params:
            param.grad = self._pending_grads.pop(param, None)
        stepped = [p for p in params if p.grad is not None]
        if stepped:  # the norm is logged; clipping would multiply every gradient even by 1
            if self.max_grad_norm is None:
                norm = torch.nn.utils.get_total_norm([p.grad for p in stepped])
            else:
                norm = torch.nn.utils.clip_grad_norm_(stepped, self.max_grad_norm)
            self._update_norms.append(norm.detach().float())
        self.versions[stage].before_update(lambda: [t for v in self.versions.values() for t in v.live_tensors()])
        self.optimizer.step()
        for param in params:
            param.grad = None
        self.versions[stage].after_update()

    # -- data movement ----------------------------------------------------------------------

    def _post(self, message: Message) -> None:
        transfer = self.transfers[message.value]
        self._posted[message] = self.messenger.post_recv(
            transfer.shape,
            transfer.dtype,
            self.device,
            message.src,
            self._tag(transfer, message.microbatch, message.backward),
        )

    def _take(self, message: Message, what: str) -> torch.Tensor:
        if message not in self._posted:  # every message is planned; this would be a bug
            raise PipelineError(f"[rank {self.rank}] {what} from rank {message.src} was never expected")
        work, buffer = self._posted.pop(message)
        self.messenger.wait(work, f"receiving {what} from rank {message.src}")
        return buffer

    def _incoming(self, value: str, m: int) -> torch.Tensor:
        if (value, m) in self._outputs:
            return self._outputs[(value, m)]
        if (value, m) not in self._received:
            transfer = self.transfers[value]
            message = Message(transfer.source_rank, self.rank, value, m, backward=False)
            self._received[(value, m)] = self._take(message, f"{value} of micro-batch {m}")
            self._deliveries.forward_ran(transfer.producer_stage, m)
        return self._received[(value, m)]

    def _flush(self, older_than: int | None = None) -> None:
        self.messenger.flush(older_than)
        self._deliveries.forget_finished()

    def _output_grad(self, value: str, m: int) -> torch.Tensor | None:
        """The gradient of a sent value: local consumers' share plus one message per remote rank."""
        grad = self._grads.pop((value, m), None)
        transfer = self.transfers.get(value)
        if transfer is not None and transfer.carries_gradient:
            for src in transfer.reader_ranks:
                message = Message(src, self.rank, value, m, backward=True)
                remote = self._take(message, f"gradient of {value} for micro-batch {m}")
                grad = remote if grad is None else grad + remote
                self._deliveries.gradient_came_back(value, m, src)
        return grad

    def _deliver_grad(self, value: str, m: int, grad: torch.Tensor) -> None:
        """Add a consumer's gradient; once every local consumer gave its share, send it if remote."""
        key = (value, m)
        self._grads[key] = grad if key not in self._grads else self._grads[key] + grad
        transfer = self.transfers.get(value)
        if transfer is None or transfer.source_rank == self.rank:
            return  # produced here: the producer's backward picks the sum up
        if key not in self._grad_parts_left:
            consumers = self.specs[transfer.producer_stage].consumers[value]
            self._grad_parts_left[key] = sum(1 for s in consumers if self.stage_rank[s] == self.rank)
        self._grad_parts_left[key] -= 1
        if self._grad_parts_left[key] == 0:
            send_id = self.messenger.send(
                self._grads.pop(key).to(transfer.dtype),
                transfer.source_rank,
                self._tag(transfer, m, backward=True),
                f"gradient of {value} for micro-batch {m}",
            )
            self._deliveries.gradient_sent(transfer.producer_stage, m, send_id)
            del self._grad_parts_left[key]

    def _tag(self, transfer: Transfer, m: int, backward: bool) -> int:
        # Messages with one tag between two ranks arrive in the order sent, so indices may wrap.
        return (transfer.value_id * 2 + int(backward)) * self.num_microbatches + m % self.num_microbatches

    # -- after the micro-batches ------------------------------------------------------------

    def _check_loss_weights(self, loss_weights: Sequence[float] | None) -> list[float]:
        if loss_weights is None:
            return [1.0 / self.num_microbatches] * self.num_microbatches
        weights = [float(w) for w in loss_weights]
        if len(weights) != self.num_microbatches or any(not w >= 0 for w in weights):
            raise PipelineError(
                f"`loss_weights` needs one weight >= 0 per micro-batch ({self.num_microbatches}), got {weights}"
            )
        return weights

    def _seed(self, m: int) -> float:
        """The gradient of the step's loss with respect to micro-batch ``m``'s loss."""
        weight = self._loss_weight.get(m, 1.0 / self.num_microbatches) * self.loss_scale
        if self.schedule.name == "async":  # the update averages over its own group of micro-batches
            return weight * self.num_microbatches / self.gradient_accumulation_steps
        return weight

    def _mean_loss(self, losses: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """The weighted loss of a step's micro-batches, which every rank has (see `Transfer.target_ranks`).

        Exactly ``sum(w[m] * loss[m])`` when they are one whole mini-batch; otherwise the mean of
        ``w[m] * num_microbatches * loss[m]``. Losses of weight 0 (NaN: no label) are left out.
        """
        weights = [self._loss_weight.pop(m, 1.0 / self.num_microbatches) for m, _ in losses]
        if not losses:
            return torch.tensor(float("nan"), device=self.device)
        values = torch.stack([loss.float() for _, loss in losses])
        scale = torch.tensor(weights, dtype=values.dtype, device=values.device)
        total = torch.where(scale > 0, values * scale, torch.zeros_like(values)).sum()
        if len(losses) == self.num_microbatches:
            return total
        return total * self.num_microbatches / len(losses)
