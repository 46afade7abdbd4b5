"""`hf_ftpipe.graph.dynamic_shapes`: one export serves every batch shape. Its formulas give each
value's shape at a shape it was never run at, as a measurement there does; sizes a model's code
needs are fixed, and a model that cannot be exported with varying sizes is traced at fixed ones."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import capture_model

from models import KINDS, FixedLengthLM, tiny_batch
from tiny_captures import PLANNED, PLANNED_TARGET, tiny_capture


@pytest.mark.parametrize("kind", KINDS)
def test_batch_and_sequence_vary_and_the_formulas_give_the_shapes_a_measurement_finds(kind: str) -> None:
    planned = {
        name: tuple(value.shape)
        for name, value in tiny_batch(kind, PLANNED[0], seq=PLANNED[1], target=PLANNED_TARGET).items()
    }
    _, traced = tiny_capture(kind)  # traced on 2 rows of 8 tokens, planned for `PLANNED`
    graph, formulas = traced.cost_graph, traced.shapes

    for name in ("input_ids", "attention_mask"):
        assert graph.inputs[name].varying == (0, 1), name
        assert graph.inputs[name].shape == PLANNED, f"{name}: the graph is measured at the planned shape"
    assert graph.inputs["labels"].varying == tuple(range(len(planned["labels"])))
    assert traced.per_shape is None, "every batch and sequence size varies: no graph per shape"

    bound = formulas.bind(planned)
    checked = 0
    for node in graph.topological_order():
        measured = graph.node(node)["output_shapes"]
        if len(measured) != 1:  # a tuple: each part is read by a getitem node, checked there
            continue
        assert node in formulas.values, f"{node} has no shape formula"
        assert formulas.shape_of(node, bound, traced=()) == tuple(measured[0]), node
        checked += 1
    logits = graph.node(graph.outputs[graph.output_names.index("logits")])["output_shapes"][0]
    assert checked > 50 and logits[0] == PLANNED[0], "measured at the planned shape, not the traced one"

    # a size node reads a dimension of a tensor: its value is that dimension at the bound shapes
    sizes = [n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.sym_size.int]
    for node in sizes:
        tensor, dim = node.args
        shape = planned[tensor.name] if tensor.op == "placeholder" else formulas.shape_of(tensor.name, bound, ())
        assert formulas.size_of(node.name, bound) == shape[dim], node.name

    if kind in ("bert", "roberta"):  # one label per row was traced: a (rows, 2) layout is refused
        with pytest.raises(PipelineError, match=r"^'labels' has 2 dimensions \(3, 2\), but \w+ was traced with 1"):
            formulas.bind({**planned, "labels": (3, 2)})
    if kind == "gpt2":  # the loss needs as many labels as tokens: export words it as a relation of their sizes
        with pytest.raises(PipelineError) as info:
            formulas.bind({**planned, "labels": (3, 4)})
        assert str(info.value).startswith("the micro-batch's 'attention_mask' (3, 5), 'labels' (3, 4) break what ")
        relation = "(attention_mask.shape[0]*attention_mask.shape[1]) == (labels.shape[1]*labels.shape[0])"
        assert relation in str(info.value)
    if kind == "bert":  # no longer than its 32 position embeddings
        longer = {name: (3, 33) if name != "labels" else shape for name, shape in planned.items()}
        with pytest.raises(PipelineError, match=r"break what BertForSequenceClassification's code needs of them "):
            formulas.bind(longer)
    # export's caution about sizes it saw no example of (a T5 label length below 3) is not refused:
    # a batch of one row of one token (and one label token) is bound, not refused
    formulas.bind({name: (1, 1, *shape[2:]) if len(shape) > 1 else (1,) for name, shape in planned.items()})


class _Pairs(nn.Module):
    """Reads its rows two at a time (``view(2, -1)``): export keeps the batch size at 2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.embed(input_ids).view(2, -1).sum()}


class _OneRow(nn.Module):
    """Takes one row only, and says so: no batch of 2 rows exports."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        if input_ids.shape[0] != 1:
            raise ValueError(f"_OneRow takes one row, got {input_ids.shape[0]}")
        return {"loss": self.embed(input_ids).sum()}


def test_a_size_the_models_code_needs_stays_fixed_and_other_sizes_are_refused() -> None:
    traced = capture_model(_Pairs(), {"input_ids": torch.ones(2, 8, dtype=torch.long)})
    assert traced.cost_graph.inputs["input_ids"].varying == (1,)
    assert traced.shapes.bind({"input_ids": (2, 5)})  # the sequence still varies
    with pytest.raises(PipelineError) as error:
        traced.shapes.bind({"input_ids": (3, 5)})
    assert str(error.value).startswith(
        "'input_ids' has size 3 in dimension 0, but _Pairs takes only 2 there (torch.export found that the "
        "model's code needs that size; traced as (2, "
    )
    assert str(error.value).endswith(
        "give batches whose 'input_ids' has 2 there (pad to that length, drop a short last batch)"
    )


class _LongBranch(nn.Module):
    """Takes another path for sequences longer than 8: its graph holds only the path it was traced on."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.embed(input_ids)
        return {"loss": hidden.sum() if input_ids.shape[1] > 8 else hidden.mean()}


def test_a_batch_the_traced_branch_does_not_serve_is_refused_not_run_on_it() -> None:
    traced = capture_model(_LongBranch(), {"input_ids": torch.ones(2, 12, dtype=torch.long)})
    assert traced.shapes.bind({"input_ids": (3, 9)})
    with pytest.raises(PipelineError) as error:
        traced.shapes.bind({"input_ids": (3, 4)})
    assert str(error.value) == (
        "the micro-batch's 'input_ids' (3, 4) break what _LongBranch's code needs of them (torch.export found it): "
        "input_ids.shape[1] > 8; give inputs whose sizes satisfy it (matching shapes, e.g. padded by one collator, "
        "within the model's limits)"
    )


def test_a_model_that_cannot_vary_its_sizes_is_traced_at_fixed_shapes_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # export grows sizes of 1 to 2 to keep them variable, which _OneRow refuses
    with caplog.at_level(logging.WARNING, logger="hf_ftpipe.graph.trace"):
        traced = capture_model(_OneRow(), {"input_ids": torch.ones(1, 8, dtype=torch.long)})
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "hf_ftpipe.graph.trace"]
    assert warning.startswith("_OneRow cannot take batches of varying shapes (cannot trace _OneRow: ")
    assert "ValueError: _OneRow takes one row" in warning
    assert warning.endswith(
        "it was traced with fixed shapes {'input_ids': (1, 8)}, and a batch of other shapes runs on a graph "
        "traced at its shape (hf_ftpipe.runtime.per_shape)"
    )
    assert traced.cost_graph.inputs["input_ids"].varying == ()
    assert traced.cost_graph.inputs["input_ids"].shape == (1, 8)
    fixed = (
        r"'input_ids' has size 7 in dimension 1, but _OneRow takes only 8 there \(the pipeline was traced with fixed"
    )
    with pytest.raises(PipelineError, match=fixed):
        traced.shapes.bind({"input_ids": (1, 7)})
    # what the runtime needs to trace it again at another shape: every size is fixed, for the reason export gave
    capture = traced.per_shape
    assert capture.fixed == (("input_ids", 0), ("input_ids", 1)) and not capture.dynamic
    assert capture.reason.startswith("cannot trace _OneRow: ") and "_OneRow takes one row" in capture.reason
    assert capture.capture({"input_ids": (1, 5)}).cost_graph.inputs["input_ids"].shape == (1, 5)


def test_a_model_whose_export_fixes_the_length_is_planned_at_the_planned_length() -> None:
    """Traced on a batch of 9 tokens, planned for 16: the graph the plan is made on is exported at 16
    (the export fixes the length), its rows still vary, and it records what fixed the length."""
    sample = tiny_batch("gpt2", 2, seq=9)
    planned = {name: (3, 16) for name in sample}
    traced = capture_model(FixedLengthLM(), sample, planned=planned)
    inputs = traced.cost_graph.inputs
    assert {name: (info.shape, info.varying) for name, info in inputs.items()} == {
        "input_ids": ((3, 16), (0,)),
        "attention_mask": ((3, 16), (0,)),
        "labels": ((3, 16), (0, 1)),  # the loss flattens it: export lets its length vary
    }
    assert traced.per_shape.fixed == (("input_ids", 1), ("attention_mask", 1)) and traced.per_shape.dynamic
    assert traced.per_shape.reason == (
        "torch.export found that its code fixes 'input_ids' dimension 1 (at 16), 'attention_mask' dimension 1 (at 16)"
    )
