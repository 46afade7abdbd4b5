"""PipeTrainer with pipeline replicas, for test_replicas_trainer.py: every run of
`replica_trainer_runs.RUNS` in one ``torchrun --nproc_per_node 4`` launch (starting 4 processes is
most of a launch's time), in order (the last resumes the first's checkpoint).

Rank 0 writes ``OUTPUT/<run>.pt`` with the run's logs and what it ran.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from replica_trainer_runs import RUNS, pipe_run


def main(output_dir: str) -> None:
    for spec in RUNS:
        result = pipe_run(spec, output_dir)
        if torch.distributed.get_rank() == 0:
            torch.save(result, Path(output_dir) / f"{spec['name']}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
