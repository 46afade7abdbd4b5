"""The files the suite starts first (tests/helpers/suite_order.py) exist: a slow file renamed and
not renamed there would start wherever its number of tests puts it. The files that share the session's
T5 examples launch are one unit of work: on two workers it would be launched twice; so are the files
that plan on the full-size models' traces (tests/helpers/planning_graphs.py) and those that read the tiny
models' captures (tests/helpers/tiny_captures.py), each traced once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from suite_order import SHARED_LAUNCHES, SLOWEST_FILES, work_unit

TESTS = Path(__file__).resolve().parent


def test_every_file_the_suite_starts_first_exists() -> None:
    missing = [file for file in SLOWEST_FILES if not (TESTS / file).is_file()]
    assert not missing, f"suite_order.SLOWEST_FILES names files that are not there: {missing}"
    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)


def test_the_files_of_the_shared_t5_examples_launch_are_one_unit_of_work() -> None:
    named = {file for pair in SHARED_LAUNCHES.items() for file in pair}
    missing = [file for file in named if not (TESTS / file).is_file()]
    assert not missing, f"suite_order.SHARED_LAUNCHES names files that are not there: {missing}"
    readers = sorted(
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if re.search(r"def \w+\([^)]*\bt5_examples_run\b", path.read_text(encoding="utf-8"))
    )
    assert len(readers) > 1, readers
    units = {work_unit(f"tests/{file}") for file in readers}
    assert units == {"tests/examples/test_run_glue.py"}, f"{readers} run on the workers of {units}"
    assert work_unit("tests/trainer/test_lora.py") == "tests/trainer/test_lora.py"


@pytest.mark.parametrize(
    ("helper", "unit"), [("planning_graphs", "tests/test_docs.py"), ("tiny_captures", "tests/graph/test_trace.py")]
)
def test_the_files_that_share_a_helpers_captures_are_one_unit_of_work(helper: str, unit: str) -> None:
    readers = sorted(
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if re.search(rf"^from {helper} import", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    )
    assert len(readers) > 1, readers
    units = {work_unit(f"tests/{file}") for file in readers}
    assert units == {unit}, f"{readers} capture the models of {helper} on the workers of {units}"
