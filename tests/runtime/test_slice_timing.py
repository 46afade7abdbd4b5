"""slice_timing: a stage's forward + backward timed per (slice, context) length, ready for `SliceLatency.fit`."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_ftpipe.costmodel.latency import LatencyKey, LatencySample, SliceLatency
from hf_ftpipe.graph.token_slices import SlicedModel, capture_token_slices
from hf_ftpipe.plan.blocks import layer_stages
from hf_ftpipe.runtime import build_stage_module, plan_stages
from hf_ftpipe.runtime.slice_timing import time_slice, time_slice_grid, time_stages
from hf_ftpipe.runtime.token_slicing import TokenSlicing


@pytest.fixture(scope="module")
def captured() -> tuple[SlicedModel, dict[str, int], dict[str, torch.Tensor]]:
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (1, 32))
    batch = {"input_ids": ids, "labels": ids.clone()}
    sliced = capture_token_slices(model, batch, [4, 8, 4, 16], dynamic=False)
    whole = sliced.full
    # Two stages: everything up to the second block on stage 0, the rest on stage 1.
    order = whole.cost_graph.topological_order()
    first = next(i for i, n in enumerate(order) if whole.cost_graph.node(n)["scope"].startswith("transformer.h.1"))
    node_stage = {n: int(i >= first) for i, n in enumerate(order)}
    return sliced, node_stage, batch


@pytest.fixture(scope="module")
def slicing_and_batch(captured) -> tuple[TokenSlicing, dict[str, torch.Tensor]]:
    sliced, node_stage, batch = captured
    whole = sliced.full
    specs = plan_stages(whole.cost_graph, node_stage)
    cpu = torch.device("cpu")
    modules = {
        s: build_stage_module(whole.graph_module, spec, whole.canonical_names, whole.tensors, cpu)
        for s, spec in enumerate(specs)
    }
    return TokenSlicing(sliced, specs, node_stage, modules, cpu), batch


def test_grid_times_every_point_of_both_stages(slicing_and_batch):
    slicing, batch = slicing_and_batch
    grid = [(4, 0), (4, 8), (4, 28), (8, 0), (8, 8), (8, 24), (16, 0), (16, 16)]
    for stage in (0, 1):
        samples = time_slice_grid(slicing, stage, batch, grid, repeats=1)
        assert [(s, c, b) for s, c, b, _ in samples] == [(s, c, 1) for s, c in grid]
        assert all(t > 0 for *_, t in samples)
    # What the slicing DP takes: a latency fitted to them.
    key = LatencyKey(model_fingerprint="x", model_class="GPT2LMHeadModel", seq_len=32, num_stages=2, device="cpu",
                     dtype="float32")  # fmt: skip
    fitted = SliceLatency.fit([LatencySample(*x) for x in samples], key, source="measured")
    assert fitted.time_s(8, 8) > 0


def test_a_barrier_runs_before_each_point(slicing_and_batch):
    slicing, batch = slicing_and_batch
    calls = []
    time_slice_grid(slicing, 1, batch, [(4, 0), (8, 4)], repeats=1, barrier=lambda: calls.append(1))
    assert len(calls) == 2


def test_a_length_without_its_stage_is_refused(slicing_and_batch):
    slicing, batch = slicing_and_batch
    with pytest.raises(ValueError, match=r"no stage is built for slices of 12 tokens.*built: \[4, 8, 16\]"):
        time_slice(slicing, 0, batch, 12, 0)


def test_stages_cut_on_layers_are_timed_as_their_blocks(captured, capsys):
    # stage 0: embeddings + layer 0, stage 1: layer 1 + head; the two layers are alike: 3 timings per point
    sliced, node_stage, batch = captured
    grid = [(4, 0), (8, 8), (16, 16)]
    samples = time_stages(sliced, node_stage, batch, grid, torch.device("cpu"), repeats=1)
    assert [(s, c, b) for s, c, b, _ in samples] == [(s, c, 1) for s, c in grid]
    assert all(t > 0 for *_, t in samples)
    assert (
        "timing 3 of 4 blocks (the others repeat one) at 3 (slice, context) points, those without attention once "
        "per slice length: 9 timings" in capsys.readouterr().err
    )


def test_a_model_on_the_meta_device_is_timed_on_its_timed_blocks_weights_alone(capsys):
    # The model never gets weights: only the 3 timed blocks do, random (`slices --measure` on GPT2-XL).
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (1, 32))
    batch = {"input_ids": ids, "labels": ids.clone()}
    # one capture with a symbolic length, as training and `slices --measure` use
    sliced = capture_token_slices(model, {k: v.to("meta") for k, v in batch.items()}, [16, 16])
    assert sliced.dynamic
    node_stage = layer_stages(sliced.full.cost_graph, 2)
    samples = time_stages(sliced, node_stage, batch, [(16, 0), (16, 16)], torch.device("cpu"), repeats=1)
    assert [(s, c) for s, c, _, _ in samples] == [(16, 0), (16, 16)] and all(t > 0 for *_, t in samples)
    assert all(p.is_meta for p in model.parameters())
    # Made: wte 64×16 + wpe 32×16 (embeddings), one layer (ln_1 32, c_attn 16×48 + 48, attn c_proj 16×16 + 16,
    # ln_2 32, c_fc 16×64 + 64, mlp c_proj 64×16 + 16 = 3280), ln_f 32 (the head; lm_head is wte, made once):
    # 4848 of 1024 + 512 + 4 × 3280 + 32 = 14688. The embeddings and the head have no attention: timed
    # once for the one slice length, the layer at both points.
    err = capsys.readouterr().err
    assert "timing 3 of 6 blocks (the others repeat one) at 2 (slice, context) points" in err
    assert ": 4 timings of 1 warm-up + 1 runs, on 4,848 of the model's 14,688 parameters" in err
