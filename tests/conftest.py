"""Shared test set-up: one thread per process, so multi-rank tests do not oversubscribe 2 cores; and a
temporary HF_HOME, so no test reads or writes the user's Hugging Face cache (PipeTrainer caches the
plans it computes there) and no test picks up a plan another test cached."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

# Module-scoped fixtures (jobs run once per module) see this one; each test gets its own below.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf_ftpipe-tests-hf_home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
