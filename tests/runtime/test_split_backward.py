"""`hf_ftpipe.runtime.split_backward`: a stage's backward split into B (input gradients) and W (weight
gradients) gives exactly the gradients of one whole backward, in one process: float32, recomputed,
under bfloat16 autocast. Then the pipelines that run B and W as separate actions (``zb-h1``, ``zbv``),
and ``interleaved-1f1b``, across gloo processes equal single-process training, one launch per model."""

from __future__ import annotations

import copy
import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.runtime.compiled_stages import CompileOptions, StageCompiler
from hf_ftpipe.runtime.shapes import ShapeBook
from hf_ftpipe.runtime.split_backward import collecting, defer_weight_gradients, whole_products
from hf_ftpipe.runtime.stage import build_stage_module, plan_stages

from distributed import run_ranks, values_or_raise
from engine_runs import LR, MICROBATCH, NUM_MICROBATCHES, batches, reference_run
from models import tiny_batch, tiny_model
from placements import contiguous_placement


@pytest.fixture(scope="module")
def stages():
    """The whole tiny model as one stage module twice (the same weights), the second's products
    deferred; its inputs; the position of the loss among its outputs."""
    batch = tiny_batch("gpt2", 2)  # its products: Conv1D's addmm with a bias, the lm_head's linear (T5's: linear)
    traced = capture_model(tiny_model("gpt2"), batch)
    graph = traced.cost_graph
    (spec,) = plan_stages(graph, dict.fromkeys(graph.topological_order(), 0))
    whole, split = (
        build_stage_module(traced.graph_module, spec, traced.canonical_names, traced.tensors, torch.device("cpu"))
        for _ in range(2)
    )
    defer_weight_gradients(split)
    defer_weight_gradients(split)  # once is enough: the second does nothing
    sizes = ShapeBook(traced.shapes, graph, [], spec.size_inputs).of(batch).sizes
    args = [*(batch[name] for name in spec.batch_inputs), *(sizes[name] for name in spec.size_inputs)]
    return whole, split, args, spec.sent.index(spec.model_outputs["loss"])


def gradients(module, args, loss_index: int, recompute: bool, dtype: torch.dtype | None):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        outputs = checkpoint(module, *args, use_reentrant=False) if recompute else module(*args)
    with collecting() as pending:
        outputs[loss_index].backward()
    params = dict(module.named_parameters())
    missing_after_b = {name for name, p in params.items() if p.grad is None}
    weights = {name for name, p in params.items() if any(d.weight is p for d in pending)}
    for deferred in pending:
        deferred.apply()
    return {name: p.grad.clone() for name, p in params.items()}, missing_after_b, weights, len(pending)


@pytest.mark.parametrize(
    ("recompute", "dtype"), [(False, None), (True, None), (False, torch.bfloat16)], ids=["fp32", "recompute", "bf16"]
)
def test_b_then_w_gives_the_whole_backwards_gradients(stages, recompute: bool, dtype: torch.dtype | None) -> None:
    whole_module, split_module, args, loss_index = stages
    whole, _, _, none_pending = gradients(whole_module, args, loss_index, recompute, dtype)
    assert none_pending == 0  # the module not swapped defers nothing
    split, missing_after_b, weights, num_pending = gradients(split_module, args, loss_index, recompute, dtype)

    products = 8 + 1  # 2 layers of 4 Conv1D addmms, and the lm_head
    assert num_pending == products
    # W alone gives the products' weights (less the embedding they share) gradients; B gives the rest
    assert missing_after_b == weights - {"transformer.wte.weight"}
    assert missing_after_b and all(".attn." in n or ".mlp." in n for n in missing_after_b), missing_after_b
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-6 if dtype is None else 1e-5, rtol=0, msg=name)
        assert split[name].stride() == grad.stride(), f"{name}: {split[name].stride()}, autograd's {grad.stride()}"


@pytest.mark.parametrize("recompute", [False, True], ids=["fp32", "recompute"])
def test_within_whole_products_a_deferring_module_runs_one_ordinary_backward(stages, recompute: bool) -> None:
    """A micro-batch whose W would follow its B at once runs forward and backward within
    `whole_products`: nothing is handed to W, and B alone gives the whole backward's gradients (also
    with the forward recomputed inside the backward, which must record what the first forward did)."""
    whole_module, split_module, args, loss_index = stages
    whole, _, _, _ = gradients(whole_module, args, loss_index, recompute, None)
    with whole_products():
        split, missing_after_b, _, num_pending = gradients(split_module, args, loss_index, recompute, None)
    assert num_pending == 0 and not missing_after_b
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=0, rtol=0, msg=name)


def test_a_compiled_stage_still_defers_its_products_weight_gradients_to_w(stages) -> None:
    """``torch_compile`` with a split backward: each stage is compiled with its products swapped, and each
    product runs between compiled pieces (dynamo cannot keep B's hand-over to W in a graph: one graph break
    per product), so B still leaves the products' weight gradients to W, and B + W give the whole backward's."""
    whole_module, split_module, args, loss_index = stages
    compiled = copy.deepcopy(split_module)
    compiler = StageCompiler(CompileOptions(backend="eager"), dynamic=False)
    compiler.prepare(compiled)
    whole, _, _, _ = gradients(whole_module, args, loss_index, False, None)
    split, missing_after_b, weights, num_pending = gradients(compiled, args, loss_index, False, None)
    products = 8 + 1
    assert num_pending == products
    assert missing_after_b == weights - {"transformer.wte.weight"}
    assert compiler.graphs == products + 1, compiler.summary()
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-6, rtol=0, msg=name)


def test_w_gives_a_weight_without_a_gradient_the_weights_strides(stages) -> None:
    """A weight whose first gradient comes from W (a rank's copy of a tied weight, any linear's on a
    stage without its embedding) gets one with the weight's strides, as autograd's `.grad` has:
    linear's dW is a transposed product, and a fused optimizer (`Trainer`'s default AdamW) reads a
    gradient's memory in the weight's order, so a transposed view updates the wrong entries."""
    _, split_module, args, loss_index = stages
    with collecting() as pending:
        split_module(*args)[loss_index].backward()
    split_module.zero_grad(set_to_none=True)  # here the lm_head's W finds the tied wte without a gradient
    assert any(d.transposed and d.weight.grad is None for d in pending)  # a linear's, first
    for deferred in pending:
        deferred.apply()
    for name, param in split_module.named_parameters():
        if any(d.weight is param for d in pending):
            assert param.grad.stride() == param.stride(), f"{name}: {param.grad.stride()}, weight's {param.stride()}"


def test_w_frees_what_it_read_and_leaves_gradients_without_a_graph(stages) -> None:
    """What W keeps holds no graph: x detached (an unpacked saved input keeps its grad_fn, and through
    it the stage's autograd nodes and the received activations they accumulate into, until W), and
    W's product records none, or each gradient would hold that micro-batch's g until the step's end."""
    _, split_module, args, loss_index = stages
    split_module.zero_grad(set_to_none=True)
    with collecting() as pending:
        split_module(*args)[loss_index].backward()
    kept = [weakref.ref(t) for d in pending for t in (d.inputs, d.grad)]
    # Detached: a view of an activation that requires grad holds, through its base, the stage's graph.
    assert pending and not any(d.inputs.requires_grad or d.grad.requires_grad for d in pending)
    for deferred in pending:
        deferred.apply()
    del deferred, pending
    gc.collect()
    assert all(ref() is None for ref in kept), f"{sum(ref() is not None for ref in kept)} of {len(kept)} kept"
    assert not any(p.grad.requires_grad for p in split_module.parameters() if p.grad is not None)


# -- pipelines: B and W as separate actions (zb-h1, zbv), and interleaved-1f1b -----------------------


def split_runs(rank: int, world_size: int, kind: str, configs: list[tuple]) -> list:
    """Train ``kind`` under each ``(schedule, stage_device, recompute, autocast dtype, loss scale)``,
    from the same initial weights; returns each one's losses, this rank's weights, and its gradients
    of each step with their strides and their weights'."""
    data = batches(kind)
    traced = capture_model(tiny_model(kind), {name: value[:MICROBATCH] for name, value in data[0].items()})
    initial = {name: tensor.detach().clone() for name, tensor in traced.tensors.items()}
    results = []
    for schedule, stage_device, recompute, dtype, loss_scale in configs:
        with torch.no_grad():  # the stages are the model's own tensors: every run starts from the same
            for name, tensor in traced.tensors.items():
                tensor.copy_(initial[name])
        engine = PipelineEngine(
            traced,
            contiguous_placement(traced.cost_graph, stage_device),
            num_microbatches=NUM_MICROBATCHES,
            schedule=schedule,
            recompute=recompute,
            autocast_dtype=dtype,
        )
        engine.loss_scale = loss_scale
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        losses, gradients = [], []
        for batch in data:
            optimizer.zero_grad()
            losses.append(engine.train_step(batch).item())
            for param in engine.parameters():
                param.grad.div_(loss_scale)
            gradients.append({n: (p.grad.clone(), p.grad.stride(), p.stride()) for n, p in engine.named_parameters()})
            optimizer.step()
        results.append((losses, {name: value.clone() for name, value in engine.state_dict().items()}, gradients))
    return results


CONFIGS = {  # (schedule, stage_device, recompute, autocast dtype, loss scale)
    "gpt2": [
        ("zb-h1", [0, 1], False, None, 1.0),  # wte / lm_head tied across ranks
        ("zb-h1", [0, 1, 1, 0], True, None, 1.0),
        ("zbv", [0, 1, 1, 0], False, None, 1.0),
        ("interleaved-1f1b", [0, 1, 0, 1], True, None, 1.0),
        ("zbv", [0, 1, 1, 0], False, torch.bfloat16, 1.0),
        ("zb-h1", [0, 1], False, torch.float16, 1024.0),  # the loss's gradient seeded with the loss scale
    ],
    "t5": [  # the shared embedding tied across encoder, decoder and lm_head
        ("zb-h1", [0, 1], True, None, 1.0),
        ("zbv", [0, 1, 1, 0], True, None, 1.0),
        ("zbv", [0, 1, 1, 0], False, None, 1.0),
        ("interleaved-1f1b", [0, 1, 0, 1], False, None, 1.0),
    ],
}


HAND_WRITTEN = """\
rank 0: 0F0 0F1 0B0 0B1 0W1 0W0
rank 1: 1F0 1B0 1F1 1W0 1B1 1W1
"""
"""A schedule file with W actions (`hf_ftpipe.schedules.from_file`), rank 0's in the other order."""


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_split_backward_schedules_equal_single_process(kind: str, tmp_path: Path) -> None:
    configs = CONFIGS[kind]
    if kind == "gpt2":
        (tmp_path / "order.txt").write_text(HAND_WRITTEN)
        configs = [*configs, (str(tmp_path / "order.txt"), [0, 1], False, None, 1.0)]
    results = values_or_raise(run_ranks(split_runs, 2, kind, configs))
    references, reference_gradients = {}, {}
    trainable = {name for name, _ in tiny_model(kind).named_parameters()}
    for i, (schedule, stage_device, recompute, dtype, loss_scale) in enumerate(configs):
        what = f"{schedule} on {stage_device}{', recomputed' if recompute else ''}{f', {dtype}' if dtype else ''}"
        if dtype not in references:
            reference_gradients[dtype] = []
            references[dtype] = reference_run(kind, dtype, loss_scale, reference_gradients[dtype])
        reference_losses, reference_state = references[dtype]
        covered = set()
        for rank, per_config in enumerate(results):
            losses, state, gradients = per_config[i]
            assert losses == pytest.approx(reference_losses, abs=1e-5), f"{what}: rank {rank} losses"
            for name, value in state.items():
                torch.testing.assert_close(
                    value,
                    reference_state[name],
                    atol=1e-5,
                    rtol=0,
                    msg=lambda m, w=what, r=rank, n=name: f"{w}: rank {r}: {n}: {m}",
                )
                covered.add(name)
            # Every weight's gradient, each step: a W missed or run twice shows here whatever the update
            # does with it; and with the weight's strides (autograd's layout contract), which fused
            # optimizers (`Trainer`'s default AdamW) read a gradient's memory by.
            for step, (step_gradients, want) in enumerate(zip(gradients, reference_gradients[dtype], strict=True)):
                for name, (grad, grad_stride, weight_stride) in step_gradients.items():
                    where = f"{what}: rank {rank}: step {step + 1}: {name}"
                    assert grad_stride == weight_stride, f"{where}: gradient {grad_stride}, weight {weight_stride}"
                    torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
        assert trainable <= covered, f"{what}: parameters on no rank: {sorted(trainable - covered)}"
