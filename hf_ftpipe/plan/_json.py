"""The strict JSON reader (`hf_ftpipe._strict_json`) worded for partition files."""

from __future__ import annotations

from typing import Any

from hf_ftpipe import _strict_json
from hf_ftpipe._strict_json import json_type
from hf_ftpipe.errors import PartitionFormatError

MAX_FILE_BYTES = 64 * 2**20
"""Largest file ``read_json`` reads: a T5-3B plan is ~100 KiB, a file this big is not a plan."""

__all__ = ["MAX_FILE_BYTES", "build", "json_type", "read_json"]


def read_json(path: str) -> object:
    """The parsed JSON of the file at ``path``; every defect is a `PartitionFormatError` naming
    the file. Messages say what is wrong only: what to do depends on where the file came from
    (see `plan.with_fix`)."""
    return _strict_json.read_json(path, error=PartitionFormatError, what="partition file", max_bytes=MAX_FILE_BYTES)


def build(cls: type, data: object, where: str) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, checking names and types of every field."""
    return _strict_json.build(cls, data, where, PartitionFormatError)
