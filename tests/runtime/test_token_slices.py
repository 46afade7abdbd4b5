"""Token slices (TeraPipe) compute exactly what whole sequences compute: in one process, loss and
every gradient of GPT-2 (learned positions) and a Llama-style model (RoPE, grouped-query
attention); across two gloo ranks, training under gpipe (GPT-2) and 1f1b (Llama) step by step on
sequences of a different length each step, from one capture."""

from __future__ import annotations

import pytest
import torch

from hf_ftpipe.errors import PipelineError, TraceError
from hf_ftpipe.graph.token_slices import (
    capture_token_slices,
    check_sliceable,
    cut_slices,
    fit_slices,
    sequence_inputs,
)
from hf_ftpipe.runtime import PipelineEngine

from distributed import run_ranks, values_or_raise
from engine_runs import LR, MICROBATCH, NUM_MICROBATCHES
from models import SEQ, tiny_batch, tiny_model
from placements import contiguous_placement

SLICES = [3, 1, 4]
"""Uneven, with a one-token slice; tiny_batch pads the last two tokens of its first sequence."""
CASES = [(kind, dtype) for kind in ("gpt2", "llama") for dtype in (torch.float64, torch.float32)]
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def one_process_run(rank: int, world_size: int) -> dict:
    """Both stages on this one rank: loss and gradients of one sliced mini-batch per case."""
    results = {}
    for kind, dtype in CASES:
        batch = tiny_batch(kind, MICROBATCH)
        sliced = capture_token_slices(tiny_model(kind).to(dtype), batch, SLICES)
        engine = PipelineEngine(sliced, contiguous_placement(sliced.full.cost_graph, [0, 0]), num_microbatches=1)
        loss = engine.train_step(batch)
        results[(kind, dtype)] = loss, {name: p.grad.clone() for name, p in engine.named_parameters()}
    results["mixed window"] = mixed_accumulation_window()
    return results


def mixed_accumulation_window() -> str:
    """The refusal of an accumulation window whose batches were padded to different lengths."""
    batch = tiny_batch("gpt2", MICROBATCH)
    sliced = capture_token_slices(tiny_model("gpt2"), batch, SLICES)
    placement = contiguous_placement(sliced.full.cost_graph, [0, 0])
    engine = PipelineEngine(sliced, placement, num_microbatches=1, batches_per_step=2)
    shorter = tiny_batch("gpt2", MICROBATCH, seq=5)
    try:
        engine.train_step([batch, shorter])
    except PipelineError as error:
        return str(error)
    return "no error"


def test_slices_equal_the_whole_sequence_in_one_process() -> None:
    (results,) = values_or_raise(run_ranks(one_process_run, 1))
    for kind, dtype in CASES:
        model = tiny_model(kind).to(dtype)
        reference = model(**tiny_batch(kind, MICROBATCH)).loss
        reference.backward()
        loss, grads = results[(kind, dtype)]
        # transformers computes the loss in float32 (`logits.float()`), whatever the model's dtype
        assert loss.item() == pytest.approx(reference.item(), rel=1e-6), (kind, dtype)
        expected = dict(model.named_parameters())
        assert grads and set(grads) <= set(expected)
        for name, grad in grads.items():
            assert (grad - expected[name].grad).abs().max().item() <= TOLERANCE[dtype], (kind, dtype, name)
    assert results["mixed window"] == (
        "token slicing cuts every sequence of a step alike, but this step's batches have [5, 8] tokens (gradient "
        "accumulation over batches padded apart); pad the batches of an accumulation window to one length "
        "(padding='max_length'), or set gradient_accumulation_steps=1"
    )


SHAPES = [(4, 8), (2, 5), (3, 3)]
"""(rows, sequence length) of each step: the planned shape, then shorter sequences in micro-batches of
one row and of unequal rows (2 + 1). `SLICES` cut them as (3, 1, 4), (3, 1, 1) and (3,): a different number of slices
per step, from one capture."""
PIPELINES = (("gpt2", "gpipe", False), ("llama", "1f1b", True))
"""(model, schedule, activation recomputation: the recomputed forward reads the keys and values again)."""


def varying_batches(kind: str) -> list[dict[str, torch.Tensor]]:
    return [tiny_batch(kind, rows, seed=step, seq=seq) for step, (rows, seq) in enumerate(SHAPES)]


def row_weights(rows: int) -> list[float]:
    sizes = [len(piece) for piece in torch.arange(rows).tensor_split(min(rows, NUM_MICROBATCHES))]
    return [size / rows for size in sizes]


def pipeline_run(rank: int, world_size: int) -> dict:
    """SGD steps of the sliced pipeline on sequences of 8, 5 and 3 tokens, one stage per rank."""
    results = {}
    for kind, schedule, recompute in PIPELINES:
        data = varying_batches(kind)
        sample = {name: value[:MICROBATCH] for name, value in data[0].items()}
        sliced = capture_token_slices(tiny_model(kind), sample, SLICES)
        engine = PipelineEngine(
            sliced,
            contiguous_placement(sliced.full.cost_graph, [0, 1]),
            num_microbatches=NUM_MICROBATCHES,
            schedule=schedule,
            recompute=recompute,
        )
        optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
        losses, slicings = [], []
        for batch in data:
            optimizer.zero_grad()
            losses.append(engine.train_step(batch, loss_weights=row_weights(len(batch["input_ids"]))).item())
            slicings.append(engine.token_slicing.slice_lengths)
            optimizer.step()
        evaluated = engine.eval_step(data[1], ("loss",))["loss"]  # whole sequences
        results[(kind, schedule)] = losses, engine.state_dict(), evaluated, slicings, sliced.dynamic
    results["auto"] = auto_slicings(rank)
    return results


AUTO_LENGTHS = (64, 50, 35, 17, 3)
"""Sequence lengths ``token_slices="auto"`` is asked to cut, the first the planned one."""


def auto_slicings(rank: int) -> dict[int, tuple[int, ...]]:
    """PipeTrainer's ``token_slices="auto"`` on this rank: a Llama planned for 64 tokens on the ``cpu``
    profile (long enough for the DP to cut it), then each of `AUTO_LENGTHS` as a batch would be cut."""
    from hf_ftpipe import PipeTrainingArguments
    from hf_ftpipe.runtime import Watchdog
    from hf_ftpipe.trainer.token_slicing import capture_for_pipeline

    args = PipeTrainingArguments(
        output_dir="unused", use_cpu=True, report_to="none", per_device_train_batch_size=2, num_microbatches=1,
        token_slices="auto", gpu_profile="cpu",
    )  # fmt: skip
    batch = tiny_batch("llama", 2, seq=AUTO_LENGTHS[0])
    sliced = capture_for_pipeline(args, tiny_model("llama"), batch, Watchdog(rank, 2, 60.0, run_id="auto-slices"))
    return {length: tuple(sliced.slices_for(length)) for length in AUTO_LENGTHS} | {0: sliced.slice_lengths}


def varying_reference(kind: str) -> tuple[list[float], dict, list[float]]:
    """One process, the same micro-batches and weights; then the losses of `pipeline_run`'s evaluation."""
    model = tiny_model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in varying_batches(kind):
        optimizer.zero_grad()
        rows = len(batch["input_ids"])
        split = {name: value.tensor_split(min(rows, NUM_MICROBATCHES)) for name, value in batch.items()}
        total = 0.0
        for m, weight in enumerate(row_weights(rows)):
            loss = model(**{name: pieces[m] for name, pieces in split.items()}).loss
            (loss * weight).backward()
            total += loss.item() * weight
        optimizer.step()
        losses.append(total)
    model.eval()
    evaluated = varying_batches(kind)[1]
    with torch.no_grad():
        expected_eval = [
            model(**{k: v[rows] for k, v in evaluated.items()}).loss.item() for rows in (slice(1), slice(1, 2))
        ]
    return losses, model.state_dict(), expected_eval


@pytest.fixture(scope="module")
def pipeline_results() -> list[dict]:
    return values_or_raise(run_ranks(pipeline_run, 2))


def test_sliced_pipeline_trains_on_any_length_like_one_process(pipeline_results: list[dict]) -> None:
    per_rank = pipeline_results
    for kind, schedule, _ in PIPELINES:
        reference_losses, reference_state, expected_eval = varying_reference(kind)
        for rank_results in per_rank:
            losses, state, evaluated, slicings, dynamic = rank_results[(kind, schedule)]
            assert dynamic, f"{kind}: captured with a fixed sequence length"
            assert slicings == [(3, 1, 4), (3, 1, 1), (3,)], (kind, schedule)
            assert losses == pytest.approx(reference_losses, rel=1e-5), (kind, schedule)
            for name, value in state.items():
                torch.testing.assert_close(value, reference_state[name], rtol=1e-5, atol=1e-5)
            assert evaluated.tolist() == pytest.approx(expected_eval, rel=1e-5)
        covered = set(per_rank[0][(kind, schedule)][1]) | set(per_rank[1][(kind, schedule)][1])
        assert {n for n, p in tiny_model(kind).named_parameters()} <= covered | {"lm_head.weight"}


def test_auto_slices_every_length_alike_on_every_rank(pipeline_results: list[dict]) -> None:
    """``token_slices="auto"`` re-plans each length on each rank from rank 0's latency model, with no
    message per length: every rank cuts every length alike."""
    first, second = (rank_results["auto"] for rank_results in pipeline_results)
    assert first == second
    assert first[0] == first[AUTO_LENGTHS[0]] and len(first[0]) > 1, "the planned length must be cut"
    for length in AUTO_LENGTHS:
        assert sum(first[length]) == length and min(first[length]) >= 1, length


def test_slice_inputs_shift_labels_across_slices_and_keep_global_positions() -> None:
    batch = tiny_batch("gpt2", 2)
    pieces = cut_slices(sequence_inputs(batch), SLICES)
    assert [p["input_ids"].shape[1] for p in pieces] == SLICES
    assert pieces[1]["position_ids"].tolist() == [[3], [3]]
    # slice 0's last token learns slice 1's token; the sequence's last token learns nothing
    assert pieces[0]["shift_labels"][:, -1].tolist() == batch["labels"][:, 3].tolist()
    assert pieces[-1]["shift_labels"][:, -1].tolist() == [-100, -100]
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    assert all(int(p["num_items_in_batch"]) == labelled for p in pieces)
    with pytest.raises(TraceError, match=r"\[3, 4\] \(sum 7\).*sequence length 8"):
        cut_slices(sequence_inputs(batch), [3, 4])


@pytest.mark.parametrize(
    ("seq_len", "slices"),
    [(8, (3, 1, 4)), (7, (3, 1, 3)), (5, (3, 1, 1)), (4, (3, 1)), (3, (3,)), (2, (2,)), (1, (1,))],
)
def test_given_slices_keep_their_leading_slices_and_cut_the_last_for_a_shorter_sequence(
    seq_len: int, slices: tuple[int, ...]
) -> None:
    assert fit_slices(SLICES, seq_len) == slices


def test_a_sequence_longer_than_the_given_slices_is_refused_with_both_lengths() -> None:
    with pytest.raises(TraceError, match=r"sequences of 9 tokens, longer than the 8 that `token_slices=\[3, 1, 4\]`"):
        fit_slices(SLICES, 9)


def test_models_slicing_cannot_train_exactly_are_refused_with_the_fix() -> None:
    with pytest.raises(TraceError, match="encoder-decoder.*num_microbatches"):
        check_sliceable(tiny_model("t5"), SEQ)
    with pytest.raises(TraceError, match="not a causal LM.*num_microbatches"):
        check_sliceable(tiny_model("bert"), SEQ)
    checkpointed = tiny_model("llama")
    checkpointed.activation_checkpointing_enable()
    with pytest.raises(TraceError, match="activation .gradient. checkpointing.*activation_checkpointing=True"):
        check_sliceable(checkpointed, SEQ)
    dynamic = tiny_model("llama")
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(TraceError, match="dynamic-NTK"):
        check_sliceable(dynamic, SEQ)
    windowed = tiny_model("llama")
    windowed.config.sliding_window = 4
    with pytest.raises(TraceError, match="sliding window of 4 tokens"):
        check_sliceable(windowed, SEQ)
    eager = tiny_model("gpt2")
    eager.config._attn_implementation = "eager"
    with pytest.raises(TraceError, match='attn_implementation="sdpa"'):
        check_sliceable(eager, SEQ)
    with pytest.warns(UserWarning, match=r"dropout \(.*0\.1.*equal only statistically"):
        check_sliceable(tiny_model("gpt2", dropout=0.1), SEQ)


def streaming_run(rank: int, world_size: int) -> str:
    batch = tiny_batch("gpt2", MICROBATCH)
    sliced = capture_token_slices(tiny_model("gpt2"), batch, SLICES)
    try:
        PipelineEngine(sliced, contiguous_placement(sliced.full.cost_graph, [0]), num_microbatches=1, schedule="async")
    except PipelineError as error:
        return str(error)
    return "no error"


def test_streaming_schedules_refuse_token_slices() -> None:
    (message,) = values_or_raise(run_ranks(streaming_run, 1))
    assert "token slices" in message and "gpipe" in message and "1f1b" in message
