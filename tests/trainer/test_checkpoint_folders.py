"""Checkpoint folders in ``output_dir`` (no processes): which one ``resume_from_checkpoint=True`` takes, what
the rotation deletes, how a folder is published, and which damaged file a resume is refused for."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_ftpipe.errors import CheckpointError
from hf_ftpipe.trainer.checkpoint_check import check_readable
from hf_ftpipe.trainer.checkpoint_folders import (
    StagedCheckpoint,
    check_output_dir,
    leftovers,
    newest_complete,
    rotate_complete,
)


def checkpoint(folder: Path, complete: bool = True, mtime: float | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    if complete:
        (folder / "trainer_state.json").write_text("{}")
    if mtime is not None:
        os.utime(folder, (mtime, mtime))
    return folder


def test_resume_true_takes_the_newest_complete_checkpoint_and_names_what_it_skipped(tmp_path: Path) -> None:
    checkpoint(tmp_path / "checkpoint-5")
    checkpoint(tmp_path / "checkpoint-3")
    checkpoint(tmp_path / "checkpoint-20", complete=False)  # numbered 20 > 5: sorted by number, not by name
    checkpoint(tmp_path / "_tmp-checkpoint-10" / "checkpoint-10", complete=False)
    newest, skipped = newest_complete(tmp_path)
    assert newest == tmp_path / "checkpoint-5"
    assert [str(s) for s in skipped] == [
        f"{tmp_path / 'checkpoint-20'} (no trainer_state.json: a save that did not finish; left as it is)",
        f"{tmp_path / '_tmp-checkpoint-10'} (a save that did not finish; removed)",
    ]
    assert leftovers(tmp_path) == [tmp_path / "_tmp-checkpoint-10"]
    assert newest_complete(tmp_path / "nothing-here") == (None, [])


def test_rotation_deletes_the_oldest_complete_checkpoints_only_never_the_newest_nor_the_best(tmp_path: Path) -> None:
    now = time.time()
    for age, step in enumerate((6, 4, 2)):  # checkpoint-6 newest
        checkpoint(tmp_path / f"checkpoint-{step}", mtime=now - 10 * age)
    checkpoint(tmp_path / "checkpoint-8", complete=False, mtime=now + 10)  # newer, but no checkpoint
    rotate_complete(tmp_path, save_total_limit=2, best=str(tmp_path / "checkpoint-2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-6", "checkpoint-8"]
    rotate_complete(tmp_path, save_total_limit=1, best=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8"]


def test_publishing_replaces_an_existing_checkpoint_folder_whole(tmp_path: Path) -> None:
    checkpoint(tmp_path / "checkpoint-4")
    (tmp_path / "checkpoint-4" / "stale.txt").write_text("from an earlier run")
    staged = StagedCheckpoint(tmp_path, "checkpoint-4")
    checkpoint(staged.folder)
    staged.publish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert sorted(p.name for p in (tmp_path / "checkpoint-4").iterdir()) == ["model.safetensors", "trainer_state.json"]


def test_an_output_dir_under_a_file_is_refused_with_the_folder_and_the_fix(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError) as error:
        check_output_dir(tmp_path / "a-file" / "out", rank=0)
    assert str(error.value).startswith(f"cannot write to output_dir {str(tmp_path / 'a-file' / 'out')!r} ([Errno 20]")
    check_output_dir(tmp_path / "fine" / "out", rank=1)
    assert list((tmp_path / "fine" / "out").iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("model.safetensors", "is truncated or damaged (SafetensorError: "),
        ("trainer_state.json", "is not valid JSON ("),
        ("scheduler.pt", "is not a whole torch.save archive ("),
    ],
)
def test_a_truncated_file_is_named_with_what_is_wrong(tmp_path: Path, name: str, problem: str) -> None:
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    save_file({"w": torch.ones(64)}, folder / "model.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": [{"loss": 1.0}]}))
    torch.save({"last_epoch": 2}, folder / "scheduler.pt")
    check_readable(folder)
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as error:
        check_readable(folder)
    assert str(error.value).startswith(f"the checkpoint {folder} cannot be resumed: {path} {problem}")
