"""What every rank checks, and the ranks agree on, before the first training step.

Three things fail late and on one rank only if nobody looks first: ``resume_from_checkpoint=True``
taking a folder a crash left half-written, a checkpoint file that is truncated (rank 1 dies
reading its optimizer shard while rank 0 trains on), and an ``output_dir`` that cannot be written
(found by `Trainer` at the first checkpoint, after the training it was to save). So before
anything is built, each rank resolves the checkpoint to resume, reads the header of every file
in it (`hf_ftpipe.trainer.checkpoint_check`) and writes a file into ``output_dir``; the ranks
then compare what they found in one gather, and all raise the same `CheckpointError`, or all go on
with rank 0's checkpoint.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import torch.distributed as dist

from hf_ftpipe.errors import CheckpointError
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.trainer.checkpoint_check import check_resumable
from hf_ftpipe.trainer.checkpoint_folders import check_output_dir, leftovers, newest_complete
from hf_ftpipe.trainer.run_log import get_logger

__all__ = ["agree_before_training"]

logger = get_logger(__name__)


@dataclass(frozen=True)
class _Finding:
    """What one rank found: the checkpoint to resume, the folders it skipped, or the error."""

    resume: str | None
    skipped: tuple[str, ...] = ()
    error: str | None = None


def agree_before_training(
    output_dir: str, resume_from_checkpoint: str | bool | None, rank: int, watchdog: Watchdog | None
) -> str | None:
    """The checkpoint every rank resumes from (``None``: none), checked on every rank; or the same
    `CheckpointError` on every rank. ``watchdog`` bounds the gather (``None``: one process, no gather).

    Rank 0 warns once about the incomplete folders ``True`` skipped, and removes the ones a crash
    left while saving (``_tmp-checkpoint-N``): nobody has to delete anything by hand.
    """
    try:
        mine = _look(output_dir, resume_from_checkpoint, rank)
    except Exception as error:  # not a finding: the others must not wait for this rank in the gather
        if watchdog is not None:
            watchdog.report_exception("checking the checkpoint to resume and output_dir", error)
        raise
    everyone = [mine]
    if watchdog is not None:
        everyone = [None] * dist.get_world_size()
        with watchdog.waiting("checking the checkpoint to resume and output_dir on every rank", collective=True):
            dist.all_gather_object(everyone, mine)
    failed = [(r, finding.error) for r, finding in enumerate(everyone) if finding.error is not None]
    if failed:
        if mine.error is not None:
            raise CheckpointError(mine.error)
        other, error = failed[0]
        raise CheckpointError(f"[rank {rank}] rank {other} cannot start training: {error}")
    chosen = {finding.resume for finding in everyone}
    if len(chosen) > 1:
        seen = ", ".join(f"rank {r} {finding.resume}" for r, finding in enumerate(everyone))
        raise CheckpointError(
            f"the ranks found different checkpoints to resume in {output_dir} ({seen}); every rank must see the "
            "same output_dir (one machine, or a file system shared by every machine), or pass the checkpoint's path"
        )
    if rank == 0:
        if mine.skipped:
            logger.warning(
                "resume_from_checkpoint=True: resuming from %s, the newest complete checkpoint in %s; skipped %s",
                mine.resume,
                output_dir,
                "; ".join(mine.skipped),
            )
        for folder in leftovers(output_dir):
            logger.info("removing %s, left by a save that did not finish", folder)
            shutil.rmtree(folder, ignore_errors=True)
    return mine.resume


def _look(output_dir: str, resume: str | bool | None, rank: int) -> _Finding:
    skipped: tuple[str, ...] = ()
    try:
        if resume is True:
            newest, passed_over = newest_complete(output_dir)
            skipped = tuple(str(folder) for folder in passed_over)
            if newest is None:
                raise CheckpointError(
                    f"No valid checkpoint found in output directory ({output_dir}) for `resume_from_checkpoint=True`"
                    + (f" (incomplete: {'; '.join(skipped)})" if skipped else "")
                    + "; pass a checkpoint's path, or train without resuming"
                )
            resume = str(newest)
        if isinstance(resume, str):
            check_resumable(resume)
        if output_dir:
            check_output_dir(output_dir, rank)
    except CheckpointError as error:
        return _Finding(None, error=str(error))
    return _Finding(resume if isinstance(resume, str) else None, skipped)
