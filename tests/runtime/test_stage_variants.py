"""`hf_ftpipe.runtime.stage_variants`: a capture at another shape whose stages would hand on other
values than the planned graph's is refused, naming the stage and the values (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime.rank_stages import build_rank_stages
from hf_ftpipe.runtime.stage import plan_stages
from hf_ftpipe.runtime.stage_variants import build_variant

CPU = torch.device("cpu")


class _HalvesLongSequences(nn.Module):
    """Scales the hidden states of sequences longer than 8 tokens: only long ones run that ``mul``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 4)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.first(self.embed(input_ids))
        if int(input_ids.shape[1]) > 8:  # an int: export fixes the length
            hidden = hidden * 0.5
        return {"loss": self.second(hidden).sum()}


def test_a_capture_whose_stages_send_other_values_is_refused_by_name() -> None:
    model = _HalvesLongSequences()
    planned = capture_model(model, {"input_ids": torch.ones(2, 16, dtype=torch.long)})
    order = planned.cost_graph.topological_order()
    cut = next(i for i, name in enumerate(order) if planned.cost_graph.node(name)["op"] == "aten.mul.Tensor")
    node_stage = {name: int(i > cut) for i, name in enumerate(order)}  # stage 0 ends with the mul
    specs = plan_stages(planned.cost_graph, node_stage)
    modules = build_rank_stages(planned, specs, [0, 1], None, CPU)
    short = planned.per_shape.capture({"input_ids": (2, 4)})  # no mul: stage 0 would send the linear's output
    with pytest.raises(PipelineError) as error:
        build_variant(planned.cost_graph, short, specs, node_stage, modules, CPU, where="at length 4", fix="pad to 16")
    assert str(error.value) == (
        f"stage 0 at length 4 reads [] and sends ['linear'], but the planned graph's reads [] and sends "
        f"{specs[0].sent}; pad to 16"
    )
