"""The ``hf-ftpipe`` command: plan a pipeline for a model, or compare every partitioner on it.

No GPU, no weights and (for the shipped models) no network: the model is built on the meta
device from its config, traced, and partitioned for the GPUs you name::

    hf-ftpipe partition t5-3b --gpus 8 --gpu-profile rtx2080ti --batch-size 4 --seq-len 512 \\
        --target-len 4 --schedule async --num-microbatches 8 -o t5-3b-8x2080ti.json
    hf-ftpipe compare t5-3b --gpus 8 --gpu-profile rtx2080ti --batch-size 4 --seq-len 512 \\
        --target-len 4 --schedule async [--json]

``--batch-size`` is the micro-batch, the batch of one trace. Errors a user can fix (unknown
model, profile or partitioner; nothing fits) print one message on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any, get_args

__all__ = ["main"]

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or argparse's own usage errors (status 2)
        return int(exit_.code or 0)
    from hf_ftpipe.errors import FtpipeError, PlanDoesNotFitError

    try:
        return args.run(args)
    except (FtpipeError, OSError) as error:
        message = error.message("cli") if isinstance(error, PlanDoesNotFitError) else str(error)
        print(f"hf-ftpipe {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


# -- arguments ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from hf_ftpipe.costmodel.estimate import Optimizer, Schedule

    parser = argparse.ArgumentParser(
        prog="hf-ftpipe",
        description="Plan FTPipe pipeline partitions for Hugging Face models (no GPU or weights needed).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    partition = commands.add_parser(
        "partition", help="make a partition and print its summary", description="Make a partition plan."
    )
    compare = commands.add_parser(
        "compare",
        help="run every partitioner and print them side by side",
        description="Run every registered partitioner on the model and print their predictions side by side.",
    )
    for command in (partition, compare):
        command.add_argument(
            "model",
            help="a shipped short name (t5-3b, gpt2-xl, bert-large: offline), a folder with config.json, "
            "a config JSON file, or a Hub model id",
        )
        command.add_argument("--gpus", type=int, required=True, help="number of GPUs (pipeline ranks)")
        command.add_argument(
            "--gpu-profile", required=True, help="built-in GPU profile (e.g. rtx2080ti, a100-80gb) or a JSON file"
        )
        command.add_argument("--batch-size", type=int, required=True, help="samples per micro-batch")
        command.add_argument("--seq-len", type=int, required=True, help="input length in tokens")
        command.add_argument("--target-len", type=int, help="target length of an encoder-decoder (default: seq-len)")
        command.add_argument(
            "--task",
            choices=["seq2seq-lm", "causal-lm", "masked-lm", "question-answering", "sequence-classification"],
            help="head to put on the model instead of the config's `architectures`",
        )
        command.add_argument("--attention-mask", action="store_true", help="trace with an attention_mask input")
        command.add_argument("--schedule", choices=get_args(Schedule), default="gpipe", help="default: gpipe")
        command.add_argument("--num-microbatches", type=int, default=4, help="micro-batches per step (default: 4)")
        command.add_argument("--optimizer", choices=get_args(Optimizer), default="adamw", help="default: adamw")
        command.add_argument("--dtype", help="compute dtype for the costs, e.g. bfloat16 (default: the weights')")
        command.add_argument("--recompute", action="store_true", help="plan with activation recomputation")
        command.add_argument(
            "--headroom", type=float, default=0.1, help="fraction of GPU memory kept free (default: 0.1)"
        )
        command.add_argument(
            "--time-budget-s", type=float, default=60.0, help="auto/compare: start no partitioner after this"
        )
        command.add_argument("--json", action="store_true", help="print JSON instead of a table")
    schedule = commands.add_parser(
        "schedule",
        help="print the actions each rank runs under a pipeline schedule",
        description="Print, per rank, the actions of a pipeline schedule (1F0: stage 1 forward of micro-batch 0; "
        "0B3: backward; 0U3: stage 0 updates its weights), checked for order without starting any process.",
    )
    schedule.add_argument(
        "--placement",
        required=True,
        help="the rank of each stage, stages feeding each other in order, e.g. 0,1,1,0 (rank 0 runs stages 0 and 3)",
    )
    schedule.add_argument("--schedule", choices=get_args(Schedule), default="gpipe", help="default: gpipe")
    schedule.add_argument("--num-microbatches", type=int, default=4, help="micro-batches per step (default: 4)")
    schedule.add_argument("--steps", type=int, default=2, help="async/2bw: steps to print before the drain")
    schedule.add_argument("--async-update-interval", type=int, default=1, help="async: backwards per update")
    schedule.set_defaults(run=_run_schedule)
    _add_plan_commands(commands)
    partition.add_argument("--partitioner", default="auto", help="a registered partitioner (default: auto)")
    partition.add_argument("-o", "--output", help="write the plan to this JSON file")
    partition.set_defaults(run=_run_partition)
    compare.set_defaults(run=_run_compare)
    from hf_ftpipe.cli.hub import add_hub_commands

    add_hub_commands(commands)
    return parser


def _add_plan_commands(commands: Any) -> None:
    """``show``, ``profiles`` and the ``partitions/`` folder's commands (their code: ``cli.plans``)."""
    from hf_ftpipe.cli import plans as _cli_plans

    show = commands.add_parser(
        "show",
        help="print a plan's per-GPU and per-stage predictions; --plot draws them",
        description="Print what the cost model predicts for a partition file: per GPU and per stage compute, "
        "communication, memory, and the predicted throughput.",
    )
    show.add_argument("plan", help="a partition JSON file (hf-ftpipe partition -o, or partitions/...)")
    show.add_argument("--json", action="store_true", help="print JSON instead of tables")
    show.add_argument("--plot", metavar="PNG", help="also draw the per-GPU load and the stage graph to this image")
    show.set_defaults(run=_cli_plans.run_show)
    profiles = commands.add_parser(
        "profiles",
        help="list the built-in GPU profiles",
        description="The built-in GPU profiles (datasheet speeds) that --gpu-profile names.",
    )
    profiles.add_argument("--json", action="store_true", help="print JSON instead of a table")
    profiles.set_defaults(run=_cli_plans.run_profiles)
    regenerate = commands.add_parser(
        "regenerate-partitions",
        help="recompute the shipped plans in partitions/ with their index and card",
        description="Trace each shipped setup's model (meta device) and rewrite its plan, index.json and README.md.",
    )
    regenerate.add_argument("--folder", default="partitions", help="default: partitions")
    regenerate.add_argument("--only", nargs="+", metavar="NAME", help="only these plans, e.g. t5-3b/rtx2080ti-x8-rte")
    regenerate.set_defaults(run=_cli_plans.run_regenerate)
    publish = commands.add_parser(
        "publish-partitions",
        help="upload the partitions/ folder to a Hub dataset repository",
        description="Upload the plans, index and card to a Hub dataset repository (created when missing).",
    )
    publish.add_argument("repo_id", help="the dataset repository, e.g. USER/hf-ftpipe-partitions")
    publish.add_argument("--folder", default="partitions", help="default: partitions")
    publish.add_argument("--private", action="store_true", help="create the repository private")
    publish.add_argument("--revision", help="branch to commit to (default: main)")
    publish.set_defaults(run=_cli_plans.run_publish)


# -- commands ----------------------------------------------------------------------------------


def _run_schedule(args: argparse.Namespace) -> int:
    from hf_ftpipe.errors import PipelineError
    from hf_ftpipe.schedules.orders import StreamingSchedule, check_order, format_actions, make_schedule

    try:
        stage_rank = [int(rank) for rank in args.placement.split(",")]
    except ValueError:
        raise PipelineError(
            f"--placement takes ranks separated by commas, e.g. 0,1,1,0; got {args.placement!r}"
        ) from None
    if sorted(set(stage_rank)) != list(range(max(stage_rank) + 1)):
        raise PipelineError(f"ranks must be 0..N-1, each holding a stage; got {stage_rank}")
    try:
        schedule = make_schedule(
            args.schedule,
            stage_rank,
            args.num_microbatches,
            gradient_accumulation_steps=args.async_update_interval,
        )
    except ValueError as error:
        raise PipelineError(str(error)) from error
    if isinstance(schedule, StreamingSchedule):
        steps = [(f"step {t}", schedule.next_step()) for t in range(args.steps)] + [("drain", schedule.drain())]
        total = args.steps * args.num_microbatches
    else:
        steps, total = [("step", schedule.global_order())], args.num_microbatches
    check_order([a for _, order in steps for a in order], stage_rank, schedule.edges, range(total))
    ranks = range(max(stage_rank) + 1)
    for title, order in steps:
        print(f"{title}:")
        for rank in ranks:
            print(f"  rank {rank}: {format_actions([a for a in order if stage_rank[a.stage_index] == rank])}")
    return 0


def _run_partition(args: argparse.Namespace) -> int:
    from hf_ftpipe.costmodel.estimate import usable_capacity
    from hf_ftpipe.partitioners.auto import partition_auto, result_of
    from hf_ftpipe.partitioners.registry import get_partitioner
    from hf_ftpipe.plan.validate import validate_partition

    request = _Request(args)
    get_partitioner(args.partitioner)  # an unknown name fails before the trace
    graph = request.trace()
    started = time.perf_counter()
    report: list = []
    if args.partitioner == "auto":
        plan = partition_auto(
            graph, request.profile, **request.options, time_budget_s=args.time_budget_s, report=report
        )
    else:
        plan = get_partitioner(args.partitioner)(graph, request.profile, **request.options)
    time_s = time.perf_counter() - started
    validate_partition(plan, graph, memory_capacity_bytes=usable_capacity(request.profile, request.options["memory"]))
    result = result_of(plan.partitioner, plan, time_s)
    if args.output:
        plan.to_json(args.output)
    summary = {
        "model": args.model,
        "model_class": graph.model_class,
        "num_ops": graph.num_nodes,
        "gpu_profile": request.profile.name,
        "num_gpus": request.profile.count,
        "partitioner": plan.partitioner,
        "chosen_by_auto": args.partitioner == "auto",
        **{k: v for k, v in result.to_dict().items() if k not in ("partitioner", "error", "skipped")},
        "gpus": _gpu_rows(plan),
        "output": args.output,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(_partition_text(summary, report))
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    from hf_ftpipe.partitioners.auto import (
        PartitionerResult,
        best_result,
        compare_partitioners,
        no_plan_fits,
        reason_line,
    )

    request = _Request(args)
    graph = request.trace()
    started = time.perf_counter()
    report = compare_partitioners(
        graph, request.profile, **request.options, time_budget_s=args.time_budget_s, unlimited_figures=True
    )
    best = best_result(report)
    if best is not None:  # auto is the best of the others, timed as running them all
        auto = PartitionerResult(**{**best.__dict__, "partitioner": "auto", "time_s": time.perf_counter() - started})
        why = None
    else:
        why = no_plan_fits(graph, request.profile, report, **request.options).message("cli")
        auto = PartitionerResult(partitioner="auto", feasible=False, time_s=time.perf_counter() - started, error=why)
    rows = [{**r.to_dict(), "best": r is best} for r in report]
    rows.append({**auto.to_dict(), "best": False, "chosen": best.partitioner if best else None})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(_header(args, graph, request.profile))
        print(_compare_table(rows))
        if best is not None:  # else auto's message lists every reason
            print("\n".join(f"  {reason_line(r)}" for r in report if r.error))
        print(f"auto chooses {best.partitioner}" if best else f"auto: {why}")
    return 0


class _Request:
    """The profile, the traced graph and the partitioner options that a command line asks for."""

    def __init__(self, args: argparse.Namespace) -> None:
        import hf_ftpipe.partitioners  # noqa: F401  (registers the partitioners it imports)
        import hf_ftpipe.partitioners.auto  # noqa: F401
        from hf_ftpipe.costmodel import get_profile
        from hf_ftpipe.costmodel.estimate import MemoryOptions
        from hf_ftpipe.errors import PartitionError
        from hf_ftpipe.partitioners.registry import available_partitioners
        from hf_ftpipe.plan.request import PlanRequest

        self.args = args
        if getattr(args, "partitioner", "auto") not in available_partitioners():
            raise PartitionError(f"unknown partitioner {args.partitioner!r}; choose one of {available_partitioners()}")
        for name in ("gpus", "batch_size", "seq_len", "num_microbatches"):
            if getattr(args, name) < 1:
                raise PartitionError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        self.profile = get_profile(args.gpu_profile, count=args.gpus)
        self.plan_request = PlanRequest(
            profile=self.profile,
            num_microbatches=args.num_microbatches,
            microbatch_size=args.batch_size,
            schedule=args.schedule,
            optimizer=args.optimizer,
            dtype=args.dtype,
            memory=MemoryOptions(headroom=args.headroom, recompute=args.recompute),
        )
        self.options: dict[str, Any] = self.plan_request.options()

    def trace(self) -> Any:
        from hf_ftpipe.graph import trace_model
        from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for

        args = self.args
        started = time.perf_counter()
        model = load_model_for_planning(args.model, task=args.task)
        inputs = sample_inputs_for(
            model, args.batch_size, args.seq_len, args.target_len, attention_mask=args.attention_mask
        )
        graph = trace_model(model, inputs)
        print(
            f"traced {graph.model_class} ({graph.num_nodes} ops) in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
        return graph


# -- output ------------------------------------------------------------------------------------

_GiB = 2**30


def _gpu_rows(plan: Any) -> list[dict[str, Any]]:
    predicted = plan.predicted
    return [
        {
            "gpu": g,
            "stages": plan.stages_on(g),
            "compute_ms": gpu.compute_s * 1e3,
            "cost_ms": gpu.cost_s * 1e3,
            "memory_gib": gpu.memory_bytes / _GiB,
            "capacity_gib": gpu.capacity_bytes / _GiB,
            "memory_fraction": gpu.memory_bytes / gpu.capacity_bytes,
        }
        for g, gpu in enumerate(predicted.gpus)
    ]


def _header(args: argparse.Namespace, graph: Any, profile: Any) -> str:
    shape = f"{args.seq_len}" + (f"/{args.target_len}" if args.target_len else "")
    extras = ", recompute" if args.recompute else ""
    return (
        f"{args.model} ({graph.model_class}, {graph.num_nodes} ops) on {profile.count} × {profile.name} "
        f"({profile.memory_bytes / _GiB:.1f} GiB, {args.headroom:.0%} kept free); micro-batch {args.batch_size} "
        f"× {args.num_microbatches}, length {shape}, {args.schedule}, {args.optimizer}{extras}"
    )


def _partition_text(summary: dict[str, Any], report: list) -> str:
    from hf_ftpipe.cli.format import table as format_table

    lines = [
        f"{summary['model']} ({summary['model_class']}, {summary['num_ops']} ops) on {summary['num_gpus']} × "
        f"{summary['gpu_profile']}",
        f"partitioner: {summary['partitioner']}"
        + (f" (chosen by auto among {len(report)})" if summary["chosen_by_auto"] else ""),
        f"predicted: {summary['throughput_samples_per_s']:.2f} samples/s, worst GPU / ideal "
        f"{summary['worst_over_ideal']:.3f}, {summary['num_stages']} stages, peak memory "
        f"{summary['max_memory_fraction']:.0%} of capacity",
    ]
    table = [["GPU", "stages", "compute ms", "cost ms", "memory GiB", "of capacity"]]
    for row in summary["gpus"]:
        table.append(
            [
                str(row["gpu"]),
                ",".join(map(str, row["stages"])),
                f"{row['compute_ms']:.1f}",
                f"{row['cost_ms']:.1f}",
                f"{row['memory_gib']:.2f} / {row['capacity_gib']:.1f}",
                f"{row['memory_fraction']:.0%}",
            ]
        )
    lines.append(format_table(table))
    if summary["output"]:
        lines.append(f"wrote {summary['output']}")
    return "\n".join(lines)


def _compare_table(rows: list[dict[str, Any]]) -> str:
    from hf_ftpipe.cli.format import table

    cells = [
        ["partitioner", "fits", "samples/s", "worst/ideal", "peak GiB", "of capacity", "stages", "per GPU", "time s"]
    ]
    for row in rows:
        has_plan = row["step_time_s"] is not None
        name = row["partitioner"] + (" *" if row["best"] else "")
        if row["partitioner"] == "auto" and row.get("chosen"):
            name = f"auto ({row['chosen']})"
        cells.append(
            [
                name,
                "yes" if row["feasible"] else ("skipped" if row["skipped"] else "no"),
                f"{row['throughput_samples_per_s']:.2f}" if has_plan else "-",
                f"{row['worst_over_ideal']:.3f}" if has_plan else "-",
                f"{max(row['memory_gib_per_gpu']):.2f}" if has_plan else "-",
                f"{row['max_memory_fraction']:.0%}" if has_plan else "-",
                str(row["num_stages"]) if has_plan else "-",
                _stages_per_gpu(row["stages_per_gpu"]) if has_plan else "-",
                f"{row['time_s']:.2f}",
            ]
        )
    return table(cells)


def _stages_per_gpu(counts: list[int]) -> str:
    """``[1, 1, 1]`` → ``"1"``; ``[2, 1, 3]`` → ``"1-3"``."""
    low, high = min(counts, default=0), max(counts, default=0)
    return str(low) if low == high else f"{low}-{high}"


if __name__ == "__main__":
    sys.exit(main())
