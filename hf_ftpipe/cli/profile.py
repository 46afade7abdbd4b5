"""``hf-ftpipe profile``: time a model's blocks on this machine and write the measured cost table.

::

    hf-ftpipe profile gpt2-xl --seq-len 1024 --batch-size 1 [--dtype bfloat16] [--out measured.json]
    hf-ftpipe partition gpt2-xl --gpus 8 --gpu-profile a100-80gb --batch-size 1 --seq-len 1024 --costs measured.json

The model is built from its config (random weights: only the timed blocks get real tensors, on the
device), traced at one micro-batch, and each block type is timed once (`runtime.block_timing`). The
table is written to ``--out`` and to the cache (``$HF_HOME/hf_ftpipe/costs/``), where
``PipeTrainingArguments(cost_table="measured")`` finds it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from hf_ftpipe.cli.options import add_command, add_json_option, add_model_argument
from hf_ftpipe.cli.trace_arguments import add_trace_arguments, model_and_inputs

__all__ = ["add_profile_command"]


def add_profile_command(commands: Any) -> None:
    """Add ``profile`` to the ``hf-ftpipe`` subparsers ``commands``."""
    profile = add_command(
        commands, "profile", _run_profile, "time the model's blocks on this device and write a measured cost table"
    )
    add_model_argument(profile)
    profile.add_argument("--seq-len", type=int, required=True, help="input length in tokens")
    profile.add_argument("--batch-size", "--microbatch-size", type=int, required=True, help="samples per micro-batch")
    add_trace_arguments(profile)
    profile.add_argument("--dtype", help="compute dtype, e.g. bfloat16 (autocast; default: the weights')")
    profile.add_argument("--device", help="torch device to time on (default: cuda when available, else cpu)")
    profile.add_argument(
        "--threads",
        type=int,
        help="CPU: torch threads to time with, as many as each rank of the run will have (default: torch's)",
    )
    profile.add_argument("--repeats", type=int, default=3, help="timed runs per block, median kept (default: 3)")
    profile.add_argument("--warmup", type=int, default=1, help="untimed runs per block first (default: 1)")
    profile.add_argument("--out", help="also write the table to this file (it is always cached under HF_HOME)")
    add_json_option(profile)


def _run_profile(args: argparse.Namespace) -> int:
    """Time one block of each kind (a layer, the ops between layers) of the model on this device,
    forward and backward at one micro-batch, and write the cost table that `partition --costs`
    and `show --costs` price plans with instead of the roofline."""
    import torch

    from hf_ftpipe.costmodel import CostTable, detect_profile
    from hf_ftpipe.costmodel.measured import cache_path
    from hf_ftpipe.errors import ProfileError
    from hf_ftpipe.graph.trace import capture_model
    from hf_ftpipe.plan.partition import collect_versions
    from hf_ftpipe.runtime.block_timing import dtype_name, time_blocks

    for name in ("seq_len", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise ProfileError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads is not None:
        if args.threads < 1:
            raise ProfileError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)  # a CPU block's time depends on it (and on what else runs)
    dtype = dtype_name(args.dtype) if args.dtype else None  # a wrong name fails before the trace
    device = torch.device(args.device) if args.device else None
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(f"--device {args.device}: no CUDA device is visible here; drop --device to time on the CPU")
    started = time.perf_counter()
    model, inputs = model_and_inputs(args)
    traced = capture_model(model, inputs)
    print(f"traced {traced.cost_graph.model_class} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    # as hf_ftpipe.profile_model does (cli and trainer sit side by side: neither imports the other)
    timings = time_blocks(traced, dtype=dtype, device=device, warmup=args.warmup, repeats=args.repeats)
    table = CostTable.from_timings(traced.cost_graph, timings, detect_profile(1), info=collect_versions())
    cached = cache_path(table.key)
    table.save(cached)
    if args.out:
        table.save(args.out)
    rows = _rows(table)
    if args.json:
        print(json.dumps({"key": table.to_dict()["key"], "blocks": rows, "cached": str(cached), "out": args.out}))
    else:
        from hf_ftpipe.cli.format import table as text_table

        header = ["block", "blocks like it", "forward ms", "backward ms"]
        cells = [[r["block"], str(r["count"]), f"{r['forward_ms']:.3f}", f"{r['backward_ms']:.3f}"] for r in rows]
        key = table.key
        print(f"{key.model_class} on {key.device} in {key.dtype}, micro-batch {key.input_shapes}")
        print(text_table([header, *cells]))
        print(f"{len(table.blocks)} blocks, {table.num_timed} timed in {time.perf_counter() - started:.1f} s")
        print(f"cached: {cached}" + (f"\nwrote {args.out}" if args.out else ""))
    return 0


def _rows(table: Any) -> list[dict[str, Any]]:
    """One row per timed block, with how many blocks reuse its time."""
    count = {b.name: 1 for b in table.blocks if not b.timed_as}
    for b in table.blocks:
        if b.timed_as:
            count[b.timed_as] += 1
    return [
        {"block": b.name, "count": count[b.name], "forward_ms": b.forward_s * 1e3, "backward_ms": b.backward_s * 1e3}
        for b in table.blocks
        if not b.timed_as
    ]
