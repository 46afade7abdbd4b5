"""The rows, checks and printout of ``benchmarks/runtime.py``: one row per runner from its ranks' figures.

Apart from the runs themselves, so that what is reported (the table, the notes that say how each
column was measured, the targets checked) reads in one place; the JSON rows are `make_row`'s.
"""

from __future__ import annotations

from typing import Any

from _checks import verdict
from _gpt2_split import Setup
from _runtime_ranks import SYNCHRONOUS

BASELINE = "torch/gpipe"
MIN_ASYNC_SPEEDUP = 1.15
MIN_ASYNC_EFFICIENCY = 0.90
MAX_MEMORY_ERROR = 0.10
MAX_ACCUMULATION_SLOWDOWN = 0.05
MB = 2**20


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
