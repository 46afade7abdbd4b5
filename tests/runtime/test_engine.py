"""The flushing schedules (GPipe, 1F1B) across real gloo processes equal single-process training,
loss by loss and weight by weight, on contiguous and Mixed-Pipe placements.

The flushing, autocast, loss-weight and evaluation cases of a model share a launch and its trace (each case on
a deep copy of it: the initial weights of a launch of its own); each case is asserted by its own test."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hf_ftpipe.graph import TracedModel, capture_model
from hf_ftpipe.runtime import PipelineEngine

from distributed import run_ranks, values_or_raise
from engine_runs import LR, MICROBATCH, NUM_MICROBATCHES, STEPS, batches, reference_run
from models import tiny_batch, tiny_model
from placements import contiguous_placement

reference = functools.cache(reference_run)
"""`reference_run` once per model and precision: the flushing and autocast tests of a model compare
with the same single-process run (read only)."""


def train_pipeline(
    traced: TracedModel,
    steps: list[tuple[dict[str, torch.Tensor], list[float] | None]],
    stage_device: tuple[int, ...],
    schedule: str,
):
    """SGD steps of this rank's stages on ``steps`` (a mini-batch and its micro-batch loss weights
    each); returns the step losses and this rank's weights."""
    engine = PipelineEngine(
        traced,
        contiguous_placement(traced.cost_graph, list(stage_device)),
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
    )
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
    losses = []
    for batch, weights in steps:
        optimizer.zero_grad()
        losses.append(engine.train_step(batch, loss_weights=weights).item())
        optimizer.step()
    return losses, engine.state_dict()


def train_cases(
    traced: TracedModel,
    steps: list[tuple[dict[str, torch.Tensor], list[float] | None]],
    cases: list[tuple[tuple[int, ...], str]],
) -> dict[tuple[tuple[int, ...], str], tuple]:
    """`train_pipeline` for each (placement, schedule) of ``cases``, each on a deep copy of
    ``traced``: the same initial weights, as a launch of its own would start from."""
    return {case: train_pipeline(copy.deepcopy(traced), steps, *case) for case in cases}


FLUSHING = [
    ("gpt2", [0, 1], "gpipe"),  # wte / lm_head tied across ranks
    ("t5", [0, 1], "gpipe"),  # shared embedding tied across encoder, decoder and lm_head
    ("t5", [0, 1, 0], "gpipe"),  # Mixed-Pipe placement: rank 0 holds the non-adjacent stages 0 and 2
    ("gpt2", [0, 1], "1f1b"),
    ("t5", [0, 1], "1f1b"),
    ("gpt2", [0, 1, 1, 0], "gpipe"),  # 2 ranks, 4 stages, rank 0 holding stages 0 and 3
    ("gpt2", [0, 1, 1, 0], "1f1b"),
]
"""Every case on 2 ranks; one launch per model runs its cases."""


def model_run(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    """This rank's results of every case of ``kind`` (`FLUSHING`, `AUTOCAST`, `WEIGHTED` for GPT-2,
    the evaluation for T5), each on a deep copy of one trace: an export per model and rank, not per
    group of cases (every group's first micro-batch has the same shapes)."""
    data = batches(kind)
    traced = capture_model(tiny_model(kind), {name: value[:MICROBATCH] for name, value in data[0].items()})
    flushing = [(tuple(stage_device), schedule) for k, stage_device, schedule in FLUSHING if k == kind]
    results = {
        "flushing": train_cases(traced, [(batch, None) for batch in data], flushing),
        "autocast": autocast_cases(traced, kind),
    }
    if kind == "gpt2":
        results["weighted"] = train_cases(traced, weighted_batches(), WEIGHTED)
    if kind == "t5":
        results["eval"] = eval_steps(copy.deepcopy(traced))
    return results


@pytest.fixture(scope="module")
def model_results() -> Callable[[str], list[dict[str, Any]]]:
    """Each rank's results of `model_run` for a model on 2 ranks, launched the first time a test asks."""
    done: dict[str, list[dict[str, Any]]] = {}

    def results(kind: str) -> list[dict[str, Any]]:
        if kind not in done:
            done[kind] = values_or_raise(run_ranks(model_run, 2, kind, deadline_s=240.0))
        return done[kind]

    return results


@pytest.mark.parametrize(
    ("kind", "stage_device", "schedule"),
    FLUSHING,
    ids=lambda value: "-".join(map(str, value)) if isinstance(value, list) else str(value),
)
def test_flushing_schedules_equal_single_process(
    model_results: Callable[[str], list[dict]], kind: str, stage_device: list[int], schedule: str
) -> None:
    results = [figures["flushing"][tuple(stage_device), schedule] for figures in model_results(kind)]
    reference_losses, reference_state = reference(kind)

    for rank, (losses, _) in enumerate(results):
        assert losses == pytest.approx(reference_losses, abs=1e-5), f"rank {rank} losses"
    covered = set()
    for rank, (_, state) in enumerate(results):
        for name, value in state.items():
            torch.testing.assert_close(value, reference_state[name], atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")
            covered.add(name)
    trainable = {name for name, p in tiny_model(kind).named_parameters()}
    assert trainable <= covered, f"parameters on no rank: {sorted(trainable - covered)}"


def eval_steps(traced: TracedModel) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """T5's evaluation outputs on ``traced``: the loss and logits, then position 2's logits alone."""
    batch = tiny_batch("t5", MICROBATCH * NUM_MICROBATCHES)
    engine = PipelineEngine(traced, contiguous_placement(traced.cost_graph, [0, 1]), num_microbatches=NUM_MICROBATCHES)
    return engine.eval_step(batch), engine.eval_step(batch, output_names=("loss", "logits"), position=2)


def test_eval_step_returns_loss_and_logits_on_every_rank(model_results: Callable[[str], list[dict]]) -> None:
    results = [figures["eval"] for figures in model_results("t5")]
    model = tiny_model("t5").eval()
    batch = tiny_batch("t5", MICROBATCH * NUM_MICROBATCHES)
    with torch.no_grad():
        pieces = [model(**{k: v[m * MICROBATCH : (m + 1) * MICROBATCH] for k, v in batch.items()}) for m in range(2)]
    logits = torch.cat([p.logits for p in pieces])
    for outputs, one_position in results:
        torch.testing.assert_close(outputs["logits"], logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(outputs["loss"], torch.stack([p.loss for p in pieces]), atol=1e-5, rtol=0)
        # a decoder step's read: position 2 of the logits alone crosses between ranks; the loss is whole
        torch.testing.assert_close(one_position["logits"], logits[:, 2:3], atol=1e-5, rtol=0)
        torch.testing.assert_close(one_position["loss"], outputs["loss"], atol=0, rtol=0)


RECOMPUTED = ("gpipe", "async")
"""The schedules of the recomputation cases, in one launch."""


def recompute_run(rank: int, world_size: int) -> dict[str, list[tuple]]:
    """For each schedule of `RECOMPUTED`, the same training with and without recomputation, dropout
    on: equal only if the recomputed forward repeats the original one exactly (random state
    included). Every run is on a deep copy of one trace: the same initial weights, for one export's time."""
    data = batches("gpt2")
    traced = capture_model(
        tiny_model("gpt2", dropout=0.2), {name: value[:MICROBATCH] for name, value in data[0].items()}
    )
    return {schedule: recompute_runs(traced, data, schedule) for schedule in RECOMPUTED}


def recompute_runs(traced: TracedModel, data: list[dict[str, torch.Tensor]], schedule: str) -> list[tuple]:
    """This rank's losses and weights under ``schedule`` without, then with, recomputation."""
    runs = []
    for recompute in (False, True):
        copied = copy.deepcopy(traced)
        placement = contiguous_placement(copied.cost_graph, [0, 1])
        engine = PipelineEngine(
            copied, placement, num_microbatches=NUM_MICROBATCHES, schedule=schedule, recompute=recompute
        )
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        engine.attach_optimizer(optimizer)
        torch.manual_seed(1234)
        losses = []
        for batch in data:
            losses.append(engine.train_step(batch).item())
            if not engine.streaming:
                optimizer.step()
                optimizer.zero_grad()
        engine.drain()
        runs.append((losses, {k: v.clone() for k, v in engine.state_dict().items()}))
    return runs


@pytest.fixture(scope="module")
def recompute_results() -> list[dict[str, list[tuple]]]:
    return values_or_raise(run_ranks(recompute_run, 2, deadline_s=240.0))


@pytest.mark.parametrize("schedule", RECOMPUTED)
def test_recomputation_changes_nothing_but_memory(recompute_results: list[dict], schedule: str) -> None:
    for (plain_losses, plain_state), (losses, state) in (figures[schedule] for figures in recompute_results):
        assert losses == plain_losses
        assert not any(torch.isnan(torch.tensor(losses)))
        for name, value in state.items():
            torch.testing.assert_close(value, plain_state[name], atol=0, rtol=0, msg=name)


AUTOCAST = [
    ("gpt2", [0, 1], torch.bfloat16, 1.0, 1e-5),
    # T5's shared embedding feeds stages on both ranks: the bfloat16 gradients of values read on
    # several ranks are summed in another order than autograd's, which rounds differently.
    ("t5", [0, 1, 0], torch.bfloat16, 1.0, 3e-3),
    # float16: the loss's gradient seeded with the loss scale, as PipeTrainer's fp16 does.
    ("gpt2", [0, 1], torch.float16, 1024.0, 1e-5),
]
"""(kind, stage_device, dtype, loss_scale, atol); one launch per model runs its cases."""


def autocast_cases(traced: TracedModel, kind: str) -> dict[tuple[tuple[int, ...], torch.dtype], tuple]:
    """This rank's losses, weights and logits for each of the model's `AUTOCAST` cases, each on a deep
    copy of ``traced`` (the initial weights of a launch of its own)."""
    data = batches(kind)
    results = {}
    for k, stage_device, dtype, loss_scale, _ in AUTOCAST:
        if k != kind:
            continue
        copied = copy.deepcopy(traced)
        engine = PipelineEngine(
            copied,
            contiguous_placement(copied.cost_graph, stage_device),
            num_microbatches=NUM_MICROBATCHES,
            autocast_dtype=dtype,
        )
        engine.loss_scale = loss_scale
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        losses = []
        for batch in data:
            optimizer.zero_grad()
            losses.append(engine.train_step(batch).item())
            for param in engine.parameters():
                param.grad.div_(loss_scale)
            optimizer.step()
        logits = engine.eval_step(data[0], output_names=("logits",))["logits"]
        results[tuple(stage_device), dtype] = (losses, engine.state_dict(), logits)
    return results


@pytest.mark.parametrize(
    ("kind", "stage_device", "dtype", "loss_scale", "atol"),
    AUTOCAST,
    ids=["bf16-gpt2-0-1", "bf16-t5-0-1-0", "fp16-gpt2-0-1"],
)
def test_autocast_equals_single_process_autocast(
    model_results: Callable[[str], list[dict]],
    kind: str,
    stage_device: list[int],
    dtype: torch.dtype,
    loss_scale: float,
    atol: float,
) -> None:
    results = [figures["autocast"][tuple(stage_device), dtype] for figures in model_results(kind)]
    reference_losses, reference_state = reference(kind, autocast_dtype=dtype, loss_scale=loss_scale)
    model = tiny_model(kind)
    model.load_state_dict(reference_state)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        reference_logits = model.eval()(**batches(kind)[0]).logits
    full_precision_losses, full_precision_state = reference(kind)
    assert reference_losses != pytest.approx(full_precision_losses, abs=atol), "autocast changed too little"
    for rank, (losses, state, logits) in enumerate(results):
        assert losses == pytest.approx(reference_losses, abs=atol), f"rank {rank} losses"
        # The traced graph returns the loss's float32 upcast of the logits; the values are the same.
        torch.testing.assert_close(logits.float(), reference_logits.float(), atol=20 * atol, rtol=2**-6)
        for name, value in state.items():
            assert value.dtype == torch.float32, f"{name} left float32"
            # Equal to one process under autocast, or where sums run in another order (T5's shared
            # embedding), no further from float32 than that process's own rounding, twice over: how
            # far the orders' roundings fall apart depends on the CPU's kernels (AVX2 here, 5.5e-3
            # on 10 of 2048 weights).
            own = (reference_state[name] - full_precision_state[name]).abs().max().item()
            off = (value - full_precision_state[name]).abs().max().item()
            if off > 2 * own + atol:
                torch.testing.assert_close(
                    value,
                    reference_state[name],
                    atol=atol,
                    rtol=0,
                    msg=lambda why, r=rank, n=name, o=off, w=own: f"rank {r}: {n}: {why} (vs float32 {o}, own {w})",
                )


def weighted_batches() -> list[tuple[dict[str, torch.Tensor], list[float]]]:
    """GPT-2 mini-batches whose micro-batches hold different numbers of label tokens; in the first,
    micro-batch 1 has none (its mean loss is NaN, its weight 0)."""
    data = []
    for step in range(STEPS):
        batch = tiny_batch("gpt2", MICROBATCH * NUM_MICROBATCHES, seed=step)
        batch["labels"][MICROBATCH:, : 3 + step] = -100
        if step == 0:
            batch["labels"][MICROBATCH:] = -100
        counts = [int(c.ne(-100).sum()) for c in batch["labels"][:, 1:].chunk(NUM_MICROBATCHES)]
        data.append((batch, [c / sum(counts) for c in counts]))
    return data


WEIGHTED = [((0, 1), "gpipe"), ((0, 1), "1f1b"), ((0, 1, 1, 0), "1f1b")]
"""(placement, schedule) of the loss-weight cases, on 2 ranks, in GPT-2's launch."""


@pytest.mark.parametrize(("stage_device", "schedule"), WEIGHTED, ids=str)
def test_loss_weights_give_the_token_mean_of_the_mini_batch(
    model_results: Callable[[str], list[dict]], stage_device: tuple[int, ...], schedule: str
) -> None:
    """The step's loss and gradients are those of the mean over the mini-batch's label tokens (what
    Trainer computes with num_items_in_batch), also when a micro-batch has no label token."""
    results = [figures["weighted"][stage_device, schedule] for figures in model_results("gpt2")]
    model = tiny_model("gpt2")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference_losses = []
    for batch, _ in weighted_batches():
        optimizer.zero_grad()
        loss = model(**batch).loss  # the model's own mean over every label token of the mini-batch
        loss.backward()
        optimizer.step()
        reference_losses.append(loss.item())
    reference_state = model.state_dict()
    for rank, (losses, state) in enumerate(results):
        assert losses == pytest.approx(reference_losses, abs=1e-5), f"rank {rank} losses"
        for name, value in state.items():
            torch.testing.assert_close(value, reference_state[name], atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")
