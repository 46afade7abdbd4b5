"""Time `trace_model` on full-size models built on the meta device (no weights, no GPU).

Each model is traced in its own subprocess so that its peak RSS is its own; the parent collects
one JSON line per child. Target (FTPipe issue): every model under 30 s and 4 GB of RSS.

    python benchmarks/trace.py                          # all models, a table
    python benchmarks/trace.py --models t5-3b --json    # a JSON list
    python benchmarks/trace.py --one gpt2-xl            # one model in this process, one JSON line

Shapes: T5-3B at batch 8, source 512, target 128 (the heavier of FTPipe's T5 settings; RTE at
320/8 traces the same graph with smaller shapes); GPT2-XL at batch 1, 1024 tokens with labels;
BERT-large for SQuAD at batch 24, 384 tokens, start/end positions as labels. Models come from
the configs shipped with hf_ftpipe (``hf_ftpipe.graph.sources``), inputs with an attention mask.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


# Model short name -> (micro-batch, sequence length, target length): the configs ship with hf_ftpipe.
SHAPES: dict[str, tuple[int, int, int | None]] = {
    "t5-3b": (8, 512, 128),
    "gpt2-xl": (1, 1024, None),
    "bert-large": (24, 384, None),
}


def measure(name: str) -> dict[str, object]:
    """Build ``name`` on the meta device and trace it; returns the row for this process."""
    from hf_ftpipe.graph import trace_model
    from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for

    start = time.perf_counter()
    model = load_model_for_planning(name)
    build_s = time.perf_counter() - start
    batch_size, seq_len, target_len = SHAPES[name]
    inputs = sample_inputs_for(model, batch_size, seq_len, target_len, attention_mask=True)
    start = time.perf_counter()
    graph = trace_model(model, inputs)
    trace_s = time.perf_counter() - start
    params = sum(p.numel for p in graph.params.values() if not p.is_buffer)
    return {
        "model": name,
        "trace_s": round(trace_s, 2),
        "build_s": round(build_s, 2),
        "num_nodes": graph.num_nodes,
        "params_b": round(params / 1e9, 3),
        "forward_tflops": round(graph.total_flops / 1e12, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),  # Linux: KiB
        "fingerprint": graph.fingerprint,
    }


def run_child(name: str, timeout_s: float) -> dict[str, object]:
    """``measure(name)`` in a fresh interpreter; its last stdout line is the JSON row."""
    result = subprocess.run(
        [sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"tracing {name} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return json.loads(lines[-1])


def print_table(rows: list[dict[str, object]]) -> None:
    columns = ["model", "trace_s", "build_s", "num_nodes", "params_b", "forward_tflops", "peak_rss_mb"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=list(SHAPES), help="models to trace")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--one", choices=sorted(SHAPES), help="trace one model in this process (used by the parent)")
    parser.add_argument("--timeout_s", type=float, default=600.0, help="limit per model")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    rows = [run_child(name, args.timeout_s) for name in args.models]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)


if __name__ == "__main__":
    main()
