"""Run the T5 examples' ``main`` in one launch (2 processes): ``run_glue_pipe.py`` once per task, then
``run_summarization_pipe.py``, for test_run_glue.py and test_run_summarization.py.

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 tests/examples/t5_examples_job.py OUT

Each case writes its results to ``OUT/<case>/``: a tiny T5 trained a few steps on the fixture,
evaluated by generation. Starting the processes, importing torch and setting up the process group
once for all of them keeps the tests short.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from doc_blocks import cpu_launch_arguments
from example_modules import DATA, load_example

# case -> the flags that make it; "rte_glue" is RTE in GLUE's columns (sentence1, sentence2).
CASES: dict[str, list[str]] = {
    "boolq": ["--task_name", "boolq"],
    "cb": ["--task_name", "cb", "--train_sampling_strategy", "group_by_length"],  # batches of similar lengths
    "copa": ["--task_name", "copa"],
    # docs/examples.md's multirc command, then fewer evaluation samples (main's --output_dir comes last, and wins)
    "multirc": [*cpu_launch_arguments("docs/examples.md", "run_glue_pipe.py"), "--max_eval_samples", "12"],
    # Trainer's loss options: one optimizer step of 2 batches (one flush), label smoothing on the last stage
    "rte": ["--task_name", "rte", "--gradient_accumulation_steps", "2", "--label_smoothing_factor", "0.1"],
    "rte_glue": [
        *("--task_name", "rte", "--do_predict", "--max_steps", "40"),  # long enough to generate labels
        *("--train_file", str(DATA / "glue_rte_train.jsonl")),
        *("--validation_file", str(DATA / "glue_rte_validation.jsonl")),
    ],
    "wic": ["--task_name", "wic", "--adafactor_scale_parameter", "--learning_rate", "1e-3"],
}
# docs/examples.md's command, shortened to 4 optimizer steps of 2 accumulated batches of 8 (one flush of
# 4 micro-batches; one epoch of the first 64 items) with label smoothing; generation greedy and at most
# 12 tokens, the flags passed through.
SUMMARIZATION = [
    *cpu_launch_arguments("docs/examples.md", "run_summarization_pipe.py"),
    *("--do_train", "--do_eval", "--do_predict", "--test_file", str(DATA / "news_test.jsonl")),
    *("--max_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "8", "--num_microbatches", "2"),
    *("--gradient_accumulation_steps", "2", "--label_smoothing_factor", "0.1"),
    *("--max_train_samples", "64", "--max_eval_samples", "8", "--max_predict_samples", "8"),
    *("--per_device_eval_batch_size", "8"),
    *("--generation_max_length", "12", "--generation_num_beams", "1"),
]
COMMON = [
    *("--do_train", "--do_eval", "--max_steps", "2", "--max_train_samples", "64", "--max_eval_samples", "8"),
    *("--max_source_length", "32", "--max_target_length", "4", "--logging_steps", "1"),
    *("--per_device_train_batch_size", "4", "--num_microbatches", "2", "--per_device_eval_batch_size", "8"),
    *("--save_strategy", "no", "--use_cpu", "true"),
]


def unlabelled_test_file(out: Path) -> Path:
    """GLUE-RTE validation rows with label -1, as Hub test splits have them."""
    rows = [json.loads(line) for line in (DATA / "glue_rte_validation.jsonl").read_text().splitlines()[:5]]
    path = out / "glue_rte_test.jsonl"
    path.write_text("".join(json.dumps({**row, "label": -1}) + "\n" for row in rows))
    return path


def main(out: Path) -> None:
    run_glue = load_example("run_glue_pipe")
    test_file = unlabelled_test_file(out)
    for case, flags in CASES.items():
        start = time.monotonic()
        extra = ["--test_file", str(test_file)] if "--do_predict" in flags else []
        run_glue.main([*COMMON, *flags, *extra, "--output_dir", str(out / case)])
        print(f"{case}: {time.monotonic() - start:.1f} s", flush=True)
    start = time.monotonic()
    load_example("run_summarization_pipe").main([*SUMMARIZATION, "--output_dir", str(out / "summarization")])
    print(f"summarization: {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
