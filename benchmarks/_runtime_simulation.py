"""The simulator's step for ``benchmarks/runtime.py``'s hf_ftpipe runners, priced by a measured cost table.

As ``benchmarks/simulator.py`` does with ``--profile alone`` (what ``cost_table="measured"`` does): the
model is profiled here (`hf_ftpipe.profile_traced` at the run's micro-batch shape and a rank's torch
threads, nothing else of the benchmark running), and `hf_ftpipe.simulate` prices each runner's split,
placement and schedule with that table over the ``cpu`` profile's link (gloo over loopback). The
issue's target: each new schedule's simulated step within 10% of the measured one.

Each simulated runner gets a table of its own, timed right before each of its launches: on cores
shared with other jobs the load moves within minutes, and one table timed before a run of half an
hour priced the same runner 11% over its step in one run and 11% under in the next. Its simulated
step is set beside the step of its own launch (`_runtime_report.median_rows` takes the median of
the ratios over rounds).
"""

from __future__ import annotations

import sys
from typing import Any

from _gpt2_split import Setup, build_model, first_microbatch, make_batch, simulation_plan
from _runtime_ranks import flushes, runner_schedule

PROFILE_REPEATS = 10
"""Timed runs per block (the median is kept): a layer takes tens of ms on a CPU thread, so ten cost a
second or two, and the one timed layer prices all eight."""


def traced_model(setup: Setup) -> Any:
    """The model traced once at the run's micro-batch shape, for every profile of this benchmark."""
    from hf_ftpipe.graph import capture_model

    return capture_model(build_model(setup), first_microbatch(setup, make_batch(setup, 0)))


def measured_costs(setup: Setup, traced: Any | None = None) -> Any:
    """The `CostTable` (each op's forward and backward seconds on one micro-batch) of a profile taken here,
    now, of ``traced`` (`traced_model`; traced here when not given)."""
    import torch

    from hf_ftpipe.trainer.measured_costs import profile_traced

    traced = traced if traced is not None else traced_model(setup)
    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads_per_rank)  # what each rank runs with
    try:
        return profile_traced(traced, warmup=2, repeats=PROFILE_REPEATS, show_progress=False)
    finally:
        torch.set_num_threads(threads)


def simulates(runner: str) -> bool:
    """Whether ``runner`` gets a simulated step: hf_ftpipe's synchronous schedules (gradient accumulation aside)."""
    kind, schedule = runner_schedule(runner)
    return kind == "hf_ftpipe" and schedule != "gradient_accumulation" and flushes(schedule)


def simulated_step_ms(setup: Setup, runner: str, split: dict[str, Any], table: Any) -> float | None:
    """The simulated step of a `simulates` runner on ``setup``'s placement, priced by ``table`` (None if the
    simulation fails: the benchmark still reports the runs)."""
    import hf_ftpipe
    from hf_ftpipe.costmodel.profiles import BUILTIN_PROFILES

    _, schedule = runner_schedule(runner)
    graph, node_stage = split["graph"], split["node_stage"]
    try:
        plan = simulation_plan(setup, graph, node_stage, schedule)
        profile = BUILTIN_PROFILES["cpu"].with_count(setup.num_ranks)
        result = hf_ftpipe.simulate(plan, schedule, table.node_costs(graph), graph=graph, profile=profile)
    except Exception as error:
        print(f"no simulation for {runner}: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return round(1000 * result.step_time_s, 1)


def zb_auto_order(setup: Setup, split: dict[str, Any], table: Any | None, folder: str) -> str:
    """Write the order ``zb-auto`` builds for ``setup``'s split (`hf_ftpipe.simulator.auto_schedule`: zb-h1's
    list scheduler timed by the stages' F, B and W) to a file in ``folder``; its path. Timed by ``table``
    (profiled right before the launch, as the simulated step is), else by the ``cpu`` profile's roofline."""
    from pathlib import Path

    from hf_ftpipe.costmodel.profiles import BUILTIN_PROFILES
    from hf_ftpipe.simulator import auto_schedule, pipeline_costs

    graph = split["graph"]
    plan = simulation_plan(setup, graph, split["node_stage"], "zb-auto")
    profile = BUILTIN_PROFILES["cpu"].with_count(setup.num_ranks)
    costs = None if table is None else table.node_costs(graph)
    microbatches = setup.num_microbatches
    pipeline = pipeline_costs(plan, graph, profile, costs=costs, schedule="zb-auto", num_microbatches=microbatches)
    schedule, _ = auto_schedule(pipeline, microbatches)
    path = Path(folder) / "zb-auto-order.txt"
    path.write_text(str(schedule), encoding="utf-8")
    return str(path)
