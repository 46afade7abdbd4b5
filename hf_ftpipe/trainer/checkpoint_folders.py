"""The checkpoint folders in ``output_dir``: a ``checkpoint-N`` exists only once it is complete.

Each rank writes its share of a checkpoint (rank 0 the model and ``trainer_state.json``, every
rank its optimizer state and random state) into ``_tmp-checkpoint-N/checkpoint-N``; once every
rank has written it (a barrier bounded by ``pipeline_timeout_s``), rank 0 renames the folder to
``checkpoint-N``. A rank killed while saving so leaves ``_tmp-checkpoint-N`` behind, never a
``checkpoint-N`` that `Trainer`'s ``get_last_checkpoint``, its rotation (``save_total_limit``) or
``load_best_model_at_end`` could take for a checkpoint. The leading underscore also keeps the
folder out of what ``push_to_hub`` uploads from ``output_dir``.

A ``checkpoint-N`` without ``trainer_state.json`` (written by another tool that crashed while
saving, or copied in part) is still no checkpoint here: `newest_complete` skips it, and the
rotation neither counts nor deletes it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from hf_ftpipe.errors import CheckpointError

__all__ = [
    "TRAINER_STATE",
    "Skipped",
    "StagedCheckpoint",
    "check_output_dir",
    "is_complete",
    "leftovers",
    "newest_complete",
    "numbered",
    "rotate_complete",
]

TRAINER_STATE = "trainer_state.json"
"""`Trainer` writes it last: a folder without it is no (complete) checkpoint."""
_STAGING_PREFIX = "_tmp-"
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


@dataclass(frozen=True)
class StagedCheckpoint:
    """Where ``checkpoint-N`` of ``run_dir`` is written before it is published.

    `Trainer` appends ``checkpoint-N`` to the folder it saves into, so the staging folder
    (``root``) holds the checkpoint folder itself (``folder``), renamed to ``final`` when complete.
    """

    run_dir: Path
    name: str

    @property
    def root(self) -> Path:
        return self.run_dir / f"{_STAGING_PREFIX}{self.name}"

    @property
    def folder(self) -> Path:
        return self.root / self.name

    @property
    def final(self) -> Path:
        return self.run_dir / self.name

    def publish(self) -> None:
        """Rank 0, once every rank wrote its share: rename the folder to ``checkpoint-N``.

        A ``checkpoint-N`` already there (a run resumed from an older checkpoint saves the same
        step again, or one a crash left incomplete) is moved aside first and deleted after, so
        that at every moment the name holds a whole checkpoint or none.
        """
        replaced = self.run_dir / f"{_STAGING_PREFIX}{self.name}-replaced"
        if self.final.exists():
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(self.final, replaced)
        os.rename(self.folder, self.final)
        shutil.rmtree(replaced, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class Skipped:
    """A folder `newest_complete` passed over, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path} ({self.reason})"


def is_complete(folder: str | os.PathLike) -> bool:
    return (Path(folder) / TRAINER_STATE).is_file()


def leftovers(run_dir: str | os.PathLike) -> list[Path]:
    """Staging folders that a save interrupted by a crash left in ``run_dir`` (rank 0 removes them
    before training, see `newest_complete`)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"{_STAGING_PREFIX}{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir())


def numbered(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders of ``run_dir``, complete or not, newest (highest N) first."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NUMBERED.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def newest_complete(run_dir: str | os.PathLike) -> tuple[Path | None, list[Skipped]]:
    """``resume_from_checkpoint=True``: the complete ``checkpoint-N`` with the highest N, and the
    incomplete folders that were skipped (staging leftovers, and ``checkpoint-N`` folders without
    ``trainer_state.json`` newer than the one taken)."""
    newest, skipped = None, []
    for _, path in numbered(run_dir):
        if is_complete(path):
            newest = path
            break
        skipped.append(Skipped(path, f"no {TRAINER_STATE}: a save that did not finish; left as it is"))
    skipped += [Skipped(path, "a save that did not finish; removed") for path in leftovers(run_dir)]
    return newest, skipped


def rotate_complete(run_dir: str | os.PathLike, save_total_limit: int | None, best: str | None) -> None:
    """`Trainer`'s rotation (``save_total_limit``), over complete checkpoints only: delete the
    oldest (by modification time, as `Trainer` orders them) until ``save_total_limit`` are left,
    never the newest nor the best. An incomplete folder is neither counted nor deleted."""
    if not save_total_limit or save_total_limit <= 0:
        return
    ordered = [Path(p) for p in sort_checkpoints(str(run_dir), use_mtime=True, best_model_checkpoint=best)]
    complete = [path for path in ordered if is_complete(path)]
    keep = {complete[-1]} if complete else set()
    if best is not None:
        keep.add(Path(best))
    excess = len(complete) - max(save_total_limit, len(keep))
    for path in complete:
        if excess <= 0:
            break
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
            excess -= 1


def check_output_dir(folder: str | os.PathLike, rank: int | None = None) -> None:
    """Raise `CheckpointError` if this process cannot create ``folder`` (and, given its ``rank``,
    write a file in it): found before training, instead of at the first checkpoint after it."""
    try:
        os.makedirs(folder, exist_ok=True)
        if rank is not None:
            probe = Path(folder) / f".hf_ftpipe-write-check-rank{rank}"
            probe.write_bytes(b"")
            probe.unlink()
    except OSError as error:
        raise CheckpointError(
            f"cannot write to output_dir {os.fspath(folder)!r} ({error}); checkpoints and the trained model are "
            "written there. Pass an `output_dir` that every rank can create and write: check the path (no part of it "
            "a file), its permissions, and that its disk is neither full nor read-only"
        ) from error
