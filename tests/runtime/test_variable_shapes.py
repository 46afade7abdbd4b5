"""Batches of any shape through one traced pipeline: every step's length and row count differ,
short batches give fewer or unequal micro-batches, and training equals one process on the same
micro-batches, loss by loss and weight by weight; evaluation returns the model's own logits. A batch
the plan cannot take (longer or larger than planned, shapes the model's code ties together) is
refused on every rank with a message that says what to change.

A model whose export fixes the sequence length runs each length on a graph traced at its bucket
(`hf_ftpipe.runtime.per_shape`) and trains as one process too.

Before it trains, the T5 capture (symbolic source and target lengths) generates through the
stages' key/value cache (`EncoderDecoderKV`) under stages [0, 1] and Mixed-Pipe's [0, 1, 1, 0]:
greedy, beams returning two sequences each, and sampling from a seed, on padded sources of
different lengths, token for token as ``model.generate`` on one process (no capture of its own).

One launch trains every model in turn (process start-up is most of a launch's time)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import TracedModel, capture_model
from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.runtime.per_shape import PerShapeOptions

from distributed import run_ranks, values_or_raise
from generation_cases import assert_engines_generated_like_one_process, generate_through_engines
from models import FixedLengthLM, tiny_batch, tiny_model
from placements import contiguous_placement

NUM_MICROBATCHES = 2
LR = 0.5
SHAPES = [(6, 8), (5, 5), (1, 4), (3, 7)]
"""(rows, sequence length) of each step: equal halves, unequal micro-batches (3 + 2), fewer rows
than micro-batches, and 2 + 1; the first is the planned (largest) shape: micro-batches of (3, 8)."""
CASES = {  # kind: (stage → rank, schedule)
    "gpt2": ([0, 1], "gpipe"),  # wte / lm_head tied across ranks
    "t5": ([0, 1, 0], "1f1b"),  # Mixed-Pipe: rank 0 holds stages 0 and 2; labels vary too
    "bert": ([0, 1], "1f1b"),
    "llama": ([0, 1, 1, 0], "gpipe"),
}
GENERATION_PLANS = {"one stage per rank": [0, 1], "mixed": [0, 1, 1, 0]}


def steps(kind: str) -> list[dict[str, torch.Tensor]]:
    return [
        tiny_batch(kind, rows, seed=step, seq=seq, target=max(2, seq // 2)) for step, (rows, seq) in enumerate(SHAPES)
    ]


def row_weights(rows: int) -> list[float]:
    """Each micro-batch's share of the mini-batch's rows: its weight in a loss averaged over rows."""
    sizes = [len(piece) for piece in torch.arange(rows).tensor_split(min(rows, NUM_MICROBATCHES))]
    return [size / rows for size in sizes]


def pipeline_run(rank: int, world_size: int) -> dict[str, tuple[list[float], dict, dict] | dict[str, str]]:
    results = {}
    for kind, (stage_device, schedule) in CASES.items():
        data = steps(kind)
        planned = {name: value[:3] for name, value in data[0].items()}
        model = tiny_model(kind)
        traced = capture_model(model, planned)
        if kind == "t5":  # on the initial weights, before the training engine below changes them
            results["t5_generated"] = generate_through_engines(model, traced, GENERATION_PLANS)
        engine = PipelineEngine(
            traced,
            contiguous_placement(traced.cost_graph, stage_device),
            num_microbatches=NUM_MICROBATCHES,
            schedule=schedule,
        )
        if kind == "gpt2":  # first: a refused batch must leave the engine as it was
            results["refusals"] = refusals(traced, engine)
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        losses = []
        for batch in data:
            optimizer.zero_grad()
            rows = len(batch["input_ids"])
            losses.append(engine.train_step(batch, loss_weights=row_weights(rows)).item())
            optimizer.step()
        evaluated = engine.eval_step(data[1], output_names=("loss", "logits"))
        results[kind] = (losses, engine.state_dict(), evaluated, engine.shape_book.cached)
    results["per_shape"] = per_shape_run()
    return results


PER_SHAPE_STEPS = [(6, 16), (5, 7), (4, 3), (6, 10), (3, 5)]
"""(rows, length) per step of `FixedLengthLM`, whose export fixes the length. With buckets of 4 and at
most 3 graphs: 16 is the planned graph's; 7 runs on a graph traced at 8 (the 2nd), 3 at 4 (the 3rd);
10 would need 12, but 3 graphs are the most, so it is padded to 16; 5 runs on the graph of 8 again."""
PER_SHAPE_OPTIONS = PerShapeOptions(multiple_of=4, max_shapes=3)


def per_shape_steps() -> list[dict[str, torch.Tensor]]:
    return [tiny_batch("gpt2", rows, seed=10 + step, seq=seq) for step, (rows, seq) in enumerate(PER_SHAPE_STEPS)]


def per_shape_run() -> tuple[list[float], dict, dict, list[str]]:
    """gpipe on 2 ranks; the per-shape warnings this rank logged."""
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("hf_ftpipe.runtime.per_shape")
    log.addHandler(handler)
    try:
        data = per_shape_steps()
        traced = capture_model(FixedLengthLM(), {name: value[:3] for name, value in data[0].items()})
        engine = PipelineEngine(
            traced,
            contiguous_placement(traced.cost_graph, [0, 1]),
            num_microbatches=NUM_MICROBATCHES,
            per_shape=PER_SHAPE_OPTIONS,
        )
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        losses = []
        for batch in data:
            optimizer.zero_grad()
            losses.append(engine.train_step(batch, loss_weights=row_weights(len(batch["input_ids"]))).item())
            optimizer.step()
        evaluated = engine.eval_step(data[1], output_names=("loss", "logits"))
    finally:
        log.removeHandler(handler)
    return losses, engine.state_dict(), evaluated, warnings


def refusals(traced: TracedModel, engine: PipelineEngine) -> dict[str, str]:
    """The error each batch the plan (micro-batches of at most 3 rows of 8 tokens) cannot take raises
    here, from ``engine`` and from an ``async`` one on the same graph."""
    streaming = PipelineEngine(
        traced, contiguous_placement(traced.cost_graph, [0, 1]), num_microbatches=NUM_MICROBATCHES, schedule="async"
    )
    streaming.attach_optimizer(torch.optim.SGD(streaming.parameters(), lr=LR))
    mismatched = tiny_batch("gpt2", 4, seq=6)
    mismatched["attention_mask"] = mismatched["attention_mask"][:, :5]
    cases = {
        "too long": (engine, tiny_batch("gpt2", 4, seq=9)),
        "too many rows": (engine, tiny_batch("gpt2", 8, seq=4)),
        "async, fewer rows than micro-batches": (streaming, tiny_batch("gpt2", 1, seq=4)),
        "inputs of different lengths": (engine, mismatched),
    }
    errors = {}
    for case, (pipeline, batch) in cases.items():
        try:
            pipeline.train_step(batch)
            errors[case] = "no error"
        except PipelineError as error:
            errors[case] = str(error)
    return errors


def reference_run(kind: str) -> tuple[list[float], dict, torch.Tensor]:
    """One process, the same micro-batches (unpadded), gradients accumulated with the same weights."""
    model = FixedLengthLM() if kind == "per_shape" else tiny_model(kind)
    data = per_shape_steps() if kind == "per_shape" else steps(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in data:
        optimizer.zero_grad()
        rows = len(batch["input_ids"])
        split = {name: value.tensor_split(min(rows, NUM_MICROBATCHES)) for name, value in batch.items()}
        total = 0.0
        for m, weight in enumerate(row_weights(rows)):
            microbatch = {name: pieces[m] for name, pieces in split.items()}
            loss = model(**microbatch)["loss"]
            (loss * weight).backward()
            total += loss.item() * weight
        optimizer.step()
        losses.append(total)
    model.eval()
    evaluated = data[1]
    with torch.no_grad():  # the same micro-batches: logits equal to the float rounding
        logits = torch.cat(
            [model(**{k: v[rows] for k, v in evaluated.items()})["logits"] for rows in (slice(3), slice(3, 5))]
        )
    return losses, model.state_dict(), logits


@pytest.fixture(scope="module")
def pipeline_results() -> list[dict]:
    return values_or_raise(run_ranks(pipeline_run, 2, deadline_s=240))


@pytest.mark.distributed
@pytest.mark.parametrize("kind", list(CASES))
def test_every_batch_shape_trains_as_one_process(pipeline_results: list[dict], kind: str) -> None:
    reference_losses, reference_state, reference_logits = reference_run(kind)
    covered = set()
    for rank, results in enumerate(pipeline_results):
        losses, state, evaluated, cached = results[kind]
        assert losses == pytest.approx(reference_losses, abs=1e-5), f"rank {rank} losses"
        for name, value in state.items():
            torch.testing.assert_close(value, reference_state[name], atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")
            covered.add(name)
        torch.testing.assert_close(evaluated["logits"], reference_logits, atol=1e-5, rtol=1e-4)
        # micro-batch shapes: (3, 8); (3, 5) (2, 5); (1, 4); (2, 7) (1, 7); evaluation's (3, 5) (2, 5) again
        assert cached == 6, f"rank {rank} evaluated {cached} micro-batch shapes"
    trainable = {name for name, _ in tiny_model(kind).named_parameters()}
    assert trainable <= covered, f"parameters on no rank: {sorted(trainable - covered)}"


@pytest.mark.distributed
def test_t5_generates_through_the_stages_key_value_cache_as_one_process(pipeline_results: list[dict]) -> None:
    for results in pipeline_results:
        assert set(results["t5_generated"]) == set(GENERATION_PLANS)
        assert_engines_generated_like_one_process(results["t5_generated"], tiny_model("t5"))


@pytest.mark.distributed
def test_batches_larger_than_planned_or_of_shapes_the_model_ties_are_refused_on_every_rank(
    pipeline_results: list[dict],
) -> None:
    """Refused before anything is sent, the same on every rank; the engine then trains as if they
    had never come (`test_every_batch_shape_trains_as_one_process` on gpt2)."""
    assert pipeline_results[0]["refusals"] == pipeline_results[1]["refusals"], "every rank says the same"
    errors = pipeline_results[0]["refusals"]
    assert errors["too long"].startswith("'input_ids' has length 9 (dimension 1), but the pipeline was planned for")
    assert "at most 8" in errors["too long"] and "PipeTrainingArguments(plan_max_length=9)" in errors["too long"]
    assert errors["too many rows"].startswith("'input_ids' gives a micro-batch of 4 rows, but the pipeline was")
    assert "planned for at most 3 (2 micro-batches of a mini-batch of 6)" in errors["too many rows"]
    assert "per_device_train_batch_size" in errors["too many rows"]
    assert errors["async, fewer rows than micro-batches"].startswith(
        "the 'async' schedule streams whole mini-batches of num_microbatches=2 micro-batches, but this batch "
        "has only 1 row,"
    )
    assert "dataloader_drop_last=True" in errors["async, fewer rows than micro-batches"]
    assert errors["inputs of different lengths"] == (  # ShapeFormulas.bind's
        "'attention_mask' has size 5 in dimension 1, but 'input_ids' has 6 in dimension 1, and GPT2LMHeadModel "
        "needs the two equal (torch.export found its code uses them together); give inputs of matching shapes, "
        "e.g. padded by one collator"
    )


@pytest.mark.distributed
def test_a_model_whose_export_fixes_the_length_trains_each_length_on_its_own_graph(
    pipeline_results: list[dict],
) -> None:
    """Lengths 16, 7, 3, 10 and 5 on graphs of 16, 8 and 4 tokens (padded with a 0 mask and -100
    labels): every loss and weight equal to one process on the unpadded micro-batches; evaluation's
    logits cut back to the batch's 7 tokens. Each rank warns once per traced shape, with the count,
    and once when the bound is reached."""
    reference_losses, reference_state, reference_logits = reference_run("per_shape")
    for rank, results in enumerate(pipeline_results):
        losses, state, evaluated, warnings = results["per_shape"]
        assert losses == pytest.approx(reference_losses, abs=1e-5), f"rank {rank} losses"
        for name, value in state.items():
            torch.testing.assert_close(value, reference_state[name], atol=1e-5, rtol=0, msg=f"rank {rank}: {name}")
        assert evaluated["logits"].shape == (5, 7, reference_logits.shape[-1])
        torch.testing.assert_close(evaluated["logits"], reference_logits, atol=1e-5, rtol=1e-4)
        assert len(warnings) == 3, warnings
        because = (
            "since torch.export found that its code fixes 'input_ids' dimension 1 (at 16), 'attention_mask' "
            "dimension 1 (at 16)"
        )
        for warning, (count, shape) in zip(warnings, [(2, (3, 8)), (3, (2, 4))], strict=False):
            assert warning.startswith(
                f"FixedLengthLM: traced a graph for micro-batches of shape {{'attention_mask': {shape}, "
                f"'input_ids': {shape}, 'labels': {shape}}}, {count} shapes traced so far (at most 3, lengths "
                "padded to multiples of 4), " + because
            ), warning
        assert warnings[2].startswith(
            "FixedLengthLM: 3 shapes traced, the most kept (PerShapeOptions.max_shapes); micro-batches of a new "
            "shape are padded to the nearest traced one from now on (sizes (12, 12) of [('input_ids', 1), "
            "('attention_mask', 1)] to (16, 16))"
        ), warnings[2]
