"""What each rank of ``benchmarks/simulator.py`` does: profile the model, then run every schedule, timed inside.

One launch runs every schedule in turn in the same two rank processes (``runtime.py`` gives each
runner fresh processes; here what is compared is each run with its own simulation, and one launch
keeps the benchmark short). First the model is profiled with `hf_ftpipe.profile_model` at the
run's micro-batch shape and threads: ``alone``, rank 0 profiles while the others wait, as
``PipeTrainingArguments(cost_table="measured")`` does, and its table prices every stage;
``together``, every rank profiles the whole model at the same moment, so that the profile competes
for the cores as the pipeline's ranks do, and rank r's table prices stage r. Then, per schedule,
warm-up steps and timed steps, with `StageClock` timing each stage's forward and backward inside
the executor.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from _gpt2_split import Setup, build_model, first_microbatch, make_batch
from _runtime_ranks import HfFtpipeRunner


class StageClock:
    """Compute time of each stage's forwards and backwards on this rank, waits on messages left out.

    Wraps the engine's `Executor._forward` and `_backward` (the calls that run a stage's module and
    its autograd) with `time.perf_counter`, and the messenger's `wait`: a forward that waits for its
    input, or a backward for its output's gradient, has that wait taken off, so what is left is the
    stage's compute, what the simulator prices per action. Weight updates are timed apart
    (``update_s``), since the simulator prices them at 0.
    """

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.busy_s: dict[int, float] = defaultdict(float)
        """Stage → seconds of forward + backward compute since the last `reset`."""
        self.forward_s: dict[int, float] = defaultdict(float)
        """Stage → the forwards' share of ``busy_s``."""
        self.actions: dict[int, int] = defaultdict(int)
        self.update_s = 0.0
        """Seconds of weight updates: the streaming schedules' update actions, else the optimizer's step
        after each step (the simulator prices neither)."""
        self._waited_s = 0.0
        if engine.streaming_weights is not None:
            engine.streaming_weights.update = self._timed_update(engine.streaming_weights.update)
        else:
            optimizer.step = self._timed_update(optimizer.step)
        engine.executor._forward = self._timed(engine.executor._forward)
        engine.executor._backward = self._timed(engine.executor._backward)
        wait = engine.messenger.wait

        def timed_wait(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return wait(*args, **kwargs)
            finally:
                self._waited_s += time.perf_counter() - start

        engine.messenger.wait = timed_wait

    def _timed(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def timed(action: Any, *args: Any) -> Any:
            waited, start = self._waited_s, time.perf_counter()
            try:
                return run(action, *args)
            finally:
                elapsed = time.perf_counter() - start - (self._waited_s - waited)
                self.busy_s[action.stage_index] += elapsed
                if action.computation == "F":
                    self.forward_s[action.stage_index] += elapsed
                self.actions[action.stage_index] += 1

        return timed

    def _timed_update(self, run: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                self.update_s += time.perf_counter() - start

        return timed

    def reset(self) -> None:
        self.update_s = 0.0
        self.busy_s.clear()
        self.forward_s.clear()
        self.actions.clear()


def profiled_costs(pipe: HfFtpipeRunner, setup: Setup, repeats: int, own_stage: bool) -> dict[str, list[float]]:
    """Ops → ``[forward_s, backward_s]`` from a profile of the whole model taken here: this rank's
    stage's ops when ``own_stage``, else all of them."""
    from hf_ftpipe import profile_model

    model = build_model(setup)
    microbatch = first_microbatch(setup, make_batch(setup, 0))
    table = profile_model(model, microbatch, device=pipe.device, warmup=2, repeats=repeats, show_progress=False)
    costs = table.node_costs(pipe.traced.cost_graph)  # refused if the table were of another graph
    node_stage = pipe.placement.node_stage
    return {n: [c.forward_s, c.backward_s] for n, c in costs.items() if not own_stage or node_stage.get(n) == pipe.rank}


def run_rank(rank: int, setup: Setup, work: dict[str, Any]) -> dict[str, Any]:
    """Profile (``work["profile"]``: ``"alone"`` or ``"together"``), then run each of ``work["schedules"]``;
    the costs this rank profiled and, per schedule, its timings."""
    schedules, together = work["schedules"], work["profile"] == "together"
    model = build_model(setup)
    batches = [make_batch(setup, step) for step in range(2)]
    dist.barrier()
    costs: dict[str, list[float]] = {}
    if together or rank == 0:
        profile_pipe = HfFtpipeRunner(rank, setup, model, schedules[0])
        costs = profiled_costs(profile_pipe, setup, repeats=max(3, setup.stage_repeats), own_stage=together)
    dist.barrier()  # alone: the other ranks wait, idle, while rank 0 profiles
    runs: dict[str, Any] = {}
    for schedule in schedules:
        pipe = HfFtpipeRunner(rank, setup, build_model(setup), schedule)
        pipe.build()
        clock = StageClock(pipe.engine, pipe.optimizer)
        dist.barrier()
        # Streaming schedules go on from the warm-up into the timed steps without a drain: every timed
        # step is a steady one, as the simulator's step is.
        for step in range(setup.warmup):
            pipe.step(batches[step % 2])
        clock.reset()
        step_times_s = []
        for step in range(setup.steps):
            start = time.perf_counter()
            pipe.step(batches[(setup.warmup + step) % 2])
            step_times_s.append(time.perf_counter() - start)
        busy, forward, actions = dict(clock.busy_s), dict(clock.forward_s), dict(clock.actions)
        pipe.finish()
        dist.barrier()
        runs[schedule] = {
            "step_times_s": step_times_s,
            "median_step_s": statistics.median(step_times_s),
            "wall_s": sum(step_times_s),
            "busy_s": busy,
            "forward_s": forward,
            "update_s": clock.update_s,
            "actions": actions,
        }
    return {"rank": rank, "costs": costs, "runs": runs}
