"""``hf-ftpipe simulate``: a plan's schedule replayed in time, per rank, before any run.

::

    hf-ftpipe simulate partitions/t5-3b/rtx2080ti-x8-wic.json [--schedule gpipe] [--num-microbatches 16] \\
        [--costs measured.json] [--plot timeline.png] [--json]

Reads the plan file alone (its recorded prediction prices each stage, or ``--costs``, a measured
cost table of its graph: ``hf-ftpipe profile``; `hf_ftpipe.simulate` takes the graph or per-node
costs from Python). ``--plot`` draws the timeline as a Gantt chart
(`hf_ftpipe.cli.timeline_plot`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, get_args

from hf_ftpipe._units import GiB
from hf_ftpipe.cli.options import add_command, add_json_option, add_plan_argument, add_token_slices_option

__all__ = ["add_simulate_command", "format_simulation", "simulated_figures"]


def add_simulate_command(commands: Any) -> None:
    """Add ``simulate`` to the ``hf-ftpipe`` subparsers ``commands``."""
    from hf_ftpipe.costmodel.options import Schedule

    simulate = add_command(
        commands,
        "simulate",
        _run_simulate,
        "replay a plan's schedule in time: step time, busy and idle per rank, bubble, memory; --plot draws it",
    )
    add_plan_argument(simulate)
    simulate.add_argument("--schedule", choices=get_args(Schedule), help="default: the plan's own")
    simulate.add_argument("--num-microbatches", type=int, help="micro-batches per step (default: the plan's)")
    simulate.add_argument(
        "--gpu-profile", help="the link's profile, a built-in name or a JSON file (default: the plan's)"
    )
    add_token_slices_option(simulate)
    simulate.add_argument(
        "--costs",
        metavar="TABLE",
        help="price the stages' compute by this measured cost table (hf-ftpipe profile) instead of the plan's",
    )
    simulate.add_argument(
        "--write-zb-auto",
        metavar="FILE",
        help="build zb-auto, a zero-bubble order timed by the plan's stage costs (checked, never slower than "
        "zb-h1 in the simulation), write it to FILE (a schedule file) and simulate it",
    )
    simulate.add_argument("--plot", metavar="PNG", help="draw the timeline (one row per rank) to this image")
    add_json_option(simulate, "print the whole result (events included) as JSON")


def _run_simulate(args: argparse.Namespace) -> int:
    """Simulate one training step of a plan (the steady step of async and 2bw): each rank's lowered
    program (forwards, backwards, updates, sends and receives over the profile's link) replayed
    as events, priced by the plan's recorded per-stage times."""
    from hf_ftpipe.errors import PartitionError
    from hf_ftpipe.plan.partition import Partition, user_file_fix, with_fix
    from hf_ftpipe.simulator import simulate

    with with_fix(user_file_fix(args.plan)):
        plan = Partition.from_json(args.plan)
    if args.costs:
        from hf_ftpipe.cli.plans import repriced

        plan = repriced(plan, args.costs)
    if args.num_microbatches is not None and args.num_microbatches < 1:
        raise PartitionError(f"--num-microbatches must be at least 1, got {args.num_microbatches}")
    if args.write_zb_auto:
        from hf_ftpipe.simulator.auto_schedule import plan_auto_schedule

        schedule, result = plan_auto_schedule(plan, profile=args.gpu_profile, num_microbatches=args.num_microbatches)
        Path(args.write_zb_auto).write_text(str(schedule) + "\n", encoding="utf-8")
        print(f"wrote {args.write_zb_auto} ({schedule.name})", file=sys.stderr if args.json else sys.stdout)
    else:
        result = simulate(
            plan,
            args.schedule,
            profile=args.gpu_profile,
            num_microbatches=args.num_microbatches,
            num_slices=args.token_slices,
        )
    print(result.to_json() if args.json else format_simulation(result, source=args.plan))
    if args.plot:
        from hf_ftpipe.cli.timeline_plot import plot_timeline

        plot_timeline(result, args.plot, title=f"{args.plan}: {plan.key.model_class} on {plan.key.num_gpus} × "
                      f"{plan.key.gpu_profile}")  # fmt: skip
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def format_simulation(result: Any, *, source: str | None = None) -> str:
    """The headline figures and one row per rank: busy, idle, its share busy, its peak memory."""
    slices = f", {result.num_slices} token slices" if result.num_slices else ""
    streaming = f" (steady: mean of steps 2-{result.num_steps})" if result.num_steps > 1 else ""
    lines = [
        *([source] if source else []),
        f"{result.schedule}, {result.num_microbatches} micro-batches{slices}: "
        f"step {result.step_time_s * 1e3:.1f} ms{streaming}, bubble {result.bubble_fraction:.1%}, "
        f"{result.throughput_samples_per_s:.2f} samples/s",
    ]
    if result.analytical_step_s is not None:
        ratio = result.step_time_s / result.analytical_step_s if result.analytical_step_s > 0 else float("nan")
        lines.append(
            f"analytical (cost model, {result.num_microbatches} × the slowest GPU, no fill or drain): "
            f"{result.analytical_step_s * 1e3:.1f} ms; simulated / analytical {ratio:.3f}"
        )
    lines.append("")
    from hf_ftpipe.cli.format import table

    rows = [["rank", "busy ms", "idle ms", "busy", "peak memory GiB"]]
    for rank in range(result.num_ranks):
        busy, idle = result.busy_s[rank], result.idle_s[rank]
        share = busy / result.step_time_s if result.step_time_s > 0 else 0.0
        rows.append(
            [str(rank), f"{busy * 1e3:.1f}", f"{idle * 1e3:.1f}", f"{share:.0%}",
             f"{result.peak_memory_bytes[rank] / GiB:.2f}"]
        )  # fmt: skip
    lines.append(table(rows))
    lines.extend(f"  {note}" for note in result.notes)
    return "\n".join(lines)


def simulated_figures(plan: Any, profile: Any = None) -> dict[str, Any]:
    """The simulated step of ``plan``'s own schedule beside the analytical one, for ``show`` and
    ``compare`` (``None`` values, and the reason, where the plan cannot be simulated)."""
    from hf_ftpipe.errors import FtpipeError
    from hf_ftpipe.simulator import simulate

    try:
        result = simulate(plan, profile=profile)
    except (FtpipeError, ValueError) as error:
        return {"simulated_step_ms": None, "analytical_step_ms": None, "simulated_bubble": None, "why_not": str(error)}
    return {
        "simulated_step_ms": result.step_time_s * 1e3,
        "analytical_step_ms": None if result.analytical_step_s is None else result.analytical_step_s * 1e3,
        "simulated_bubble": result.bubble_fraction,
    }
