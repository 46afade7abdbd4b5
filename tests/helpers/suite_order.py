"""The order whole test files start in (tests/conftest.py): the slowest first, so that with the suite
on two workers (``--dist loadfile``) no long file starts last on one worker while the other idles;
and files that share a session's launch go to one worker together, so that it runs once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

SLOWEST_FILES = (
    "trainer/test_any_batch.py",
    "trainer/test_pipe_trainer.py",
    "trainer/test_checkpoint.py",
    "examples/test_run_glue.py",
    "runtime/test_memory_prediction.py",
    "faults/test_stalled_rank.py",
    "runtime/test_engine.py",
    "trainer/test_replicas_trainer.py",
    "runtime/test_replicas.py",
    "trainer/test_trainer_surface.py",
    "test_docs.py",
    "graph/test_trace.py",  # with the files that read its tiny captures (SHARED_LAUNCHES)
    "runtime/test_streaming.py",
    "faults/test_checkpoint_faults.py",
    "hub/test_trainer_hub.py",
    "trainer/test_lora.py",
    "trainer/test_parity.py",
    "trainer/test_fp16.py",
    "faults/test_same_batch.py",
    "faults/test_infeasible_plan.py",
    "hub/test_shipped_plans.py",
    "runtime/test_failure.py",
    "cli/test_partition.py",
    "trainer/test_launch.py",
)
"""Files under tests/ that take 20 s or more on a worker (most start multi-rank jobs), slowest first,
from ``--durations=0`` summed per file. A new slow file goes in by its time; an order a little
off costs little, a slow file missing from the list can end the suite alone."""


def slowest_files_first(items: list[pytest.Item], tests: Path) -> list[pytest.Item]:
    """``items`` by file: `SLOWEST_FILES`, then the others by number of tests, most first (xdist's
    own order), then as collected; a file's tests keep their order. Paths are relative to ``tests``."""
    files = [item.path.resolve().relative_to(tests).as_posix() for item in items]
    counts = Counter(files)
    first = {file: index for index, file in reversed(list(enumerate(files)))}
    slowest = {file: index for index, file in enumerate(SLOWEST_FILES)}
    order = sorted(
        range(len(items)), key=lambda i: (slowest.get(files[i], len(slowest)), -counts[files[i]], first[files[i]])
    )
    return [items[i] for i in order]


SHARED_LAUNCHES = {
    "examples/test_run_summarization.py": "examples/test_run_glue.py",
    **dict.fromkeys(
        (
            "hub/test_shipped_plans.py",
            "faults/test_infeasible_plan.py",
            "cli/test_partition.py",
            "graph/test_full_size.py",
        ),
        "test_docs.py",
    ),
    **dict.fromkeys(
        (
            "graph/test_dynamic_shapes.py",
            "graph/test_measure.py",
            "partitioners/test_real_models.py",
            "partitioners/test_baselines.py",
            "partitioners/test_mixed_partition.py",
            "plan/test_reanchor.py",
            "runtime/test_stage.py",
            "faults/test_error_messages.py",
        ),
        "graph/test_trace.py",
    ),
}
"""A file → the file whose worker runs it too, because both read what one process makes once: a
session fixture's launch (tests/examples/conftest.py's T5 examples job, 70-100 s), or the full-size
models' traces (tests/helpers/planning_graphs.py: T5-3B, GPT2-XL and BERT-large, 10-35 s each, then
measured at each file's shapes in seconds), or the tiny models' captures (tests/helpers/tiny_captures.py:
2-10 s each). Each runs once per worker, so with the files on different workers the job was launched, or
a model traced, once on each. Paths are relative to tests/."""


def work_unit(file: str) -> str:
    """The unit of work `--dist loadfile` hands a worker for ``file`` (a test's file, as its node id
    names it from the repository, ``tests/...``): the file, or the file it shares a launch with."""
    folder, _, relative = file.rpartition("tests/")
    shared = SHARED_LAUNCHES.get(relative)
    return f"{folder}tests/{shared}" if shared else file


def shared_launch_scheduling(config: pytest.Config, log: Any) -> Any:
    """xdist's `LoadFileScheduling` with the files of `SHARED_LAUNCHES` in the unit of their partner's."""
    from xdist.scheduler import LoadFileScheduling

    class SharedLaunchScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(super()._split_scope(nodeid))

    return SharedLaunchScheduling(config, log)
