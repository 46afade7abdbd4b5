"""A crash while saving never blocks the resume; a damaged checkpoint or an ``output_dir`` that cannot be
written is refused on every rank before any trains, naming the file and the fix; a rank that fails
reading its share of a checkpoint stops the others at once, naming it.

Two launches of two CPU processes on a tiny GPT-2, shared by the module: ``crash_save_job.py`` kills
rank 1 while it writes its share of ``checkpoint-6``; ``errors_resume_job.py`` resumes that run with
``resume_from_checkpoint=True``, tries every case that must be refused, and ends with rank 1 failing
to read its optimizer state (which ends the job).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hf_ftpipe.errors import CheckpointError
from hf_ftpipe.trainer.checkpoint_check import check_resumable

from distributed import accelerate_launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CRASH_JOB = str(Path(__file__).with_name("crash_save_job.py"))
ERRORS_JOB = str(Path(__file__).with_name("errors_resume_job.py"))


@dataclass
class Faults:
    root: Path
    crash_output: str
    crash_returncode: int
    after_crash: dict[str, list[str]]
    """Each folder ``crashed/`` held after the crash, and the files in it."""
    resume_output: str
    resume_ended_at: float
    """When the second job ended (its last case ends it with an error)."""


def _listing(folder: Path) -> dict[str, list[str]]:
    return {
        sub.name: sorted(str(p.relative_to(sub)) for p in sub.rglob("*") if p.is_file())
        for sub in folder.iterdir()
        if sub.is_dir()
    }


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Faults:
    root = tmp_path_factory.mktemp("checkpoint-faults")
    # The launcher ends the other rank soon after one dies: 1 s lets rank 0 say what it saw first.
    crash = accelerate_launch(CRASH_JOB, str(root), timeout_s=200, check=False, monitor_interval_s=1)
    after_crash = _listing(root / "crashed")
    resumed = accelerate_launch(ERRORS_JOB, str(root), timeout_s=280, check=False)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode != 0 and (root / "failed_at").exists(), output[-8000:]  # it ended at the last case
    return Faults(root, crash.stdout + crash.stderr, crash.returncode, after_crash, output, time.time())


def _messages(root: Path, case: str) -> list[str]:
    return [(root / f"{case}-rank{rank}.txt").read_text() for rank in (0, 1)]


# -- a crash while saving ---------------------------------------------------------------------


def test_a_rank_killed_while_saving_leaves_no_checkpoint_folder_only_a_temporary_one(faults: Faults) -> None:
    # Before: a half-written checkpoint-6 (no trainer_state.json, an empty optimizer/) that
    # `resume_from_checkpoint=True` picked and refused.
    assert faults.crash_returncode != 0, faults.crash_output[-4000:]
    listing = faults.after_crash
    assert set(listing) == {"checkpoint-3", "_tmp-checkpoint-6"}, listing
    assert "trainer_state.json" in listing["checkpoint-3"]
    partial = listing["_tmp-checkpoint-6"]
    assert "checkpoint-6/model.safetensors" in partial and "checkpoint-6/trainer_state.json" not in partial
    # Rank 0 names the rank that never finished its share, not gloo's bare "Connection closed by peer".
    stopped = "[rank 0] stopped while waiting for every rank to write its share of checkpoint-6: "
    assert stopped in faults.crash_output, faults.crash_output[-4000:]
    assert "rank 1 did not answer" in faults.crash_output.split(stopped, 1)[1].splitlines()[0]


def test_resume_true_after_the_crash_takes_the_last_whole_checkpoint_and_logs_the_uninterrupted_losses(
    faults: Faults,
) -> None:
    crashed = faults.root / "crashed"
    uninterrupted = json.loads((faults.root / "losses.json").read_text())
    resumed = json.loads((crashed / "result.json").read_text())["losses"]
    assert list(uninterrupted) == list(resumed) == ["1", "2", "3", "4", "5", "6"]
    assert resumed == pytest.approx(uninterrupted, abs=1e-6)  # dropout on: every random state restored
    # One warning names what was skipped and why; the crash's leftover is gone, the other folder is not ours.
    warning = next(line for line in faults.resume_output.splitlines() if "resume_from_checkpoint=True" in line)
    assert f"resuming from {crashed / 'checkpoint-3'}, the newest complete checkpoint in {crashed}" in warning
    assert f"{crashed / 'checkpoint-9'} (no trainer_state.json: a save that did not finish; left as it is)" in warning
    assert f"{crashed / '_tmp-checkpoint-6'} (a save that did not finish; removed)" in warning
    after = _listing(crashed)
    # save_total_limit=1 rotated checkpoint-3 away once checkpoint-6 was whole, and never counted checkpoint-9.
    assert set(after) == {"checkpoint-6", "checkpoint-9"}, after
    assert "trainer_state.json" in after["checkpoint-6"] and "trainer_state.json" not in after["checkpoint-9"]


# -- damaged checkpoints and output_dir -------------------------------------------------------


def test_a_truncated_weight_file_is_refused_on_every_rank_naming_it_and_the_checkpoint_before(faults: Faults) -> None:
    # Before: a bare `SafetensorError: Error while deserializing header: incomplete metadata`.
    rank0, rank1 = _messages(faults.root, "truncated-weights")
    assert rank0 == rank1
    folder = faults.root / "truncated-weights"
    assert rank0.startswith(
        f"the checkpoint {folder / 'checkpoint-3'} cannot be resumed: {folder / 'checkpoint-3' / 'model.safetensors'} "
        "is truncated or damaged (SafetensorError: "
    ), rank0
    assert f'Resume from the checkpoint before it, `resume_from_checkpoint="{folder / "checkpoint-2"}"`' in rank0


def test_a_truncated_optimizer_shard_of_one_rank_is_refused_on_every_rank_before_any_trains(faults: Faults) -> None:
    # Before: rank 1 failed reading it while rank 0 started training and died on gloo's "Connection closed by peer".
    rank0, rank1 = _messages(faults.root, "truncated-optimizer")
    assert rank0 == rank1
    shard = faults.root / "truncated-optimizer" / "checkpoint-3" / "optimizer" / "rank1.safetensors"
    assert f"cannot be resumed: {shard} is truncated or damaged" in rank0
    assert rank0.endswith("Copy the checkpoint again if it was copied, or train without resuming"), rank0


def test_an_output_dir_that_cannot_be_written_fails_on_every_rank_before_training(faults: Faults) -> None:
    # Before: found by rank 0 only (plain Trainer: at the first checkpoint, after training).
    rank0, rank1 = _messages(faults.root, "unwritable")
    assert rank0 == rank1
    assert rank0.startswith(f"cannot write to output_dir {str(faults.root / 'a-file' / 'out')!r} ("), rank0
    assert "Not a directory" in rank0 and "Pass an `output_dir` that every rank can create and write" in rank0


def test_a_rank_that_fails_reading_its_optimizer_state_stops_the_others_at_once_naming_it(faults: Faults) -> None:
    # Before: rank 0 trained on and died on gloo's "Connection closed by peer ... GLHF!".
    waited = faults.resume_ended_at - float((faults.root / "failed_at").read_text())
    assert waited < 10, f"{waited:.1f} s, pipeline_timeout_s is 10 s"  # the job ends with rank 0
    whole = faults.root / "truncated-weights" / "checkpoint-2"
    failure = (
        f"[rank 1] failed while reading its optimizer state from {whole}: OSError: [Errno 5] Input/output error: "
        f"'{whole}/optimizer/rank1.safetensors'"
    )
    stopping = [line for line in faults.resume_output.splitlines() if "[rank 0] stop" in line]
    assert any(failure in line for line in stopping), faults.resume_output[-6000:]
    assert "timed out" not in faults.resume_output and "GLHF" not in faults.resume_output


@pytest.mark.parametrize("case", ["missing", "missing-empty-weights"])
def test_resuming_from_a_path_that_does_not_exist_names_the_path(faults: Faults, case: str) -> None:
    # Before: "the model has empty (meta) weights ... set `weights_path`", for both models.
    for message in _messages(faults.root, case):
        missing = faults.root / "no-such-checkpoint"
        assert message.startswith(f"Can't find a valid checkpoint at {missing}: no such folder")
        assert "checkpoint-N folder" in message and "weights_path" not in message


def test_a_checkpoint_missing_a_rank_tensor_file_is_refused_on_every_rank(faults: Faults) -> None:
    # Before: a raw FileNotFoundError on rank 1 and "a peer probably died" on rank 0.
    rank0, rank1 = _messages(faults.root, "incomplete")
    assert rank0 == rank1
    checkpoint = faults.root / "incomplete-checkpoint"
    assert rank0.startswith(f"the checkpoint {checkpoint} is incomplete: optimizer/rank1.safetensors is missing")
    assert "resume from another checkpoint" in rank0


def test_a_folder_that_is_no_whole_checkpoint_says_what_it_lacks(faults: Faults, tmp_path: Path) -> None:
    unfinished = tmp_path / "unfinished"
    shutil.copytree(faults.root / "crashed" / "checkpoint-6", unfinished)
    (unfinished / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="it has no trainer_state.json, which a checkpoint gets last"):
        check_resumable(unfinished)
    (unfinished / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="it holds no model weights"):
        check_resumable(unfinished)
