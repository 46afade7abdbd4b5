"""Replicas of a pipeline (``data_parallel_size``) across 4 real gloo processes: 2 × 2 and 1 × 4 equal
single-process training on the global batch, loss by loss, gradient by gradient, weight by weight
(token slices too: each replica slices its share);
``2bw`` follows its rule with the gradients summed over the replicas; evaluation and the gathered
model are the whole model's. Every case shares one launch (each on a deep copy of its model's trace);
each is asserted by its own test."""

from __future__ import annotations

import copy
import io
import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph import capture_model
from hf_ftpipe.graph.token_slices import SlicedModel, capture_token_slices
from hf_ftpipe.runtime import PipelineEngine
from hf_ftpipe.runtime.microbatches import microbatch_rows
from hf_ftpipe.runtime.replicas import ReplicaLayout

from distributed import RankResult, run_ranks
from models import tiny_batch, tiny_model
from placements import contiguous_placement

MICROBATCH = 2
"""Rows of a planned micro-batch."""
TIMEOUT_S = 60
NUM_MICROBATCHES = 2
"""Micro-batches per replica."""
LR = 0.5

CASES = {  # name: (model, schedule, stage_device, data_parallel_size, rows of each step's global batch (or batches))
    "gpt2-gpipe": ("gpt2", "gpipe", [0, 1], 2, [8, 8, 3]),  # 3 rows: 2 micro-batches on replica 0, 1 on replica 1
    "gpt2-1f1b": ("gpt2", "1f1b", [0, 1], 2, [8, 2, 8]),  # 2 rows: replica 1 runs none (an empty step)
    "gpt2-zb-h1": ("gpt2", "zb-h1", [0, 1], 2, [8, 5]),
    "gpt2-zbv": ("gpt2", "zbv", [0, 1, 1, 0], 2, [8, 3]),  # wte and lm_head on two stages of one rank
    "t5-gpipe": ("t5", "gpipe", [0, 1], 2, [8, 3]),  # the shared embedding tied across ranks
    "t5-1f1b": ("t5", "1f1b", [0, 1], 2, [8, 2]),  # in buckets of at most 2 kB: many per stage (see replica_run)
    "t5-zb-h1": ("t5", "zb-h1", [0, 1], 2, [8, 8]),
    "gpt2-1x4": ("gpt2", "1f1b", [0], 4, [16, 5]),  # plain data parallelism: one stage per rank
    "gpt2-accumulated": ("gpt2", "1f1b", [0, 1], 2, [[8, 3], [2, 8]]),  # lists of mini-batches (batches_per_step=2)
    # 2bw updates each rank's copy of a tied weight apart until drain (WeightSync.reconcile_tied), so the rule
    # holds where no weight spans ranks: here T5's shared embedding is on stages 0, 1 and 3 of position 0 only
    "t5-2bw": ("t5", "2bw", [0, 0, 1, 0], 2, [8, 8, 8]),
    "gpt2-sliced": ("gpt2", "1f1b", [0, 1], 2, [8, 3]),  # token slices (SLICED): each replica slices its share
}
SLICED = {"gpt2-sliced": [3, 1, 4]}
"""Cases captured for token slicing (TeraPipe): the slice lengths of the planned 8 tokens."""
REFUSED = {  # name: (model, schedule, stage_device, data_parallel_size)
    "async": ("gpt2", "async", [0, 1], 2),
    "world": ("gpt2", "gpipe", [0, 1], 3),  # 2 x 3 = 6 processes needed, 4 started
}


def test_layout_numbers_replicas_by_consecutive_ranks() -> None:
    layout = ReplicaLayout(pipeline_size=3, data_parallel_size=2)
    assert layout.world_size == 6
    assert [layout.replica_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [layout.position_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert layout.global_rank(1, 2) == 5
    assert layout.pipeline_ranks(1) == [3, 4, 5]
    assert layout.data_ranks(1) == [1, 4]
    with pytest.raises(PipelineError, match="data_parallel_size"):
        ReplicaLayout(2, 0)


def global_batches(kind: str, rows: list) -> list:
    """Each step's global mini-batch of ``rows[step]`` rows (or mini-batches, for a list)."""
    return [
        [tiny_batch(kind, n, seed=10 + 10 * step + i) for i, n in enumerate(count)]
        if isinstance(count, list)
        else tiny_batch(kind, count, seed=10 + step)
        for step, count in enumerate(rows)
    ]


def flat(data: list) -> list:
    """The mini-batches (or losses) of every step in order, a step's list unpacked."""
    return [batch for step in data for batch in (step if isinstance(step, list) else [step])]


def replica_run(traced, kind: str, schedule: str, stage_device: list[int], data_parallel_size: int, rows: list[int]):
    """SGD steps on the global batches; each step's loss, gradients and global gradient norm, then this
    rank's weights, the model gathered on rank 0, an evaluation's outputs, where this rank sits and when
    its stages' all-reduces started."""
    graph = traced.full.cost_graph if isinstance(traced, SlicedModel) else traced.cost_graph
    engine = PipelineEngine(
        traced,
        contiguous_placement(graph, stage_device),
        num_microbatches=NUM_MICROBATCHES,
        schedule=schedule,
        data_parallel_size=data_parallel_size,
        timeout_s=TIMEOUT_S,
        batches_per_step=max(len(n) if isinstance(n, list) else 1 for n in rows),
    )
    if kind == "t5" and schedule == "1f1b":
        engine.replica_gradients.bucket_bytes = 2048
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
    if engine.streaming:
        engine.attach_optimizer(optimizer)
    losses, gradients, norms = [], [], []
    data = global_batches(kind, rows)
    for batch in data:
        optimizer.zero_grad()
        losses.append(engine.train_step(batch).tolist())  # one per mini-batch for a list
        if not engine.streaming:
            gradients.append({n: p.grad.clone() for n, p in engine.named_parameters() if p.grad is not None})
            norms.append(engine.clip_grad_norm_(float("inf")).item())
            optimizer.step()
    gathered = engine.gather_state_dict(0)
    outputs = [engine.eval_step(batch) for batch in evaluated(data)]
    where = (engine.replica, engine.position, engine.microbatches_per_batch)
    overlap = None
    if engine.replica_gradients is not None and not engine.streaming:  # the last step's
        overlap = (dict(engine.replica_gradients.started_after), engine.replica_gradients.actions_in_step)
    return {
        "losses": losses,
        "gradients": gradients,
        "norms": norms,
        "state": engine.state_dict(),
        "gathered": gathered,
        "outputs": outputs,
        "where": where,
        "overlap": overlap,
    }


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


# -- a rank that dies ------------------------------------------------------------------------------


def dying_replica_run(rank: int, traced, folder: str):
    """2 x 2 1f1b on GPT-2; rank 3 (replica 1's stage 1) kills itself at its first forward of the second
    step, after noting the time. Returns the error this rank stopped with."""
    data = global_batches("gpt2", [8, 8, 8])
    engine = PipelineEngine(
        traced,
        contiguous_placement(traced.cost_graph, [0, 1]),
        num_microbatches=NUM_MICROBATCHES,
        schedule="1f1b",
        data_parallel_size=2,
        timeout_s=TIMEOUT_S,
    )
    optimizer = torch.optim.SGD(engine.parameters(), lr=LR)
    if rank == 3:
        original, calls = engine.modules[1].forward, []

        def dying_forward(*args):
            calls.append(1)
            if len(calls) == NUM_MICROBATCHES + 1:
                with open(os.path.join(folder, "killed"), "w") as file:
                    file.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args)

        engine.modules[1].forward = dying_forward
    try:
        for batch in data:
            optimizer.zero_grad()
            engine.train_step(batch)
            optimizer.step()
    except PipelineError as error:
        return str(error)
    return "no error"


def all_cases(rank: int, world_size: int, folder: str):
    """Every case, its results saved in ``folder``; then the run in which rank 3 dies (last: it ends the launch)."""
    traces = {}
    for kind in ("gpt2", "t5"):
        batch = global_batches(kind, [MICROBATCH])[0]
        traces[kind] = capture_model(tiny_model(kind), batch)
    results = {name: refused_run(copy.deepcopy(traces[kind]), *rest) for name, (kind, *rest) in REFUSED.items()}
    for name, (kind, *rest) in CASES.items():
        if name in SLICED:
            traced = capture_token_slices(tiny_model(kind), global_batches(kind, [MICROBATCH])[0], SLICED[name])
        else:
            traced = copy.deepcopy(traces[kind])
        results[name] = replica_run(traced, kind, *rest)
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    return dying_replica_run(rank, traces["gpt2"], folder)


@dataclass
class Launch:
    cases: list[dict]
    """Each rank's results of every case."""
    stops: list[RankResult]
    """How each rank ended the run in which rank 3 dies."""
    stopped_after_s: float
    """From rank 3's death to the end of the launch."""


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    folder = tmp_path_factory.mktemp("replicas")
    stops = run_ranks(all_cases, 4, str(folder), deadline_s=TIMEOUT_S + 300)
    ended = time.time()
    missing = [f"--- rank {r.rank} ---\n{r.error}" for r in stops if not (folder / f"rank{r.rank}.pt").exists()]
    if missing:
        raise AssertionError("ranks failed:\n" + "\n".join(missing))
    cases = [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(4)]
    return Launch(cases, stops, ended - float((folder / "killed").read_text()))


@pytest.fixture(scope="module")
def runs(launch: Launch) -> list[dict]:
    return launch.cases


def reference(kind: str, data_parallel_size: int, rows: list[int]):
    """One process on the global batches cut into D x M micro-batches, each weighted 1 / (their count):
    every step's loss, gradients and gradient norm, the last weights, and the evaluations (`evaluated`)."""
    model = tiny_model(kind).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, gradients, norms = [], [], []
    data = global_batches(kind, rows)
    for step in data:
        optimizer.zero_grad()
        batches = step if isinstance(step, list) else [step]
        counts = [len(microbatch_rows(len(b["input_ids"]), data_parallel_size * NUM_MICROBATCHES)) for b in batches]
        totals = []
        for batch, count in zip(batches, counts, strict=True):
            totals.append(0.0)
            for m in range(count):  # each micro-batch of the step weighted 1 / (their count)
                loss = model(**{k: v.tensor_split(count)[m] for k, v in batch.items()}).loss
                (loss / sum(counts)).backward()
                totals[-1] += loss.item() / sum(counts)
        losses.append(totals if isinstance(step, list) else totals[0])
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
    outputs = [evaluation(model, batch, data_parallel_size) for batch in evaluated(data)]
    return losses, gradients, norms, model.state_dict(), outputs


def evaluated(data: list) -> list[dict[str, torch.Tensor]]:
    """The batches a case evaluates after training: the first, and the shortest (a replica's share may be empty)."""
    return [flat(data)[0], min(flat(data), key=lambda batch: len(batch["input_ids"]))]


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
    want_losses, want_gradients, want_norms, want_state, want_outputs = reference(kind, data_parallel_size, rows)
    layout = ReplicaLayout(len(set(stage_device)), data_parallel_size)
    trainable = {n for n, _ in tiny_model(kind).named_parameters()}
    covered = set()
    for rank, per_case in enumerate(runs):
        run = per_case[name]
        state, gathered, outputs = run["state"], run["gathered"], run["outputs"]
        where = (layout.replica_of(rank), layout.position_of(rank), data_parallel_size * NUM_MICROBATCHES)
        assert run["where"] == where
        assert [type(loss) for loss in run["losses"]] == [type(loss) for loss in want_losses]  # a list per list
        assert flat(run["losses"]) == pytest.approx(flat(want_losses), abs=1e-5), f"{name}: rank {rank}"
        assert run["norms"] == pytest.approx(want_norms, abs=1e-5), f"{name}: rank {rank} gradient norms"
        for step, (got, want) in enumerate(zip(run["gradients"], want_gradients, strict=True)):
            assert set(got) == set(state) & trainable, f"{name}: rank {rank} step {step}: gradients of {sorted(got)}"
            check_weights(f"{name} step {step} gradients", rank, got, want)
        check_weights(name, rank, state, want_state)
        covered |= set(state)
        assert (gathered is not None) == (rank == 0), f"{name}: rank {rank} gathered {gathered is not None}"
        if gathered is not None:
            assert trainable <= set(gathered), f"{name}: not gathered: {sorted(trainable - set(gathered))}"
            check_weights(f"{name} gathered", rank, gathered, want_state)
        for key in ("loss", "logits"):
            for got, want in zip(outputs, want_outputs, strict=True):
                torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=0, msg=f"{name}: rank {rank}: {key}")
    assert trainable <= covered, f"{name}: parameters on no rank: {sorted(trainable - covered)}"


def test_2bw_replicas_update_by_the_gradients_summed_over_replicas(runs: list[dict]) -> None:
    kind, _, _, data_parallel_size, rows = CASES["t5-2bw"]
    want_losses, want_weights = replay_2bw(kind, data_parallel_size, rows)
    covered = set()
    for rank, per_case in enumerate(runs):
        losses, state = per_case["t5-2bw"]["losses"], per_case["t5-2bw"]["state"]
        assert losses == pytest.approx(want_losses, abs=1e-5), f"rank {rank} losses"
        trained = {k: v for k, v in state.items() if k in want_weights}
        check_weights("2bw", rank, trained, want_weights)
        covered |= set(trained)
    assert covered == set(want_weights), f"parameters on no rank: {sorted(set(want_weights) - covered)}"


def test_a_stage_starts_its_all_reduce_after_its_last_w_before_the_rank_is_done(runs: list[dict]) -> None:
    """zbv on positions [0, 1, 1, 0]: position 0 runs stage 3 and stage 0, whose backward comes last; stage
    3's buckets start once its last W ran, while stage 0 still has work; stage 0's after the rank's last action."""
    for rank in (0, 2):  # position 0 of each replica
        started_after, actions = runs[rank]["gpt2-zbv"]["overlap"]
        assert set(started_after) == {0, 3}, started_after
        assert started_after[3] < actions, f"rank {rank}: stage 3 started after {started_after[3]} of {actions}"
        assert started_after[0] == actions, f"rank {rank}: stage 0 started after {started_after[0]} of {actions}"


def test_async_with_replicas_is_refused(runs: list[dict]) -> None:
    for rank, per_case in enumerate(runs):
        message = per_case["async"]
        assert "'async'" in message and "data_parallel_size=1" in message, f"rank {rank}: {message}"


def test_world_size_not_p_times_d_names_p_d_and_the_fix(runs: list[dict]) -> None:
    for rank, per_case in enumerate(runs):
        message = per_case["world"]
        assert "P=2" in message and "D=3" in message and "6 processes" in message and "4 were started" in message
        assert "--num_processes 6" in message and "data_parallel_size=2" in message, f"rank {rank}: {message}"


def test_a_rank_dying_in_one_replica_stops_every_rank_of_every_replica(launch: Launch) -> None:
    """Rank 3's pipeline peer (rank 2) and its data-group peer (rank 1) wait on it directly; rank 0 on
    them. Each stops with an error naming the rank that failed or died, or is stopped by its watchdog
    (exit 1) on the failure another rank published, well within the timeout."""
    results = launch.stops
    assert results[3].exitcode == -signal.SIGKILL, results[3]
    assert launch.stopped_after_s < TIMEOUT_S, f"the ranks took {launch.stopped_after_s:.0f} s to stop"
    messages = {}
    for result in results[:3]:
        if result.error is not None:  # ended by its watchdog on a published failure
            assert result.exitcode == 1, f"rank {result.rank}: {result.error}"
            continue
        message = torch.load(io.BytesIO(result.value), weights_only=False)
        messages[result.rank] = message
        assert message.startswith(f"[rank {result.rank}"), message
        assert "rank 3" in message, message  # waited on it, or stopped by the failure of a rank that did
    assert messages, "no rank reported why it stopped"
