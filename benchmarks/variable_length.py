"""Dynamic padding through the pipeline: fine-tuning on sentences of natural lengths, three ways.

A BERT-style classifier (built from a config: hidden 256, 4 layers, 4 heads, maximum length 128)
fine-tuned through `PipeTrainer` on 2 CPU ranks (torchrun, gloo, one torch thread each, gpipe,
4 micro-batches of 4), on English sentences whose lengths are skewed as real text is (the Python
language reference shipped with CPython; `_variable_length_data.py`): most rows are far shorter
than the maximum. Runners, side by side in one run, each in fresh rank processes:

- ``max_length``: every row padded to the maximum (``run_glue.py --pad_to_max_length``);
- ``dynamic``: `DataCollatorWithPadding`, each batch padded to its longest row;
- ``dynamic_group_by_length``: the same with ``train_sampling_strategy="group_by_length"``.

    python benchmarks/variable_length.py            # a table and the checks (about 6 minutes on 2 cores)
    python benchmarks/variable_length.py --json     # one JSON object per runner, one per line
    python benchmarks/variable_length.py --repeats 1 --samples 256   # a quick look

Every runner plans for the maximum length (``plan_max_length``), so all share one partition.
samples/s: the samples of one epoch over its wall time (data loading, pipeline, optimizer), after
two untimed warm-up steps of the longest batch; the median over ``--repeats`` launches, run
round-robin so that a busy spell of the machine hits every runner alike. CPU ms/sample: both
ranks' CPU time per sample, which other work on a shared machine does not stretch (compare its
ratios there too). Peak memory per rank: the rank's peak resident set size (``ru_maxrss``: the
interpreter and libraries included).
The ``dynamic`` runner also times the engine's ``train_step`` on a batch of a length the run has
not seen (the first step of a new length) against the same batch again (a known length).

Targets (issue 25): ``dynamic`` ≥ 1.3× and ``dynamic_group_by_length`` ≥ 1.6× ``max_length``
samples/s; the first step of a new length ≤ 2× a step of a known one. Exit status 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _checks import failed, print_checks, verdict  # noqa: E402
from _launch import run_for_result  # noqa: E402

RUNNERS = ("max_length", "dynamic", "dynamic_group_by_length")
TARGETS = {"dynamic": 1.3, "dynamic_group_by_length": 1.6}
MAX_NEW_LENGTH_COST = 2.0


def prepare(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Write what every runner reads (config, sentences, tokenizer); return the length statistics."""
    import transformers
    from _variable_length_data import build_tokenizer, label_of, length_stats, sample_sentences, sentences

    transformers.logging.set_verbosity_error()
    texts = sample_sentences(args.samples, args.seed)
    tokenizer = build_tokenizer(sentences(), vocab_size=args.vocab)
    tokenizer.save_pretrained(folder / "tokenizer")
    labels = [label_of(text) for text in texts]
    (folder / "sentences.json").write_text(json.dumps({"texts": texts, "labels": labels}))
    config = {
        "seed": args.seed,
        "hidden": args.hidden,
        "layers": args.layers,
        "heads": args.heads,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "num_microbatches": args.microbatches,
        "schedule": args.schedule,
        "partitioner": args.partitioner,
        "threads_per_rank": 1,
        "probe": not args.no_probe,
    }
    (folder / "config.json").write_text(json.dumps(config))
    stats = length_stats(tokenizer, texts, args.max_length)
    return {**vars(stats), "labels_positive": sum(labels) / len(labels), "vocab": len(tokenizer)}


def launch(folder: Path, runner: str, timeout_s: float) -> list[dict[str, Any]]:
    """Run ``runner`` on 2 fresh ranks; every rank's figures, with ``launched`` (time.time()) added.
    Raises RuntimeError with the first rank's traceback."""
    result = folder / f"result-{runner}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(HERE / "_variable_length_rank.py"), str(folder), runner, str(result),
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(folder / "hf_home"),  # plans cached here, not in the user's cache
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    launched = time.time()
    ranks = run_for_result(runner, command, env, result, timeout_s)
    for rank in ranks:
        rank["phases"]["launched"] = launched
    return ranks


PHASES = ("launched", "imported", "trainer_built", "traced_and_planned", "warmed_up", "trained", "probed")


def summarize(runner: str, runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One runner's row from its launches: medians over launches (per rank where per rank)."""
    samples_per_s, cpu_ms_per_sample, step_ms = [], [], []
    for ranks in runs:
        steps = ranks[0]["steps"]
        samples = sum(s["rows"] for s in steps)
        samples_per_s.append(samples / max(r["epoch_s"][-1] for r in ranks))  # the slowest rank's clock
        cpu_ms_per_sample.append(1000 * sum(r["epoch_cpu_s"][-1] for r in ranks) / samples)
        step_ms += [1000 * max(r["steps"][i]["time_s"] for r in ranks) for i in range(len(steps))]
    first = runs[0][0]
    steps = first["steps"]  # the same batches in every launch (same seed)
    computed = sum(s["rows"] * s["length"] for s in steps)
    real = sum(s["real_tokens"] for s in steps)
    phases = {}
    for before, after in zip(PHASES, PHASES[1:]):
        spans = [max(r["phases"][after] for r in ranks) - ranks[0]["phases"][before] for ranks in runs
                 if after in ranks[0]["phases"]]  # fmt: skip
        if spans:
            phases[after] = round(statistics.median(spans), 1)
    return {
        "runner": runner,
        "samples_per_s": round(statistics.median(samples_per_s), 2),
        "ratio_vs_max_length": None,
        "peak_memory_mb": [round(statistics.median(ranks[r]["peak_memory_mb"] for ranks in runs)) for r in range(2)],
        "rss_at_start_mb": [round(statistics.median(ranks[r]["rss_at_start_mb"] for ranks in runs)) for r in range(2)],
        "samples_per_s_launches": [round(v, 2) for v in samples_per_s],
        "cpu_ms_per_sample": round(statistics.median(cpu_ms_per_sample), 1),
        "cpu_ratio_vs_max_length": None,
        "steps": len(steps),
        "step_ms_median": round(statistics.median(step_ms), 1),
        "tokens_per_sample": round(computed / sum(s["rows"] for s in steps), 1),
        "token_ratio_vs_max_length": None,
        "padding_fraction": round(1 - real / computed, 3),
        "distinct_lengths": len({s["length"] for s in steps}),
        "shapes_cached": first["shapes_cached"],
        "planned_length": first["planned"]["input_ids"][1],
        "stages_per_rank": [ranks["stages"] for ranks in runs[0]],
        "launch_phases_s": phases,
        "probe": _probe_summary([ranks for ranks in runs if "probe" in ranks[0]]),
        "_step_tokens": [s["rows"] * s["length"] for s in steps],
    }


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope of ``points``."""
    mean_x, mean_y = statistics.mean(x for x, _ in points), statistics.mean(y for _, y in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def _probe_summary(runs: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The first step of a new length over a step of the same batch again, per length and launch;
    the known steps fitted as fixed ms + ms per token."""
    if not runs:
        return None
    lengths, ratios, formulas_ms, first_ms, known_ms, points = [], [], [], [], [], []
    for ranks in runs:
        for i, item in enumerate(ranks[0]["probe"]):
            if item["new_shapes"] != 1:
                raise RuntimeError(f"probe length {item['length']} added {item['new_shapes']} shapes, not 1")
            first = max(r["probe"][i]["first_s"] for r in ranks)
            known = statistics.median(max(r["probe"][i]["known_s"][k] for r in ranks) for k in range(2))
            lengths.append(item["length"])
            ratios.append(first / known)
            first_ms.append(1000 * first)
            known_ms.append(1000 * known)
            points.append((item["rows"] * item["length"], 1000 * known))
            formulas_ms.append(1000 * max(r["probe"][i]["formulas_new_s"] for r in ranks))
    fixed_ms, ms_per_token = _line(points)
    return {
        "lengths": sorted(set(lengths)),
        "ratio_median": round(statistics.median(ratios), 2),
        "ratio_max": round(max(ratios), 2),
        "first_ms_median": round(statistics.median(first_ms), 1),
        "known_ms_median": round(statistics.median(known_ms), 1),
        "shape_formulas_ms_median": round(statistics.median(formulas_ms), 2),
        "shape_formulas_ms_max": round(max(formulas_ms), 2),
        "step_fixed_ms": round(fixed_ms, 1),
        "step_us_per_token": round(1000 * ms_per_token, 1),
    }


def compare(rows: dict[str, dict[str, Any]]) -> None:
    """Ratios to ``max_length``: measured, in CPU time, in computed tokens, and as the probe's fit
    of step time (fixed + per token) predicts them for each runner's batches."""
    baseline = rows.get("max_length")
    probe = rows.get("dynamic", {}).get("probe")
    for row in rows.values():
        tokens = row.pop("_step_tokens")
        if probe is not None:
            row["fitted_pipeline_s"] = round(sum(probe["step_fixed_ms"] + probe["step_us_per_token"] * t / 1000
                                                 for t in tokens) / 1000, 1)  # fmt: skip
        if baseline is None:
            continue
        row["ratio_vs_max_length"] = round(row["samples_per_s"] / baseline["samples_per_s"], 2)
        row["cpu_ratio_vs_max_length"] = round(baseline["cpu_ms_per_sample"] / row["cpu_ms_per_sample"], 2)
        row["token_ratio_vs_max_length"] = round(baseline["tokens_per_sample"] / row["tokens_per_sample"], 2)
    if baseline is not None and probe is not None:
        for row in rows.values():
            row["fitted_ratio_vs_max_length"] = round(baseline["fitted_pipeline_s"] / row["fitted_pipeline_s"], 2)


def checks(rows: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(check, verdict) pairs; verdicts are PASS, FAIL or n/a with the figures."""
    out = []
    for runner, target in TARGETS.items():
        name = f"{runner} >= {target}x max_length samples/s"
        ratio = rows.get(runner, {}).get("ratio_vs_max_length")
        out.append((name, "n/a" if ratio is None else verdict(ratio >= target, f"{ratio:.2f}x")))
    probe = rows.get("dynamic", {}).get("probe")
    name = f"first step of a new length <= {MAX_NEW_LENGTH_COST}x a known one"
    if probe is None:
        out.append((name, "n/a"))
    else:
        figures = f"median {probe['ratio_median']:.2f}x, worst {probe['ratio_max']:.2f}x"
        out.append((name, verdict(probe["ratio_max"] <= MAX_NEW_LENGTH_COST, figures)))
    return out


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ["runner", "samples/s", "vs max_length", "launches", "CPU ms/sample", "tokens/sample", "fitted",
              "padding", "lengths", "step ms", "peak MB (rank 0 / 1)", "at start MB"]  # fmt: skip
    table = [header]
    for row in rows:
        table.append(
            [
                row["runner"],
                f"{row['samples_per_s']:.1f}",
                _ratio(row["ratio_vs_max_length"]),
                ", ".join(f"{v:.1f}" for v in row["samples_per_s_launches"]),
                f"{row['cpu_ms_per_sample']:.0f} ({_ratio(row['cpu_ratio_vs_max_length'])})",
                f"{row['tokens_per_sample']:.1f} ({_ratio(row['token_ratio_vs_max_length'])})",
                _ratio(row.get("fitted_ratio_vs_max_length")),
                f"{row['padding_fraction']:.0%}",
                str(row["distinct_lengths"]),
                f"{row['step_ms_median']:.0f}",
                " / ".join(str(v) for v in row["peak_memory_mb"]),
                " / ".join(str(v) for v in row["rss_at_start_mb"]),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


NOTES = """
samples/s: one epoch's samples over its wall time (the slowest rank), the median of the launches listed.
CPU ms/sample: both ranks' CPU time in the epoch per sample (not stretched by other load); (x): max_length's
  over this runner's. tokens/sample: tokens computed per sample (rows x padded length); (x): the ratio if
  time followed computed tokens alone. fitted: the ratio the probe's fit of a step (fixed + per token)
  predicts for each runner's batches. padding: the share of computed tokens that are padding. lengths:
  distinct batch lengths in the epoch. step ms: the median train_step (pipeline only, slowest rank).
peak MB: each rank's ru_maxrss (interpreter and libraries included); at start MB: the same once the
  pipeline is traced, planned and warmed up on the longest batch."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS), metavar="RUNNER")
    parser.add_argument("--repeats", type=int, default=3, help="launches per runner, round-robin; medians")
    parser.add_argument("--samples", type=int, default=512, help="training sentences (one timed epoch)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--partitioner", default="auto", help="PipeTrainingArguments.partitioner (the plan)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary (upper bound)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-probe", action="store_true", help="skip the new-length step measurement")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="limit per launch")
    parser.add_argument("--json", action="store_true", help="print one JSON object per runner, one per line")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.batch_size % args.microbatches:
        parser.error(f"--batch-size ({args.batch_size}) must be a multiple of --microbatches ({args.microbatches})")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="variable_length-") as name:
        folder = Path(name)
        stats = prepare(folder, args)
        runs: dict[str, list[Any]] = {runner: [] for runner in args.runners}
        for repeat in range(args.repeats):
            for runner in args.runners:
                launched = time.perf_counter()
                runs[runner].append(launch(folder, runner, args.timeout_s))
                if not args.json:
                    elapsed_s = time.perf_counter() - launched
                    print(f"  {runner} ({repeat + 1}/{args.repeats}): {elapsed_s:.0f} s", file=sys.stderr)
    rows = {runner: summarize(runner, launches) for runner, launches in runs.items()}
    compare(rows)
    for row in rows.values():
        row.update(mean_length=round(stats["mean"], 1), plan_max_length=args.max_length, repeats=args.repeats)
    verdicts = checks(rows)
    if args.json:
        for row in rows.values():
            print(json.dumps(row))
        return 1 if failed(verdicts) else 0
    print(
        f"BERT classifier (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocabulary "
        f"{stats['vocab']}), maximum length {args.max_length}; 2 ranks on CPU (gloo, 1 thread each), "
        f"{args.schedule}, batch {args.batch_size} = {args.microbatches} micro-batches; {stats['count']} sentences, "
        f"one timed epoch, medians of {args.repeats} launches\n"
        f"lengths (tokens, truncated at {args.max_length}): mean {stats['mean']:.1f} "
        f"({stats['mean'] / args.max_length:.0%} of the maximum), median {stats['median']:.0f}, 90th percentile "
        f"{stats['p90']}, longest {stats['longest']} ({stats['truncated']} rows truncated)\n"
    )
    print_table(list(rows.values()))
    print(NOTES)
    probe = rows.get("dynamic", {}).get("probe")
    if probe is not None:
        print(
            f"\nnew length (dynamic runner, after training): train_step on {args.batch_size} rows of a length the run "
            f"had not seen ({', '.join(map(str, probe['lengths']))}): {probe['first_ms_median']:.0f} ms (median) "
            f"against {probe['known_ms_median']:.0f} ms for the same batch again, {probe['ratio_median']:.2f}x "
            f"(worst {probe['ratio_max']:.2f}x).\n  The new shape's formulas (ShapeBook.of on a fresh book): "
            f"{probe['shape_formulas_ms_median']:.2f} ms (worst {probe['shape_formulas_ms_max']:.2f}). The known "
            f"steps fit {probe['step_fixed_ms']:.0f} ms + {probe['step_us_per_token']:.0f} µs per computed token."
        )
    for row in rows.values():
        phases = ", ".join(f"{name} {seconds:.0f}" for name, seconds in row["launch_phases_s"].items())
        print(f"launch phases of {row['runner']} (s, median, each from the previous): {phases}")
    print_checks(verdicts, started)
    return 1 if failed(verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
