"""The rows, checks and printout of ``benchmarks/runtime.py``: one row per runner from its ranks' figures.

Apart from the runs themselves, so that what is reported (the table, the notes that say how each
column was measured, the targets checked) reads in one place; the JSON rows are `make_row`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from _checks import Check, verdict
from _gpt2_split import Setup
from _runtime_ranks import flushes, runner_schedule

BASELINE = "torch/gpipe"
MIN_ASYNC_SPEEDUP = 1.15
MIN_ASYNC_EFFICIENCY = 0.90
MIN_ZBV_SPEEDUP = 1.15
MAX_MEMORY_ERROR = 0.10
MAX_STEP_ERROR = 0.10
MAX_ACCUMULATION_SLOWDOWN = 0.05
PAIRED = ("gpipe", "1f1b")
"""Schedules both libraries run on one stage per rank, compared pairwise."""
NEW_SCHEDULES = ("hf_ftpipe/zb-h1", "hf_ftpipe/zbv", "hf_ftpipe/interleaved-1f1b", "hf_ftpipe/zb-auto")
"""Issue 28's schedules: their peak memory is checked against the prediction."""
MB = 2**20


def make_row(
    setup: Setup, runner: str, ranks: list[dict[str, Any]], predicted: tuple[str, list[float] | None]
) -> dict[str, Any]:
    """One runner's figures in one round from every rank's: the slowest rank's step, every rank's memory."""
    step_time_s = max(r["step_time_s"] for r in ranks)
    slowest_stage_s = max(r["stage_time_s"] for r in ranks)
    predicted_schedule, predicted_mb = predicted
    return {
        "runner": runner,
        "samples_per_s": round(setup.num_microbatches * setup.microbatch_size / step_time_s, 3),
        "ratio_vs_torch_gpipe": None,
        "step_time_ms": round(1000 * step_time_s, 1),
        "step_cpu_ms": [round(1000 * r["step_cpu_s"], 1) for r in ranks],
        "efficiency": round(slowest_stage_s * setup.num_microbatches / step_time_s, 3),
        "stage_time_ms": [round(1000 * r["stage_time_s"], 1) for r in ranks],
        "peak_memory_mb": [round(r["peak_bytes"] / MB, 1) for r in ranks],
        "predicted_memory_mb": _rounded(predicted_mb),
        "predicted_schedule": predicted_schedule,
        "stage_rank": setup.ranks_of_stages(),
        "weight_mb": [round(r["weight_bytes"] / MB, 1) for r in ranks],
        # The losses are the last stage's rank's (rank 0 on a V).
        "losses": [None if v is None else round(v, 4) for v in ranks[setup.ranks_of_stages()[-1]]["losses"]],
        "error": None,
    }


def _rounded(values: list[float] | None) -> list[float] | None:
    return None if values is None else [round(v, 1) for v in values]


def failed_row(runner: str, error: str) -> dict:
    return {
        "runner": runner,
        "samples_per_s": None,
        "peak_memory_mb": None,
        "predicted_memory_mb": None,
        "efficiency": None,
        "error": error,
    }


def median_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per runner from its rounds: the round of median speed (the upper median of an even
    count), with every round's samples/s beside it and the ratio to torch/gpipe as the median of the
    rounds' ratios (each within one round, so a busy spell of the machine cancels); likewise the
    simulated step's ratio to the measured one (each launch's own profile and step)."""
    rows = []
    for rounds in runs.values():
        done = sorted((r for r in rounds if r["error"] is None), key=lambda r: r["samples_per_s"])
        row = dict(done[len(done) // 2]) if done else dict(rounds[-1])
        row["samples_per_s_runs"] = [r["samples_per_s"] for r in rounds]
        row["paired_step_ms_runs"] = [r.get("paired_step_ms") for r in rounds]
        simulated = [r["simulated_step_ms"] / r["step_time_ms"] for r in done if r.get("simulated_step_ms")]
        if simulated:
            row["simulated_ratio_runs"] = [round(ratio, 3) for ratio in simulated]
            row["simulated_ratio"] = round(statistics.median(simulated), 3)
        rows.append(row)
    by_runner = {row["runner"]: row for row in rows}
    for row in rows:
        if row["error"] is None and BASELINE in by_runner:
            row["ratio_vs_torch_gpipe"] = round_ratio(row, by_runner[BASELINE])
    return rows


def round_ratio(row: dict[str, Any], other: dict[str, Any]) -> float | None:
    """Median over the rounds both ran of row's speed / other's (None if no round has both): with
    ``--paired``, each round's the median of their step-by-step ratios in its paired launch; else each
    round's samples/s / other's, from their separate launches."""
    paired = zip(row.get("paired_step_ms_runs", ()), other.get("paired_step_ms_runs", ()))
    ratios = [statistics.median(b / a for a, b in zip(mine, theirs)) for mine, theirs in paired if mine and theirs]
    if not ratios:
        runs = zip(row.get("samples_per_s_runs", ()), other.get("samples_per_s_runs", ()))
        ratios = [a / b for a, b in runs if a and b]
    return round(statistics.median(ratios), 3) if ratios else None


def _speedup(out: list[Check], name: str, row: dict | None, other: dict | None, minimum: float) -> None:
    ratio = None if row is None or other is None else round_ratio(row, other)
    if ratio is None:
        out.append((name, "n/a (a runner did not run)"))
    else:
        out.append((name, verdict(ratio >= minimum, f"{ratio:.3f}x")))


def _memory(out: list[Check], runner: str, row: dict | None) -> None:
    name = f"{runner} peak memory within {MAX_MEMORY_ERROR:.0%} of the prediction on every rank"
    if row is None or row["predicted_memory_mb"] is None:
        out.append((name, "n/a"))
        return
    errors = [m / p - 1 for m, p in zip(row["peak_memory_mb"], row["predicted_memory_mb"])]
    figures = ", ".join(f"{e:+.0%}" for e in errors)
    out.append((name, verdict(all(abs(e) <= MAX_MEMORY_ERROR for e in errors), figures)))


def _simulated(out: list[Check], runner: str, row: dict | None) -> None:
    name = f"{runner} simulated step within {MAX_STEP_ERROR:.0%} of the measured one"
    if row is None or row.get("simulated_ratio") is None:
        out.append((name, "n/a"))
        return
    error = row["simulated_ratio"] - 1
    figures = f"{error:+.0%}"
    if len(row["simulated_ratio_runs"]) > 1:
        figures += ", median of the rounds' " + ", ".join(f"{r - 1:+.0%}" for r in row["simulated_ratio_runs"])
    out.append((name, verdict(abs(error) <= MAX_STEP_ERROR, figures)))


def checks(rows: list[dict[str, Any]]) -> list[Check]:
    """(check, verdict) pairs; verdicts are PASS, FAIL or n/a with the figures (ratios: medians of the
    rounds' ratios)."""
    ok_rows = {row["runner"]: row for row in rows if row["error"] is None}
    out: list[Check] = []
    for schedule in PAIRED:
        name = f"hf_ftpipe/{schedule} >= torch/{schedule}"
        _speedup(out, name, ok_rows.get(f"hf_ftpipe/{schedule}"), ok_rows.get(f"torch/{schedule}"), 1.0)
    ours = _best([r for name, r in ok_rows.items() if name.startswith("hf_ftpipe/") and _synchronous(name)])
    theirs = _best([r for name, r in ok_rows.items() if name.startswith("torch/")])
    name = "our best synchronous >= torch's best synchronous"
    if ours is not None and theirs is not None:
        name += f" ({ours['runner']} vs {theirs['runner']})"
    _speedup(out, name, ours, theirs, 1.0)
    name = f"hf_ftpipe/zbv >= {MIN_ZBV_SPEEDUP}x hf_ftpipe/gpipe"
    _speedup(out, name, ok_rows.get("hf_ftpipe/zbv"), ok_rows.get("hf_ftpipe/gpipe"), MIN_ZBV_SPEEDUP)
    for runner in NEW_SCHEDULES:
        _memory(out, runner, ok_rows.get(runner))
    for runner in NEW_SCHEDULES:
        _simulated(out, runner, ok_rows.get(runner))
    async_row = ok_rows.get("hf_ftpipe/async")
    name = f"hf_ftpipe/async >= {MIN_ASYNC_SPEEDUP}x {BASELINE}"
    _speedup(out, name, async_row, ok_rows.get(BASELINE), MIN_ASYNC_SPEEDUP)
    name = f"hf_ftpipe/gradient_accumulation within {MAX_ACCUMULATION_SLOWDOWN:.0%} of hf_ftpipe/1f1b"
    accumulating, whole = ok_rows.get("hf_ftpipe/gradient_accumulation"), ok_rows.get("hf_ftpipe/1f1b")
    _speedup(out, name, accumulating, whole, 1 - MAX_ACCUMULATION_SLOWDOWN)
    name = f"hf_ftpipe/async efficiency >= {MIN_ASYNC_EFFICIENCY:.0%}"
    if async_row is None:
        out.append((name, "n/a"))
    else:
        efficiency = async_row["efficiency"]
        out.append((name, verdict(efficiency >= MIN_ASYNC_EFFICIENCY, f"{efficiency:.0%}")))
    _memory(out, "hf_ftpipe/async", async_row)
    return out


def _synchronous(runner: str) -> bool:
    """A hf_ftpipe runner whose schedule flushes (gradient accumulation aside: another batch size per pass)."""
    kind, schedule = runner_schedule(runner)
    return schedule != "gradient_accumulation" and flushes(schedule)


def _best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest by its ratio to torch/gpipe (within rounds) where there is one, else by samples/s."""
    return max(rows, key=lambda r: (r.get("ratio_vs_torch_gpipe") or 0.0, r["samples_per_s"]), default=None)


def _per_rank(values: list[float] | None, digits: int = 0) -> str:
    return "-" if values is None else " / ".join(f"{v:.{digits}f}" for v in values)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ["runner", "samples/s", f"vs {BASELINE}", "step ms", "sim ms", "CPU ms", "efficiency", "stage ms"]
    header.append("peak MB")
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
                "-" if row.get("simulated_step_ms") is None else f"{row['simulated_step_ms']:.0f}",
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


def print_notes(
    setup: Setup,
    splits: dict[int, dict[str, Any]],
    rows: list[dict[str, Any]],
    cores: int,
    repeats: int,
    paired_steps: int | None = None,
) -> None:
    notes = []
    for num_stages, split in sorted(splits.items()):
        split_setup = dataclasses.replace(setup, stage_rank=tuple(range(num_stages)))
        stages = []
        for s, params in enumerate(split["stage_params"]):
            blocks = split_setup.blocks_of(s)
            parts = (["embeddings"] if s == 0 else []) + [f"blocks {blocks[0]}-{blocks[-1]}"]
            parts += ["ln_f + lm_head + loss"] if s == num_stages - 1 else []
            stages.append(f"stage {s} = {' + '.join(parts)} ({params / 1e6:.2f} M params)")
        notes.append(f"split of {num_stages} stages: {'; '.join(stages)}.")
    notes += [
        f"  On {setup.num_ranks} ranks: {setup.num_ranks} stages one per rank; {2 * setup.num_ranks} stages as a V "
        "(stage s on rank min(s, 2P-1-s): *-v, zbv, dualpipev) or looped (rank s mod P: interleaved-1f1b).",
        "  Both runners' stages hold the same parameters and give the model's loss on the first micro-batch "
        f"({next(iter(splits.values()))['loss']:.4f}): checked.",
        f"ranks: {setup.num_ranks} on {setup.device} ({'NCCL' if setup.device == 'cuda' else 'gloo'}), "
        f"{setup.threads_per_rank} torch thread(s) each ({cores} cores); fresh processes per runner.",
        f"step ms: median of {setup.steps} timed steps after {setup.warmup} warm-up, the slowest rank's"
        + (
            f"; the run of median speed of {repeats} rounds (ratios: median of the rounds' ratios)"
            if repeats > 1
            else ""
        )
        + "; samples/s = micro-batches × micro-batch size / step.",
        *(
            [
                f"vs {BASELINE} and the speed checks (--paired): per round, one more launch builds every runner and "
                f"steps them in turn ({setup.warmup} warm-up, then {paired_steps} steps of each, every step between "
                "barriers); a ratio is the median of its step-by-step ratios there, then the median over the rounds.",
            ]
            if paired_steps
            else []
        ),
        "CPU ms: each rank's process CPU time per step (median; its threads, gloo's included): what a step costs "
        "when the shared cores make wall-clock times vary.",
        "stage ms: each rank's stages, forward + backward of one micro-batch with no communication (fastest of "
        f"{setup.stage_repeats},",
        "  every rank at once, the runner's own stage modules: exported-graph stages for hf_ftpipe, eager GPT-2 "
        "blocks for torch; summed over a rank's stages).",
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
        "  set. torch's runners get our prediction of the matching schedule on the same placement (gpipe, 1f1b,",
        "  interleaved-1f1b, zbv; DualPipeV: zbv's), or 1f1b's where this hf_ftpipe lacks it:",
        "  "
        + ", ".join(f"{row['runner']} -> {row['predicted_schedule']}" for row in rows if row.get("predicted_schedule"))
        + ".",
        "sim ms: hf_ftpipe.simulate of the runner's split, placement and schedule, priced by a cost table profiled",
        "  in this process right before the launch (hf_ftpipe.profile_traced, a rank's threads), as",
        "  benchmarks/simulator.py --profile alone does; synchronous hf_ftpipe runners only. Checked: the median",
        "  over rounds of sim ms / step ms, each launch's own.",
        "loss: first warm-up step -> last timed step (every runner starts from the same weights and data).",
    ]
    if any(row["error"] is None and row["efficiency"] > 1.0 for row in rows):
        notes.append("WARNING: an efficiency above 100% means the machine was busy while steps or stages were timed.")
    print("\n" + "\n".join(notes))
