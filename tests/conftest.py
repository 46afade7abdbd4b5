"""Shared test set-up: one thread per process, so multi-rank tests do not oversubscribe 2 cores; a
temporary HF_HOME per session, module and test, so no test reads or writes the user's Hugging Face
cache (PipeTrainer caches the plans it computes there) and no test picks up a plan another cached;
and the slowest files first, so that no long file starts last on one worker while the other idles,
with files that share a session's launch on one worker."""

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from suite_order import shared_launch_scheduling, slowest_files_first

torch.set_num_threads(1)

# What runs outside any module's fixtures sees this one; each module and each test get their own below.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf_ftpipe-tests-hf_home-")
atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    # `--dist loadfile` would hand files out by their number of tests, most first, putting the slow
    # files of few tests (a launch in a module fixture) last; they come in collection order instead,
    # which `pytest_collection_modifyitems` sets.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadfile`, files that share a session fixture's launch are one unit of work
    (`suite_order.SHARED_LAUNCHES`); other modes are xdist's own (None)."""
    return shared_launch_scheduling(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = slowest_files_first(items, Path(__file__).resolve().parent)


@pytest.fixture(scope="module", autouse=True)
def _module_hf_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A fresh HF_HOME for each module's shared jobs (autouse: set before its other module fixtures),
    so that no module finds a plan another module cached: with the suite on several workers, which
    modules ran before this one on the same process is not fixed."""
    previous = os.environ["HF_HOME"]
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    yield
    os.environ["HF_HOME"] = previous


@pytest.fixture(autouse=True)
def _fresh_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
