"""Strict JSON for files that may come from anywhere: size- and depth-limited, no duplicate keys, no
NaN, and decoded into typed dataclasses field by field, so every defect is named with its path.

One reader for every hf_ftpipe file format (partition files, latency models): each caller passes
its own error class and the noun its messages use ("partition file"), so the checks live once.
`read_versioned` reads a file of a small format (latency models, cost tables): its ``"format"`` and
``"format_version"`` fields checked, its body built, every defect prefixed with the file and followed
by the fix. `write_json` is the one writer of the small formats (latency models, cost tables, GPU profiles):
sorted keys and a final newline, so that files diff cleanly.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, fields, is_dataclass
from typing import Any

from hf_ftpipe._json_depth import check_json_depth


def write_json(path: str | os.PathLike, data: object, *, indent: int = 2) -> None:
    """Write ``data`` to ``path`` as JSON with sorted keys and a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=indent, sort_keys=True)
        f.write("\n")


def read_json(path: str, *, error: type[Exception], what: str, max_bytes: int) -> object:
    """The parsed JSON of the file at ``path``; every defect is an ``error`` naming the file and
    calling it a ``what`` (e.g. "partition file"). Messages say what is wrong only: what to do
    depends on where the file came from (see `plan.with_fix`)."""
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise error(
                f"{path}: file is {size} bytes, more than the {max_bytes} bytes a {what} may have; this is not a {what}"
            )
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e}") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text, so not a {what}") from e
    check_json_depth(text, path, error)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant(what))
    except json.JSONDecodeError as e:
        ends_early = e.pos >= len(text.rstrip())
        why = "it ends early (truncated file?)" if ends_early else "it is corrupt or not JSON"
        raise error(f"{path}: not valid JSON, {why}: {e.msg} at line {e.lineno} column {e.colno}") from e
    except ValueError as e:  # from the hooks
        raise error(f"{path}: {e}") from e


def read_versioned(
    path: str | os.PathLike,
    cls: type,
    *,
    format_name: str,
    format_version: int,
    what: str,
    error: type[Exception],
    max_bytes: int,
    fix: str,
    check: Callable[[Any], None] | None = None,
    expected_key: Any = None,
    made: str = "written",
) -> Any:
    """The ``cls`` that the file at ``path`` (a ``what`` of ``format_name`` in ``format_version``)
    holds, checked by ``check``; every defect is an ``error`` naming the file, the field and ``fix``.
    With an ``expected_key``, a file ``made`` (fitted, measured) for another key is one too (`check_key`)."""
    where = os.fspath(path)
    data = read_json(where, error=error, what=what, max_bytes=max_bytes)
    try:
        body = _versioned_body(data, format_name=format_name, format_version=format_version, what=what, error=error)
        value = build(cls, body, "", error)
        if check is not None:
            check(value)
    except error as e:
        raise error(f"{where}: {e}; {fix}") from None
    if expected_key is not None:
        check_key(expected_key, value.key, where=where, made=made, error=error, fix=fix)
    return value


def check_key(expected: Any, found: Any, *, where: str, made: str, error: type[Exception], fix: str) -> None:
    """An ``error`` unless the file at ``where`` was ``made`` (fitted, measured) for the ``expected``
    key: each field where its key ``found`` differs, then ``fix``."""
    differ = key_differences(expected, found)
    if differ:
        raise error(f"{where} was {made} for another setup: {'; '.join(differ)}; {fix}")


def key_differences(expected: Any, found: Any) -> list[str]:
    """``["key.dtype is 'float16', expected 'float32'"]``: each field where the dataclass ``found`` (a
    file's key) differs from ``expected``."""
    ours, theirs = asdict(expected), asdict(found)
    return [f"key.{k} is {theirs[k]!r}, expected {ours[k]!r}" for k in ours if ours[k] != theirs[k]]


def _versioned_body(
    data: object, *, format_name: str, format_version: int, what: str, error: type[Exception]
) -> dict[str, Any]:
    """``data`` less its ``"format"`` and ``"format_version"`` fields, once they say it is a ``what``
    ("cost table") of ``format_name`` in ``format_version``; else an ``error`` naming the field."""
    if not isinstance(data, dict):
        raise error(f"not a {what}: expected a JSON object, got {json_type(data)}")
    if data.get("format") != format_name:
        found = f"is {data['format']!r}" if "format" in data else "is missing"
        raise error(f"not a {what}: field 'format' {found}, expected {format_name!r}")
    version = data.get("format_version")
    if version != format_version or isinstance(version, bool):
        raise error(f"field 'format_version' is {version!r}; this hf_ftpipe reads version {format_version} only")
    return {k: v for k, v in data.items() if k not in ("format", "format_version")}


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


def _refuse_constant(what: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not a number a {what} may hold")

    return refuse


def build(cls: type, data: object, where: str, error: type[Exception]) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, checking names and types of every field; a
    defect is an ``error`` naming the field's path."""
    try:
        return _build(cls, data, where)
    except _FieldError as e:
        raise error(str(e)) from None


class _FieldError(ValueError):
    """A defect found while building; re-raised as the caller's error class by `build`."""


def _build(cls: type, data: object, where: str) -> Any:
    if not isinstance(data, dict):
        raise _FieldError(f"field '{where}' should be an object, got {json_type(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise _FieldError(
            f"unknown fields {[_join(where, u) for u in unknown]}; valid ones are "
            f"{sorted(known)} (a newer hf_ftpipe would have raised format_version)"
        )
    values = {}
    for name, f in known.items():
        path = _join(where, name)
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise _FieldError(f"missing field '{path}'")
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
        return _build(hint, value, path)
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
    if hint is bool:
        if not isinstance(value, bool):
            raise _wrong_type(path, hint, value)
        return value
    raise TypeError(f"no JSON rule for {hint!r} at {path}")  # a bug here, not in the file


def _wrong_type(path: str, hint: Any, value: object) -> _FieldError:
    expected = getattr(hint, "__name__", None) if typing.get_origin(hint) is None else None
    return _FieldError(
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
