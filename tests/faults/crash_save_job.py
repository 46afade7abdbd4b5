"""A PipeTrainer run whose rank 1 is killed (SIGKILL) while it writes its share of ``checkpoint-6``.

``crash_save_job.py OUTPUT``: the run of tests/helpers/resume_runs.py (dropout on, a checkpoint every
3 steps, 6 steps, ``save_total_limit=1``) in ``OUTPUT/crashed``; rank 0 writes every loss it logs to
``OUTPUT/losses.json`` as it goes (the uninterrupted run's losses: step 6 is logged before it is
saved). Rank 1 kills itself inside the save of ``checkpoint-6``, after writing its optimizer state
and before the barrier that ends its share. The job fails; `test_checkpoint_faults.py` checks what
it left and resumes from it.
"""

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from hf_ftpipe import PipeTrainer

from resume_runs import run

SPEC = {"dropout": 0.1, "save_total_limit": 1}
"""Shared with the resumed run (errors_resume_job.py)."""


class RecordLosses(TrainerCallback):
    def __init__(self, path: Path) -> None:
        self.path, self.losses = path, {}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs and "loss" in logs:
            self.losses[str(state.global_step)] = logs["loss"]
            self.path.write_text(json.dumps(self.losses))


class KilledWhileSaving(PipeTrainer):
    def _save_rng_state(self, output_dir: str) -> None:
        if self.state.global_step == 6 and self.args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._save_rng_state(output_dir)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    run({"output_dir": str(root / "crashed"), **SPEC}, KilledWhileSaving, [RecordLosses(root / "losses.json")])
