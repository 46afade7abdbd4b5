"""Pipeline × data parallelism on CPU: 4 processes as 2 × 2, 4 × 1 and 1 × 4, measured beside the planner.

Each layout runs D replicas of a P-process pipeline (replica d on ranks d·P … d·P + P − 1,
`PipelineEngine(data_parallel_size=D)`, gloo on CPU) on ``runtime.py``'s GPT-2 (8 layers, d_model
256, sequence 128, vocabulary 2048, SGD), every rank reading the same global mini-batch of M
micro-batches: each replica runs M / D of them (the engine's ``num_microbatches`` is per replica,
D × M / D = M globally; the planner's M is the global count). 4 × 1 is one deeper pipeline, 1 × 4
plain data parallelism (P = 1, the whole model on every rank).

The prediction is `compare_layouts`' for a topology of this machine: one node of 4 ``cpu`` ranks
(gloo over loopback), each op priced by a cost table measured here before the runs
(``_runtime_simulation.measured_costs``, as ``runtime.py``'s simulated step), so every layout runs
the plan the planner made for it and the prediction and the measurement are of the same plan.
``planner_choice`` marks the planner's pick (`best_layout`); the check is whether it is also the
fastest measured.

    python benchmarks/hybrid.py                        # the three layouts, a table and the check
    python benchmarks/hybrid.py --repeats 3 --json     # 3 rounds, medians; a JSON list, one object per layout

Reported per layout: samples/s over the global batch (M × micro-batch size / the slowest rank's
median step), every round's figure, the ratio to the planner's pick (median of the rounds' ratios,
each within one round, so a busy spell of the machine cancels), the predicted samples/s and the
plan the planner made (partitioner, stages per rank). The load average before and after is printed:
4 processes share whatever cores there are, which the planner does not know (it prices each process
as a device of its own); ``cores_bound_samples_per_s`` is what the cores could do at best, the global
batch's measured compute spread over them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _checks import failed, print_checks, verdict  # noqa: E402
from _gpt2_split import Setup, add_model_arguments, build_model, first_microbatch, make_batch  # noqa: E402
from _hybrid_ranks import LayoutRun, run_layout_rank  # noqa: E402
from _rank_processes import run_ranks  # noqa: E402
from _runtime_report import round_ratio  # noqa: E402
from _runtime_simulation import measured_costs  # noqa: E402

LAYOUTS = ("2x2", "4x1", "1x4")
"""P × D: a pipeline of P processes, D replicas of it."""


def parse_layout(text: str, world: int) -> tuple[int, int]:
    """``"2x2"`` → (2, 2); an `argparse.ArgumentTypeError` naming the fix unless P × D is the world."""
    try:
        p, d = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is PxD, e.g. 2x2, got {text!r}") from None
    if p < 1 or d < 1 or p * d != world:
        raise argparse.ArgumentTypeError(f"layout {text} has {p * d} processes, --ranks is {world}: P × D must be it")
    return p, d


def plan_layouts(setup: Setup, layouts: list[tuple[int, int]], schedule: str, budget_s: float) -> tuple[float, list]:
    """The measured compute of one micro-batch through the whole model (forward + backward, seconds),
    and `compare_layouts`' result for each layout on a topology of this machine."""
    from hf_ftpipe.costmodel import BUILTIN_PROFILES, Topology
    from hf_ftpipe.graph import capture_model
    from hf_ftpipe.partitioners.layouts import compare_layouts

    table = measured_costs(setup)  # before the runs, nothing else of this benchmark running
    graph = capture_model(build_model(setup), first_microbatch(setup, make_batch(setup, 0))).cost_graph
    machine = Topology.single_node(BUILTIN_PROFILES["cpu"].with_count(setup.num_ranks))
    results = compare_layouts(
        graph,
        machine,
        layouts=layouts,
        time_budget_s=budget_s,
        num_microbatches=setup.num_microbatches,
        microbatch_size=setup.microbatch_size,
        schedule=schedule,
        optimizer="sgd",
        cost_table=table,
    )
    compute_s = sum(cost.total_s for cost in table.node_costs(graph).values())
    return compute_s, results


def measure(setup: Setup, result: Any, schedule: str, timeout_s: float) -> dict[str, Any]:
    """One round of one layout: its samples/s over the global batch, or why it failed."""
    plan = result.partition
    run = LayoutRun(result.pipeline_gpus, result.replicas, dict(plan.node_stage), list(plan.stage_device), schedule)
    try:
        ranks = run_ranks(setup, run_layout_rank, run, timeout_s)
    except Exception as error:
        return {"samples_per_s": None, "error": str(error)[-2000:]}
    step_time_s = max(r["step_time_s"] for r in ranks)
    return {
        "samples_per_s": round(setup.num_microbatches * setup.microbatch_size / step_time_s, 3),
        "step_time_ms": round(1000 * step_time_s, 1),
        "losses": [None if v is None else round(v, 4) for v in ranks[-1]["losses"]],
        "error": None,
    }


def make_rows(results: list, rounds: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per layout: the round of median speed, every round's samples/s, the ratio to the pick."""
    from hf_ftpipe.partitioners.layouts import best_layout

    best = best_layout(results)
    rows = []
    for result in results:
        runs = rounds.get(result.layout, [])
        done = sorted((r for r in runs if r["error"] is None), key=lambda r: r["samples_per_s"])
        row: dict[str, Any] = {
            "layout": result.layout,
            "samples_per_s": None,
            "predicted_samples_per_s": None if result.samples_per_s is None else round(result.samples_per_s, 3),
            "planner_choice": result is best,
        }
        row.update(dict(done[len(done) // 2]) if done else (dict(runs[-1]) if runs else {"error": result.error}))
        row["samples_per_s_runs"] = [r["samples_per_s"] for r in runs]
        row.update(pipeline_gpus=result.pipeline_gpus, replicas=result.replicas, partitioner=result.partitioner)
        plan = result.partition
        row["stages_per_rank"] = None if plan is None else [len(plan.stages_on(g)) for g in range(plan.num_devices)]
        row["predicted_step_ms"] = None if result.step_time_s is None else round(1000 * result.step_time_s, 1)
        rows.append(row)
    pick = next((row for row in rows if row["planner_choice"]), None)
    for row in rows:
        row["ratio_vs_pick"] = round_ratio(row, pick) if pick is not None and row["error"] is None else None
        predicted_ratio = None
        if pick is not None and row["predicted_samples_per_s"] and pick["predicted_samples_per_s"]:
            predicted_ratio = round(row["predicted_samples_per_s"] / pick["predicted_samples_per_s"], 3)
        row["predicted_ratio_vs_pick"] = predicted_ratio
    return rows


def checks(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """Whether the planner's pick is the fastest measured layout (by the rounds' ratios to it)."""
    pick = next((row for row in rows if row["planner_choice"]), None)
    measured = [row for row in rows if row["error"] is None and row["ratio_vs_pick"] is not None]
    if pick is None or len(measured) < 2:
        return [("planner's pick is the fastest measured", "n/a (fewer than two layouts measured, or no pick)")]
    fastest = max(measured, key=lambda row: row["ratio_vs_pick"])
    figures = ", ".join(f"{row['layout']} {row['ratio_vs_pick']:.3f}x" for row in measured)
    return [
        (
            f"planner's pick ({pick['layout']}) is the fastest measured",
            verdict(fastest is pick or fastest["ratio_vs_pick"] <= 1.0, f"measured / pick: {figures}"),
        )
    ]


def print_table(rows: list[dict[str, Any]], setup: Setup, schedule: str) -> None:
    from hf_ftpipe.cli.format import table

    print(
        f"GPT-2 {setup.n_layer} layers, d_model {setup.d_model}, {setup.n_head} heads, sequence {setup.seq_len}, "
        f"vocabulary {setup.vocab_size}; {setup.num_ranks} processes; global batch {setup.num_microbatches} "
        f"micro-batches × {setup.microbatch_size} samples; {schedule}, SGD\n"
    )
    lines = [["layout", "samples/s", "/ pick", "runs", "predicted", "/ pick", "plan", "stages/rank", "note"]]
    for row in rows:
        plan = f"{row['partitioner']}" if row.get("partitioner") else "-"
        stages = " ".join(map(str, row["stages_per_rank"])) if row.get("stages_per_rank") else "-"
        note = ("planner's pick; " if row["planner_choice"] else "") + (row.get("error") or "")[-200:]
        lines.append(
            [
                row["layout"],
                "-" if row["samples_per_s"] is None else f"{row['samples_per_s']:.2f}",
                "-" if row["ratio_vs_pick"] is None else f"{row['ratio_vs_pick']:.3f}",
                " ".join("-" if v is None else f"{v:.2f}" for v in row["samples_per_s_runs"]),
                "-" if row["predicted_samples_per_s"] is None else f"{row['predicted_samples_per_s']:.2f}",
                "-" if row["predicted_ratio_vs_pick"] is None else f"{row['predicted_ratio_vs_pick']:.3f}",
                plan,
                stages,
                note.strip("; "),
            ]
        )
    print(table(lines))
    print("layout: P × D, a pipeline of P processes and D replicas of it; / pick: to the planner's pick, in one round")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="processes (world size = P × D)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), metavar="PxD", help="default: 2x2 4x1 1x4")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    add_model_arguments(parser, microbatches=8, microbatches_help="of the global batch, shared by the replicas")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every layout, round-robin; medians")
    parser.add_argument("--time-budget-s", type=float, default=20.0, help="the planner's, per layout")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit per layout and round")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per layout")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments and plan, run nothing")
    args = parser.parse_args()
    for name in ("ranks", "microbatches", "microbatch_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    try:
        layouts = [parse_layout(text, args.ranks) for text in args.layouts]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    for p, d in layouts:
        if args.microbatches % d or args.microbatches // d < p:
            parser.error(
                f"layout {p}x{d}: --microbatches ({args.microbatches}) must be a multiple of D = {d} with at least "
                f"P = {p} per replica for 1F1B, e.g. {d * max(p, 1) * 2}"
            )
    cores = len(os.sched_getaffinity(0))
    setup = Setup.of_arguments(
        args,
        num_ranks=args.ranks,
        warmup=max(1, args.warmup),
        device="cpu",
        threads_per_rank=max(1, cores // args.ranks),
    )
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    started, load_before = time.perf_counter(), os.getloadavg()
    compute_s, results = plan_layouts(setup, layouts, args.schedule, args.time_budget_s)
    # What the cores can do at best: the global batch's compute spread over every core, nothing else
    # (no bubble, no message, no all-reduce). The planner prices each rank as a device of its own.
    usable_cores = min(cores, args.ranks)
    cores_bound = args.microbatch_size * usable_cores / compute_s  # M micro-batches in M × compute_s / cores
    rounds: dict[str, list[dict[str, Any]]] = {r.layout: [] for r in results if r.feasible}
    for repeat in range(0 if args.dry_run else args.repeats):  # round-robin: a busy spell hits every layout alike
        for result in results:
            if not result.feasible:
                continue
            layout_started = time.perf_counter()
            rounds[result.layout].append(measure(setup, result, args.schedule, args.timeout_s))
            if not args.json:
                row = rounds[result.layout][-1]
                outcome = "failed" if row["error"] else f"{row['samples_per_s']:.2f} samples/s"
                print(
                    f"  {result.layout} (run {repeat + 1}/{args.repeats}): {outcome} "
                    f"in {time.perf_counter() - layout_started:.0f} s",
                    file=sys.stderr,
                )
    rows = make_rows(results, rounds)
    load = {"load_average_before": [round(v, 2) for v in load_before], "load_average_after": None}
    load["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    for row in rows:
        row.update(load, cores=cores, schedule=args.schedule, global_microbatches=args.microbatches)
        row["cores_bound_samples_per_s"] = round(cores_bound, 3)
        row["microbatch_size"] = args.microbatch_size
    verdicts = [] if args.dry_run else checks(rows)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows, setup, args.schedule)
        before, after = load["load_average_before"], load["load_average_after"]
        print(f"{cores} cores; load average (1, 5, 15 min) before {before}, after {after}")
        print(
            f"at best {cores_bound:.2f} samples/s on {usable_cores} cores: the measured compute of the global batch "
            "spread over them, no bubble, message or all-reduce (the planner gives each process a core)"
        )
        print_checks(verdicts, started)
    return 1 if failed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
