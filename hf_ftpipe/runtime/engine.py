"""The pipeline engine: one rank's stages, driven through a schedule, one mini-batch at a time.

Every rank builds the same traced graph and stage plan, then keeps only its own stages (any
set, adjacent or not). A step splits the rank's own copy of the mini-batch into micro-batches,
performs the rank's actions in schedule order, exchanges activations and their gradients with
the ranks that hold neighbouring stages, sums the gradients of weights that several ranks hold
(tied embeddings), and leaves the gradients in the local parameters for the optimizer.
"""

from __future__ import annotations

import itertools
import os
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import fx, nn

from ..errors import PartitionError, PipelineError
from ..graph.trace import TracedModel
from .comm import Messenger
from .schedule import Action, ScheduleGPipe
from .stage import build_stage_module, plan_stages
from .weight_sync import WeightSync
from .weights import load_stage_weights

__all__ = ["PipelineEngine", "StagePlacement"]

_run_counter = itertools.count()


class StagePlacement(Protocol):
    """What the engine needs of a partition: node → stage and stage → rank."""

    node_stage: dict[str, int]
    stage_device: list[int]


@dataclass
class _Transfer:
    """A value that crosses ranks: produced on one rank, read by stages on others."""

    value_id: int
    name: str
    producer_stage: int
    source_rank: int
    target_ranks: list[int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class PipelineEngine:
    """Runs one rank's share of a pipeline.

    Args:
        traced (`TracedModel`): the model captured on a micro-batch (every rank captures the same).
        placement (`StagePlacement`): the partition; ``stage_device[s]`` is the rank running stage ``s``.
        num_microbatches (`int`): micro-batches per mini-batch.
        device (`torch.device`): where this rank's stages run.
        timeout_s (`float`, defaults to 300): the longest wait for any transfer before the step fails.
        weights_path (`str`, *optional*): a checkpoint folder (safetensors) to read this rank's
            weights from, for a model built with empty weights (``accelerate.init_empty_weights``).
    """

    def __init__(
        self,
        traced: TracedModel,
        placement: StagePlacement,
        *,
        num_microbatches: int,
        device: torch.device | str = "cpu",
        timeout_s: float = 300.0,
        weights_path: str | os.PathLike | None = None,
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
        self.schedule = ScheduleGPipe(self.stage_rank, num_microbatches)
        self.actions = self.schedule.actions_of(self.rank)
        self.transfers = self._plan_transfers()
        self.loss_stage = next((s.stage_index for s in self.specs if "loss" in s.model_outputs), None)
        self.messenger = Messenger(self.rank, timeout_s, run_id=str(next(_run_counter)))
        # Collective set-up first: a rank that fails below must not leave the others in new_group.
        self.weight_sync = WeightSync(self.graph, self.specs, self.stage_rank, self.messenger, self.device)
        try:
            self.modules = self._build_modules(traced, weights_path)
        except Exception as error:
            message = f"[rank {self.rank}, stages {self.local_stages}] could not build its stages: {error}"
            self.messenger.report_failure(message)
            raise PipelineError(message) from error
        self.module = nn.ModuleDict({str(s): m for s, m in self.modules.items()})

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

        Every rank must call it.
        """
        names = [name for name in self.weight_sync.holders if self.graph.params[name].in_state_dict]
        return self.weight_sync.gather(self.state_dict(), names, dst)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global gradient norm over every stage (a tied weight counted once); returns the norm."""
        return self.weight_sync.clip_grad_norm_(dict(self.named_parameters()), max_norm)

    def train_step(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Forward and backward of one mini-batch; returns the mean micro-batch loss on every rank.

        Gradients are accumulated into the local parameters (call ``zero_grad`` between steps).
        """
        return self._step(batch, training=True)

    @torch.no_grad()
    def eval_step(
        self, batch: Mapping[str, Any], output_names: tuple[str, ...] = ("loss", "logits")
    ) -> dict[str, torch.Tensor]:
        """Forward only; returns the requested model outputs, concatenated over micro-batches, on every rank."""
        self._step(batch, training=False)
        outputs: dict[str, torch.Tensor] = {}
        for name in output_names:
            owner = next((s for s in self.specs if name in s.model_outputs), None)
            if owner is None:
                continue
            value = owner.model_outputs[name]
            shape, dtype = self._value_shape(value)
            pieces = []
            for m in range(self.num_microbatches):
                local = self._outputs.get((value, m)) if self.stage_rank[owner.stage_index] == self.rank else None
                tensor = (
                    local.detach().clone() if local is not None else torch.empty(shape, dtype=dtype, device=self.device)
                )
                pieces.append(self.messenger.broadcast(tensor, self.stage_rank[owner.stage_index], name))
            outputs[name] = torch.stack(pieces) if pieces[0].dim() == 0 else torch.cat(pieces)
        self._outputs.clear()
        return outputs

    def train(self, mode: bool = True) -> PipelineEngine:
        self.module.train(mode)
        return self

    def eval(self) -> PipelineEngine:
        return self.train(False)

    # -- the step ---------------------------------------------------------------------------

    def _step(self, batch: Mapping[str, Any], training: bool) -> torch.Tensor:
        microbatches = self._split(batch)
        self.module.train(training)
        self._outputs: dict[tuple[str, int], torch.Tensor] = {}
        self._received: dict[tuple[str, int], torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self._grads: dict[tuple[str, int], torch.Tensor] = {}
        self._grad_parts_left: dict[tuple[str, int], int] = {}
        self._losses: dict[int, torch.Tensor] = {}
        for action in self.actions:
            if action.computation == "B" and not training:
                continue
            try:
                if action.computation == "F":
                    self._forward(action, microbatches[action.microbatch_index], training)
                else:
                    self._backward(action)
            except PipelineError as error:
                self.messenger.report_failure(str(error))
                raise
            except Exception as error:
                message = (
                    f"[rank {self.rank}, stage {action.stage_index}] micro-batch {action.microbatch_index}, "
                    f"{'forward' if action.computation == 'F' else 'backward'}: {type(error).__name__}: {error}"
                )
                self.messenger.report_failure(message + "\n" + traceback.format_exc(limit=6))
                raise PipelineError(message) from error
        self.messenger.flush()
        if training:
            self.weight_sync.sum_tied_gradients(dict(self.named_parameters()))
        loss = self._mean_loss()
        if training:
            self._outputs.clear()
        self._saved.clear()
        self._received.clear()
        self._grads.clear()
        return loss

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

    def _forward(self, action: Action, microbatch: dict[str, Any], training: bool) -> None:
        spec = self.specs[action.stage_index]
        m = action.microbatch_index
        leaves = []
        for value in spec.received:
            tensor = self._incoming(value, m)
            leaf = tensor.detach()
            if training and self.graph.node(value)["requires_grad"] and leaf.is_floating_point():
                leaf.requires_grad_(True)
            leaves.append(leaf)
        with torch.set_grad_enabled(training):
            outputs = self.modules[spec.stage_index](*[microbatch[name] for name in spec.batch_inputs], *leaves)
        if training:
            self._saved[(spec.stage_index, m)] = (leaves, outputs)
        for value, tensor in zip(spec.sent, outputs, strict=True):
            self._outputs[(value, m)] = tensor
            transfer = self.transfers.get(value)
            if transfer is not None:
                for dst in transfer.target_ranks:
                    self.messenger.send(
                        tensor, dst, self._tag(transfer, m, backward=False), f"{value} of micro-batch {m}"
                    )
        if "loss" in spec.model_outputs:
            self._losses[m] = outputs[spec.sent.index(spec.model_outputs["loss"])].detach()

    def _backward(self, action: Action) -> None:
        spec = self.specs[action.stage_index]
        m = action.microbatch_index
        leaves, outputs = self._saved.pop((spec.stage_index, m))
        roots, grads = [], []
        for value, tensor in zip(spec.sent, outputs, strict=True):
            if not tensor.requires_grad:
                continue
            if spec.model_outputs.get("loss") == value:
                roots.append(tensor)
                grads.append(torch.full_like(tensor, 1.0 / self.num_microbatches))
            elif spec.consumers.get(value):
                grad = self._output_grad(value, m)
                if grad is not None:
                    roots.append(tensor)
                    grads.append(grad)
        if roots:
            torch.autograd.backward(roots, grads)
        for value, leaf in zip(spec.received, leaves, strict=True):
            if leaf.requires_grad:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._deliver_grad(value, m, grad)

    # -- data movement ----------------------------------------------------------------------

    def _incoming(self, value: str, m: int) -> torch.Tensor:
        if (value, m) in self._outputs:
            return self._outputs[(value, m)]
        if (value, m) not in self._received:
            transfer = self.transfers[value]
            self._received[(value, m)] = self.messenger.recv(
                transfer.shape,
                transfer.dtype,
                self.device,
                transfer.source_rank,
                self._tag(transfer, m, backward=False),
                f"{value} of micro-batch {m}",
            )
        return self._received[(value, m)]

    def _output_grad(self, value: str, m: int) -> torch.Tensor | None:
        """The gradient of a sent value: local consumers' share plus one message per remote rank."""
        if not self.graph.node(value)["requires_grad"]:
            return None
        grad = self._grads.pop((value, m), None)
        transfer = self.transfers.get(value)
        if transfer is not None:
            for src in transfer.target_ranks:
                remote = self.messenger.recv(
                    transfer.shape,
                    transfer.dtype,
                    self.device,
                    src,
                    self._tag(transfer, m, backward=True),
                    f"gradient of {value} for micro-batch {m}",
                )
                grad = remote if grad is None else grad + remote
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
            self.messenger.send(
                self._grads.pop(key),
                transfer.source_rank,
                self._tag(transfer, m, backward=True),
                f"gradient of {value} for micro-batch {m}",
            )
            del self._grad_parts_left[key]

    def _tag(self, transfer: _Transfer, m: int, backward: bool) -> int:
        return (transfer.value_id * self.num_microbatches + m) * 2 + int(backward)

    def _plan_transfers(self) -> dict[str, _Transfer]:
        transfers: dict[str, _Transfer] = {}
        for spec in self.specs:
            source = self.stage_rank[spec.stage_index]
            for value in spec.sent:
                targets = sorted({self.stage_rank[c] for c in spec.consumers[value]} - {source})
                if not targets:
                    continue
                shape, dtype = self._value_shape(value)
                transfers[value] = _Transfer(
                    value_id=len(transfers),
                    name=value,
                    producer_stage=spec.stage_index,
                    source_rank=source,
                    target_ranks=targets,
                    shape=shape,
                    dtype=dtype,
                    requires_grad=bool(self.graph.node(value)["requires_grad"]),
                )
        return transfers

    def _value_shape(self, value: str) -> tuple[tuple[int, ...], torch.dtype]:
        attrs = self.graph.node(value)
        return tuple(attrs["output_shapes"][0]), getattr(torch, attrs["output_dtypes"][0])

    # -- after the micro-batches ------------------------------------------------------------

    def _mean_loss(self) -> torch.Tensor:
        if self.loss_stage is None:
            return torch.tensor(float("nan"))
        owner = self.stage_rank[self.loss_stage]
        if owner == self.rank:
            loss = torch.stack([self._losses[m] for m in range(self.num_microbatches)]).mean().float()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        return self.messenger.broadcast(loss, owner, "the loss")
