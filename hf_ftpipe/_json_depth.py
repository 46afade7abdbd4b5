"""How deeply a JSON text nests, measured before it is parsed.

Python's ``json`` module recurses once per ``[`` or ``{``: a few hundred kilobytes of ``[`` end in
a `RecursionError` (or worse, a crashed interpreter) instead of a message. Files that come from
users or the Hub (partition files, GPU profiles, model configs, checkpoint indexes) are therefore
measured first, with a scan that never recurses, and refused when deeper than any real one.
"""

from __future__ import annotations

import re
from itertools import accumulate

MAX_JSON_DEPTH = 64
"""Deepest nesting accepted. A partition file nests 4 levels, a GPU profile 2, a model config
rarely more than 5: anything deeper is not a file hf_ftpipe reads."""

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text``; brackets inside strings do not count."""
    brackets = _BRACKET.findall(_STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_depth(text: str, source: str, error: type[Exception]) -> None:
    """Raise ``error`` (the caller's class, e.g. `PartitionFormatError`) if ``text`` nests deeper
    than `MAX_JSON_DEPTH`; the message begins with ``source``, the file it came from."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise error(
            f"{source}: JSON nested {depth} levels deep, more than the {MAX_JSON_DEPTH} levels any file "
            "hf_ftpipe reads has; refused unparsed (is it the right file?)"
        )
