"""The stages one rank runs, built from the traced graph, with their weights under the model's own names."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module
from hf_ftpipe.runtime.weights import load_stage_weights

if TYPE_CHECKING:
    from hf_ftpipe.graph.trace import TracedModel

__all__ = ["build_rank_stages", "rank_parameters", "rank_state_dict"]


def build_rank_stages(
    traced: TracedModel,
    specs: Sequence[StageSpec],
    local_stages: Sequence[int],
    weights_path: str | os.PathLike | None,
    device: torch.device,
) -> dict[int, fx.GraphModule]:
    """Stage index → module for ``local_stages``, weights loaded from ``weights_path`` when given."""
    modules = {
        s: build_stage_module(traced.graph_module, specs[s], traced.canonical_names, traced.tensors, device)
        for s in local_stages
    }
    if weights_path is not None:
        load_stage_weights(modules, traced.cost_graph, weights_path, device)
    empty = [name for m in modules.values() for name, t in m.state_dict().items() if t.is_meta]
    if empty:
        raise PipelineError(
            f"{len(empty)} weights of this rank's stages are empty (meta), e.g. {empty[:3]}; the model "
            "was built without weights: pass `weights_path` (a folder written by save_pretrained)"
        )
    return {s: module.to(device) for s, module in modules.items()}


def rank_parameters(modules: Mapping[int, nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """The stages' parameters under their original (canonical) names, each once (stages on one
    rank share a tied weight)."""
    seen: set[int] = set()
    for module in modules.values():
        for name, param in module.named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield name, param


def rank_state_dict(modules: Mapping[int, nn.Module], graph: CostGraph) -> dict[str, torch.Tensor]:
    """The stages' weights and buffers under the model's own (canonical) names, constants left out."""
    state: dict[str, torch.Tensor] = {}
    for module in modules.values():
        for name, tensor in module.state_dict().items():
            info = graph.params.get(name)
            if info is not None and info.in_state_dict:
                state[name] = tensor
    return state
