"""The stages one rank runs, built from the traced graph, with their weights."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import fx

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module
from hf_ftpipe.runtime.weights import load_stage_weights

if TYPE_CHECKING:
    from hf_ftpipe.graph.trace import TracedModel

__all__ = ["build_rank_stages"]


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
