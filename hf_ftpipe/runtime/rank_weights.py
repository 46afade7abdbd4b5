"""One rank's weights as a model's: parameters and state dict under the model's own names, the
whole model gathered onto one rank, gradients clipped by the global norm, the optimizer that
streaming schedules step inside the pipeline.

A mixin of `PipelineEngine`, which holds the stage modules, the graph and the `WeightSync` of
weights shared between ranks (tied embeddings), and drains a streaming pipeline before the weights
are read whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.comm import Messenger
from hf_ftpipe.runtime.prediction import check_predictable
from hf_ftpipe.runtime.rank_stages import rank_parameters, rank_state_dict
from hf_ftpipe.runtime.weight_sync import WeightSync

__all__ = ["RankWeights"]


class RankWeights:
    modules: dict[int, nn.Module]
    graph: CostGraph
    weight_sync: WeightSync
    messenger: Messenger
    device: torch.device
    streaming: bool
    weight_prediction: bool
    optimizer: torch.optim.Optimizer | None
    max_grad_norm: float | None
    _update_norms: list[torch.Tensor]

    drain: Callable[[], None]
    """`PipelineEngine.drain`: finishes the micro-batches in flight."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original (canonical) names, each once."""
        return rank_parameters(self.modules)

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights and buffers under the model's own (canonical) names, constants left out."""
        return rank_state_dict(self.modules, self.graph)

    def gather_state_dict(self, dst: int = 0, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank ``dst`` (CPU tensors, canonical names); ``None`` elsewhere.

        With ``trainable_only``, the parameters that train alone (a LoRA model's adapter: its frozen
        base never changes). Every rank must call it, alike. A streaming pipeline is drained first.
        """
        self.drain()
        params = self.graph.params
        names = [
            name
            for name in self.weight_sync.holders
            if params[name].in_state_dict and (params[name].requires_grad or not trainable_only)
        ]
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
        over every rank of the pipeline (before clipping; replicas update alike); 0 when no update ran."""
        local = torch.stack(self._update_norms).max() if self._update_norms else torch.zeros(())
        norm = local.to(self.device, torch.float32)
        self.messenger.all_reduce(norm, self.messenger.pipeline_group, "update gradient norms", op=dist.ReduceOp.MAX)
        return norm
