"""Token slicing (TeraPipe) on 2 CPU ranks: unsliced GPipe, uniform slices, and the DP's slices.

One GPT-2 (4 layers, d_model 256, 4 heads, vocabulary 2048, untied embeddings, no dropout, sdpa
attention), batch 1, sequence 2048, split in 2 stages (blocks evenly; embeddings on the first,
ln_f + lm_head + loss on the last), one per rank, gloo. With one sequence GPipe cannot
micro-batch, so unsliced the two stages take turns: the bubble is half the step. Slicing the
tokens fills it (TeraPipe, Li et al., ICML 2021).

Runners: ``unsliced`` (the whole sequence, `TracedModel`), ``uniform-<n>`` (n equal slices) and
``dp`` (``plan_slicing`` on a latency fitted to this machine's timings of both stages on a grid of
slice and context lengths, `hf_ftpipe.runtime.slice_timing`). Each runs in fresh rank processes
with the GPipe schedule and SGD.

    python benchmarks/terapipe.py                         # table and checks
    python benchmarks/terapipe.py --json                  # one JSON object per runner
    python benchmarks/terapipe.py --runners unsliced uniform-8 --steps 3 --rounds 1

Reported: samples/s (1 / median step time of the slowest rank), the ratio to ``unsliced``, peak
tensor memory per rank (`PeakMemory`, construction and warm-up included) and the prediction of
``hf_ftpipe.costmodel.estimate_memory`` with `TokenSlices`. Targets: uniform slicing ≥ 1.5×
unsliced; dp ≥ the best uniform; peak memory within 10% of the prediction on every rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _gpt2_split import Setup, split_graph  # noqa: E402
from _rank_processes import run_ranks  # noqa: E402
from _terapipe_ranks import capture, run_job  # noqa: E402

MB = 2**20
MIN_SPEEDUP = 1.5
MAX_MEMORY_ERROR = 0.10


def make_setup(args: argparse.Namespace) -> Setup:
    return Setup(
        num_ranks=2,
        num_microbatches=1,
        microbatch_size=1,
        steps=args.steps,
        warmup=args.warmup,
        device="cpu",
        threads_per_rank=1,
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=4,
        seq_len=args.seq_len,
        vocab_size=args.vocab,
    )


# -- latency, slicing, prediction ----------------------------------------------------------


def measure_latency(setup: Setup, repeats: int, timeout_s: float) -> Any:
    """`SliceLatency` fitted to both stages' forward + backward on this machine, the slower per point:
    the DP takes equal stages, and the slower one (the last, with lm_head and the loss) sets the pace."""
    from hf_ftpipe.costmodel.latency import LatencyKey, LatencySample, SliceLatency

    per_stage = run_ranks(setup, run_job, ("latency", repeats), timeout_s)
    samples = [
        LatencySample(points[0][0], points[0][1], points[0][2], max(p[3] for p in points))
        for points in zip(*(r["samples"] for r in per_stage))
    ]
    _, traced = capture(setup, None)
    key = LatencyKey(
        model_fingerprint=traced.cost_graph.fingerprint,
        model_class="GPT2LMHeadModel",
        seq_len=setup.seq_len,
        num_stages=setup.num_ranks,
        device="cpu",
        dtype="float32",
    )
    return SliceLatency.fit(samples, key, source="measured"), samples


CALIBRATION_SLICES = (4, 16)
"""Uniform slicings run to measure the engine's cost per slice that a stage timed alone misses."""


def with_engine_cost(latency: Any, setup: Setup, step: int, timeout_s: float) -> tuple[Any, float]:
    """``latency`` with the engine's own cost per slice added to its fixed term, and that cost in ms.

    A stage timed alone (`time_slice`) leaves out what the pipeline adds per slice: its messages
    (hidden states forward, their gradients back), the executor's bookkeeping, and the gradient
    accumulation into the weights that every slice's backward does. With K stages each slice's
    cost counts k + K − 1 times in a step of k slices (TeraPipe's Σ t_i + (K − 1)·max t), so two
    short sliced runs at different k give it: the growth of (measured − modelled) over the growth
    of k + K − 1.
    """
    from dataclasses import replace

    from hf_ftpipe.partitioners.slicing import step_time_s, uniform_slices

    excess, counts = [], []
    for count in CALIBRATION_SLICES:
        slices = uniform_slices(setup.seq_len, count, step=step)
        ranks = run_ranks(replace(setup, steps=3, warmup=1), run_job, ("train", list(slices)), timeout_s)
        measured = max(r["step_time_s"] for r in ranks)
        excess.append(measured - step_time_s(latency, [(1, slices)], setup.num_ranks))
        counts.append(count + setup.num_ranks - 1)
    per_slice = max(0.0, (excess[1] - excess[0]) / (counts[1] - counts[0]))
    return replace(latency, fixed_s=latency.fixed_s + per_slice), 1e3 * per_slice


def modelled_gain(latency: Any, seq_len: int, num_stages: int, step: int) -> dict[str, Any]:
    """What ``latency`` itself says slicing can gain: the DP's modelled step time against the best
    slicing into equal slices (any count that divides the sequence in steps of ``step``), at
    ``step`` and at 8 tokens (TeraPipe's step, the finest the DP plans in; close to the bound for
    any slicing). When this is within the fit's error, no measurement can tell the DP from uniform."""
    from hf_ftpipe.partitioners.slicing import plan_slicing, step_time_s

    units = seq_len // step
    counts = [k for k in range(1, units + 1) if units % k == 0]
    equal = {k: step_time_s(latency, [(1, [seq_len // k] * k)], num_stages) for k in counts}
    best_k = min(equal, key=equal.get)
    gains = {}
    for dp_step in sorted({step, 8}, reverse=True):
        if seq_len % dp_step == 0 and seq_len // dp_step <= 512:
            chosen = plan_slicing(latency, seq_len, num_stages, step=dp_step, tolerance=0.0)
            gains[f"dp_step_{dp_step}"] = round(equal[best_k] / chosen.step_time_s, 4)
    return {"best_equal": f"uniform-{best_k}", "best_equal_ms": round(1e3 * equal[best_k], 1), **gains}


def predicted_memory_mb(setup: Setup, slices: tuple[int, ...] | None) -> list[float]:
    from hf_ftpipe.costmodel import TokenSlices, estimate_memory

    _, traced = capture(setup, slices, dynamic=False)
    whole = traced if slices is None else traced.full
    token_slices = None
    if slices is not None:
        graphs = {length: t.cost_graph for length, t in traced.by_length.items()}
        token_slices = TokenSlices(
            slice_lengths=tuple(slices),
            graphs=graphs,
            node_stages={length: split_graph(g, setup) for length, g in graphs.items()},
        )
    predicted = estimate_memory(
        whole.cost_graph,
        split_graph(whole.cost_graph, setup),
        [0, 1],
        num_microbatches=1,
        optimizer="sgd",
        schedule="gpipe",
        token_slices=token_slices,
    )
    return [b / MB for b in predicted]


# -- main -----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runners", nargs="+", default=["unsliced", "uniform-2", "uniform-4", "uniform-8", "uniform-16", "dp"]
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="every runner this many times, interleaved")
    parser.add_argument("--step", type=int, default=64, help="the DP's slice lengths are multiples of this")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    setup = make_setup(args)

    from hf_ftpipe.partitioners.slicing import plan_slicing, step_time_s, uniform_slices

    slicings: dict[str, tuple[int, ...] | None] = {}
    latency = None
    for runner in args.runners:
        if runner == "unsliced":
            slicings[runner] = None
        elif runner.startswith("uniform-"):
            slicings[runner] = tuple(uniform_slices(setup.seq_len, int(runner.split("-")[1]), step=args.step))
        elif runner == "dp":
            start = time.perf_counter()
            latency, samples = measure_latency(setup, 3, args.timeout)
            latency, engine_ms = with_engine_cost(latency, setup, args.step, args.timeout)
            chosen = plan_slicing(latency, setup.seq_len, setup.num_ranks, step=args.step)
            slicings[runner] = tuple(chosen.slices)
            bound = modelled_gain(latency, setup.seq_len, setup.num_ranks, args.step)
            print(f"modelled gain of slicing over equal slices (this fit): {bound}", file=sys.stderr)
            print(
                f"latency: {len(samples)} timings in {time.perf_counter() - start:.0f} s, fit within "
                f"{latency.fit_error:.0%}: fixed {1e3 * latency.fixed_s:.2f} ms, token {1e6 * latency.token_s:.1f} us, "
                f"context {1e6 * latency.context_s:.2f} us, token x context {1e9 * latency.token_context_s:.2f} ns, "
                f"token^2 {1e9 * latency.token_squared_s:.2f} ns (the engine's {engine_ms:.2f} ms per slice "
                f"included); dp slices {list(chosen.slices)}",
                file=sys.stderr,
            )
        else:
            parser.error(f"unknown runner {runner!r}; use unsliced, uniform-<n> or dp")

    # Runners interleaved over rounds, each in fresh processes: a process's step time varies by
    # ~10% from launch to launch on 2 cores, more than the runners differ by; the median of the
    # rounds' medians is reported.
    times: dict[str, list[float]] = {runner: [] for runner in slicings}
    rows: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for runner, slices in slicings.items():
            if runner in rows and rows[runner]["error"] is not None:
                continue
            try:
                ranks = run_ranks(setup, run_job, ("train", None if slices is None else list(slices)), args.timeout)
            except Exception as error:  # the other runners still run
                rows[runner] = {"runner": runner, "slices": slices, "samples_per_s": None, "error": str(error)}
                continue
            times[runner].append(max(r["step_time_s"] for r in ranks))
            if runner not in rows:
                rows[runner] = {
                    "runner": runner,
                    "slices": None if slices is None else list(slices),
                    "peak_memory_mb": [round(r["peak_bytes"] / MB, 1) for r in ranks],
                    "predicted_memory_mb": [round(v, 1) for v in predicted_memory_mb(setup, slices)],
                    "loss": ranks[-1]["loss"],
                    "error": None,
                }
    for runner, row in rows.items():
        if row["error"] is None:
            step = statistics.median(times[runner])
            row.update(
                samples_per_s=round(1 / step, 3),
                step_time_ms=round(1000 * step, 1),
                step_time_ms_rounds=[round(1000 * t, 1) for t in times[runner]],
            )
            if latency is not None:
                lengths = [setup.seq_len] if row["slices"] is None else row["slices"]
                row["modelled_step_ms"] = round(1000 * step_time_s(latency, [(1, lengths)], setup.num_ranks), 1)
        print(json.dumps(row) if args.json else _line(row), flush=True)
    return _checks(list(rows.values()))


def _line(row: dict[str, Any]) -> str:
    if row["error"] is not None:
        return f"{row['runner']:<11} error: {row['error'].strip().splitlines()[-1][:200]}"
    peak = " / ".join(f"{v:.0f}" for v in row["peak_memory_mb"])
    predicted = " / ".join(f"{v:.0f}" for v in row["predicted_memory_mb"])
    slices = "-" if row["slices"] is None else f"{len(row['slices'])}"
    rounds = " ".join(f"{t:.0f}" for t in row["step_time_ms_rounds"])
    return (
        f"{row['runner']:<11} slices {slices:>3}  {row['samples_per_s']:6.3f} samples/s"
        f"  step {row['step_time_ms']:7.1f} ms ({rounds})  modelled {row.get('modelled_step_ms', '-')} ms"
        f"  peak MB {peak}  predicted MB {predicted}  loss {row['loss']:.4f}"
    )


def _checks(rows: list[dict[str, Any]]) -> int:
    ok = {r["runner"]: r for r in rows if r["error"] is None}
    failed = 0
    base = ok.get("unsliced")
    uniform = [r for name, r in ok.items() if name.startswith("uniform-")]
    best = max(uniform, key=lambda r: r["samples_per_s"], default=None)
    lines = []
    if base and best:
        ratio = best["samples_per_s"] / base["samples_per_s"]
        lines.append(
            (f"best uniform ({best['runner']}) >= {MIN_SPEEDUP}x unsliced", ratio >= MIN_SPEEDUP, f"{ratio:.2f}x")
        )
    if best and "dp" in ok:
        ratio = ok["dp"]["samples_per_s"] / best["samples_per_s"]
        lines.append(("dp >= best uniform", ratio >= 1.0, f"{ratio:.3f}x"))
    for r in ok.values():
        errors = [m / p - 1 for m, p in zip(r["peak_memory_mb"], r["predicted_memory_mb"])]
        good = all(abs(e) <= MAX_MEMORY_ERROR for e in errors)
        lines.append(
            (f"{r['runner']} peak within {MAX_MEMORY_ERROR:.0%}", good, ", ".join(f"{e:+.1%}" for e in errors))
        )
    for name, good, figures in lines:
        failed += not good
        print(f"{'PASS' if good else 'FAIL'}  {name} ({figures})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
