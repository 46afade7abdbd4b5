"""`hf_ftpipe.runtime.per_shape`: the buckets and the bound as literal data, and a model whose export
fixes the sequence length split into micro-batches padded to their bucket, each on stages traced at
that shape that hold the planned stages' own weights (one process; the pipeline trains them in
tests/runtime/test_variable_shapes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime.microbatches import split_batch
from hf_ftpipe.runtime.per_shape import PerShapeOptions, PerShapeStages, bucket_length, choose_shape
from hf_ftpipe.runtime.rank_stages import build_rank_stages
from hf_ftpipe.runtime.stage import plan_stages

from models import FixedLengthLM, tiny_batch
from placements import contiguous_placement

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("length", "multiple_of", "planned", "bucket"),
    [
        (5, 8, 64, 8),
        (8, 8, 64, 8),
        (9, 8, 64, 16),
        (60, 8, 64, 64),
        (58, 8, 61, 61),  # 64 would pass the planned length: the planned graph's
        (70, 8, 64, 72),  # longer than planned (evaluation only): rounded up all the same
        (3, 1, 64, 3),
    ],
)
def test_a_length_is_rounded_up_to_its_bucket_but_not_past_the_planned_length(
    length: int, multiple_of: int, planned: int, bucket: int
) -> None:
    assert bucket_length(length, multiple_of, planned) == bucket


@pytest.mark.parametrize(
    ("needed", "traced", "chosen"),
    [
        ((3, 8), [(3, 16)], (3, 8)),  # room for a new one
        ((3, 8), [(3, 16), (3, 8), (2, 8)], (3, 8)),  # traced already
        ((3, 12), [(3, 16), (3, 8), (2, 8)], (3, 16)),  # full: the least padding above it
        ((2, 4), [(3, 16), (3, 8), (2, 8)], (2, 8)),
        ((1, 4), [(3, 16), (3, 8), (2, 8)], None),  # rows are never padded: no graph takes 1 row
    ],
)
def test_a_new_shape_is_traced_until_the_bound_then_padded_to_the_nearest_traced_one(
    needed: tuple[int, int], traced: list[tuple[int, int]], chosen: tuple[int, int] | None
) -> None:
    """(rows, length): rows exact, the length paddable; at most 3 graphs."""
    assert choose_shape(needed, (False, True), traced, max_shapes=3) == chosen


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`multiple_of` must be a positive integer, got 0"):
        PerShapeOptions(multiple_of=0)


def per_shape_stages(model: nn.Module, sample: dict, options: PerShapeOptions) -> tuple[PerShapeStages, dict]:
    """One process holding both stages of a 2-stage plan."""
    traced = capture_model(model, sample)
    placement = contiguous_placement(traced.cost_graph, [0, 1])
    specs = plan_stages(traced.cost_graph, placement.node_stage)
    modules = build_rank_stages(traced, specs, [0, 1], None, CPU)
    values = [value for spec in specs for value in spec.sent]
    stages = PerShapeStages(traced, specs, placement.node_stage, modules, CPU, values, 2, options)
    return stages, modules


def test_micro_batches_are_padded_to_their_bucket_and_run_on_stages_with_the_planned_weights() -> None:
    sample = tiny_batch("gpt2", 2, seq=16)
    stages, modules = per_shape_stages(FixedLengthLM(hidden=12), sample, PerShapeOptions(multiple_of=4, pad_token_id=7))
    graph, formulas = stages.graph, stages.planned.shapes
    batch = tiny_batch("gpt2", 3, seq=6)
    split = split_batch(graph, formulas, batch, 2, CPU, training=True, fit=stages.fit)

    assert [tuple(mb["input_ids"].shape) for mb in split] == [(2, 8), (1, 8)]
    first = split[0]
    assert first["input_ids"][:, 6:].tolist() == [[7, 7], [7, 7]]  # the pad token
    assert first["attention_mask"][:, 6:].tolist() == [[0, 0], [0, 0]]
    assert first["labels"][:, 6:].tolist() == [[-100, -100], [-100, -100]]
    assert torch.equal(first["input_ids"][:, :6], batch["input_ids"][:2])
    assert stages.padding == {8: 6}

    shapes = stages.shapes_of(first)
    assert shapes is not None and shapes.stages is not None
    variant = shapes.stages
    assert [spec.sent for spec in variant.specs] == [spec.sent for spec in plan_stages(graph, stages.node_stage)]
    for s, module in variant.modules.items():  # the planned stages' own parameters, not copies
        planned = dict(modules[s].named_parameters())
        assert {name: id(p) for name, p in module.named_parameters()} == {
            n: id(planned[n]) for n, _ in module.named_parameters()
        }
    for value in variant.specs[0].sent:  # what stage 0 sends, at the padded length (planned: 16)
        planned = graph.node(value)["output_shapes"][0]
        assert shapes.values[value] == tuple(8 if size == 16 else size for size in planned), value

    planned_batch = tiny_batch("gpt2", 4, seq=16)  # the planned length: the planned graph, unpadded
    split = split_batch(graph, formulas, planned_batch, 2, CPU, training=True, fit=stages.fit)
    assert stages.shapes_of(split[0]) is None and stages.padding == {}

    with pytest.raises(
        PipelineError, match=r"^'input_ids' has length 17 \(dimension 1\), but the pipeline was planned"
    ):
        split_batch(graph, formulas, tiny_batch("gpt2", 4, seq=17), 2, CPU, training=True, fit=stages.fit)


class _Pairs(nn.Module):
    """Reads its rows two at a time: export fixes the rows at 2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.out(self.embed(input_ids)).view(2, -1).sum()}


def test_a_row_count_no_graph_takes_once_the_bound_is_reached_is_refused() -> None:
    stages, _ = per_shape_stages(
        _Pairs(), {"input_ids": torch.ones(2, 8, dtype=torch.long)}, PerShapeOptions(max_shapes=1)
    )
    batch = {"input_ids": torch.ones(3, 8, dtype=torch.long)}  # micro-batches of 2 and 1 rows
    with pytest.raises(PipelineError) as error:
        split_batch(stages.graph, stages.planned.shapes, batch, 2, CPU, training=True, fit=stages.fit)
    assert str(error.value) == (
        "_Pairs needs a graph for sizes (1,) of [('input_ids', 0)], but 1 shapes are traced, the most kept "
        "(PerShapeOptions.max_shapes), and none takes it ([(2,)]); give batches of the planned rows, or raise "
        "`max_shapes`"
    )
