"""Replicas of a pipeline (``data_parallel_size``) across 4 real gloo processes: 2 × 2 and 1 × 4 equal
single-process training on the global batch, loss by loss, gradient by gradient, weight by weight;
``2bw`` follows its rule with the gradients summed over the replicas; evaluation and the gathered
model are the whole model's. Every case shares one launch (each on a deep copy of its model's trace);
each is asserted by its own test."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import capture_model
from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.runtime.microbatches import microbatch_rows
from hf_ftpipe.runtime.replicas import ReplicaLayout

from distributed import run_ranks, values_or_raise
from models import tiny_batch, tiny_model
from placements import contiguous_placement

MICROBATCH = 2
"""Rows of a planned micro-batch."""
NUM_MICROBATCHES = 2
"""Micro-batches per replica."""
LR = 0.5

CASES = {  # name: (model, schedule, stage_device, data_parallel_size, rows of each step's global batch)
    "gpt2-gpipe": ("gpt2", "gpipe", [0, 1], 2, [8, 8, 3]),  # 3 rows: 2 micro-batches on replica 0, 1 on replica 1
    "gpt2-1f1b": ("gpt2", "1f1b", [0, 1], 2, [8, 2, 8]),  # 2 rows: replica 1 runs none (an empty step)
    "gpt2-zb-h1": ("gpt2", "zb-h1", [0, 1], 2, [8, 5]),
    "gpt2-zbv": ("gpt2", "zbv", [0, 1, 1, 0], 2, [8, 3]),  # wte and lm_head on two stages of one rank
    "t5-gpipe": ("t5", "gpipe", [0, 1], 2, [8, 3]),  # the shared embedding tied across ranks
    "t5-1f1b": ("t5", "1f1b", [0, 1], 2, [8, 2]),
    "t5-zb-h1": ("t5", "zb-h1", [0, 1], 2, [8, 8]),
    "gpt2-1x4": ("gpt2", "1f1b", [0], 4, [16, 5]),  # plain data parallelism: one stage per rank
    # 2bw updates each rank's copy of a tied weight apart until drain (WeightSync.reconcile_tied): BERT ties none
    "bert-2bw": ("bert", "2bw", [0, 1], 2, [8, 8, 8]),
}
REFUSED = {  # name: (model, schedule, stage_device, data_parallel_size)
    "async": ("gpt2", "async", [0, 1], 2),
    "world": ("gpt2", "gpipe", [0, 1], 3),  # 2 x 3 = 6 processes needed, 4 started
}


def global_batches(kind: str, rows: list[int]) -> list[dict[str, torch.Tensor]]:
    return [tiny_batch(kind, count, seed=10 + step) for step, count in enumerate(rows)]


def replica_run(traced, kind: str, schedule: str, stage_device: list[int], data_parallel_size: int, rows: list[int]):
    """SGD steps on the global batches; each step's loss and gradients, then this rank's weights, the
    model gathered on rank 0, an evaluation's outputs, and where this rank sits."""
    engine = PipelineEngine(
        traced,
        contiguous_placement(traced.cost_graph, stage_device),
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        data_parallel_size=data_parallel_size,
        timeout_s=60,
    )
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
    if engine.streaming:
        engine.attach_optimizer(optimizer)
    losses, gradients = [], []
    data = global_batches(kind, rows)
    for batch in data:
        optimizer.zero_grad()
        losses.append(engine.train_step(batch).item())
        if not engine.streaming:
            gradients.append({n: p.grad.clone() for n, p in engine.named_parameters() if p.grad is not None})
            optimizer.step()
    gathered = engine.gather_state_dict(0)
    outputs = engine.eval_step(data[0])
    where = (engine.replica, engine.position, engine.microbatches_per_batch)
    return losses, gradients, engine.state_dict(), gathered, outputs, where


def refused_run(traced, schedule: str, stage_device: list[int], data_parallel_size: int) -> str:
    try:
        PipelineEngine(
            traced,
            contiguous_placement(traced.cost_graph, stage_device),
            num_microbatches=NUM_MICROBATCHES,
            schedule=schedule,
            data_parallel_size=data_parallel_size,
        )
    except PipelineError as error:
        return str(error)
    return "no error"


def all_cases(rank: int, world_size: int) -> dict:
    traces = {}
    for kind in ("gpt2", "t5", "bert"):
        batch = global_batches(kind, [MICROBATCH])[0]
        traces[kind] = capture_model(tiny_model(kind), batch)
    results = {name: refused_run(copy.deepcopy(traces[kind]), *rest) for name, (kind, *rest) in REFUSED.items()}
    for name, (kind, *rest) in CASES.items():
        results[name] = replica_run(copy.deepcopy(traces[kind]), kind, *rest)
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return values_or_raise(run_ranks(all_cases, 4, deadline_s=300))


def reference(kind: str, data_parallel_size: int, rows: list[int]):
    """One process on the global batches cut into D x M micro-batches, each weighted 1 / (their count):
    every step's loss and gradients, the last weights, and an evaluation of the first batch."""
    model = tiny_model(kind).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, gradients = [], []
    data = global_batches(kind, rows)
    for batch in data:
        optimizer.zero_grad()
        count = len(microbatch_rows(len(batch["input_ids"]), data_parallel_size * NUM_MICROBATCHES))
        total = 0.0
        for m in range(count):
            loss = model(**{k: v.tensor_split(count)[m] for k, v in batch.items()}).loss
            (loss / count).backward()
            total += loss.item() / count
        losses.append(total)
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        optimizer.step()
    return losses, gradients, model.state_dict(), evaluation(model, data[0], data_parallel_size)


def evaluation(model, batch: dict[str, torch.Tensor], data_parallel_size: int) -> dict[str, torch.Tensor]:
    """The model's loss per micro-batch of the global batch (``D x M`` of them, as training cuts it) and
    its logits."""
    count = len(microbatch_rows(len(batch["input_ids"]), data_parallel_size * NUM_MICROBATCHES))
    model.eval()
    with torch.no_grad():
        outputs = [model(**{k: v.tensor_split(count)[m] for k, v in batch.items()}) for m in range(count)]
    model.train()
    return {"loss": torch.stack([o.loss for o in outputs]), "logits": torch.cat([o.logits for o in outputs])}


def replay_2bw(kind: str, data_parallel_size: int, rows: list[int]):
    """PipeDream-2BW on the global batches: mini-batch b runs on W(b - 1) (the first two on W(0)) and
    W(b + 1) = W(b) - lr * sum over every replica's micro-batches of w * grad, w = 1 / (D x M)."""
    model = tiny_model(kind).train()
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    losses = []
    for b, batch in enumerate(global_batches(kind, rows)):
        with torch.no_grad():
            for name, value in weights[max(b - 1, 0)].items():
                model.get_parameter(name).copy_(value)
        model.zero_grad()
        count = data_parallel_size * NUM_MICROBATCHES
        total = 0.0
        for m in range(count):
            loss = model(**{k: v.tensor_split(count)[m] for k, v in batch.items()}).loss
            (loss / count).backward()
            total += loss.item() / count
        losses.append(total)
        weights.append({n: weights[b][n] - LR * model.get_parameter(n).grad for n in weights[b]})
    return losses, weights[-1]


def check_weights(name: str, rank: int, state: dict, want: dict) -> None:
    for key, value in state.items():
        torch.testing.assert_close(
            value, want[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{name}: rank {rank}: {k}: {m}"
        )


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[1] != "2bw"])
def test_replicas_equal_one_process_on_the_global_batch(runs: list[dict], name: str) -> None:
    kind, _, stage_device, data_parallel_size, rows = CASES[name]
    want_losses, want_gradients, want_state, want_outputs = reference(kind, data_parallel_size, rows)
    layout = ReplicaLayout(len(set(stage_device)), data_parallel_size)
    trainable = {n for n, _ in tiny_model(kind).named_parameters()}
    covered = set()
    for rank, per_case in enumerate(runs):
        losses, gradients, state, gathered, outputs, where = per_case[name]
        assert where == (layout.replica_of(rank), layout.position_of(rank), data_parallel_size * NUM_MICROBATCHES)
        assert losses == pytest.approx(want_losses, abs=1e-5), f"{name}: rank {rank} losses"
        for step, (got, want) in enumerate(zip(gradients, want_gradients, strict=True)):
            assert set(got) <= set(want) and set(got) <= set(state), f"{name}: rank {rank} step {step}: {sorted(got)}"
            check_weights(f"{name} step {step} gradients", rank, got, want)
        check_weights(name, rank, state, want_state)
        covered |= set(state)
        assert (gathered is not None) == (rank == 0), f"{name}: rank {rank} gathered {gathered is not None}"
        if gathered is not None:
            assert trainable <= set(gathered), f"{name}: not gathered: {sorted(trainable - set(gathered))}"
            check_weights(f"{name} gathered", rank, gathered, want_state)
        for key in ("loss", "logits"):
            torch.testing.assert_close(outputs[key], want_outputs[key], atol=1e-5, rtol=0, msg=f"{name}: {key}")
    assert trainable <= covered, f"{name}: parameters on no rank: {sorted(trainable - covered)}"


def test_2bw_replicas_update_by_the_gradients_summed_over_replicas(runs: list[dict]) -> None:
    kind, _, _, data_parallel_size, rows = CASES["bert-2bw"]
    want_losses, want_weights = replay_2bw(kind, data_parallel_size, rows)
    for rank, per_case in enumerate(runs):
        losses, _, state, gathered, _, _ = per_case["bert-2bw"]
        assert losses == pytest.approx(want_losses, abs=1e-5), f"rank {rank} losses"
        check_weights("2bw", rank, {k: v for k, v in state.items() if k in want_weights}, want_weights)


def test_async_with_replicas_is_refused(runs: list[dict]) -> None:
    for rank, per_case in enumerate(runs):
        message = per_case["async"]
        assert "'async'" in message and "data_parallel_size=1" in message, f"rank {rank}: {message}"


def test_world_size_not_p_times_d_names_p_d_and_the_fix(runs: list[dict]) -> None:
    for rank, per_case in enumerate(runs):
        message = per_case["world"]
        assert "P=2" in message and "D=3" in message and "6 processes" in message and "4 were started" in message
        assert "--num_processes 6" in message and "data_parallel_size=2" in message, f"rank {rank}: {message}"
