"""Every check of the first GPU run in one command: correctness, memory, split graph vs eager, cost model.

On a machine with one NVIDIA GPU (the first run's figures, on an H200, are in benchmarks/README.md)::

    python benchmarks/gpu_checks.py --device cuda            # a table per check, about 11 min on an H200
    python benchmarks/gpu_checks.py --device cuda --json     # {"device": ..., "checks": [...]}
    python benchmarks/gpu_checks.py --device cpu --quick     # tiny models; the test suite runs this

With one GPU, NCCL cannot run two ranks on it, so the engine runs every stage on rank 0 (one
process; several stages, non-adjacent ones among them). The checks:

1. ``correctness`` (`_gpu_check_correctness`): every schedule (gpipe, 1f1b, async, 2bw), float32,
   bfloat16 autocast and float64, on a GPT-2 and a T5, against one process on the same device: loss
   of every step and every parameter after the last; float64 must match exactly, the others be no
   further from float64 than one process at their precision is.
2. ``memory`` (`_gpu_check_runtime`): `PeakMemory` against `estimate_memory` per schedule, with and
   without recomputation: measured / predicted per rank.
3. ``split_vs_eager`` (`_gpu_check_runtime`): steps/s of the engine (gpipe, one micro-batch)
   against the model's own modules trained eagerly.
4. ``cost_model`` (`_gpu_check_costs`): one layer of T5-3B (BoolQ's shapes) and of GPT2-XL (1024
   tokens), forward and backward, measured against the roofline prediction of the device's
   profile, per block and per op kind.

Sizes (`_gpu_check_models`): the default is ``gpu-checks.md``'s (GPT-2 24 layers d 1024, T5 of
t5-large's shapes); ``--quick`` uses tiny models, a subset of the runs (each schedule and dtype
at least once) and wide tolerances: it checks that the script works, not the figures. It installs
nothing and needs no ``datasets``. Exit status 1 when a check fails; a check that raises is
reported as failed with its error and the others still run, and a model whose capture raises
fails every check that needs it (``correctness``: a failed run naming the model and the error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _checks import failed, print_checks, verdict  # noqa: E402

CHECKS = ("correctness", "memory", "split_vs_eager", "cost_model")
LIMITS = {
    # (memory |measured / predicted - 1|, split graph ≥ this × eager steps/s, cost within ×/÷ this)
    "full": {"memory_tolerance": 0.10, "min_speed_ratio": 0.9, "cost_max_ratio": 3.0},
    # Tiny models: allocations and kernel launches of a few bytes and FLOPs dominate, so the figures
    # only show that each check measures something (tiny GPT-2 on 2 CPU cores: memory 0.3-0.8× the
    # prediction, the roofline 30× too fast).
    "quick": {"memory_tolerance": 0.8, "min_speed_ratio": 0.1, "cost_max_ratio": 1e6},
}


def run_checks(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    import torch
    from _gpu_check_correctness import check_correctness
    from _gpu_check_costs import capture_config, check_cost_model
    from _gpu_check_models import FULL, QUICK, capture_all, captured, single_process_group
    from _gpu_check_runtime import check_memory, check_split_vs_eager

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sizes = QUICK if args.quick else FULL
    cost_dtypes = ("float32", "bfloat16") if device.type == "cuda" else ("float32",)
    results = []
    with single_process_group(device, args.backend):
        captures: list[Any] = []

        def models() -> list[Any]:  # captured once, on first use: the export is the slow part
            # A model whose capture raised stays in the list as a CaptureFailure, so that every check
            # needing it reports the error rather than running on the models captured before it.
            if not captures:
                captures.extend(capture_all(sizes, log))
            return captures

        def cost_models() -> Iterator[tuple[str, Any]]:  # captured one at a time, as the check goes
            if sizes.cost_shapes:
                yield from ((name, capture_config(name, sizes)) for name in sizes.cost_shapes)
            else:
                yield from ((c.size.name, c.traced) for c in map(captured, models()))

        runners = {
            "correctness": lambda: check_correctness(models(), sizes, device, log),
            "memory": lambda: check_memory(captured(models()[0]), sizes, device, args.memory_tolerance, log),
            "split_vs_eager": lambda: check_split_vs_eager(
                captured(models()[0]), sizes, device, args.min_speed_ratio, log
            ),
            "cost_model": lambda: check_cost_model(cost_models(), sizes, device, cost_dtypes, args.cost_max_ratio, log),
        }
        for name in args.checks:
            started = time.perf_counter()
            try:
                result = runners[name]()
            except Exception as error:  # report it and go on: one GPU run should bring back every figure it can
                result = {"check": name, "ok": False, "error": f"{type(error).__name__}: {error}"}
                log(traceback.format_exc())
            result["wall_s"] = round(time.perf_counter() - started, 1)
            results.append(result)
    return results


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def summary(result: dict[str, Any]) -> str:
    """The figures of one check on a line, for its PASS/FAIL verdict."""
    if "error" in result:
        return result["error"]
    name = result["check"]
    errors = [run for run in result.get("runs", ()) if "error" in run]
    failed_runs = f", {len(errors)} raised" if errors else ""
    if name == "correctness":
        diffs = (
            "no run compared"
            if result["max_loss_diff"] is None
            else (f"max loss diff {result['max_loss_diff']:.2e}, max param diff {result['max_param_diff']:.2e}")
        )
        return f"{len(result['runs'])} runs{failed_runs}, {diffs}"
    if name == "memory":
        ratios = [r for run in result["runs"] for r in run.get("ratio", ())] or [float("nan")]
        within = f"tolerance ±{result['tolerance']}"
        return f"measured / predicted {min(ratios):.3f}-{max(ratios):.3f} ({within}){failed_runs}"
    if name == "split_vs_eager":
        return (
            f"engine {result['engine_steps_per_s']} steps/s, eager {result['eager_steps_per_s']}: "
            f"{result['ratio']}× (≥ {result['min_ratio']})"
        )
    ratios = [b[k] for b in result["blocks"] for k in ("forward_ratio", "backward_ratio")]
    within = f"within ×/÷ {result['max_ratio']}"
    return f"measured / roofline ({result['profile']}) {min(ratios):.2f}-{max(ratios):.2f} ({within})"


def print_tables(results: list[dict[str, Any]]) -> None:
    """Each check's rows as a Markdown table."""
    for result in results:
        if "error" not in result:
            header, rows = _rows(result)
            _table(header, rows)


def _rows(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    name = result["check"]
    if name == "correctness":
        header = [
            "model",
            "schedule",
            "dtype",
            "max loss diff",
            "max param diff",
            "vs float64: engine loss / one process",
            "engine param / one process",
            "ok",
        ]
        return header, [[r["model"], r["schedule"], r["dtype"], *_diffs(r), r["ok"]] for r in result["runs"]]
    if name == "memory":
        header = ["schedule", "recompute", "measured MB", "predicted MB", "measured / predicted", "ok"]
        return header, [
            [
                r["schedule"],
                r["recompute"],
                r.get("measured_mb", r.get("error")),
                r.get("predicted_mb"),
                r.get("ratio"),
                r["ok"],
            ]
            for r in result["runs"]
        ]
    if name == "split_vs_eager":
        header = ["model", "engine steps/s", "eager steps/s", "engine / eager", "ok"]
        r = result
        return header, [[r["model"], r["engine_steps_per_s"], r["eager_steps_per_s"], r["ratio"], r["ok"]]]
    header = [
        "block",
        "dtype",
        "forward ms (measured / roofline)",
        "backward ms",
        f"measured / roofline ({result['profile']}) fwd, bwd",
        "per op kind: fwd, bwd",
        "ok",
    ]
    rows = []
    for b in result["blocks"]:
        kinds = "; ".join(
            f"{kind} {v['forward_ratio']}, {v['backward_ratio']}"
            for kind, v in b["kinds"].items()
            if v["forward_ratio"]
        )
        rows.append(
            [
                f"{b['model']} {b['block']}",
                b["dtype"],
                f"{b['forward_ms']} / {b['forward_roofline_ms']}",
                f"{b['backward_ms']} / {b['backward_roofline_ms']}",
                f"{b['forward_ratio']}, {b['backward_ratio']}",
                kinds,
                b["ok"],
            ]
        )
    return header, rows


def _diffs(run: dict[str, Any]) -> list[str]:
    """Against one process at the run's precision; then against one process in float64, the
    engine's difference beside one process's own (module docstring of ``_gpu_check_correctness``)."""
    if "error" in run:
        return [run["error"], "", "", ""]
    return [
        f"{run['max_loss_diff']:.2e}",
        f"{run['max_param_diff']:.2e}",
        f"{run['float64_loss_diff']:.2e} / {run['own_loss_diff']:.2e}",
        f"{run['float64_param_diff']:.2e} / {run['own_param_diff']:.2e}",
    ]


def _table(header: list[str], rows: list[list[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="for CUDA tensors (default nccl)")
    parser.add_argument("--quick", action="store_true", help="tiny models, a subset of the runs, wide tolerances")
    parser.add_argument(
        "--checks",
        nargs="+",
        choices=CHECKS,
        default=list(CHECKS),
        metavar="CHECK",
        help=f"subset of {', '.join(CHECKS)}",
    )
    parser.add_argument("--memory-tolerance", type=float, help="largest |measured / predicted - 1| (default 0.10)")
    parser.add_argument("--min-speed-ratio", type=float, help="engine steps/s at least this × eager's (default 0.9)")
    parser.add_argument("--cost-max-ratio", type=float, help="measured within ×/÷ this of the roofline (default 3)")
    parser.add_argument("--json", action="store_true", help='print {"device": ..., "checks": [...]}')
    args = parser.parse_args()
    for name, value in LIMITS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible; use --device cpu (with --quick for tiny models)")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the CPU memory profiler announces itself on every start
    started = time.perf_counter()
    results = run_checks(args, lambda line: print(line, file=sys.stderr))
    verdicts = [(r["check"], verdict(r["ok"], f"{summary(r)}; {r['wall_s']:.0f} s")) for r in results]
    if args.json:
        device = device_name(args.device)
        print(
            json.dumps({"device": device, "torch": torch.__version__, "quick": args.quick, "checks": results}, indent=1)
        )
    else:
        print(f"device: {device_name(args.device)}, torch {torch.__version__}{', quick' if args.quick else ''}\n")
        print_tables(results)
        print_checks(verdicts, started)
    return 1 if failed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
