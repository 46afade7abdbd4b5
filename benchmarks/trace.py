"""Time `trace_model` on full-size models built on the meta device (no weights, no GPU).

Each model is traced in its own subprocess so that its peak RSS is its own; the parent collects
one JSON line per child. Target (FTPipe issue): every model under 30 s and 4 GB of RSS.

    python benchmarks/trace.py                          # all models, a table
    python benchmarks/trace.py --models t5-3b --json    # a JSON list
    python benchmarks/trace.py --one gpt2-xl            # one model in this process, one JSON line

Shapes: T5-3B at batch 8, source 512, target 128 (the heavier of FTPipe's T5 settings; RTE at
320/8 traces the same graph with smaller shapes); GPT2-XL at batch 1, 1024 tokens with labels;
BERT-large for SQuAD at batch 24, 384 tokens, start/end positions as labels.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]


def _t5_3b() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=32128,
        d_model=1024,
        d_kv=128,
        d_ff=16384,
        num_layers=24,
        num_decoder_layers=24,
        num_heads=32,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5ForConditionalGeneration(config)


def _gpt2_xl() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25))


def _bert_large() -> torch.nn.Module:
    from transformers import BertConfig, BertForQuestionAnswering

    config = BertConfig(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
    )
    return BertForQuestionAnswering(config)


LONG = torch.int64
CASES: dict[str, Case] = {
    "t5-3b": Case(
        _t5_3b,
        {
            "input_ids": ((8, 512), LONG),
            "attention_mask": ((8, 512), LONG),
            "labels": ((8, 128), LONG),
        },
    ),
    "gpt2-xl": Case(
        _gpt2_xl,
        {
            "input_ids": ((1, 1024), LONG),
            "attention_mask": ((1, 1024), LONG),
            "labels": ((1, 1024), LONG),
        },
    ),
    "bert-large": Case(
        _bert_large,
        {
            "input_ids": ((24, 384), LONG),
            "attention_mask": ((24, 384), LONG),
            "token_type_ids": ((24, 384), LONG),
            "start_positions": ((24,), LONG),
            "end_positions": ((24,), LONG),
        },
    ),
}


def measure(name: str) -> dict[str, object]:
    """Build ``name`` on the meta device and trace it; returns the row for this process."""
    from hf_ftpipe.graph import trace_model

    case = CASES[name]
    start = time.perf_counter()
    with torch.device("meta"):
        model = case.build()
    build_s = time.perf_counter() - start
    inputs = {key: torch.empty(shape, dtype=dtype, device="meta") for key, (shape, dtype) in case.inputs.items()}
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
    parser.add_argument("--models", nargs="+", choices=sorted(CASES), default=list(CASES), help="models to trace")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--one", choices=sorted(CASES), help="trace one model in this process (used by the parent)")
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
