"""One rank's weights as a model's: parameters and state dict under the model's own names, the
whole model gathered onto one rank, gradients clipped by the global norm.

A mixin of `PipelineEngine`, which holds the stage modules, the graph and the `WeightSync` of
weights shared between ranks (tied embeddings), and drains a streaming pipeline before the weights
are read whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.rank_stages import rank_parameters, rank_state_dict
from hf_ftpipe.runtime.weight_sync import WeightSync

__all__ = ["RankWeights"]


class RankWeights:
    modules: dict[int, nn.Module]
    graph: CostGraph
    weight_sync: WeightSync

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
