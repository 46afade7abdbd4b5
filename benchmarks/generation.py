"""Generation through the pipeline with each stage's key/value cache, without it, and on one process.

Runners, each in fresh processes:

- ``pipeline_cache``: ``PipeTrainer.generate`` on 2 CPU ranks (gloo, one torch thread each), each
  stage's keys and values kept on its rank (`hf_ftpipe.runtime.KVDecoder`): a new token costs one
  token's work per stage;
- ``pipeline_no_cache``: the same with ``use_cache=False``: every new token runs the whole prefix
  through the pipeline again;
- ``single_process``: ``model.generate`` on one process (one torch thread by default, transformers'
  own cache).

The model (``--model``) is a GPT-2 built from a config (4 layers, d_model 256, 4 heads, vocabulary
2048, no dropout, sdpa) with 4 left-padded prompts of 32 tokens (32, 31, 30 and 29 real ones), or a
T5 of the same sizes (4 encoder and 4 decoder layers, d_ff 1024) with those prompts padded on the
right as its encoder's source (the cache: `hf_ftpipe.runtime.encoder_decoder_decoding`); greedy,
exactly 32 and 128 new tokens per row (``min_new_tokens``); the pipeline is planned by ``seq-dp``
for 2 ranks, 2 micro-batches. Each length is generated ``--repeats`` times after one untimed call;
``tokens/s`` = rows × new tokens / the median call's seconds. The check (issue 26's target): with
the cache, the time per new token at 128 is within 1.5× of that at 32 (no quadratic growth).

    python benchmarks/generation.py              # a table and the check
    python benchmarks/generation.py --model t5   # the same for T5
    python benchmarks/generation.py --json       # one JSON object per runner and length, one per line
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _checks import failed, print_checks, verdict
from _launch import run_for_result

HERE = Path(__file__).resolve().parent
RUNNERS = ("pipeline_cache", "pipeline_no_cache", "single_process")
MAX_GROWTH = 1.5
"""With the cache: time per new token at the longest length over that at the shortest, at most."""


def launch(folder: Path, runner: str, timeout_s: float) -> dict[str, Any]:
    """Run ``runner`` in fresh processes; its figures. Raises RuntimeError with the first traceback."""
    result = folder / f"result-{runner}.json"
    script = [str(HERE / "_generation_rank.py"), str(folder / "config.json"), runner, str(result)]
    if runner == "single_process":
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(folder / "hf_home"), "HF_HUB_OFFLINE": "1"}
    return run_for_result(runner, command, env, result, timeout_s)


def rows_of(runner: str, figures: dict[str, Any], config: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for new_tokens in config["new_tokens"]:
        median_s = figures[str(new_tokens)]["median_s"]
        rows.append(
            {
                "runner": runner,
                "new_tokens": new_tokens,
                "tokens_per_s": round(config["rows"] * new_tokens / median_s, 2),
                "ms_per_new_token": round(1000 * median_s / new_tokens, 2),
                "seconds": [round(s, 3) for s in figures[str(new_tokens)]["seconds"]],
                "error": None,
            }
        )
    return rows


def checks(rows: list[dict[str, Any]], tokens: dict[str, dict[str, Any]], config: dict[str, Any]) -> list:
    shortest, longest = min(config["new_tokens"]), max(config["new_tokens"])
    cached = {r["new_tokens"]: r for r in rows if r["runner"] == "pipeline_cache" and r["error"] is None}
    found = []
    if shortest in cached and longest in cached:
        growth = cached[longest]["ms_per_new_token"] / cached[shortest]["ms_per_new_token"]
        figures = f"{cached[longest]['ms_per_new_token']} ms at {longest} / {cached[shortest]['ms_per_new_token']} ms"
        found.append(
            (
                f"pipeline_cache ms per new token, {longest} vs {shortest}",
                verdict(growth <= MAX_GROWTH, f"{growth:.2f}x <= {MAX_GROWTH}x: {figures} at {shortest}"),
            )
        )
    else:
        found.append(("pipeline_cache ms per new token", "n/a (pipeline_cache did not run)"))
    reference = tokens.get("single_process")
    for runner in ("pipeline_cache", "pipeline_no_cache"):
        if runner in tokens and reference is not None:
            same = all(tokens[runner][str(n)]["tokens"] == reference[str(n)]["tokens"] for n in config["new_tokens"])
            found.append((f"{runner} tokens equal single_process's", verdict(same, "greedy, every length")))
    return found


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'runner':<20} {'new tokens':>10} {'tokens/s':>10} {'ms/new token':>13}  seconds (each call)")
    for row in rows:
        if row["error"] is not None:
            print(f"{row['runner']:<20} {row['new_tokens']:>10} failed: {row['error'].splitlines()[0]}")
            continue
        seconds = ", ".join(f"{s:.2f}" for s in row["seconds"])
        figures = f"{row['tokens_per_s']:>10} {row['ms_per_new_token']:>13}"
        print(f"{row['runner']:<20} {row['new_tokens']:>10} {figures}  {seconds}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("gpt2", "t5"), default="gpt2", help="the model generating (see above)")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS), metavar="RUNNER")
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per length (median taken)")
    parser.add_argument(
        "--single-process-threads",
        type=int,
        default=1,
        help="torch threads of single_process (1: on shared cores a second thread can make it slower, not faster)",
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per runner")
    parser.add_argument("--json", action="store_true", help="one JSON object per runner and length, one per line")
    args = parser.parse_args()
    config = {
        "model": args.model,
        "layers": 4,
        "d_model": 256,
        "heads": 4,
        "vocab": 2048,
        "rows": 4,
        "prompt_length": 32,
        "microbatches": 2,
        "new_tokens": sorted(args.new_tokens),
        "repeats": args.repeats,
        "single_process_threads": args.single_process_threads,
    }
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    tokens: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "config.json").write_text(json.dumps(config))
        for runner in args.runners:
            try:
                figures = launch(folder, runner, args.timeout_s)
            except RuntimeError as error:
                rows += [{"runner": runner, "new_tokens": n, "error": str(error)} for n in config["new_tokens"]]
                continue
            tokens[runner] = figures
            rows += rows_of(runner, figures, config)
            if not args.json:
                print(f"{runner} done after {time.perf_counter() - started:.0f} s", file=sys.stderr)
    found = checks(rows, tokens, config)
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows)
        print(f"load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print_checks(found, started)
    return 1 if failed(found) else 0


if __name__ == "__main__":
    sys.exit(main())
