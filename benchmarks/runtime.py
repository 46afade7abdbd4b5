"""hf_ftpipe's schedules against torch.distributed.pipelining on one GPT-2 split: speed, memory, efficiency.

Runners: hf_ftpipe's `PipelineEngine` with the gpipe, 1f1b, async and 2bw schedules, and
torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B, one stage per rank; and with two
stages per rank (the 8 layers in 2P equal groups): torch's ScheduleInterleaved1F1B on the looped
placement (stage s on rank s mod P), ScheduleZBVZeroBubble and ScheduleDualPipeV on the V (stage s on
rank min(s, 2P − 1 − s): on 2 ranks [0, 1, 1, 0], a Mixed-Pipe plan's shape), hf_ftpipe's gpipe and 1f1b
on the same V (``hf_ftpipe/gpipe-v``, ``hf_ftpipe/1f1b-v``: what the placement alone gives), and
hf_ftpipe's zero-bubble schedules (issue 28) where this checkout has them: ``zb-h1`` one stage per
rank, ``zbv`` on the V, ``interleaved-1f1b`` looped, and ``zb-auto`` on the V: the order zb-h1's list
scheduler builds for the split's stage times (the cost table profiled right before its launch, else the
``cpu`` profile's roofline), run from a file as ``PipeTrainer(pipeline_schedule="zb-auto")`` runs
it. Every runner trains the same
GPT-2 (8 layers, d_model 256, 4 heads, sequence 128, vocabulary 2048, untied embeddings, no
dropout) from the same seed on the same random tokens with SGD, split the same way (blocks
divided evenly; embeddings on the first stage; ln_f, lm_head and the loss on the last). Each
runner runs in fresh rank processes (gloo on CPU, NCCL on CUDA).

The vocabulary is small on purpose: the last stage also runs lm_head and the loss, and with 8192
tokens it takes ~1.6× the first stage on CPU. A schedule without flushes gains at most
1 + t_first / (M × t_last) over GPipe on two stages (≈ 1.15× then, 1.25× when balanced), so an
unbalanced split would hide the bubble the schedules differ by. ``--vocab 8192`` shows that case.

    python benchmarks/runtime.py                                  # 2 ranks on CPU, a table and checks
    python benchmarks/runtime.py --repeats 3                      # 3 rounds of every runner: medians
    python benchmarks/runtime.py --json                           # a JSON list, one object per runner
    python benchmarks/runtime.py --runners hf_ftpipe/async torch/gpipe --steps 10
    python benchmarks/runtime.py --device cuda                    # one rank per visible GPU

Reported per runner: samples/s (micro-batches × micro-batch size / median step time), the ratio to
torch/gpipe, peak memory per rank, hf_ftpipe's predicted memory for the same split and placement
(``hf_ftpipe.costmodel.estimate_memory``; for a torch runner, that of our matching schedule), and
the efficiency: the slowest rank's stages' forward + backward of one micro-batch timed alone ×
micro-batches / the step time (1.0 = no bubble, no communication cost). With ``--repeats N`` every
runner runs N rounds, round-robin; a row is its round of median speed and a ratio the median of
the rounds' ratios (each within one round). Targets: hf_ftpipe gpipe/1f1b ≥ torch's; async ≥ 1.15×
torch GPipe at 4 micro-batches on 2 stages with ≥ 90% efficiency and peak memory within 10% of the
prediction; (issue 28) our best synchronous schedule ≥ torch's best, zbv ≥ 1.15× our gpipe, every
new schedule's peak memory within 10% of the prediction and its simulated step (``sim ms``, priced
by a cost table profiled right before each of its launches; ``--no-simulate`` skips it) within 10%
of the measured one (the median over rounds of the ratio within each).

``hf_ftpipe/gradient_accumulation`` is 1F1B with gradient accumulation: 4 batches of a quarter of
the micro-batches each per optimizer step, run as one flush (``PipelineEngine(batches_per_step=4)``,
what ``PipeTrainer`` does with ``gradient_accumulation_steps=4``): the same samples per step as
``hf_ftpipe/1f1b``, whose speed it must be within 5% of. ``--microbatches 16`` compares G = 4 at 4
micro-batches with G = 1 at 16:

    python benchmarks/runtime.py --microbatches 16 --runners hf_ftpipe/1f1b hf_ftpipe/gradient_accumulation
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from _checks import failed, print_checks  # noqa: E402
from _gpt2_split import (  # noqa: E402
    GPT2Stage,
    Setup,
    add_model_arguments,
    build_model,
    causal_lm_loss,
    first_microbatch,
    make_batch,
    split_graph,
    stage_inputs,
)
from _rank_processes import run_ranks  # noqa: E402
from _runtime_paired import run_paired  # noqa: E402
from _runtime_ranks import ACCUMULATION_STEPS, RUNNER_SPLITS, run_rank, runner_schedule, runner_setup  # noqa: E402
from _runtime_report import MB, checks, failed_row, make_row, median_rows, print_notes, print_table  # noqa: E402
from _runtime_simulation import (  # noqa: E402
    measured_costs,
    simulated_step_ms,
    simulates,
    traced_model,
    zb_auto_order,
)

RUNNERS = (
    "hf_ftpipe/gpipe",
    "hf_ftpipe/1f1b",
    "hf_ftpipe/async",
    "hf_ftpipe/2bw",
    "hf_ftpipe/gradient_accumulation",
    "hf_ftpipe/gpipe-v",
    "hf_ftpipe/1f1b-v",
    "hf_ftpipe/zb-h1",
    "hf_ftpipe/zbv",
    "hf_ftpipe/zb-auto",
    "hf_ftpipe/interleaved-1f1b",
    "torch/gpipe",
    "torch/1f1b",
    "torch/interleaved-1f1b",
    "torch/zbv",
    "torch/dualpipev",
)


# -- the split, checked once in this process ------------------------------------------------


def check_split(setup: Setup) -> dict[str, Any]:
    """Both runners' stages hold the same parameters and compute the same loss, on ``setup``'s split."""
    import torch

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
        for s in range(setup.num_stages):
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
    return {"stage_params": stage_params, "loss": reference, "graph": graph, "node_stage": node_stage}


def predicted_schedule(runner: str) -> str:
    """The hf_ftpipe schedule whose memory prediction a runner is compared with: its own, or for torch's
    the matching one (DualPipeV: ``zbv``, the same V); ``1f1b`` where this checkout lacks that schedule."""
    from hf_ftpipe.schedules.registry import SCHEDULES

    kind, schedule = runner_schedule(runner)
    schedule = {"gradient_accumulation": "1f1b", "dualpipev": "zbv"}.get(schedule, schedule)
    return schedule if schedule in SCHEDULES else "1f1b"


def predict_memory(setup: Setup, split: dict[str, Any], schedule: str) -> list[float] | None:
    """hf_ftpipe's predicted MB per rank for ``setup``'s split and placement (None if it cannot)."""
    from hf_ftpipe.costmodel import estimate_memory

    try:
        predicted_bytes = estimate_memory(
            split["graph"],
            split["node_stage"],
            setup.ranks_of_stages(),
            num_microbatches=setup.num_microbatches,
            optimizer="sgd",
            schedule=schedule,
        )
    except Exception as error:  # the benchmark still times the runners
        print(f"no memory prediction for {schedule}: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    return [b / MB for b in predicted_bytes]


def unsupported_reason(runner: str) -> str | None:
    """Why this checkout's hf_ftpipe cannot run ``runner``, or None."""
    import inspect

    from hf_ftpipe.runtime import PipelineEngine
    from hf_ftpipe.schedules.registry import SCHEDULES

    kind, schedule = runner_schedule(runner)
    if kind != "hf_ftpipe":
        return None
    if schedule == "gradient_accumulation":
        if "batches_per_step" not in inspect.signature(PipelineEngine.__init__).parameters:
            return "skipped: PipelineEngine takes no `batches_per_step` keyword yet"
        return None
    if schedule not in SCHEDULES:
        return f"skipped: this hf_ftpipe has no schedule {schedule!r} (it has {', '.join(SCHEDULES)})"
    return None


def run_paired_round(
    setup: Setup, args: argparse.Namespace, runner_setups: dict[str, Setup], runs: dict[str, list[dict[str, Any]]]
) -> None:
    """One paired launch of the runners that ran this round (`_runtime_paired`): each round's row of a
    runner gets its step times there, ``paired_step_ms`` (rank 0's, each step between barriers)."""
    started = time.perf_counter()
    paired_setup = dataclasses.replace(setup, steps=args.paired_steps)
    try:
        ranks = run_ranks(paired_setup, run_paired, runner_setups, args.timeout_s * max(1, len(runner_setups)))
    except Exception as error:  # the separate launches' figures still stand
        print(f"  paired launch failed: {error}", file=sys.stderr)
        return
    for runner, step_ms in ranks[0]["step_ms"].items():
        runs[runner][-1]["paired_step_ms"] = [round(ms, 2) for ms in step_ms]
    if not args.json:
        elapsed_s = time.perf_counter() - started
        print(f"  paired launch of {len(runner_setups)} runners in {elapsed_s:.0f} s", file=sys.stderr)


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
    add_model_arguments(parser, microbatches=4)
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds of every runner in fresh processes; medians are reported"
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="time the runners' speed against each other in one more launch per round, stepped in turn "
        "(ratios step by step: a busy spell of the machine hits both sides of a ratio)",
    )
    parser.add_argument("--paired-steps", type=int, default=20, help="timed steps of each runner in a paired launch")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="limit per runner")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per runner")
    parser.add_argument(
        "--no-simulate",
        dest="simulate",
        action="store_false",
        help="skip the profile and the simulated step of the synchronous hf_ftpipe runners",
    )
    args = parser.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    num_ranks = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if not 1 <= num_ranks <= args.layers:
        parser.error(f"--ranks must be between 1 and --layers ({args.layers}), got {num_ranks}")
    for name in ("microbatches", "microbatch_size", "steps", "repeats", "paired_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if "hf_ftpipe/gradient_accumulation" in args.runners and args.microbatches % ACCUMULATION_STEPS:
        parser.error(
            f"--microbatches ({args.microbatches}) must be a multiple of {ACCUMULATION_STEPS} for "
            "hf_ftpipe/gradient_accumulation (its batches' micro-batches), e.g. 16; or leave the runner out"
        )
    if any(r in RUNNER_SPLITS for r in args.runners) and 2 * num_ranks > args.layers:
        parser.error(
            f"the V and looped runners put {2 * num_ranks} stages on {num_ranks} ranks: --layers ({args.layers}) "
            f"must be at least {2 * num_ranks}; or leave {', '.join(r for r in args.runners if r in RUNNER_SPLITS)} out"
        )
    if args.microbatches < num_ranks:
        parser.error(f"--microbatches ({args.microbatches}) must be at least --ranks ({num_ranks}) for 1F1B")
    cores = len(os.sched_getaffinity(0))
    setup = Setup.of_arguments(
        args,
        num_ranks=num_ranks,
        warmup=max(1, args.warmup),
        device=args.device,
        threads_per_rank=max(1, cores // num_ranks),
    )
    # The CPU memory profiler announces itself on every start; rank processes inherit this.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    started = time.perf_counter()
    runner_setups = {runner: runner_setup(setup, runner) for runner in args.runners}
    splits: dict[int, dict[str, Any]] = {}  # by number of stages: the V and looped splits are the same 4 stages
    predicted: dict[str, tuple[str, list[float] | None]] = {}
    for runner, runner_setup_ in runner_setups.items():
        if runner_setup_.num_stages not in splits:
            splits[runner_setup_.num_stages] = check_split(runner_setup_)
        schedule = predicted_schedule(runner)
        predicted[runner] = (schedule, predict_memory(runner_setup_, splits[runner_setup_.num_stages], schedule))
    traced = None
    if args.simulate and any(simulates(runner) for runner in args.runners):
        traced = traced_model(setup)  # profiled before each simulated launch, nothing else of this benchmark running
    runs: dict[str, list[dict[str, Any]]] = {runner: [] for runner in args.runners}
    orders_folder = tempfile.mkdtemp(prefix="hf_ftpipe-runtime-")  # zb-auto's order, rewritten per launch
    for repeat in range(args.repeats):  # round-robin, so a busy spell of the machine hits every runner alike
        for runner in args.runners:
            runner_started = time.perf_counter()
            reason = unsupported_reason(runner)
            if reason is not None:
                runs[runner].append(failed_row(runner, reason))
                continue
            try:
                table = measured_costs(setup, traced) if traced is not None and simulates(runner) else None
                if runner_schedule(runner)[1] == "zb-auto":  # the order built for this launch's stage times
                    split = splits[runner_setups[runner].num_stages]
                    order = zb_auto_order(runner_setups[runner], split, table, orders_folder)
                    runner_setups[runner] = dataclasses.replace(runner_setups[runner], schedule_file=order)
                    predicted[runner] = ("zb-auto", predict_memory(runner_setups[runner], split, order))
                ranks = run_ranks(runner_setups[runner], run_rank, runner, args.timeout_s)
                row = make_row(runner_setups[runner], runner, ranks, predicted[runner])
                if table is not None:
                    split = splits[runner_setups[runner].num_stages]
                    row["simulated_step_ms"] = simulated_step_ms(runner_setups[runner], runner, split, table)
            except Exception as error:
                row = failed_row(runner, str(error))
            runs[runner].append(row)
            if not args.json:
                outcome = f"{row['samples_per_s']:.2f} samples/s" if row["error"] is None else "failed"
                elapsed_s = time.perf_counter() - runner_started
                print(f"  {runner} (run {repeat + 1}/{args.repeats}): {outcome} in {elapsed_s:.0f} s", file=sys.stderr)
        if args.paired:
            ran = {r: runner_setups[r] for r in args.runners if runs[r][-1]["error"] is None}
            run_paired_round(setup, args, ran, runs)
    shutil.rmtree(orders_folder, ignore_errors=True)
    rows = median_rows(runs)
    for row in rows:
        row.update(num_ranks=setup.num_ranks, device=setup.device, num_microbatches=setup.num_microbatches)
        row.update(microbatch_size=setup.microbatch_size, num_stages=runner_setups[row["runner"]].num_stages)
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
        print_notes(setup, splits, rows, cores, args.repeats, args.paired_steps if args.paired else None)
        print_checks(verdicts, started)
    return 1 if failed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
