"""``hf-ftpipe partition`` and ``compare``: trace a model on the meta device and plan it for the GPUs named.

::

    hf-ftpipe partition t5-3b --gpus 8 --gpu-profile rtx2080ti --batch-size 4 --seq-len 512 \\
        --target-len 4 --schedule async --num-microbatches 8 -o t5-3b-8x2080ti.json
    hf-ftpipe compare t5-3b --gpus 8 --gpu-profile rtx2080ti --batch-size 4 --seq-len 512 \\
        --target-len 4 --schedule async [--json]

``--batch-size`` is the micro-batch, the batch of one trace. `_Request` turns the shared flags
into a profile, a traced graph and the options every partitioner takes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, get_args

from hf_ftpipe.cli.layouts import add_layout_arguments, run_layouts, topology_of
from hf_ftpipe.cli.options import (
    add_command,
    add_dtype_option,
    add_json_option,
    add_model_argument,
    add_schedule_options,
)
from hf_ftpipe.cli.trace_arguments import add_trace_arguments, model_and_inputs

__all__ = ["add_partition_commands"]


def add_partition_commands(commands: Any) -> None:
    """Add ``partition`` and ``compare`` to the ``hf-ftpipe`` subparsers ``commands``."""
    from hf_ftpipe.costmodel.estimate import Optimizer
    from hf_ftpipe.plan.request import Placement

    partition = add_command(commands, "partition", _run_partition, "make a partition and print its summary")
    compare = add_command(commands, "compare", _run_compare, "run every partitioner and print them side by side")
    for command in (partition, compare):
        add_model_argument(command)
        command.add_argument(
            "--gpus",
            type=int,
            required=command is partition,
            help="number of GPUs (pipeline ranks); compare: or --nodes/--topology",
        )
        command.add_argument(
            "--gpu-profile",
            required=command is partition,
            help="built-in GPU profile (e.g. rtx2080ti, a100-80gb) or a JSON file; compare --topology: the topology's",
        )
        command.add_argument("--batch-size", type=int, required=True, help="samples per micro-batch")
        command.add_argument("--seq-len", type=int, required=True, help="input length in tokens")
        add_trace_arguments(command)
        add_schedule_options(command)
        command.add_argument(
            "--placement",
            choices=get_args(Placement),
            default="chain",
            help="contiguous partitioners: 'chain', stage s on GPU s (default), or 'v', 2 stages per GPU, stage s on "
            "GPU min(s, 2P-1-s), the placement of --schedule zbv",
        )
        command.add_argument("--optimizer", choices=get_args(Optimizer), default="adamw", help="default: adamw")
        add_dtype_option(command)
        command.add_argument("--recompute", action="store_true", help="plan with activation recomputation")
        command.add_argument(
            "--lora-r",
            type=int,
            metavar="R",
            help="plan LoRA fine-tuning: adapters of rank R (peft), the base weights frozen (no gradients, "
            "no optimizer state); needs hf_ftpipe[peft]",
        )
        command.add_argument(
            "--lora-targets",
            nargs="+",
            metavar="MODULE",
            help="with --lora-r: the modules to adapt (default: peft's for the model type, e.g. T5 q v)",
        )
        command.add_argument(
            "--headroom", type=float, default=0.1, help="fraction of GPU memory kept free (default: 0.1)"
        )
        command.add_argument(
            "--time-budget-s", type=float, default=60.0, help="auto/compare: start no partitioner after this"
        )
        command.add_argument(
            "--costs",
            metavar="TABLE",
            help="price ops with this measured cost table (hf-ftpipe profile) instead of the roofline; "
            "its dtype is the default --dtype",
        )
        add_json_option(command)
    partition.add_argument("--partitioner", default="auto", help="a registered partitioner (default: auto)")
    partition.add_argument("-o", "--output", help="write the plan to this JSON file")
    partition.add_argument(
        "--rank-by",
        choices=["predicted", "simulated"],
        default="predicted",
        help="auto: keep the plan with the shortest predicted step (default) or simulated step (hf-ftpipe simulate)",
    )
    add_layout_arguments(compare)


def _run_partition(args: argparse.Namespace) -> int:
    """Make a partition plan."""
    from hf_ftpipe.cli.format import format_partition, gpu_rows
    from hf_ftpipe.cli.simulate import simulated_figures
    from hf_ftpipe.costmodel.estimate import usable_capacity
    from hf_ftpipe.errors import PartitionError
    from hf_ftpipe.partitioners.auto import partition_auto, result_of
    from hf_ftpipe.partitioners.registry import get_partitioner
    from hf_ftpipe.plan.validate import validate_partition

    request = _Request(args)
    get_partitioner(args.partitioner)  # an unknown name fails before the trace
    if args.rank_by != "predicted" and args.partitioner != "auto":
        raise PartitionError(f"--rank-by chooses among auto's candidates; {args.partitioner!r} makes one plan")
    graph = request.trace()
    started = time.perf_counter()
    report: list = []
    if args.partitioner == "auto":
        plan = partition_auto(
            graph,
            request.profile,
            **request.options,
            time_budget_s=args.time_budget_s,
            report=report,
            rank_by=args.rank_by,
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
        "gpus": gpu_rows(plan),
        "costs": args.costs,
        "output": args.output,
        "rank_by": args.rank_by,
        **simulated_figures(plan, request.profile),
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_partition(summary, report))
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    """Run every registered partitioner on the model and print their predictions side by side."""
    from hf_ftpipe.cli.format import format_compare, setup_line
    from hf_ftpipe.partitioners.auto import (
        PartitionerResult,
        best_result,
        compare_partitioners,
        no_plan_fits,
        reason_line,
        simulate_results,
    )

    topology = topology_of(args)
    if topology is not None:  # --gpus counts the GPUs of the machines, of the topology's kind
        args.gpus = topology.world_size
        args.gpu_profile = args.gpu_profile or topology.profile_of(0)
    request = _Request(args)
    graph = request.trace()
    if topology is not None:
        return run_layouts(args, topology, graph, request.options)
    started = time.perf_counter()
    report = compare_partitioners(
        graph, request.profile, **request.options, time_budget_s=args.time_budget_s, unlimited_figures=True
    )
    simulate_results(report, request.profile)  # beside each prediction, its simulated step
    best = best_result(report)
    if best is not None:  # auto is the best of the others, timed as running them all
        auto = PartitionerResult(**{**best.__dict__, "partitioner": "auto", "time_s": time.perf_counter() - started})
        why = None
    else:
        why = no_plan_fits(graph, request.profile, report, **request.options).message("cli")
        auto = PartitionerResult(partitioner="auto", feasible=False, time_s=time.perf_counter() - started, error=why)
    per_step = args.num_microbatches  # the prediction is per micro-batch; the simulated step per mini-batch
    rows = [
        {**r.to_dict(), "best": r is best, "analytical_step_s": r.step_time_s and r.step_time_s * per_step}
        for r in report
    ]
    analytical = auto.step_time_s and auto.step_time_s * per_step
    rows.append(
        {**auto.to_dict(), "best": False, "chosen": best.partitioner if best else None, "analytical_step_s": analytical}
    )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(setup_line(args, graph, request.profile))
        print(format_compare(rows))
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
        if args.lora_targets and args.lora_r is None:
            raise PartitionError("--lora-targets needs --lora-r (the adapters' rank)")
        if args.gpus is None or args.gpu_profile is None:
            raise PartitionError("give --gpus and --gpu-profile, or --nodes with --gpus-per-node, or --topology")
        for name in ("gpus", "batch_size", "seq_len", "num_microbatches"):
            if getattr(args, name) < 1:
                raise PartitionError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        self.profile = get_profile(args.gpu_profile, count=args.gpus)
        cost_table = None
        if args.costs:
            from hf_ftpipe.costmodel.measured import CostTable

            cost_table = CostTable.load(args.costs)  # checked against the graph once it is traced
        self.plan_request = PlanRequest(
            profile=self.profile,
            num_microbatches=args.num_microbatches,
            microbatch_size=args.batch_size,
            schedule=args.schedule,
            optimizer=args.optimizer,
            dtype=args.dtype or (cost_table.key.dtype if cost_table else None),
            memory=MemoryOptions(headroom=args.headroom, recompute=args.recompute),
            cost_table=cost_table,
            placement=args.placement,
        )
        self.options: dict[str, Any] = self.plan_request.options()

    def trace(self) -> Any:
        from hf_ftpipe.graph import trace_model

        args = self.args
        started = time.perf_counter()
        model, inputs = model_and_inputs(args)
        if args.lora_r is not None:  # after the inputs, which follow the model's own class
            from hf_ftpipe.graph.peft_models import apply_lora

            model = apply_lora(model, args.lora_r, args.lora_targets)
        graph = trace_model(model, inputs)
        print(
            f"traced {graph.model_class} ({graph.num_nodes} ops) in {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
        return graph
