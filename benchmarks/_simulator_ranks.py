"""What each rank of ``benchmarks/simulator.py`` does: profile the model, then run every schedule, timed inside.

One launch runs every schedule in turn in the same two rank processes (``runtime.py`` gives each
runner fresh processes; here what is compared is each run with its own simulation, and one launch
keeps the benchmark short). First the model is profiled with `hf_ftpipe.profile_model` at the
run's micro-batch shape and threads: ``alone``, rank 0 profiles while the others wait, as
``PipeTrainingArguments(cost_table="measured")`` does, and its table prices every stage;
``together``, every rank profiles the whole model at the same moment, so that the profile competes
for the cores as the pipeline's ranks do, and rank r's table prices the ops of stage r of the
one-stage-per-rank split. Then, per schedule, on its own split (``zbv`` on the V, ``interleaved-1f1b``
looped: `_runtime_ranks.runner_setup`), warm-up steps and timed steps, with `StageClock` timing each
stage's forwards, backwards and weight-gradient actions inside the executor.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from _gpt2_split import Setup, build_model, first_microbatch, make_batch
from _runtime_ranks import HfFtpipeRunner, runner_setup

from hf_ftpipe.runtime.split_backward import DeferredWeightGradient

_APPLY = DeferredWeightGradient.apply
"""The runtime's own ``W`` product, which `StageClock` wraps per schedule (a class attribute)."""


class StageClock:
    """Compute time of each stage's actions on this rank, by kind, waits on messages left out.

    Wraps the engine's `Executor._forward` and `_backward` (the calls that run a stage's module and
    its autograd) with `time.perf_counter`, and the messenger's `wait`: a forward that waits for its
    input, or a backward for its output's gradient, has that wait taken off, so what is left is the
    stage's compute, what the simulator prices per action. Under a split backward (``zb-h1``,
    ``zbv``) a ``W`` is the deferred products' `DeferredWeightGradient.apply` calls, timed and put to
    the stage that owns each weight. Weight updates are timed apart (``update_s``), since the
    simulator prices them at 0.
    """

    def __init__(self, engine: Any, optimizer: Any) -> None:
        self.time_s: dict[str, dict[int, float]] = {kind: defaultdict(float) for kind in "FBW"}
        """Kind (``F``, ``B``, ``W``) → stage → seconds since the last `reset`."""
        self.count: dict[str, dict[int, int]] = {kind: defaultdict(int) for kind in "FB"}
        """Kind → stage → actions since the last `reset` (a stage's ``W`` count is its ``F`` count)."""
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
        modules = engine.executor.context.modules
        weight_stage = {id(p): s for s, module in modules.items() for p in module.parameters()}
        weight_time = self.time_s["W"]

        def timed_apply(deferred: DeferredWeightGradient) -> None:
            start = time.perf_counter()
            try:
                _APPLY(deferred)
            finally:
                weight_time[weight_stage.get(id(deferred.weight), -1)] += time.perf_counter() - start

        DeferredWeightGradient.apply = timed_apply  # type: ignore[method-assign]
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
                self.time_s[action.computation][action.stage_index] += elapsed
                self.count[action.computation][action.stage_index] += 1

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
        for per_stage in (*self.time_s.values(), *self.count.values()):
            per_stage.clear()

    def figures(self) -> dict[str, Any]:
        """Per kind and stage, seconds (``time_s``) and actions (``count``) since the last `reset`."""
        return {
            "time_s": {kind: dict(per_stage) for kind, per_stage in self.time_s.items()},
            "count": {kind: dict(per_stage) for kind, per_stage in self.count.items()},
        }


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
    if together or rank == 0:  # one stage per rank: under ``together`` rank r's table prices stage r's ops
        profile_pipe = HfFtpipeRunner(rank, runner_setup(setup, "hf_ftpipe/gpipe"), model, "gpipe")
        costs = profiled_costs(profile_pipe, setup, repeats=max(3, setup.stage_repeats), own_stage=together)
    dist.barrier()  # alone: the other ranks wait, idle, while rank 0 profiles
    runs: dict[str, Any] = {}
    for schedule in schedules:
        schedule_setup = runner_setup(setup, f"hf_ftpipe/{schedule}")  # zbv on the V, interleaved-1f1b looped
        pipe = HfFtpipeRunner(rank, schedule_setup, build_model(setup), schedule)
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
        figures = clock.figures()
        pipe.finish()
        dist.barrier()
        runs[schedule] = {
            "step_times_s": step_times_s,
            "median_step_s": statistics.median(step_times_s),
            "wall_s": sum(step_times_s),
            "update_s": clock.update_s,
            **figures,
        }
    DeferredWeightGradient.apply = _APPLY  # type: ignore[method-assign]
    return {"rank": rank, "costs": costs, "runs": runs}
