"""Strict JSON for files that may come from anywhere: size- and depth-limited, no duplicate keys, no
NaN, and decoded into typed dataclasses field by field, so every defect is named with its path."""

from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

from hf_ftpipe._json_depth import check_json_depth
from hf_ftpipe.errors import PartitionFormatError

MAX_FILE_BYTES = 64 * 2**20
"""Largest file ``read_json`` reads: a T5-3B plan is ~100 KiB, a file this big is not a plan."""


def read_json(path: str) -> object:
    """The parsed JSON of the file at ``path``; every defect is a `PartitionFormatError` naming
    the file. Messages say what is wrong only: what to do depends on where the file came from
    (see `plan.with_fix`)."""
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise PartitionFormatError(
                f"{path}: file is {size} bytes, more than the {MAX_FILE_BYTES} bytes a partition "
                "file may have; this is not a partition file"
            )
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PartitionFormatError(f"{path}: cannot read the partition file: {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PartitionFormatError(f"{path}: not UTF-8 text, so not a partition file") from e
    check_json_depth(text, path, PartitionFormatError)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        ends_early = e.pos >= len(text.rstrip())
        why = "it ends early (truncated file?)" if ends_early else "it is corrupt or not JSON"
        raise PartitionFormatError(f"{path}: not valid JSON, {why}: {e.msg} at line {e.lineno} column {e.colno}") from e
    except ValueError as e:  # from the hooks
        raise PartitionFormatError(f"{path}: {e}") from e


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        dupes = []
        for k, _ in pairs:
            if k in seen:
                dupes.append(k)
            seen.add(k)
        raise ValueError(f"a JSON object repeats the keys {dupes[:5]}")
    return result


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a partition file may hold")


def build(cls: type, data: object, where: str) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, checking names and types of every field."""
    if not isinstance(data, dict):
        raise PartitionFormatError(f"field '{where}' should be an object, got {json_type(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PartitionFormatError(
            f"unknown fields {[_join(where, u) for u in unknown]}; valid ones are "
            f"{sorted(known)} (a newer hf_ftpipe would have raised format_version)"
        )
    values = {}
    for name, f in known.items():
        path = _join(where, name)
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise PartitionFormatError(f"missing field '{path}'")
            continue
        values[name] = _convert(hints[name], data[name], path)
    return cls(**values)


def _convert(hint: Any, value: object, path: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path)
    if is_dataclass(hint):
        return build(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise _wrong_type(path, hint, value)
        return [_convert(args[0], item, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong_type(path, hint, value)
        return {k: _convert(args[1], v, f"{path}[{k!r}]") for k, v in value.items()}
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type(path, hint, value)
        return float(value)
    if hint is int or hint is str:
        if isinstance(value, bool) or not isinstance(value, hint):
            raise _wrong_type(path, hint, value)
        return value
    raise TypeError(f"no JSON rule for {hint!r} at {path}")  # a bug here, not in the file


def _wrong_type(path: str, hint: Any, value: object) -> PartitionFormatError:
    expected = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return PartitionFormatError(
        f"field '{path}' should be {expected or _type_name(hint)}, got {json_type(value)} {_short(value)}"
    )


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "")


def json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "bool", int: "int", float: "float"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name
