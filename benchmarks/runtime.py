"""hf_ftpipe's schedules against torch.distributed.pipelining on one GPT-2 split: speed, memory, efficiency.

Runners: hf_ftpipe's `PipelineEngine` with the gpipe, 1f1b, async and 2bw schedules, and
torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B. Every runner trains the same
GPT-2 (8 layers, d_model 256, 4 heads, sequence 128, vocabulary 2048, untied embeddings, no
dropout) from the same seed on the same random tokens with SGD, split the same way (blocks
divided evenly; embeddings on the first stage; ln_f, lm_head and the loss on the last), one stage
per rank. Each runner runs in fresh rank processes (gloo on CPU, NCCL on CUDA).

The vocabulary is small on purpose: the last stage also runs lm_head and the loss, and with 8192
tokens it takes ~1.6× the first stage on CPU. A schedule without flushes gains at most
1 + t_first / (M × t_last) over GPipe on two stages (≈ 1.15× then, 1.25× when balanced), so an
unbalanced split would hide the bubble the schedules differ by. ``--vocab 8192`` shows that case.

    python benchmarks/runtime.py                                  # 2 ranks on CPU, a table and checks
    python benchmarks/runtime.py --json                           # a JSON list, one object per runner
    python benchmarks/runtime.py --runners hf_ftpipe/async torch/gpipe --steps 10
    python benchmarks/runtime.py --device cuda                    # one rank per visible GPU

Reported per runner: samples/s (micro-batches × micro-batch size / median step time), the ratio to
torch/gpipe, peak memory per rank, hf_ftpipe's predicted memory for the same split
(``hf_ftpipe.costmodel.estimate_memory``), and the efficiency: the slowest stage's forward +
backward of one micro-batch timed alone × micro-batches / the step time (1.0 = no bubble, no
communication cost). Targets (issue): hf_ftpipe gpipe/1f1b ≥ torch's; async ≥ 1.15× torch GPipe
at 4 micro-batches on 2 stages with ≥ 90% efficiency and peak memory within 10% of the prediction.

``hf_ftpipe/gradient_accumulation`` is 1F1B with gradient accumulation: 4 batches of a quarter of
the micro-batches each per optimizer step, run as one flush (``PipelineEngine(batches_per_step=4)``,
what ``PipeTrainer`` does with ``gradient_accumulation_steps=4``): the same samples per step as
``hf_ftpipe/1f1b``, whose speed it must be within 5% of. ``--microbatches 16`` compares G = 4 at 4
micro-batches with G = 1 at 16:

    python benchmarks/runtime.py --microbatches 16 --runners hf_ftpipe/1f1b hf_ftpipe/gradient_accumulation
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _checks import failed, print_checks, verdict  # noqa: E402
from _runtime_ranks import (  # noqa: E402
    ACCUMULATION_STEPS,
    SYNCHRONOUS,
    GPT2Stage,
    Setup,
    build_model,
    causal_lm_loss,
    first_microbatch,
    make_batch,
    run_rank,
    split_graph,
    stage_inputs,
)

RUNNERS = (
    "hf_ftpipe/gpipe",
    "hf_ftpipe/1f1b",
    "hf_ftpipe/async",
    "hf_ftpipe/2bw",
    "hf_ftpipe/gradient_accumulation",
    "torch/gpipe",
    "torch/1f1b",
)
BASELINE = "torch/gpipe"
MIN_ASYNC_SPEEDUP = 1.15
MIN_ASYNC_EFFICIENCY = 0.90
MAX_MEMORY_ERROR = 0.10
MAX_ACCUMULATION_SLOWDOWN = 0.05
MB = 2**20


# -- rank processes -------------------------------------------------------------------------


def _rank_entry(rank: int, setup: Setup, runner: str, rendezvous: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(setup.threads_per_rank)
    try:
        if setup.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if setup.device == "cuda" else "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=setup.num_ranks,
            timeout=timedelta(seconds=120),
        )
        results.put((rank, run_rank(rank, setup, runner), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_runner(setup: Setup, runner: str, timeout_s: float) -> list[dict[str, Any]]:
    """Every rank's figures for ``runner``; raises RuntimeError with the first failing rank's traceback."""
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        processes = [
            context.Process(target=_rank_entry, args=(rank, setup, runner, rendezvous, results))
            for rank in range(setup.num_ranks)
        ]
        for process in processes:
            process.start()
        figures: dict[int, dict[str, Any]] = {}
        errors: dict[int, str] = {}
        end = time.monotonic() + timeout_s
        while len(figures) + len(errors) < setup.num_ranks and time.monotonic() < end:
            try:
                rank, value, error = results.get(timeout=0.5)
            except queue_module.Empty:
                if not any(p.is_alive() for p in processes) and results.empty():
                    break  # a rank died without a word (killed, or os._exit by a peer's failure)
                continue
            if error is None:
                figures[rank] = value
            else:
                errors[rank] = error
                end = min(end, time.monotonic() + 10.0)  # its peers may be stuck waiting for it
        for process in processes:
            process.join(timeout=max(1.0, end - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    if errors:  # the first to report is the cause; its peers' errors are mostly "connection closed"
        rank, error = next(iter(errors.items()))
        raise RuntimeError(f"rank {rank}: {error.strip()}")
    if len(figures) < setup.num_ranks:
        missing = [f"{r} (exit code {processes[r].exitcode})" for r in range(setup.num_ranks) if r not in figures]
        raise RuntimeError(f"ranks {', '.join(missing)} gave no result: died, or killed after {timeout_s:.0f} s")
    return [figures[rank] for rank in range(setup.num_ranks)]


# -- the split, checked once in this process ------------------------------------------------


def check_split(setup: Setup) -> dict[str, Any]:
    """Both runners' stages hold the same parameters and compute the same loss; hf_ftpipe's predictions."""
    import torch

    from hf_ftpipe.costmodel import estimate_memory
    from hf_ftpipe.graph import capture_model
    from hf_ftpipe.runtime import build_stage_module, plan_stages

    model = build_model(setup)
    microbatch = first_microbatch(setup, make_batch(setup, 0))
    traced = capture_model(model, microbatch)
    graph = traced.cost_graph
    node_stage = split_graph(graph, setup)
    specs = plan_stages(graph, node_stage)
    names = {id(p): name for name, p in model.named_parameters()}
    stage_params = []
    for s, spec in enumerate(specs):
        ours = set(graph.params_of(spec.nodes))
        theirs = {names[id(p)] for p in GPT2Stage(model, s, setup).parameters()}
        if ours != theirs:
            raise RuntimeError(
                f"stage {s}: the two splits differ; only hf_ftpipe: {sorted(ours - theirs)}, "
                f"only torch: {sorted(theirs - ours)}"
            )
        stage_params.append(sum(graph.params[name].numel for name in ours))

    with torch.no_grad():
        reference = model(**microbatch).loss.item()
        x = microbatch["input_ids"]
        for s in range(setup.num_ranks):
            x = GPT2Stage(model, s, setup)(x)
        torch_loss = causal_lm_loss(model)(x, microbatch["labels"]).item()
        values: dict[str, Any] = {}
        for spec in specs:
            module = build_stage_module(
                traced.graph_module, spec, traced.canonical_names, traced.tensors, torch.device("cpu")
            )
            outputs = module(*stage_inputs(traced, spec, microbatch), *[values[n] for n in spec.received])
            values.update(zip(spec.sent, outputs))
        ours_loss = values[specs[-1].model_outputs["loss"]].item()
    for name, loss in (("torch stages", torch_loss), ("hf_ftpipe stages", ours_loss)):
        if abs(loss - reference) > 1e-4:
            raise RuntimeError(f"the {name} compute loss {loss:.6f}, the model {reference:.6f}")

    predicted: dict[str, list[float] | None] = {}
    for schedule in ("gpipe", "1f1b", "async", "2bw"):
        try:
            predicted_bytes = estimate_memory(
                graph,
                node_stage,
                list(range(setup.num_ranks)),
                num_microbatches=setup.num_microbatches,
                optimizer="sgd",
                schedule=schedule,
            )
            predicted[schedule] = [b / MB for b in predicted_bytes]
        except Exception as error:  # the benchmark still times the runners
            print(f"no memory prediction for {schedule}: {type(error).__name__}: {error}", file=sys.stderr)
            predicted[schedule] = None
    predicted["gradient_accumulation"] = predicted["1f1b"]  # one 1F1B flush of as many micro-batches
    return {"stage_params": stage_params, "loss": reference, "predicted_memory_mb": predicted}


def unsupported_reason(runner: str) -> str | None:
    """Why this checkout's hf_ftpipe cannot run ``runner``, or None."""
    import inspect

    from hf_ftpipe.runtime import PipelineEngine

    kind, schedule = runner.split("/")
    if kind != "hf_ftpipe":
        return None
    if "schedule" not in inspect.signature(PipelineEngine.__init__).parameters and schedule != "gpipe":
        return "skipped: PipelineEngine takes no `schedule` keyword yet (GPipe only)"
    streaming_api = hasattr(PipelineEngine, "attach_optimizer") and hasattr(PipelineEngine, "drain")
    if schedule == "gradient_accumulation":
        if "batches_per_step" not in inspect.signature(PipelineEngine.__init__).parameters:
            return "skipped: PipelineEngine takes no `batches_per_step` keyword yet"
        return None
    if schedule not in SYNCHRONOUS and not streaming_api:
        return f"skipped: {schedule} needs PipelineEngine.attach_optimizer and .drain, which this version lacks"
    return None


# -- rows, checks, output -------------------------------------------------------------------


def make_row(
    setup: Setup, runner: str, ranks: list[dict[str, Any]], predicted: dict[str, list[float] | None]
) -> dict[str, Any]:
    """One runner's figures from every rank's: the slowest rank's step, every rank's memory."""
    kind, schedule = runner.split("/")
    step_time_s = max(r["step_time_s"] for r in ranks)
    slowest_stage_s = max(r["stage_time_s"] for r in ranks)
    return {
        "runner": runner,
        "samples_per_s": round(setup.num_microbatches * setup.microbatch_size / step_time_s, 3),
        "ratio_vs_torch_gpipe": None,
        "step_time_ms": round(1000 * step_time_s, 1),
        "step_cpu_ms": [round(1000 * r["step_cpu_s"], 1) for r in ranks],
        "efficiency": round(slowest_stage_s * setup.num_microbatches / step_time_s, 3),
        "stage_time_ms": [round(1000 * r["stage_time_s"], 1) for r in ranks],
        "peak_memory_mb": [round(r["peak_bytes"] / MB, 1) for r in ranks],
        "predicted_memory_mb": _rounded(predicted[schedule]) if kind == "hf_ftpipe" else None,
        "weight_mb": [round(r["weight_bytes"] / MB, 1) for r in ranks],
        "losses": [None if v is None else round(v, 4) for v in ranks[-1]["losses"]],
        "error": None,
    }


def _rounded(values: list[float] | None) -> list[float] | None:
    return None if values is None else [round(v, 1) for v in values]


def faster(row: dict[str, Any], other: dict[str, Any]) -> bool:
    return other["error"] is not None or row["samples_per_s"] > other["samples_per_s"]


def failed_row(runner: str, error: str) -> dict:
    return {"runner": runner, "samples_per_s": None, "peak_memory_mb": None, "efficiency": None, "error": error}


def checks(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(check, verdict) pairs; verdicts are PASS, FAIL or n/a with the figures."""
    ok_rows = {row["runner"]: row for row in rows if row["error"] is None}

    out = []
    for schedule in SYNCHRONOUS:
        name = f"hf_ftpipe/{schedule} >= torch/{schedule}"
        ours, theirs = ok_rows.get(f"hf_ftpipe/{schedule}"), ok_rows.get(f"torch/{schedule}")
        if ours is None or theirs is None:
            out.append((name, "n/a (a runner did not run)"))
        else:
            ratio = ours["samples_per_s"] / theirs["samples_per_s"]
            out.append((name, verdict(ratio >= 1.0, f"{ratio:.2f}x")))
    ours, baseline = ok_rows.get("hf_ftpipe/async"), ok_rows.get(BASELINE)
    name = f"hf_ftpipe/async >= {MIN_ASYNC_SPEEDUP}x {BASELINE}"
    if ours is None or baseline is None:
        out.append((name, "n/a (a runner did not run)"))
    else:
        ratio = ours["samples_per_s"] / baseline["samples_per_s"]
        out.append((name, verdict(ratio >= MIN_ASYNC_SPEEDUP, f"{ratio:.2f}x")))
    name = f"hf_ftpipe/gradient_accumulation within {MAX_ACCUMULATION_SLOWDOWN:.0%} of hf_ftpipe/1f1b"
    accumulating, whole = ok_rows.get("hf_ftpipe/gradient_accumulation"), ok_rows.get("hf_ftpipe/1f1b")
    if accumulating is None or whole is None:
        out.append((name, "n/a (a runner did not run)"))
    else:
        ratio = accumulating["samples_per_s"] / whole["samples_per_s"]
        out.append((name, verdict(ratio >= 1 - MAX_ACCUMULATION_SLOWDOWN, f"{ratio:.3f}x")))
    name = f"hf_ftpipe/async efficiency >= {MIN_ASYNC_EFFICIENCY:.0%}"
    if ours is None:
        out.append((name, "n/a"))
    else:
        out.append((name, verdict(ours["efficiency"] >= MIN_ASYNC_EFFICIENCY, f"{ours['efficiency']:.0%}")))
    name = f"hf_ftpipe/async peak memory within {MAX_MEMORY_ERROR:.0%} of the prediction on every rank"
    if ours is None or ours["predicted_memory_mb"] is None:
        out.append((name, "n/a"))
    else:
        errors = [m / p - 1 for m, p in zip(ours["peak_memory_mb"], ours["predicted_memory_mb"])]
        figures = ", ".join(f"{e:+.0%}" for e in errors)
        out.append((name, verdict(all(abs(e) <= MAX_MEMORY_ERROR for e in errors), figures)))
    return out


def _per_rank(values: list[float] | None, digits: int = 0) -> str:
    return "-" if values is None else " / ".join(f"{v:.{digits}f}" for v in values)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ["runner", "samples/s", f"vs {BASELINE}", "step ms", "CPU ms", "efficiency", "stage ms", "peak MB"]
    header.append("predicted MB")
    table = [[*header, "loss"]]
    for row in rows:
        if row["error"] is not None:
            table.append([row["runner"], row["error"].strip().splitlines()[-1][:160]])
            continue
        losses = [f"{v:.3f}" for v in (row["losses"][0], row["losses"][-1]) if v is not None]
        table.append(
            [
                row["runner"],
                f"{row['samples_per_s']:.2f}",
                "-" if row["ratio_vs_torch_gpipe"] is None else f"{row['ratio_vs_torch_gpipe']:.2f}x",
                f"{row['step_time_ms']:.0f}",
                _per_rank(row["step_cpu_ms"]),
                f"{row['efficiency']:.0%}",
                _per_rank(row["stage_time_ms"]),
                _per_rank(row["peak_memory_mb"]),
                _per_rank(row["predicted_memory_mb"]),
                " -> ".join(losses) or "-",
            ]
        )
    # An error row spans the columns after the runner's.
    widths = [max(len(r[i]) for r in table if i < len(r) and (len(r) > 2 or i == 0)) for i in range(len(table[0]))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def print_notes(setup: Setup, split: dict[str, Any], rows: list[dict[str, Any]], cores: int, repeats: int) -> None:
    stages = []
    for s, params in enumerate(split["stage_params"]):
        blocks = setup.blocks_of(s)
        parts = (["embeddings"] if s == 0 else []) + [f"blocks {blocks[0]}-{blocks[-1]}"]
        parts += ["ln_f + lm_head + loss"] if s == setup.num_ranks - 1 else []
        stages.append(f"stage {s} = {' + '.join(parts)} ({params / 1e6:.2f} M params)")
    notes = [
        f"split: {'; '.join(stages)}.",
        "  Both runners' stages hold the same parameters and give the model's loss on the first micro-batch "
        f"({split['loss']:.4f}): checked.",
        f"ranks: {setup.num_ranks} on {setup.device} ({'NCCL' if setup.device == 'cuda' else 'gloo'}), "
        f"{setup.threads_per_rank} torch thread(s) each ({cores} cores); fresh processes per runner.",
        f"step ms: median of {setup.steps} timed steps after {setup.warmup} warm-up, the slowest rank's"
        + (f", the fastest of {repeats} runs" if repeats > 1 else "")
        + "; samples/s = micro-batches × micro-batch size / step.",
        "CPU ms: each rank's process CPU time per step (median; its threads, gloo's included): what a step costs "
        "when the shared cores make wall-clock times vary.",
        "stage ms: each rank's stage, forward + backward of one micro-batch with no communication (fastest of "
        f"{setup.stage_repeats},",
        "  every rank at once, the runner's own stage modules: exported-graph stages for hf_ftpipe, eager GPT-2 "
        "blocks for torch).",
        f"efficiency: slowest stage ms × {setup.num_microbatches} micro-batches / step ms (1 = no bubble and no "
        "communication cost).",
    ]
    if setup.device == "cuda":
        notes.append("peak MB: torch.cuda.max_memory_allocated per rank over construction, warm-up and timed steps.")
    else:
        notes += [
            "peak MB: the highest total of this rank's live CPU tensor bytes (its weights, moved into fresh storage",
            "  first, included) from construction to the end of the warm-up steps (streaming schedules drained), from",
            "  torch.profiler's allocation events (profile_memory=True). Tensors only (no interpreter, libraries,",
            "  allocator caching or fragmentation), and only those the main thread allocates.",
        ]
    notes += [
        "predicted MB: hf_ftpipe.costmodel.estimate_memory on the same node_stage / stage_device, optimizer 'sgd',",
        "  the runner's schedule (hf_ftpipe.costmodel.memory_rules): weights × versions + gradients that outlive a",
        "  backward + (saved activations + values sent) × micro-batches in flight + the largest backward's working",
        "  set.",
        "loss: first warm-up step -> last timed step (every runner starts from the same weights and data).",
    ]
    if any(row["error"] is None and row["efficiency"] > 1.0 for row in rows):
        notes.append("WARNING: an efficiency above 100% means the machine was busy while steps or stages were timed.")
    print("\n" + "\n".join(notes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runners",
        nargs="+",
        choices=RUNNERS,
        default=list(RUNNERS),
        metavar="RUNNER",
        help=f"subset of {', '.join(RUNNERS)}",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, help="pipeline stages, one per rank (default: 2 on CPU, every GPU)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median taken)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (CPU memory is measured on them)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary; larger loads the last stage more")
    parser.add_argument("--repeats", type=int, default=1, help="runs per runner, round-robin; the fastest is kept")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit per runner")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per runner")
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    num_ranks = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if not 1 <= num_ranks <= args.layers:
        parser.error(f"--ranks must be between 1 and --layers ({args.layers}), got {num_ranks}")
    for name in ("microbatches", "microbatch_size", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if "hf_ftpipe/gradient_accumulation" in args.runners and args.microbatches % ACCUMULATION_STEPS:
        parser.error(
            f"--microbatches ({args.microbatches}) must be a multiple of {ACCUMULATION_STEPS} for "
            "hf_ftpipe/gradient_accumulation (its batches' micro-batches), e.g. 16; or leave the runner out"
        )
    if args.microbatches < num_ranks:
        parser.error(f"--microbatches ({args.microbatches}) must be at least --ranks ({num_ranks}) for 1F1B")
    cores = len(os.sched_getaffinity(0))
    setup = Setup(
        num_ranks=num_ranks,
        num_microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        steps=args.steps,
        warmup=max(1, args.warmup),
        device=args.device,
        threads_per_rank=max(1, cores // num_ranks),
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        seq_len=args.seq_len,
        vocab_size=args.vocab,
    )
    # The CPU memory profiler announces itself on every start; rank processes inherit this.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    split = check_split(setup)
    best: dict[str, dict[str, Any]] = {}
    for repeat in range(args.repeats):  # round-robin, so a busy spell of the machine hits every runner alike
        for runner in args.runners:
            runner_started = time.perf_counter()
            reason = unsupported_reason(runner)
            if reason is not None:
                best[runner] = failed_row(runner, reason)
                continue
            try:
                row = make_row(setup, runner, run_runner(setup, runner, args.timeout_s), split["predicted_memory_mb"])
            except Exception as error:
                row = failed_row(runner, str(error))
            if runner not in best or (row["error"] is None and faster(row, best[runner])):
                best[runner] = row
            if not args.json:
                outcome = "done" if row["error"] is None else "failed"
                elapsed_s = time.perf_counter() - runner_started
                print(f"  {runner} (run {repeat + 1}/{args.repeats}): {outcome} in {elapsed_s:.0f} s", file=sys.stderr)
    rows = [best[runner] for runner in args.runners]
    baseline = next((r for r in rows if r["runner"] == BASELINE and r["error"] is None), None)
    for row in rows:
        row.update(num_ranks=setup.num_ranks, device=setup.device, num_microbatches=setup.num_microbatches)
        row.update(microbatch_size=setup.microbatch_size)
        if row["error"] is None and baseline is not None:
            row["ratio_vs_torch_gpipe"] = round(row["samples_per_s"] / baseline["samples_per_s"], 3)
    verdicts = checks(rows)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(
            f"GPT-2 {setup.n_layer} layers, d_model {setup.d_model}, {setup.n_head} heads, sequence {setup.seq_len}, "
            f"vocabulary {setup.vocab_size} (untied); {setup.num_ranks} stages on {setup.num_ranks} ranks; "
            f"{setup.num_microbatches} micro-batches × {setup.microbatch_size} samples; SGD lr {setup.lr}\n"
        )
        print_table(rows)
        print_notes(setup, split, rows, cores, args.repeats)
        print_checks(verdicts, started)
    return 1 if failed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
