"""The files the suite starts first (tests/helpers/suite_order.py) exist: a slow file renamed and
not renamed there would start wherever its number of tests puts it."""

from __future__ import annotations

from pathlib import Path

from suite_order import SLOWEST_FILES

TESTS = Path(__file__).resolve().parent


def test_every_file_the_suite_starts_first_exists() -> None:
    missing = [file for file in SLOWEST_FILES if not (TESTS / file).is_file()]
    assert not missing, f"suite_order.SLOWEST_FILES names files that are not there: {missing}"
    assert len(set(SLOWEST_FILES)) == len(SLOWEST_FILES)
