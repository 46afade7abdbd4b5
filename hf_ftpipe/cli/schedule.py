"""``hf-ftpipe schedule``: print the actions each rank runs under a pipeline schedule, checked, no process started.

::

    hf-ftpipe schedule --placement 0,1,1,0 --schedule 1f1b --num-microbatches 4
    hf-ftpipe schedule --placement 0,1 --schedule 1f1b --num-microbatches 2 --token-slices 2 --messages
    hf-ftpipe schedule --placement 0,1,1,0 --schedule zbv --num-microbatches 4
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from hf_ftpipe.cli.options import add_command, add_schedule_options, add_token_slices_option

__all__ = ["add_schedule_command"]


def add_schedule_command(commands: Any) -> None:
    """Add ``schedule`` to the ``hf-ftpipe`` subparsers ``commands``."""
    schedule = add_command(
        commands, "schedule", _run_schedule, "print the actions each rank runs under a pipeline schedule"
    )
    schedule.add_argument(
        "--placement",
        required=True,
        help="the rank of each stage, stages feeding each other in order, e.g. 0,1,1,0 (rank 0 runs stages 0 and 3)",
    )
    add_schedule_options(schedule)
    schedule.add_argument("--steps", type=int, default=2, help="async/2bw: steps to print before the drain")
    schedule.add_argument("--async-update-interval", type=int, default=1, help="async: backwards per update")
    add_token_slices_option(
        schedule, " and pipeline the slices (TeraPipe); 1F0.2 is stage 1's forward of slice 2 of micro-batch 0"
    )
    schedule.add_argument(
        "--messages",
        action="store_true",
        help="print each rank's program with its SENDs and RECVs (RECV_F0:h0<0: the value h0 of micro-batch 0 from "
        "rank 0; SEND_B0:h0>0: its gradient to rank 0), stage s sending h<s> to stage s+1",
    )


def _run_schedule(args: argparse.Namespace) -> int:
    """Print, per rank, the actions of a pipeline schedule (1F0: stage 1 forward of micro-batch 0;
    0B3: backward, the input gradients only under zb-h1 and zbv; 0W3: the weight gradients of
    that backward (zb-h1, zbv); 0U3: stage 0 updates its weights), checked for order without
    starting any process."""
    from hf_ftpipe.errors import PipelineError
    from hf_ftpipe.schedules.lowering import Lowering, chain_dataflow, format_program
    from hf_ftpipe.schedules.orders import StreamingSchedule, check_order, format_actions, make_schedule

    try:
        stage_rank = [int(rank) for rank in args.placement.split(",")]
    except ValueError:
        raise PipelineError(
            f"--placement takes ranks separated by commas, e.g. 0,1,1,0; got {args.placement!r}"
        ) from None
    if sorted(set(stage_rank)) != list(range(max(stage_rank) + 1)):
        raise PipelineError(f"ranks must be 0..N-1, each holding a stage; got {stage_rank}")
    if args.token_slices is not None and args.token_slices < 1:
        raise PipelineError(f"--token-slices takes the slices per sequence, at least 1; got {args.token_slices}")
    try:
        schedule = make_schedule(
            args.schedule,
            stage_rank,
            args.num_microbatches,
            gradient_accumulation_steps=args.async_update_interval,
            num_slices=args.token_slices,
        )
    except ValueError as error:
        raise PipelineError(str(error)) from error
    if isinstance(schedule, StreamingSchedule):
        steps = [(f"step {t}", schedule.next_step()) for t in range(args.steps)] + [("drain", schedule.drain())]
        total = args.steps * args.num_microbatches
    else:
        steps, total = [("step", schedule.global_order())], args.num_microbatches
    check_order(
        [a for _, order in steps for a in order],
        stage_rank,
        schedule.edges,
        range(total),
        args.token_slices,
        split_backward=schedule.traits.split_backward,
    )
    if args.schedule == "zb-auto":  # stderr: stdout stays a schedule file's text
        print(
            "zb-auto without a plan's stage times is zb-h1's order; `hf-ftpipe simulate PLAN --write-zb-auto "
            "order.txt` builds the one for a plan",
            file=sys.stderr,
        )
    ranks = range(max(stage_rank) + 1)
    lowering = Lowering(chain_dataflow(stage_rank), stage_rank)
    for title, order in steps:
        print(f"{title}:")
        programs = lowering.lower(order) if args.messages else {}
        for rank in ranks:
            if args.messages:
                print(f"  rank {rank}: {format_program(programs.get(rank, []))}")
            else:
                print(f"  rank {rank}: {format_actions([a for a in order if stage_rank[a.stage_index] == rank])}")
    return 0
