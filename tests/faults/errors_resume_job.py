"""PipeTrainer resumed from what is not a checkpoint, or not a whole one, started by `accelerate launch`.

``errors_resume_job.py ROOT`` trains the run of ``tests/helpers/resume_runs.py`` into ``ROOT/trained``
(checkpoints at steps 3 and 6); rank 0 copies ``checkpoint-3`` without ``optimizer/rank1.safetensors``.
Then every rank resumes from a path that does not exist (a model with weights, and one built with
empty weights) and from the incomplete copy. Each rank writes the `CheckpointError` of each case
to ``ROOT/{case}-rank{r}.txt``; no case may fail otherwise.
"""

import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from hf_ftpipe import CheckpointError

from resume_runs import run


def refused(root: Path, case: str, spec: dict) -> None:
    try:
        run({"output_dir": str(root / case), **spec})
    except CheckpointError as error:
        (root / f"{case}-rank{dist.get_rank()}.txt").write_text(str(error))
        return
    raise AssertionError(f"{case}: resuming should have failed")


def main(root: Path) -> None:
    run({"output_dir": str(root / "trained")})
    incomplete = root / "incomplete-checkpoint"
    if dist.get_rank() == 0:
        shutil.copytree(root / "trained" / "checkpoint-3", incomplete)
        (incomplete / "optimizer" / "rank1.safetensors").unlink()
    dist.barrier()
    missing = str(root / "no-such-checkpoint")
    refused(root, "missing", {"resume": missing})
    refused(root, "missing-empty-weights", {"resume": missing, "empty_weights": True})
    refused(root, "incomplete", {"resume": str(incomplete)})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
