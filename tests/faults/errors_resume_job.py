"""PipeTrainer resumed after a crash, and from what is no checkpoint or no whole one, started by `accelerate launch`.

``errors_resume_job.py ROOT`` runs after ``crash_save_job.py ROOT``, which left ``ROOT/crashed``
with a whole ``checkpoint-3`` and the half-written ``_tmp-checkpoint-6`` of a rank killed while saving.
Rank 0 first copies ``checkpoint-3`` (the resumed run's rotation deletes it), damaged:

- ``incomplete-checkpoint``: without ``optimizer/rank1.safetensors``;
- ``truncated-weights/checkpoint-3``: ``model.safetensors`` cut in half, beside a whole copy
  ``truncated-weights/checkpoint-2`` (the one the error advises instead);
- ``truncated-optimizer/checkpoint-3``: ``optimizer/rank1.safetensors`` cut in half;

and adds ``ROOT/crashed/checkpoint-9`` without ``trainer_state.json`` (what a crash of another tool
leaves), and a regular file ``ROOT/a-file``. Then every rank resumes ``ROOT/crashed`` with
``resume_from_checkpoint=True`` (writing ``result.json`` and ``rank{r}.pt`` there), and tries each
case that must be refused: a path that does not exist (a model with weights, and one built with
empty weights), the damaged copies, and an ``output_dir`` under the regular file. Each rank writes
the `CheckpointError` of each case to ``ROOT/{case}-rank{r}.txt``; no case may fail otherwise.

Last, every rank resumes the whole copy of ``checkpoint-3`` (``pipeline_timeout_s`` 10 s) and rank 1
fails reading its optimizer state (an I/O error), writes the time to ``ROOT/failed_at``, and
lingers as a process that caught the error would: rank 0 must stop at once, naming rank 1 and what
it was doing, and so end the job with an error.
"""

import errno
import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

from hf_ftpipe import CheckpointError, PipeTrainer

from resume_runs import run


def refused(root: Path, case: str, spec: dict) -> None:
    try:
        run({"output_dir": str(root / case), **spec})
    except CheckpointError as error:
        (root / f"{case}-rank{dist.get_rank()}.txt").write_text(str(error))
        return
    raise AssertionError(f"{case}: resuming should have failed")


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def damaged_copies(root: Path) -> None:
    source = root / "crashed" / "checkpoint-3"
    incomplete = root / "incomplete-checkpoint"
    shutil.copytree(source, incomplete)
    (incomplete / "optimizer" / "rank1.safetensors").unlink()
    shutil.copytree(source, root / "truncated-weights" / "checkpoint-2")
    shutil.copytree(source, root / "truncated-weights" / "checkpoint-3")
    truncate(root / "truncated-weights" / "checkpoint-3" / "model.safetensors")
    shutil.copytree(source, root / "truncated-optimizer" / "checkpoint-3")
    truncate(root / "truncated-optimizer" / "checkpoint-3" / "optimizer" / "rank1.safetensors")
    shutil.copytree(source, root / "crashed" / "checkpoint-9")
    (root / "crashed" / "checkpoint-9" / "trainer_state.json").unlink()
    (root / "a-file").write_text("")


class FailsReadingItsOptimizerState(PipeTrainer):
    def _read_optimizer_and_scheduler(self, checkpoint_dir: str) -> None:
        if self.engine.rank == 1:
            shard = f"{checkpoint_dir}/optimizer/rank1.safetensors"
            raise OSError(errno.EIO, os.strerror(errno.EIO), shard)
        super()._read_optimizer_and_scheduler(checkpoint_dir)


def fail_reading(root: Path) -> None:
    whole = root / "truncated-weights" / "checkpoint-2"  # a whole copy of checkpoint-3
    spec = {"output_dir": str(root / "fails-reading"), "resume": str(whole), "timeout_s": 10}
    try:
        run(spec, FailsReadingItsOptimizerState)
    except OSError:
        (root / "failed_at").write_text(str(time.time()))
        time.sleep(120)


def main(root: Path) -> None:
    dist.init_process_group("gloo")  # accelerate takes it over; the copies must be made before any rank looks
    if dist.get_rank() == 0:
        damaged_copies(root)
    dist.barrier()
    run({"output_dir": str(root / "crashed"), "resume": True, "dropout": 0.1, "save_total_limit": 1})
    missing = str(root / "no-such-checkpoint")
    refused(root, "missing", {"resume": missing})
    refused(root, "missing-empty-weights", {"resume": missing, "empty_weights": True})
    refused(root, "incomplete", {"resume": str(root / "incomplete-checkpoint")})
    refused(root, "truncated-weights", {"resume": str(root / "truncated-weights" / "checkpoint-3")})
    refused(root, "truncated-optimizer", {"resume": str(root / "truncated-optimizer" / "checkpoint-3")})
    refused(root, "unwritable", {"output_dir": str(root / "a-file" / "out")})
    fail_reading(root)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
