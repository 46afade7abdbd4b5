"""One benchmark runner in fresh processes started by a command (torchrun, or one Python process),
waited for with a deadline, its figures read back from the JSON file it writes.

``generation.py`` and ``variable_length.py`` launch their runners this way: the whole process group
(torchrun and the ranks it started) is killed at the deadline, and a failure is raised with the first
rank's traceback rather than torchrun's summary of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def run_for_result(runner: str, command: Sequence[str], env: Mapping[str, str], result: Path, timeout_s: float) -> Any:
    """Run ``command`` (which writes ``result``) with ``env``; the JSON it wrote. Raises RuntimeError naming
    ``runner``: after ``timeout_s`` with the log's end, on a failure with the first traceback."""
    result.unlink(missing_ok=True)
    process = subprocess.Popen(
        list(command),
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # torchrun and the ranks it started
        log, _ = process.communicate()
        raise RuntimeError(f"{runner}: no result after {timeout_s:.0f} s:\n{log[-3000:]}") from None
    if process.returncode != 0 or not result.exists():
        start = max(0, log.find("Traceback"))  # the first rank's traceback, not torchrun's summary
        raise RuntimeError(f"{runner}: exited with {process.returncode}:\n{log[start : start + 4000]}")
    return json.loads(result.read_text())
