"""``hf-ftpipe slices``: TeraPipe's token slicing of a causal LM, predicted against no slicing.

::

    hf-ftpipe slices gpt2-xl --seq-len 1024 --gpus 8 [--gpu-profile a100-80gb [--latency FILE] | --measure] \\
        [--batch-size 1] [--step 8] [--save-latency FILE] [--json]

The model is traced on the meta device at one sequence; the latency of a slice on one of ``--gpus``
equal stages comes from the cost model (or from ``--latency``, a file fitted earlier for the same
model, length, stage count and device; or ``--measure``, timings of the model's stages on this
machine), and TeraPipe's dynamic program picks the slice lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

from hf_ftpipe.cli.options import add_command, add_dtype_option, add_json_option, add_model_argument

__all__ = ["add_slices_command"]


def add_slices_command(commands: Any) -> None:
    """Add ``slices`` to the ``hf-ftpipe`` subparsers ``commands``."""
    slices = add_command(
        commands, "slices", _run_slices, "choose TeraPipe token slices for a causal LM and predict the step time"
    )
    add_model_argument(slices, "a causal LM")
    slices.add_argument("--seq-len", type=int, required=True, help="sequence length in tokens")
    slices.add_argument("--gpus", type=int, required=True, help="pipeline stages, one per GPU")
    slices.add_argument("--gpu-profile", help="built-in GPU profile or a JSON file (default: the local device)")
    slices.add_argument("--batch-size", type=int, default=1, help="sequences per step (default: 1)")
    slices.add_argument("--step", type=int, default=8, help="slice lengths are multiples of this (default: 8)")
    add_dtype_option(slices)
    slices.add_argument("--latency", help="read the latency model from this file instead of the cost model")
    slices.add_argument(
        "--measure",
        action="store_true",
        help="time the model's --gpus equal stages on this machine (random weights from the config) on a grid of "
        "slice and context lengths and fit the latency to the timings, as TeraPipe does (default: the cost model)",
    )
    slices.add_argument("--save-latency", help="write the latency model used to this file")
    slices.add_argument(
        "--tolerance", type=float, default=1e-3, help="relative slack of the DP's bounds; 0 is exact (default: 1e-3)"
    )
    add_json_option(slices, "print one JSON object instead of a table")


def _run_slices(args: argparse.Namespace) -> int:
    """Cut each sequence of a causal LM into token slices that flow through the pipeline (TeraPipe's
    dynamic program) and print the predicted step time against no slicing and uniform slicing."""
    from hf_ftpipe.costmodel import detect_profile, get_profile
    from hf_ftpipe.costmodel.latency import LatencyKey, SliceLatency
    from hf_ftpipe.costmodel.roofline_latency import cost_model_slice_time, weights_dtype
    from hf_ftpipe.errors import PartitionError
    from hf_ftpipe.partitioners.slicing import plan_slicing, step_time_s, uniform_slices

    for name in ("gpus", "seq_len", "batch_size", "step"):
        if getattr(args, name) < 1:
            raise PartitionError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.seq_len % args.step:
        raise PartitionError(f"--seq-len {args.seq_len} is not a multiple of --step {args.step}; change either")
    if args.measure and (args.latency or args.gpu_profile):
        raise PartitionError("--measure times this machine: drop --latency and --gpu-profile, or --measure")
    profile = get_profile(args.gpu_profile, count=args.gpus) if args.gpu_profile else detect_profile(args.gpus)
    graph, hidden_size = _trace_causal(args)
    dtype = args.dtype or weights_dtype(graph)
    key = LatencyKey(
        model_fingerprint=graph.fingerprint,
        model_class=graph.model_class,
        seq_len=args.seq_len,
        num_stages=args.gpus,
        device=profile.name,
        dtype=dtype,
    )
    if args.measure:
        latency = fitted = _measured_latency(args, key, profile)
        source = f"timings on this machine ({profile.name}; the five-term fit is within {fitted.fit_error:.0%})"
    elif args.latency:
        latency = fitted = SliceLatency.load(args.latency, expected_key=key)
        source = f"{args.latency} ({fitted.source})"
    else:
        # The DP reads the cost model itself; the fitted form is what a file keeps.
        latency = cost_model_slice_time(graph, profile, num_stages=args.gpus, hidden_size=hidden_size, dtype=dtype)
        fitted = SliceLatency.fit(latency.samples(), latency.key, source="cost-model")
        source = f"the cost model (its five-term fit, what --save-latency writes, is within {fitted.fit_error:.0%})"
    if args.save_latency:
        fitted.save(args.save_latency)
    started = time.perf_counter()
    chosen = plan_slicing(
        latency, args.seq_len, args.gpus, batch_size=args.batch_size, step=args.step, tolerance=args.tolerance
    )
    dp_time_s = time.perf_counter() - started
    batch, units = args.batch_size, args.seq_len // args.step
    unsliced = step_time_s(latency, [(batch, [args.seq_len])], args.gpus)
    rows = [_row("unsliced", [(batch, (args.seq_len,))], unsliced, unsliced)]
    if batch > 1:
        gpipe = [(1, (args.seq_len,))] * batch
        rows.append(_row(f"{batch} micro-batches of 1", gpipe, step_time_s(latency, gpipe, args.gpus), unsliced))
    count = 2
    while count <= units:
        even = [(batch, tuple(uniform_slices(args.seq_len, count, args.step)))]
        rows.append(_row(f"uniform {count}", even, step_time_s(latency, even, args.gpus), unsliced))
        count *= 2
    rows.append(_row("TeraPipe DP", chosen.microbatches, chosen.step_time_s, unsliced))
    summary = {
        "model": args.model,
        "model_class": graph.model_class,
        "seq_len": args.seq_len,
        "num_stages": args.gpus,
        "gpu_profile": profile.name,
        "batch_size": batch,
        "step": args.step,
        "latency_source": source,
        "latency_fit": {k: v for k, v in fitted.to_dict().items() if k not in ("format", "format_version", "key")},
        "chosen": rows[-1],
        "rows": rows,
        "dp_time_s": dp_time_s,
    }
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(_format(summary))
    return 0


def _row(name: str, microbatches: Any, time_s: float, unsliced_s: float) -> dict[str, Any]:
    return {
        "slicing": name,
        "microbatches": [[size, list(slices)] for size, slices in microbatches],
        "step_time_s": time_s,
        "speedup": unsliced_s / time_s if time_s > 0 else None,
    }


def _format(summary: dict[str, Any]) -> str:
    from hf_ftpipe.cli.format import table

    header = ["slicing", "slices", "step time (ms)", "vs unsliced"]
    cells = [header] + [
        [
            row["slicing"],
            str(sum(len(slices) for _, slices in row["microbatches"])),
            f"{row['step_time_s'] * 1e3:.3f}",
            f"{row['speedup']:.2f}×" if row["speedup"] else "-",
        ]
        for row in summary["rows"]
    ]
    chosen = summary["chosen"]["microbatches"]
    lines = [
        f"{summary['model']} ({summary['model_class']}): {summary['seq_len']} tokens × {summary['batch_size']} "
        f"on {summary['num_stages']} stages of {summary['gpu_profile']}; latency from {summary['latency_source']}",
        table(cells),
        "chosen slicing"
        + "".join(f"\n  {size} sequence{'s' * (size > 1)}: {', '.join(map(str, slices))}" for size, slices in chosen),
    ]
    return "\n".join(lines)


def _measured_latency(args: argparse.Namespace, key: Any, profile: Any) -> Any:
    """`SliceLatency` fitted to this machine's timings of the model's ``--gpus`` equal stages, the
    slowest per point, on a grid: slice lengths ``--step`` × 1, 2, 4, ... up to half the sequence,
    after contexts of 0, 1/4, 1/2 and 3/4 of it.

    The model stays on the meta device: it is captured there once, with a symbolic length that
    serves every slice (as training runs them), and only the blocks `time_stages` times (one per
    repeated layer type, and the ops before and after the layers) get weights, random ones, on the
    device. GPT2-XL at 1024 tokens on 8 stages is 3 blocks, 113 million of its 1.56 billion parameters.
    """
    import torch

    from hf_ftpipe.costmodel.latency import LatencySample, SliceLatency
    from hf_ftpipe.graph.sources import load_model_for_planning
    from hf_ftpipe.graph.token_slices import capture_token_slices
    from hf_ftpipe.partitioners.registry import run_partitioner
    from hf_ftpipe.plan.blocks import layer_stages
    from hf_ftpipe.plan.request import PlanRequest
    from hf_ftpipe.runtime.block_timing import default_device
    from hf_ftpipe.runtime.slice_timing import time_stages

    started = time.perf_counter()
    device = default_device()
    model = load_model_for_planning(args.model).train()  # meta: no weights
    lengths = []
    length = args.step
    while length <= args.seq_len // 2:
        lengths.append(length)
        length *= 2
    remainder = args.seq_len - sum(lengths)  # a sliced capture's lengths add up to the sequence
    slice_lengths = [*lengths, remainder] if remainder else lengths
    ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq_len))
    sample = {"input_ids": ids, "labels": ids.clone()}
    meta_sample = {name: value.to("meta") for name, value in sample.items()}
    print(
        f"capturing {type(model).__name__} on the meta device for slices of "
        f"{', '.join(map(str, sorted(set(slice_lengths))))} tokens",
        file=sys.stderr,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # dropout: timing is not training
        # one graph of a symbolic length runs every slice, as in training (else one per length)
        sliced = capture_token_slices(model, meta_sample, slice_lengths)
    graphs = "one graph for every length" if sliced.dynamic else f"{len(sliced.by_length)} fixed-shape graphs"
    print(f"captured in {time.perf_counter() - started:.1f} s ({graphs})", file=sys.stderr)
    # Equal layers per stage (TeraPipe's equal stages): the middle stages then do the same work and are timed once.
    node_stage = layer_stages(sliced.full.cost_graph, args.gpus)
    if node_stage is None:  # fewer layers than stages
        request = PlanRequest(
            profile=profile, num_stages=args.gpus, num_microbatches=1, microbatch_size=args.batch_size
        )
        node_stage = run_partitioner("uniform", sliced.full.cost_graph, request).node_stage
    contexts = [args.seq_len * q // 4 for q in range(4)]
    grid = [(s, c) for s in lengths for c in contexts if c + s <= args.seq_len]
    samples = time_stages(sliced, node_stage, sample, grid, device, dtype=key.dtype)
    fitted = SliceLatency.fit([LatencySample(*sample) for sample in samples], key, source="measured")
    print(f"timed {len(grid)} slices on {args.gpus} stages in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return fitted


def _trace_causal(args: argparse.Namespace) -> tuple[Any, int]:
    """The traced graph of one sequence and the hidden size; refuses models slicing cannot run."""
    from hf_ftpipe.graph import trace_model
    from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for
    from hf_ftpipe.graph.token_slices import check_sliceable

    started = time.perf_counter()
    model = load_model_for_planning(args.model)
    with warnings.catch_warnings():  # dropout matters to a training run's exactness, not to its plan
        warnings.simplefilter("ignore", UserWarning)
        check_sliceable(model, args.seq_len, what=args.model)
    graph = trace_model(model, sample_inputs_for(model, 1, args.seq_len))
    print(
        f"traced {graph.model_class} ({graph.num_nodes} ops) in {time.perf_counter() - started:.1f} s", file=sys.stderr
    )
    return graph, int(model.config.hidden_size)
