"""capture_model / trace_model: the exported graph computes what the model computes, whole or cut
into stages, in training and evaluation modes; a model torch.export cannot take is refused.
What its CostGraph measures is tests/graph/test_measure.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from hf_ftpipe.errors import TraceError
from hf_ftpipe.graph import CostGraph, TracedModel, capture_model, clear_export_cache, graph_hash
from hf_ftpipe.graph.modes import ModeAwareOp
from hf_ftpipe.runtime.stage import StageSpec, build_stage_module, plan_stages

from models import KINDS, tiny_batch, tiny_model
from tiny_captures import tiny_capture, tiny_t5_with_dropout


def _graph_inputs(traced: TracedModel, batch: dict[str, torch.Tensor]) -> dict[str, object]:
    """Exactly the inputs the graph takes: the batch's tensors and the constants (``use_cache``), and
    the sizes its stages read (a sequence length), evaluated for the batch's shapes."""
    inputs = {
        name: batch[name] if info.shape is not None else info.constant
        for name, info in traced.cost_graph.inputs.items()
    }
    bound = traced.shapes.bind({name: tuple(value.shape) for name, value in batch.items()})
    return inputs | {node: traced.shapes.size_of(node, bound) for node in traced.shapes.sizes}


def _contiguous_stages(graph: CostGraph, num_stages: int) -> dict[str, int]:
    """Cut the execution order into equal runs; a getitem stays with its multi-output producer."""
    order = graph.topological_order()
    node_stage = {name: index * num_stages // len(order) for index, name in enumerate(order)}
    for name in order:
        multi = [p for p in graph.graph.predecessors(name) if len(graph.node(p)["output_shapes"]) != 1]
        if multi:
            node_stage[name] = max(node_stage[p] for p in multi)
    return node_stage


def _build_stages(traced: TracedModel, num_stages: int) -> list[tuple[StageSpec, torch.fx.GraphModule]]:
    specs = plan_stages(traced.cost_graph, _contiguous_stages(traced.cost_graph, num_stages))
    cpu = torch.device("cpu")
    return [
        (spec, build_stage_module(traced.graph_module, spec, traced.canonical_names, traced.tensors, cpu))
        for spec in specs
    ]


def _run_stages(
    stages: list[tuple[StageSpec, torch.fx.GraphModule]], inputs: dict[str, object]
) -> dict[str, torch.Tensor]:
    """Chain the stages as the runtime does, without detaching: returns the model outputs by name."""
    values: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    for spec, module in stages:
        local = [inputs[name] for name in [*spec.batch_inputs, *spec.size_inputs]]
        result = module(*local, *[values[v] for v in spec.received])
        assert len(result) == len(spec.sent)
        values.update(zip(spec.sent, result, strict=True))
        outputs.update({name: values[value] for name, value in spec.model_outputs.items()})
    return outputs


# ---------------------------------------------------------------- every kind: values and gradients


@pytest.mark.parametrize("kind", KINDS)
def test_graph_and_stages_match_eager(kind: str) -> None:
    model, traced = tiny_capture(kind)  # captured on this batch's shapes (2 rows of 8 tokens)
    model.train().zero_grad(set_to_none=True)
    batch = tiny_batch(kind, 2)
    expected = model(**batch)
    expected.loss.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    inputs = _graph_inputs(traced, batch)
    whole = _run_stages(_build_stages(traced, 1), inputs)
    torch.testing.assert_close(whole["loss"], expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole["logits"], expected.logits, atol=1e-5, rtol=1e-5)

    stages = _build_stages(traced, 3)
    assert [spec.stage_index for spec, _ in stages] == [0, 1, 2]
    assert all(spec.received for spec, _ in stages[1:]), "every later stage reads something from before"
    outputs = _run_stages(stages, inputs)
    assert set(outputs) >= {"loss", "logits"}
    torch.testing.assert_close(outputs["loss"], expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs["logits"], expected.logits, atol=1e-5, rtol=1e-5)

    outputs["loss"].backward()
    stage_params: dict[str, nn.Parameter] = {}
    for _, module in stages:
        stage_params.update(module.named_parameters())
    model_params = dict(model.named_parameters())
    assert set(stage_params) <= set(model_params), "stage parameters use the model's canonical names"
    for name, param in stage_params.items():
        assert param is model_params[name], f"{name} is a copy, not the model's tensor"
    assert set(expected_grads) == {name for name, p in stage_params.items() if p.grad is not None}
    for name, grad in expected_grads.items():
        torch.testing.assert_close(stage_params[name].grad, grad, atol=1e-5, rtol=1e-4, msg=name)
    model.zero_grad(set_to_none=True)  # the capture is shared (tiny_captures): leave its model as found


# ---------------------------------------------------------------- the export kept for the process


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The class of every model ``torch.export`` really exports from here on, with nothing kept before."""
    clear_export_cache()
    made: list[str] = []
    export = torch.export.export

    def counted(model: nn.Module, *args: object, **kwargs: object) -> torch.export.ExportedProgram:
        made.append(type(model).__name__)
        return export(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    yield made
    clear_export_cache()


def test_a_second_model_of_the_architecture_takes_the_kept_export_bound_to_its_own_weights(exports: list[str]) -> None:
    first, second = tiny_model("gpt2", seed=0), tiny_model("gpt2", seed=1)
    batch = tiny_batch("gpt2", 2)
    kept = capture_model(first, batch)
    assert exports == ["GPT2LMHeadModel"]
    traced = capture_model(second, batch)
    assert exports == ["GPT2LMHeadModel"], "the second capture exported again"
    assert traced.graph_module.code == kept.graph_module.code
    assert graph_hash(traced.cost_graph) == graph_hash(kept.cost_graph)
    assert traced.canonical_names == kept.canonical_names
    assert traced.canonical_names["lm_head.weight"] == "transformer.wte.weight"  # still tied

    expected = second.train()(**batch)
    expected.loss.backward()
    assert not torch.allclose(expected.loss, first.train()(**batch).loss), "the two models must differ"
    outputs = _run_stages(_build_stages(traced, 2), _graph_inputs(traced, batch))
    torch.testing.assert_close(outputs["loss"], expected.loss, atol=1e-5, rtol=1e-5)
    grads = {name: p.grad.clone() for name, p in second.named_parameters()}
    second.zero_grad(set_to_none=True)
    outputs["loss"].backward()
    for name, param in second.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_what_an_export_depends_on_changing_makes_a_new_one(
    exports: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = tiny_batch("gpt2", 2)
    capture_model(tiny_model("gpt2"), batch)
    capture_model(tiny_model("gpt2", dropout=0.1), batch)  # the configuration
    frozen = tiny_model("gpt2")
    frozen.transformer.wpe.weight.requires_grad_(False)
    capture_model(frozen, batch)
    assert len(exports) == 3
    mlp = type(tiny_model("gpt2").transformer.h[0].mlp)
    forward = mlp.forward
    monkeypatch.setattr(mlp, "forward", lambda self, hidden_states: forward(self, hidden_states))  # the code
    capture_model(tiny_model("gpt2"), batch)
    assert len(exports) == 4
    hooked = tiny_model("gpt2")
    hooked.transformer.h[0].register_forward_hook(lambda module, args, output: None)  # not kept: a hook
    capture_model(hooked, batch)
    capture_model(hooked, batch)
    assert len(exports) == 6


# ---------------------------------------------------------------- failures


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent Python control flow: not exportable
            return self.linear(x)
        return -x


def test_untraceable_model_raises_trace_error() -> None:
    with pytest.raises(TraceError) as info:
        capture_model(_Branchy(), {"x": torch.randn(2, 4)})
    message = str(info.value)
    assert message.startswith("cannot trace _Branchy: torch.export failed")
    assert "What to try" in message
    assert "data-dependent" in message
    assert isinstance(info.value, RuntimeError)


# ---------------------------------------------------------------- train / eval


def test_stages_follow_train_and_eval_modes() -> None:
    model, traced = tiny_t5_with_dropout()  # exported at this batch's fixed shapes: modes, not shapes, are tested
    batch = tiny_batch("t5", 2)
    inputs = _graph_inputs(traced, batch)
    stages = _build_stages(traced, 3)
    # 18 dropouts and 6 SDPA calls (encoder self, decoder self and cross attention, 2 layers each).
    mode_aware = {name for name, m in traced.graph_module.named_modules() if isinstance(m, ModeAwareOp)}
    assert len(mode_aware) == 24
    in_stages = {name for _, module in stages for name, m in module.named_modules() if isinstance(m, ModeAwareOp)}
    assert in_stages == mode_aware

    with torch.no_grad():
        expected_eval = model.eval()(**batch)
        for _, module in stages:
            module.eval()
        evaluated = _run_stages(stages, inputs)
        torch.testing.assert_close(evaluated["loss"], expected_eval.loss, atol=0, rtol=0)
        torch.testing.assert_close(evaluated["logits"], expected_eval.logits, atol=0, rtol=0)

        torch.manual_seed(1)
        expected_train = model.train()(**batch)
        for _, module in stages:
            module.train()
        torch.manual_seed(1)
        trained = _run_stages(stages, inputs)
    assert not torch.allclose(trained["logits"], evaluated["logits"])
    # The same seed draws the same dropout masks in the same order as eager training.
    torch.testing.assert_close(trained["loss"], expected_train.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trained["logits"], expected_train.logits, atol=1e-5, rtol=1e-5)
