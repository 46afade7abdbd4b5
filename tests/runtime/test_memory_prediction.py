"""The partitioner's memory prediction against the peak a real pipeline rank holds.

Two gloo ranks train a small GPT-2 (the runtime benchmark's shape, smaller) under each schedule,
with and without activation recomputation; each rank measures its peak tensor bytes with
`PeakMemory` over build, two steps and the drain, and predicts its own GPU's bytes with
`estimate_memory` for the same plan. The issue's target is ``async`` within 10%; every schedule
is held to it, since the rules (`memory_rules`) are shared. On a Mixed-Pipe placement (each rank
two stages) the rules are an upper bound where a GPU's stages interleave (``gpipe`` charges their
gradients beside all their activations): there the prediction may exceed the peak by up to 15%,
and must still not fall short of it by more than 10%.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_ftpipe.costmodel import MemoryOptions, estimate_memory
from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime import PeakMemory, PipelineEngine

from distributed import run_ranks, values_or_raise
from placements import contiguous_placement

NUM_MICROBATCHES, MICROBATCH, SEQ, VOCAB = 4, 2, 64, 1024
TOLERANCE = 0.10
MIXED_OVERESTIMATE = 0.15


def small_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=128,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )
    return transformers.GPT2LMHeadModel(config).eval()


def batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (NUM_MICROBATCHES * MICROBATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def measure(rank: int, world_size: int, schedule: str, recompute: bool, stage_device: list[int]) -> tuple[int, int]:
    """(measured peak, predicted) bytes of this rank."""
    model = small_gpt2()
    batches = [batch(seed) for seed in range(2)]
    # Fixed shapes: every step has the same ones, and a fixed-shape export costs a fraction of a
    # symbolic one, which each case paid on both ranks; peaks and predictions are the same bytes.
    traced = capture_model(model, {k: v[:MICROBATCH] for k, v in batches[0].items()}, dynamic=False)
    plan = contiguous_placement(traced.cost_graph, stage_device)
    streaming = schedule in ("async", "2bw")
    with PeakMemory(torch.device("cpu")) as memory:
        engine = PipelineEngine(traced, plan, num_microbatches=NUM_MICROBATCHES, schedule=schedule, recompute=recompute)
        memory.own(engine.parameters())
        optimizer = torch.optim.SGD(engine.parameters(), lr=1e-3)
        if streaming:
            engine.attach_optimizer(optimizer)
        for step_batch in batches:
            engine.train_step(step_batch)
            if not streaming:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if streaming:
            engine.drain()
    predicted = estimate_memory(
        traced.cost_graph,
        plan.node_stage,
        plan.stage_device,
        num_microbatches=NUM_MICROBATCHES,
        optimizer="sgd",
        schedule=schedule,
        memory=MemoryOptions(recompute=recompute),
    )
    return memory.peak_bytes(), predicted[rank]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "2bw"])
def test_each_ranks_peak_is_within_10_percent_of_the_prediction(schedule: str, recompute: bool) -> None:
    figures = values_or_raise(run_ranks(measure, 2, schedule, recompute, [0, 1]))
    errors = [measured / predicted - 1 for measured, predicted in figures]
    assert all(abs(e) <= TOLERANCE for e in errors), f"{schedule}: measured/predicted − 1 per rank {errors}, {figures}"


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "2bw"])
def test_a_mixed_placement_is_never_underpredicted_by_more_than_10_percent(schedule: str, recompute: bool) -> None:
    figures = values_or_raise(run_ranks(measure, 2, schedule, recompute, [0, 1, 1, 0]))
    errors = [measured / predicted - 1 for measured, predicted in figures]
    assert all(-MIXED_OVERESTIMATE <= e <= TOLERANCE for e in errors), (
        f"{schedule}: measured/predicted − 1 per rank {errors}, {figures}"
    )


# Issue 28's schedules, each on the placement it runs (a chain, a V, a loop). A launch per case, as
# above: engines measured one after another in one process measured the later ones up to 16% low.
SPLIT_AND_LOOPED = {"zb-h1": [0, 1], "zbv": [0, 1, 1, 0], "interleaved-1f1b": [0, 1, 0, 1]}


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", list(SPLIT_AND_LOOPED))
def test_split_and_looped_schedules_peak_within_10_percent_of_the_prediction(schedule: str, recompute: bool) -> None:
    """The order walk (`held_at_peaks`, each backward on the state it starts from) prices what ``W``
    keeps, a GPU's two stages of a V, and a recomputed backward's rebuilt activations. The per-stage
    rules it replaced under recomputation were 14% over and 15% under on zb-h1 and zbv here."""
    figures = values_or_raise(run_ranks(measure, 2, schedule, recompute, SPLIT_AND_LOOPED[schedule]))
    errors = [measured / predicted - 1 for measured, predicted in figures]
    assert all(abs(e) <= TOLERANCE for e in errors), f"{schedule}: measured/predicted − 1 per rank {errors}, {figures}"
