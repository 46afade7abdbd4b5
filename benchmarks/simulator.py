"""The simulator against the run: simulated step and bubble beside the measured ones, per schedule.

On the CPU runtime benchmark's model and split (``_gpt2_split.py``: GPT-2, 8 layers, d_model 256,
sequence 128, vocabulary 2048, two gloo ranks), for every synchronous and streaming schedule of
hf_ftpipe's `PipelineEngine`: gpipe, 1f1b, async, 2bw and zb-h1 on two stages, one per rank; zbv on
four stages as a V (``[0, 1, 1, 0]``) and interleaved-1f1b on four looped (``[0, 1, 0, 1]``), as
``runtime.py`` runs them (`_runtime_ranks.runner_setup`):

- simulated: `hf_ftpipe.simulate` of the same split, priced by a measured cost table
  (`hf_ftpipe.profile_model` at the run's micro-batch shape and torch threads, taken in the rank
  processes right before the runs: ``--profile alone``, rank 0 alone as ``cost_table="measured"``
  does; ``--profile together``, every rank at once, rank r's table pricing the ops of stage r of
  the two-stage split), over the ``cpu`` profile's link (gloo over loopback); and again with each
  stage's F, B and W at the run's own times (the simulator's error without the profile's);
- measured: the real 2-rank run's median step (the slowest rank's), and each stage's forward,
  backward (``B`` alone under a split backward) and deferred weight gradients (``W``) per
  micro-batch as timed inside the run (`_simulator_ranks.StageClock`: the engine's forward and
  backward calls, waits on messages taken off, and the ``W`` products);
- per stage: the roofline's prediction (``cpu`` profile), the table's F / B / W and the run's.

    python benchmarks/simulator.py                 # a table and the checks
    python benchmarks/simulator.py --json          # a JSON list, one object per schedule
    python benchmarks/simulator.py --quick         # tiny sizes: a smoke test (figures mean nothing)

measured_efficiency = Σ over ranks of the stages' compute / (ranks × step): the share of the ranks'
time spent computing (each rank's compute over its timed steps / their wall time, averaged over
ranks), so 1 − measured_efficiency is the measured bubble (waiting, messages, and what the
simulator does not price: the optimizer step, Python between actions). Targets (issue 27): the
simulated step within 10% of the measured median for every schedule; the simulated bubble within
5 points of 1 − measured efficiency; each stage's predicted forward + backward within 10% of the
measured one (the roofline's error beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _checks import Check, failed, print_checks, verdict  # noqa: E402
from _gpt2_split import (  # noqa: E402
    Setup,
    add_model_arguments,
    build_model,
    first_microbatch,
    make_batch,
    simulation_plan,
    split_graph,
)
from _rank_processes import run_ranks  # noqa: E402
from _runtime_ranks import runner_setup  # noqa: E402
from _simulator_ranks import run_rank  # noqa: E402

from hf_ftpipe.schedules.registry import schedule_traits  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "async", "2bw", "zb-h1", "zbv", "interleaved-1f1b")
FOUR_STAGES = ("zbv", "interleaved-1f1b")
"""Schedules run on two stages per rank (`_runtime_ranks.RUNNER_SPLITS`)."""
MAX_STEP_ERROR = 0.10
MAX_BUBBLE_POINTS = 0.05
MAX_STAGE_ERROR = 0.10
QUICK = {"layers": 4, "d_model": 32, "heads": 2, "seq_len": 16, "vocab": 128, "steps": 3, "warmup": 2}


def run_stage_times(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per kind (``F``, ``B``, ``W``), each stage's seconds per micro-batch as timed inside the run
    (``B`` is the whole backward where the schedule does not split it, ``W`` then 0)."""
    forwards: dict[int, int] = {}
    for run in runs:
        forwards.update(run["count"]["F"])
    times: dict[str, list[float]] = {}
    for kind in "FBW":
        per_stage = [0.0] * len(forwards)
        for run in runs:
            for s, t in run["time_s"][kind].items():
                per_stage[s] += t
        times[kind] = [t / forwards[s] if forwards[s] else 0.0 for s, t in enumerate(per_stage)]
    return times


def simulate_all(setup: Setup, ranks: list[dict[str, Any]], schedules: list[str]) -> dict[str, Any]:
    """Per schedule, on its split: the simulation priced by the ranks' measured costs and again with each
    stage's F, B and W at the run's own times; per stage, the roofline's and the costs' times."""
    from dataclasses import replace

    import hf_ftpipe
    from hf_ftpipe.costmodel.op_time import NodeCost, node_costs
    from hf_ftpipe.costmodel.profiles import BUILTIN_PROFILES
    from hf_ftpipe.graph import capture_model
    from hf_ftpipe.simulator import pipeline_costs, simulate_costs

    model = build_model(setup)
    graph = capture_model(model, first_microbatch(setup, make_batch(setup, 0))).cost_graph
    profile = BUILTIN_PROFILES["cpu"].with_count(setup.num_ranks)
    measured = {n: NodeCost(*fb) for r in ranks for n, fb in r["costs"].items()}
    missing = [n for n in graph.graph.nodes if n not in measured]
    if missing:
        raise RuntimeError(f"the ranks' profiles priced no time for {len(missing)} ops, e.g. {missing[:3]}")
    roofline = node_costs(graph, profile, "float32")
    out: dict[str, Any] = {}
    for schedule in schedules:
        schedule_setup = runner_setup(setup, f"hf_ftpipe/{schedule}")
        node_stage = split_graph(graph, schedule_setup)
        plan = simulation_plan(schedule_setup, graph, node_stage, schedule)
        table = pipeline_costs(
            plan, graph, profile, costs=measured, schedule=schedule, num_microbatches=setup.num_microbatches
        )
        run = run_stage_times([r["runs"][schedule] for r in ranks])
        # The simulator alone, without the profile's error: every stage's F, B and W at the run's times.
        from_run = replace(
            table, forward_s=run["F"], backward_s=[b + w for b, w in zip(run["B"], run["W"])], weight_s=run["W"]
        )
        roofline_s = [0.0] * schedule_setup.num_stages
        for n, s in node_stage.items():
            roofline_s[s] += roofline[n].forward_s + roofline[n].backward_s
        out[schedule] = {
            "setup": schedule_setup,
            "result": hf_ftpipe.simulate(plan, schedule, measured, graph=graph, profile=profile),
            "from_run": simulate_costs(from_run, schedule, setup.num_microbatches),
            "table": table,
            "run": run,
            "roofline_s": roofline_s,
        }
    return out


def make_row(setup: Setup, schedule: str, ranks: list[dict[str, Any]], simulated: dict[str, Any]) -> dict[str, Any]:
    """One schedule's figures: the simulation beside the run (the slowest rank's median step)."""
    runs = [r["runs"][schedule] for r in ranks]
    sim = simulated[schedule]
    result, from_run, table, run = sim["result"], sim["from_run"], sim["table"], sim["run"]
    busy = [sum(sum(per_stage.values()) for per_stage in r["time_s"].values()) for r in runs]
    efficiency = statistics.fmean(b / r["wall_s"] for b, r in zip(busy, runs))
    stages = []
    for s, rank in enumerate(table.stage_rank):
        b, w = table.split_s(s) if schedule_traits(schedule).split_backward else (table.backward_s[s], 0.0)
        stages.append(
            {
                "stage": s,
                "rank": rank,
                "roofline_s": sim["roofline_s"][s],
                "predicted_s": table.forward_s[s] + table.backward_s[s],
                "predicted_fbw_s": [table.forward_s[s], b, w],
                "measured_s": run["F"][s] + run["B"][s] + run["W"][s],
                "measured_fbw_s": [run["F"][s], run["B"][s], run["W"][s]],
                "measured_forward_s": run["F"][s],
            }
        )
    per_rank = [0.0] * setup.num_ranks
    for st in stages:
        per_rank[st["rank"]] += st["predicted_s"]
    return {
        "schedule": schedule,
        "placement": sim["setup"].ranks_of_stages(),
        "simulated_step_s": result.step_time_s,
        "measured_step_s": max(run["median_step_s"] for run in runs),
        "simulated_bubble": result.bubble_fraction,
        "measured_efficiency": efficiency,
        # The same costs with no fill, drain or waiting: what a stream that never stops would take.
        "no_fill_step_s": setup.num_microbatches * max(per_rank),
        # Simulated with each stage at the time the run measured: the simulator's error without the profile's.
        "simulated_from_run_step_s": from_run.step_time_s,
        "simulated_from_run_bubble": from_run.bubble_fraction,
        "simulated_busy_s": result.busy_s,
        "measured_busy_s": [b / len(run["step_times_s"]) for b, run in zip(busy, runs)],
        # Weight updates per rank and step (the optimizer's step; inside the pipeline for async and 2bw),
        # which the simulator prices at 0: part of the measured bubble.
        "measured_update_s": [run["update_s"] / len(run["step_times_s"]) for run in runs],
        "stages": stages,
        "num_microbatches": setup.num_microbatches,
        "num_ranks": setup.num_ranks,
    }


def median_row(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """A schedule's launch of median measured step, with every launch's ratios of the simulated steps to
    the measured one (each within its launch) and their medians, which the table and the checks use."""
    ordered = sorted(launches, key=lambda row: row["measured_step_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    ratios = {"sim_over_measured": "simulated_step_s", "from_run_over_measured": "simulated_from_run_step_s"}
    for name, key in ratios.items():
        row[f"{name}_runs"] = [launch[key] / launch["measured_step_s"] for launch in launches]
        row[name] = statistics.median(row[f"{name}_runs"])
    return row


def checks(rows: list[dict[str, Any]]) -> list[Check]:
    """(check, verdict) per schedule: the step, the bubble, every stage's prediction (the roofline's error beside)."""
    out: list[Check] = []
    for row in rows:
        name = row["schedule"]
        error = row["sim_over_measured"] - 1
        ok = abs(error) <= MAX_STEP_ERROR
        out.append((f"{name}: simulated step within {MAX_STEP_ERROR:.0%} of measured", verdict(ok, f"{error:+.1%}")))
        measured_bubble = 1 - row["measured_efficiency"]
        ok = abs(row["simulated_bubble"] - measured_bubble) <= MAX_BUBBLE_POINTS
        figures = f"simulated {row['simulated_bubble']:.1%}, measured {measured_bubble:.1%}"
        out.append((f"{name}: bubble within {MAX_BUBBLE_POINTS * 100:.0f} points", verdict(ok, figures)))
        errors = [
            (st["predicted_s"] / st["measured_s"] - 1, st["roofline_s"] / st["measured_s"] - 1) for st in row["stages"]
        ]
        figures = "; ".join(f"stage {s} {p:+.0%} (roofline {r:+.0%})" for s, (p, r) in enumerate(errors))
        ok = all(abs(p) <= MAX_STAGE_ERROR for p, _ in errors)
        out.append((f"{name}: stages' measured-cost fwd+bwd within {MAX_STAGE_ERROR:.0%}", verdict(ok, figures)))
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ["schedule", "sim step ms", "no-fill ms", "sim(run) ms", "meas step ms", "sim/meas", "sim(run)/meas"]
    header += ["sim bubble", "sim(run) bubble", "meas bubble", "upd ms"]
    table = [header]
    for row in rows:
        table.append(
            [
                row["schedule"],
                f"{row['simulated_step_s'] * 1e3:.0f}",
                f"{row['no_fill_step_s'] * 1e3:.0f}",
                f"{row['simulated_from_run_step_s'] * 1e3:.0f}",
                f"{row['measured_step_s'] * 1e3:.0f}",
                f"{row['sim_over_measured']:.2f}",
                f"{row['from_run_over_measured']:.2f}",
                f"{row['simulated_bubble']:.1%}",
                f"{row['simulated_from_run_bubble']:.1%}",
                f"{1 - row['measured_efficiency']:.1%}",
                " / ".join(f"{u * 1e3:.0f}" for u in row["measured_update_s"]),
            ]
        )
    _print_columns(table)
    print()
    table = [["schedule", "stage", "rank", "roofline ms", "table F / B / W ms", "run F / B / W ms", "table / run"]]
    for row in rows:
        for st in row["stages"]:
            table.append(
                [
                    row["schedule"],
                    str(st["stage"]),
                    str(st["rank"]),
                    f"{st['roofline_s'] * 1e3:.1f}",
                    " / ".join(f"{t * 1e3:.1f}" for t in st["predicted_fbw_s"]),
                    " / ".join(f"{t * 1e3:.1f}" for t in st["measured_fbw_s"]),
                    " / ".join(
                        f"{p / m:.2f}" if m else "-" for p, m in zip(st["predicted_fbw_s"], st["measured_fbw_s"])
                    ),
                ]
            )
    _print_columns(table)


def _print_columns(table: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    add_model_arguments(parser, microbatches=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank, in the profile and the run")
    parser.add_argument(
        "--profile",
        choices=["alone", "together"],
        default="alone",
        help="alone: rank 0 profiles while the others wait (cost_table='measured' does); together: every rank at once",
    )
    parser.add_argument("--repeats", type=int, default=1, help="launches; per schedule the fastest median step is kept")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per launch")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per schedule")
    args = parser.parse_args()
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    for name in ("microbatches", "microbatch_size", "steps", "repeats", "threads", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.microbatches < 2:
        parser.error(f"--microbatches ({args.microbatches}) must be at least 2, the ranks, for 1F1B")
    four_stages = [s for s in args.schedules if s in FOUR_STAGES]
    if four_stages and args.layers < 4:
        parser.error(f"{', '.join(four_stages)} run 4 stages: --layers ({args.layers}) must be at least 4")
    return args


def main() -> int:
    args = parse_args()
    setup = Setup.of_arguments(args, num_ranks=2, device="cpu", threads_per_rank=args.threads)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    launches: dict[str, list[dict[str, Any]]] = {s: [] for s in args.schedules}
    for repeat in range(args.repeats):
        work = {"schedules": list(args.schedules), "profile": args.profile}
        ranks = run_ranks(setup, run_rank, work, args.timeout_s)
        simulated = simulate_all(setup, ranks, list(args.schedules))
        for schedule in args.schedules:
            launches[schedule].append(make_row(setup, schedule, ranks, simulated))
        if not args.json:
            elapsed_s = time.perf_counter() - started
            print(f"  launch {repeat + 1}/{args.repeats} done at {elapsed_s:.0f} s", file=sys.stderr)
    rows = [{**median_row(launches[s]), "profile": args.profile} for s in args.schedules]
    verdicts = checks(rows)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(
        f"GPT-2 {setup.n_layer} layers, d_model {setup.d_model}, sequence {setup.seq_len}, "
        f"vocabulary {setup.vocab_size}; 2 gloo ranks (zbv: 4 stages on [0, 1, 1, 0], interleaved-1f1b: [0, 1, 0, 1], "
        f"else 2 stages), {setup.threads_per_rank} torch thread(s) each; "
        f"{setup.num_microbatches} micro-batches × {setup.microbatch_size}; median of {setup.steps} steps after "
        f"{setup.warmup} warm-up\n"
    )
    print_table(rows)
    print(
        "\nsim/meas, sim(run)/meas: medians over launches of the ratios within each launch; the other columns: the "
        "launch of median measured step.\n"
        "F / B / W ms: one micro-batch's forward, backward (B alone under zb-h1 and zbv) and deferred weight "
        f"gradients: the measured cost table (profiled {args.profile}) and as timed inside the run (waits on "
        "messages taken off); roofline: the 'cpu' profile's F + B + W.\n"
        "no-fill ms: micro-batches × the slowest rank's predicted forward + backward (no fill, drain or wait).\n"
        "sim(run): simulated with each stage's F, B and W at the run's own times (the simulator alone).\n"
        "meas bubble: 1 - measured efficiency (the ranks' stage compute / (ranks × step)).\n"
        "upd ms: per rank and step, the weight updates (the optimizer's step), which the simulator prices at 0.\n"
    )
    print_checks(verdicts, started)
    return 1 if failed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
