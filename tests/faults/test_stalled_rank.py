"""A rank that stops answering (SIGSTOP) at a step boundary, during evaluation, during a checkpoint
save or in the tied-weight gradient reduction: the other rank stops within ``pipeline_timeout_s``
+ 15 s, naming it, and the launcher leaves no process behind. A rank that fails writing a
checkpoint, and lingers: the other rank stops at once, naming it and what it was doing (a rank
that fails reading one: `test_checkpoint_faults.py`).

The jobs (`stall_job.py`, `accelerate launch`, 2 ranks) run at once: most of their time is spent
waiting for the timeout. The launcher then sends the stopped rank SIGTERM, which stays pending while
the rank is stopped, and kills it after a grace period of 30 s (torch's ``_stop_workers`` takes no
shorter one): once the test sees the SIGTERM pending, it continues the rank, which then ends on the
launcher's own signal (the launcher reports it) without the grace being waited out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from distributed import start_accelerate_launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STALLING_RANK = 1
TIMEOUT_S = 10

STALLS = ("step", "eval", "save", "tied")
FAILURES = {"fail-save": "writing {folder}/checkpoint-2: OSError: [Errno 28] No space left on device"}
"""What rank 0 must say rank 1 was doing, by the job's fault."""
WHERE = (*STALLS, *FAILURES)
LAUNCHER_DEADLINE_S = 150


@dataclass
class Outcome:
    output: str
    returncode: int
    waited_after_stop_s: float
    """From the stalling rank's stop (or failure) until every other rank had exited."""
    stalled_pid: int
    folder: Path
    asked_to_end: bool
    """The launcher sent the stopped rank SIGTERM (seen pending before the test continued it)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")


def _asked_to_end(pid: int) -> bool:
    """Whether a SIGTERM is pending for ``pid`` (a stopped process receives it only once continued)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    pending = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def _watch(folders: dict[str, Path], launched: dict[str, subprocess.Popen]) -> dict[str, Outcome]:
    """Watch every job at once: when its stalling rank stopped, when every other rank had exited,
    whether the launcher asked the stopped rank to end (which then continues it), and what the
    launcher printed."""
    deadline = time.monotonic() + LAUNCHER_DEADLINE_S
    stopped_at: dict[str, float] = {}
    others_gone_at: dict[str, float] = {}
    asked_to_end: set[str] = set()
    while any(p.poll() is None for p in launched.values()) and time.monotonic() < deadline:
        for where, folder in folders.items():
            if where not in stopped_at and (folder / "stopped").exists():
                stopped_at[where] = time.monotonic()
            if where in stopped_at and where not in others_gone_at:
                others = [int((folder / f"pid{r}").read_text()) for r in range(2) if r != STALLING_RANK]
                if not any(_alive(pid) for pid in others):
                    others_gone_at[where] = time.monotonic()
            if where in others_gone_at and where in STALLS and where not in asked_to_end:
                stalled_pid = int((folder / f"pid{STALLING_RANK}").read_text())
                if _asked_to_end(stalled_pid):
                    asked_to_end.add(where)
                    os.kill(stalled_pid, signal.SIGCONT)  # it ends on the launcher's SIGTERM now, not after 30 s
            if launched[where].poll() is not None and where not in stopped_at:
                pytest.fail(f"{where}: the job ended before its rank stopped:\n{launched[where].stdout.read()[-6000:]}")
        time.sleep(0.1)
    outcomes = {}
    for where, launcher in launched.items():
        try:
            output, _ = launcher.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            output, _ = launcher.communicate()
            pytest.fail(f"{where}: the launcher did not end within {LAUNCHER_DEADLINE_S} s:\n{output[-6000:]}")
        waited = others_gone_at.get(where, float("inf")) - stopped_at.get(where, 0.0)
        stalled_pid = int((folders[where] / f"pid{STALLING_RANK}").read_text())
        outcomes[where] = Outcome(
            output, launcher.returncode, waited, stalled_pid, folders[where], where in asked_to_end
        )
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    job = str(Path(__file__).with_name("stall_job.py"))
    folders, launched = {}, {}
    for where in WHERE:
        folders[where] = tmp_path_factory.mktemp(where)
        launched[where] = start_accelerate_launch(job, str(folders[where]), where, str(STALLING_RANK), str(TIMEOUT_S))
    try:
        return _watch(folders, launched)
    finally:
        for process in launched.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.parametrize("where", STALLS)
def test_other_ranks_stop_in_time_naming_the_silent_rank_and_nothing_is_left_behind(
    outcomes: dict[str, Outcome], where: str
) -> None:
    outcome = outcomes[where]
    assert outcome.returncode != 0, outcome.output[-6000:]
    assert outcome.waited_after_stop_s < TIMEOUT_S + 15, (outcome.waited_after_stop_s, outcome.output[-6000:])
    reason = f"hf_ftpipe: [rank 0] timed out after {TIMEOUT_S} s "
    stopping = [line.split(reason, 1)[1] for line in outcome.output.splitlines() if reason in line]
    assert stopping, outcome.output[-6000:]
    assert f"rank {STALLING_RANK}" in stopping[0], stopping[0]
    assert outcome.asked_to_end, f"the launcher never sent the stopped rank SIGTERM:\n{outcome.output[-6000:]}"
    assert f"Signal 15 (SIGTERM) received by PID {outcome.stalled_pid}" in outcome.output, outcome.output[-6000:]
    assert not _alive(outcome.stalled_pid), f"rank {STALLING_RANK} (pid {outcome.stalled_pid}) is still alive"


def test_a_timeout_in_the_tied_weight_reduction_names_the_peer(outcomes: dict[str, Outcome]) -> None:
    # Before: "... reducing tied-weight gradients; a peer is stuck or dead".
    output = outcomes["tied"].output
    reason = f"hf_ftpipe: [rank 0] timed out after {TIMEOUT_S} s reducing tied-weight gradients: rank {STALLING_RANK} "
    assert reason + "did not answer (last seen " in output, output[-6000:]


@pytest.mark.parametrize("where", FAILURES)
def test_a_rank_that_fails_writing_a_checkpoint_stops_the_others_at_once_naming_it(
    outcomes: dict[str, Outcome], where: str
) -> None:
    # Before: rank 0 died on gloo's "Connection closed by peer ... GLHF!", or waited for the timeout.
    outcome = outcomes[where]
    assert outcome.returncode != 0, outcome.output[-6000:]
    assert outcome.waited_after_stop_s < TIMEOUT_S, (outcome.waited_after_stop_s, outcome.output[-6000:])
    failure = f"[rank {STALLING_RANK}] failed while " + FAILURES[where].format(folder=outcome.folder)
    stopping = [line for line in outcome.output.splitlines() if "[rank 0] stop" in line]
    assert any(failure in line for line in stopping), outcome.output[-6000:]
    assert "timed out" not in outcome.output and "GLHF" not in outcome.output
    assert not _alive(outcome.stalled_pid), f"rank {STALLING_RANK} (pid {outcome.stalled_pid}) is still alive"
