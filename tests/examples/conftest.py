"""The launch the T5 example tests share: run_glue_pipe.py's tasks and run_summarization_pipe.py in one job."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from distributed import accelerate_launch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def t5_examples_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-process launch of t5_examples_job.py; each case's results in OUT/<case>/. A session fixture
    runs once per xdist worker: a new file that reads it goes in `suite_order.SHARED_LAUNCHES`, so that
    `--dist loadfile` runs it on the worker of the others."""
    out = tmp_path_factory.mktemp("t5_examples")
    start = time.monotonic()
    job = accelerate_launch(
        str(HERE / "t5_examples_job.py"),
        str(out),
        timeout_s=300,
        env={"HF_HUB_OFFLINE": "1"},  # ROUGE from the shipped rouge_mean, without waiting for the Hub
    )
    cases = list(dict.fromkeys(line for line in job.stdout.splitlines() if line.endswith(" s") and ": " in line))
    print(f"t5_examples_job.py launch: {time.monotonic() - start:.1f} s ({', '.join(cases)})")
    return out
