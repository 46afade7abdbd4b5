"""The simulator's step for ``benchmarks/runtime.py``'s hf_ftpipe runners, priced by a measured cost table.

As ``benchmarks/simulator.py`` does with ``--profile alone`` (what ``cost_table="measured"`` does): the
model is profiled once here (`hf_ftpipe.profile_model` at the run's micro-batch shape and a rank's
torch threads, nothing else running), and `hf_ftpipe.simulate` prices each runner's split, placement
and schedule with that table over the ``cpu`` profile's link (gloo over loopback). The issue's target:
each new schedule's simulated step within 10% of the measured one.
"""

from __future__ import annotations

import sys
from typing import Any

from _gpt2_split import Setup, build_model, first_microbatch, make_batch, simulation_plan
from _runtime_ranks import flushes, runner_schedule


def measured_costs(setup: Setup) -> Any:
    """The `CostTable` (each op's forward and backward seconds on one micro-batch) of a profile taken here."""
    import torch

    from hf_ftpipe import profile_model

    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads_per_rank)  # what each rank runs with
    try:
        model = build_model(setup)
        microbatch = first_microbatch(setup, make_batch(setup, 0))
        return profile_model(model, microbatch, warmup=2, repeats=max(3, setup.stage_repeats), show_progress=False)
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
