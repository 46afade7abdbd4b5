"""PipeTrainer (2 ranks) on batches as Hugging Face scripts make them, for the comparison with plain
`Trainer` in test_any_batch.py: every case of `any_batch_runs.CASES` in one launch (starting the
processes is most of a launch's time).

Rank 0 writes ``OUTPUT/<case>.pt``: the logged history, evaluation and prediction results and the
trained weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from any_batch_parts import register_logits_apart
from any_batch_runs import CASES, run


def main(output_dir: str, *names: str) -> None:
    """Run ``names`` (default: every case)."""
    from hf_ftpipe import PipeTrainer

    register_logits_apart()
    for name in names or CASES:
        result = run(name, str(Path(output_dir) / name), PipeTrainer)
        if torch.distributed.get_rank() == 0:
            torch.save(result, Path(output_dir) / f"{name}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
