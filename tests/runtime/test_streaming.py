"""``async`` and ``2bw`` across real gloo processes, against references that replay their update rules."""

from __future__ import annotations

import pytest
import torch
from streaming_replay import replay, shared_readers

from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime import PipelineEngine

from distributed import run_ranks, values_or_raise
from models import tiny_batch, tiny_model
from placements import contiguous_placement

MICROBATCH = 2
LR = 0.5
VARIABLE_SHAPES = [(6, 8), (5, 5), (2, 4), (3, 7), (4, 6)]
"""(rows, sequence length) of each step of the variable-shape runs, 2 micro-batches per step: 3 + 3,
3 + 2 (unequal), 1 + 1, 2 + 1, 2 + 2; the first is the planned (largest) shape, micro-batches of (3, 8)."""


def microbatches(kind: str, count: int) -> list[dict[str, torch.Tensor]]:
    return [tiny_batch(kind, MICROBATCH, seed=100 + m) for m in range(count)]


def variable_minibatches(kind: str) -> list[dict[str, torch.Tensor]]:
    return [tiny_batch(kind, rows, seed=200 + step, seq=seq) for step, (rows, seq) in enumerate(VARIABLE_SHAPES)]


def row_weights(rows: int, num_microbatches: int) -> list[float]:
    """Each micro-batch's share of the rows (PipeTrainer's loss weights for a loss averaged over rows)."""
    return [len(piece) / rows for piece in torch.arange(rows).tensor_split(num_microbatches)]


def split_weighted(minibatch: dict[str, torch.Tensor], num_microbatches: int) -> list[tuple[dict, float]]:
    """The pipeline's micro-batches of ``minibatch`` (`torch.tensor_split`) with their loss weights."""
    rows = len(minibatch["input_ids"])
    pieces = {k: v.tensor_split(num_microbatches) for k, v in minibatch.items()}
    weights = row_weights(rows, num_microbatches)
    return [({k: v[m] for k, v in pieces.items()}, weights[m]) for m in range(num_microbatches)]


def as_minibatches(parts: list[dict[str, torch.Tensor]], per_step: int) -> list[dict[str, torch.Tensor]]:
    return [
        {k: torch.cat([p[k] for p in parts[i : i + per_step]]) for k in parts[0]}
        for i in range(0, len(parts), per_step)
    ]


def streaming_run(
    rank: int,
    world_size: int,
    kind: str,
    stage_device,
    schedule: str,
    num_microbatches: int,
    steps: int,
    momentum: float = 0.0,
    weight_prediction: bool = False,
    caller_steps: bool = False,
    variable: bool = False,
):
    """With ``caller_steps``, step and zero the optimizer after every train_step as `Trainer`
    does: the engine owns the updates, so that must change nothing. With ``variable``, the steps
    are `VARIABLE_SHAPES` (``steps`` unused), each micro-batch weighted by its share of the rows."""
    model = tiny_model(kind)
    if variable:
        data = variable_minibatches(kind)
        planned = {name: value[: -(-len(value) // num_microbatches)] for name, value in data[0].items()}
    else:
        data = as_minibatches(microbatches(kind, num_microbatches * steps), num_microbatches)
        planned = {name: value[:MICROBATCH] for name, value in data[0].items()}
    traced = capture_model(model, planned)
    placement = contiguous_placement(traced.cost_graph, stage_device)
    engine = PipelineEngine(
        traced, placement, num_microbatches=num_microbatches, schedule=schedule, weight_prediction=weight_prediction
    )
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR, momentum=momentum)
    engine.attach_optimizer(optimizer)
    losses, norms = [], []
    for batch in data:
        weights = row_weights(len(batch["input_ids"]), num_microbatches) if variable else None
        losses.append(engine.train_step(batch, loss_weights=weights).item())
        norms.append(engine.step_grad_norm().item())
        if caller_steps:
            optimizer.step()
            optimizer.zero_grad()
    engine.drain()
    stage_params = {s: sorted(dict(m.named_parameters())) for s, m in engine.modules.items()}
    return losses, engine.state_dict(), engine.version_log, stage_params, norms


def streaming_runs(rank: int, world_size: int, runs: list[tuple]) -> list[tuple]:
    """`streaming_run` for each argument tuple in ``runs``, in one launch (start-up is most of a launch)."""
    return [streaming_run(rank, world_size, *args) for args in runs]


TWO_RANK_RUNS = {
    "async": ("bert", [0, 1], "async", 4, 3),
    "async-variable": ("bert", [0, 1], "async", 2, 0, 0.0, False, False, True),
    "2bw-variable": ("bert", [0, 1], "2bw", 2, 0, 0.0, False, False, True),
    "2bw-t5-tied": ("t5", [0, 0, 1, 0], "2bw", 2, 4),
    "async-t5-shared": ("t5", [0, 1, 0], "async", 2, 3),
    "2bw-t5-shared": ("t5", [0, 1, 0], "2bw", 2, 3),
}


@pytest.fixture(scope="module")
def two_rank_runs() -> dict[str, list[tuple]]:
    """Each of `TWO_RANK_RUNS`: every rank's `streaming_run` result."""
    results = values_or_raise(run_ranks(streaming_runs, 2, list(TWO_RANK_RUNS.values()), deadline_s=240))
    return {name: [ranks[i] for ranks in results] for i, name in enumerate(TWO_RANK_RUNS)}


def forward_backward(model, microbatch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**microbatch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_async_on_one_stage_equals_plain_training_with_an_update_per_microbatch() -> None:
    ((losses, state, log, _, norms),) = values_or_raise(run_ranks(streaming_run, 1, "bert", [0], "async", 2, 3))
    model = tiny_model("bert").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reference_losses, reference_norms = [], []
    for microbatch in microbatches("bert", 6):
        optimizer.zero_grad()
        loss = model(**microbatch).loss
        loss.backward()
        reference_norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
        reference_losses.append(loss.item())
    assert losses == pytest.approx([sum(reference_losses[i : i + 2]) / 2 for i in (0, 2, 4)], abs=1e-5)
    # the logged norm of a step: the largest of its updates' (one per micro-batch here), unclipped
    assert norms == pytest.approx([max(reference_norms[i : i + 2]) for i in (0, 2, 4)], rel=1e-5)
    assert [version for _, _, version in log] == list(range(6))  # always the newest weights
    for name, value in state.items():
        torch.testing.assert_close(value, model.state_dict()[name], atol=1e-5, rtol=0, msg=name)


def replay_async(results: list[tuple], steps: list[list[tuple[dict, float]]]) -> tuple[list[float], dict]:
    """Replay ``async`` with SGD over ``steps`` (each a list of (micro-batch, loss weight w)): micro-batch
    m's gradient for stage s is taken at the version of stage s its forward logged, scaled by
    ``w * num_microbatches`` (the engine's rule for an update per micro-batch), and stage s's k-th
    update applies micro-batch k's gradient. Returns each step's loss, sum(w * loss), and the last
    weights of each stage."""
    used = {(s, m): v for _, _, log, *_ in results for s, m, v in log}
    stage_of = {name: s for _, _, _, params, _ in results for s, names in params.items() for name in names}
    assert any(v < m for (s, m), v in used.items()), "no micro-batch ran on a stashed (older) version"
    stages = sorted(set(stage_of.values()))
    model = tiny_model("bert").train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    history = {s: [{n: v for n, v in initial.items() if stage_of[n] == s}] for s in stages}
    step_losses, m = [], 0
    for step in steps:
        step_losses.append(0.0)
        for microbatch, weight in step:
            with torch.no_grad():
                for s in stages:
                    for name, value in history[s][used[(s, m)]].items():
                        model.get_parameter(name).copy_(value)
            loss, grads = forward_backward(model, microbatch)
            step_losses[-1] += weight * loss
            for s in stages:
                latest = history[s][-1]
                history[s].append({n: latest[n] - LR * weight * len(step) * grads[n] for n in latest})
            m += 1
    return step_losses, {n: v for s in stages for n, v in history[s][-1].items()}


def test_async_two_ranks_each_gradient_uses_the_weights_its_forward_used(two_rank_runs: dict) -> None:
    num_microbatches, steps = 4, 3
    results = two_rank_runs["async"]
    parts = microbatches("bert", num_microbatches * steps)
    equal = [[(part, 1 / num_microbatches) for part in parts[i : i + num_microbatches]] for i in (0, 4, 8)]
    step_losses, weights = replay_async(results, equal)
    check_streaming_run(results, step_losses, weights)


def test_async_on_variable_shapes_updates_per_microbatch_by_its_share_of_the_rows(two_rank_runs: dict) -> None:
    """Steps of different lengths and row counts (5 rows: micro-batches of 3 and 2): each update
    applies one micro-batch's gradient times ``w * num_microbatches``, its rows over the mean rows
    of a micro-batch, so a row's gradient counts the same in every update."""
    results = two_rank_runs["async-variable"]
    steps = [split_weighted(minibatch, 2) for minibatch in variable_minibatches("bert")]
    step_losses, weights = replay_async(results, steps)
    check_streaming_run(results, step_losses, weights)


def check_streaming_run(results: list[tuple], step_losses: list[float], weights: dict) -> None:
    """Every rank reports the reference's step losses, and holds its weights."""
    for rank, (rank_losses, *_) in enumerate(results):
        assert rank_losses == pytest.approx(step_losses, abs=1e-5), f"rank {rank}"
    for rank, (_, state, _, params, _) in enumerate(results):
        for name in (n for names in params.values() for n in names):
            torch.testing.assert_close(state[name], weights[name], atol=1e-5, rtol=0, msg=f"rank {rank} {name}")


def test_async_weight_prediction_runs_each_microbatch_on_the_extrapolated_weights() -> None:
    """Replay with SGD momentum μ: stage s's forward of micro-batch m ran on W_c − k·lr·v_c, with
    (c, k) as logged; its gradient was applied by stage s's m-th update: v ← μv + g, W ← W − lr·v."""
    num_microbatches, steps, momentum = 4, 3, 0.9
    args = ("bert", [0, 1], "async", num_microbatches, steps, momentum, True)
    results = values_or_raise(run_ranks(streaming_run, 2, *args))
    logged = {(s, m): (c, k) for _, _, log, *_ in results for s, m, c, k in log}
    stage_of = {name: s for _, _, _, params, _ in results for s, names in params.items() for name in names}
    assert any(k > 0 for _, k in logged.values()), "no micro-batch was run on predicted weights"

    model = tiny_model("bert").train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = {s: [{n: v for n, v in initial.items() if stage_of[n] == s}] for s in (0, 1)}
    velocity = {s: [None] for s in (0, 1)}  # the momentum buffer after each update (none before the first)
    for m, microbatch in enumerate(microbatches("bert", num_microbatches * steps)):
        with torch.no_grad():
            for s in (0, 1):
                c, k = logged[(s, m)]
                for name, value in weights[s][c].items():
                    buffer = velocity[s][c]
                    predicted = value if buffer is None else value - k * LR * buffer[name]
                    model.get_parameter(name).copy_(predicted)
        _, grads = forward_backward(model, microbatch)
        for s in (0, 1):
            latest, buffer = weights[s][-1], velocity[s][-1]
            new_buffer = {n: grads[n] if buffer is None else momentum * buffer[n] + grads[n] for n in latest}
            velocity[s].append(new_buffer)
            weights[s].append({n: latest[n] - LR * new_buffer[n] for n in latest})

    for rank, (_, state, _, params, _) in enumerate(results):
        for name in (n for names in params.values() for n in names):
            torch.testing.assert_close(state[name], weights[rank][-1][name], atol=1e-5, rtol=0, msg=name)


def test_weight_prediction_needs_a_momentum_optimizer() -> None:
    with pytest.raises(AssertionError, match="weight prediction extrapolates a momentum, which SGD without momentum"):
        values_or_raise(run_ranks(streaming_run, 1, "bert", [0], "async", 2, 1, 0.0, True))


def replay_2bw(steps: list[list[tuple[dict, float]]], kind: str = "bert") -> tuple[list[float], dict]:
    """PipeDream-2BW over ``steps`` (each a list of (micro-batch, loss weight w)): mini-batch b runs
    on W(b - 1) (the first two on W(0)) and W(b + 1) = W(b) - lr * sum(w * grad). Returns each step's
    loss, sum(w * loss), and the last weights."""
    model = tiny_model(kind).train()
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]  # W(0)
    losses = []
    for b, step in enumerate(steps):
        with torch.no_grad():
            for name, value in weights[max(b - 1, 0)].items():
                model.get_parameter(name).copy_(value)
        model.zero_grad()
        total = 0.0
        for microbatch, weight in step:
            loss = model(**microbatch).loss
            (loss * weight).backward()
            total += loss.item() * weight
        losses.append(total)
        weights.append({n: weights[b][n] - LR * model.get_parameter(n).grad for n in weights[b]})  # W(b+1)
    return losses, weights[-1]


@pytest.mark.parametrize("caller_steps", [False, True], ids=["engine-only", "trainer-style-caller"])
def test_2bw_updates_follow_w_next_equals_w_minus_lr_grad_at_the_previous_weights(caller_steps: bool) -> None:
    # At the end of a step stage 0 has run backwards of a mini-batch whose update comes in the next
    # step: a caller's optimizer.step() / zero_grad() (Trainer's) must neither apply nor drop them.
    num_microbatches, steps = 2, 4
    results = values_or_raise(
        run_ranks(streaming_run, 2, "bert", [0, 1], "2bw", num_microbatches, steps, 0.0, False, caller_steps)
    )
    parts = microbatches("bert", num_microbatches * steps)
    equal = [[(part, 1 / num_microbatches) for part in parts[i : i + num_microbatches]] for i in range(0, 8, 2)]
    losses, weights = replay_2bw(equal)
    check_streaming_run(results, losses, weights)  # every rank reports the loss stage's losses
    versions = {v for _, _, log, *_ in results for _, _, v in log}
    assert versions == {0, 1, 2}, "2BW runs on at most the two newest versions, here W(0), W(1), W(2)"


def test_2bw_on_variable_shapes_updates_by_the_row_weighted_mini_batch_gradient(two_rank_runs: dict) -> None:
    """Steps of different lengths and row counts: each update applies its mini-batch's gradient,
    the micro-batches' weighted by their share of the rows, at the weights from before the previous
    update."""
    results = two_rank_runs["2bw-variable"]
    losses, weights = replay_2bw([split_weighted(minibatch, 2) for minibatch in variable_minibatches("bert")])
    check_streaming_run(results, losses, weights)
    versions = {v for _, _, log, *_ in results for _, _, v in log}
    assert versions == {0, 1, 2, 3}, "five mini-batches run on W(0), W(0), W(1), W(2), W(3)"


def test_2bw_weight_read_by_several_stages_of_a_rank_takes_one_update_per_mini_batch(two_rank_runs: dict) -> None:
    """T5's shared embedding, read by stages 0, 1 and 3 of rank 0 (one tensor there): each of its
    updates applies the three stages' gradients at once, so every version kept for a mini-batch is
    a W(b) of the 2BW rule, never one stage's update ahead of another's."""
    results = two_rank_runs["2bw-t5-tied"]
    holders = {(rank, s) for rank, (*_, params, _) in enumerate(results) for s, names in params.items()}
    holders = {(rank, s) for rank, s in holders if "shared.weight" in results[rank][3][s]}
    assert holders == {(0, 0), (0, 1), (0, 3)}, "the shared embedding should be on several stages of rank 0 only"
    parts = microbatches("t5", 8)
    losses, weights = replay_2bw([[(part, 1 / 2) for part in parts[i : i + 2]] for i in range(0, 8, 2)], "t5")
    check_streaming_run(results, losses, weights)


def test_async_tied_copies_on_two_ranks_are_equal_after_drain() -> None:
    results = values_or_raise(run_ranks(streaming_run, 2, "gpt2", [0, 1], "async", 2, 2))
    tied = "transformer.wte.weight"
    first, second = results[0][1][tied], results[1][1][tied]
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    assert not torch.equal(first, tiny_model("gpt2").state_dict()[tied])


def versions_run(rank: int, world_size: int, stage_device, num_microbatches: int, steps: int):
    model = tiny_model("bert")
    data = as_minibatches(microbatches("bert", num_microbatches * steps), num_microbatches)
    traced = capture_model(model, {name: value[:MICROBATCH] for name, value in data[0].items()})
    placement = contiguous_placement(traced.cost_graph, stage_device)
    engine = PipelineEngine(traced, placement, num_microbatches=num_microbatches, schedule="async")
    engine.attach_optimizer(torch.optim.SGD(engine.parameters(), lr=LR))
    for batch in data:
        engine.train_step(batch)
    engine.drain()
    return engine.version_log, engine.streaming_weights.backward_log


def test_async_three_stages_use_pipedreams_weight_versions() -> None:
    """PipeDream's 1F1B with weight stashing, 3 stages on 3 ranks, 3 micro-batches per step, 2 steps,
    an update after every backward. Stage s holds S - s = 3 - s micro-batches between forward and
    backward, so micro-batch m's forward comes after the backwards (and updates) of micro-batches
    0 .. m - (3 - s): it runs on version max(m - (2 - s), 0), and its backward on the same one."""
    expected = {
        0: [0, 0, 0, 1, 2, 3],  # stage 0: three in flight; m - 2
        1: [0, 0, 1, 2, 3, 4],  # stage 1: two in flight; m - 1
        2: [0, 1, 2, 3, 4, 5],  # stage 2, the last: backward and update right after each forward; m
    }
    results = values_or_raise(run_ranks(versions_run, 3, [0, 1, 2], 3, 2))
    for stage, (forwards, backwards) in enumerate(results):
        assert [(s, m, v) for s, m, v in forwards] == [(stage, m, v) for m, v in enumerate(expected[stage])]
        assert sorted(backwards) == [(stage, m, v) for m, v in enumerate(expected[stage])]


@pytest.fixture(scope="module")
def t5_readers() -> dict[str, list[tuple[str, int]]]:
    """Who reads T5's shared weights in the ``*-t5-shared`` runs (one capture for both)."""
    kind, stage_device, _, num_microbatches, _ = TWO_RANK_RUNS["async-t5-shared"]
    return shared_readers(tiny_model(kind), microbatches(kind, num_microbatches)[0], stage_device)


@pytest.mark.parametrize("schedule", ["async", "2bw"])
def test_weight_read_by_stages_on_two_ranks_follows_the_per_rank_copy_rule(
    two_rank_runs: dict, t5_readers: dict, schedule: str
) -> None:
    """T5's shared embedding read by stages 0 and 2 of rank 0 (encoder embedding, lm_head) and stage 1
    of rank 1 (decoder embedding): each rank's copy is versioned with its first reader there, every
    reader runs a micro-batch on the version that owner ran it on, each update applies all of the
    rank's readers' gradients, and the drain sums the copies' changes (docs/schedules.md)."""
    kind, stage_device, _, num_microbatches, steps = TWO_RANK_RUNS[f"{schedule}-t5-shared"]
    results = two_rank_runs[f"{schedule}-t5-shared"]
    parts = microbatches(kind, num_microbatches * steps)
    readers = t5_readers
    assert {stage_device[s] for _, s in readers["shared.weight"]} == {0, 1}, readers
    log = [entry for _, _, rank_log, *_ in results for entry in rank_log]
    assert any(v < m for s, m, v in log if s == 0), "stage 0 never ran a micro-batch on a stashed version"
    stage_params = {s: names for *_, params, _ in results for s, names in params.items()}
    steps_weighted = [
        [(part, 1 / num_microbatches) for part in parts[i : i + num_microbatches]]
        for i in range(0, len(parts), num_microbatches)
    ]
    losses, weights = replay(tiny_model(kind), steps_weighted, schedule, LR, log, stage_params, readers, stage_device)
    check_streaming_run(results, losses, weights)
