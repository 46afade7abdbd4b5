"""The time one pipeline stage takes for one slice of tokens: fitted, saved, loaded, or derived.

TeraPipe (Li et al., ICML 2021, §3.3) slices a sequence along its tokens and chooses the slice
lengths with a dynamic program over a latency model ``t(slice length, context length)``. A slice of
``s`` tokens after ``c`` tokens of context does per-token work (projections, MLP: ``∝ s``) and
attention over the context and itself (``∝ s·(c + s)``), plus a fixed cost per slice (a send's
start-up, reading the weights once). TeraPipe fits ``t − t0 ≈ a·b·s + β·b·c + γ·b·s·c`` by linear
regression on a grid of timings; here the model is::

    t(s, c, b) = fixed_s + b · (token_s·s + context_s·c + token_context_s·s·c + token_squared_s·s²)

with ``b`` the sequences in the micro-batch. The ``s²`` term is attention's own square (a slice
attends to itself), which TeraPipe folds into ``a``; with it a cost-model fit is exact for
compute-bound ops. The coefficients come from timings (`fit`) or from the analytical cost model
(`from_cost_model` fits `RooflineSliceTime`, the sum of every op's roofline time, which the slicing
DP can also take as it is). A model is saved as JSON keyed by the model, its length, the stage count and the device,
so a later run reads it only for the setup it was fitted for. Pure Python: no torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from hf_ftpipe import _strict_json
from hf_ftpipe.errors import LatencyFormatError

if TYPE_CHECKING:  # only named here: it builds on this module
    from hf_ftpipe.costmodel.roofline_latency import RooflineSliceTime

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LatencyKey",
    "LatencySample",
    "SliceLatency",
]

FORMAT_NAME = "hf_ftpipe.slice_latency"
"""Value of the ``"format"`` field: tells a latency file from any other JSON file."""
FORMAT_VERSION = 1
MAX_FILE_BYTES = 2**20
"""A latency file holds five numbers and a key: anything this big is not one."""

_COEFFICIENTS = ("fixed_s", "token_s", "context_s", "token_context_s", "token_squared_s")


@dataclass(frozen=True, kw_only=True)
class LatencyKey:
    """What a latency model was fitted for; a file is used only where the keys are equal."""

    model_fingerprint: str
    """``CostGraph.fingerprint`` of the model."""
    model_class: str
    """e.g. ``"GPT2LMHeadModel"``; for messages."""
    seq_len: int
    """Full sequence length the slices add up to."""
    num_stages: int
    """The model is cut into this many equal stages; the latency is one stage's."""
    device: str
    """``GPUProfile.name`` (or the measured device's name)."""
    dtype: str
    """Compute dtype, e.g. ``"bfloat16"``."""


@dataclass(frozen=True)
class LatencySample:
    """One timing: ``time_s`` for a slice of ``slice_len`` tokens after ``context_len`` tokens, for
    ``batch_size`` sequences."""

    slice_len: int
    context_len: int
    batch_size: int
    time_s: float


@dataclass(frozen=True, kw_only=True)
class SliceLatency:
    """One stage's forward+backward time of one slice, ``t(s, c, b)`` (see the module docstring)."""

    key: LatencyKey
    fixed_s: float
    """Cost of a slice whatever its length (send start-ups, weight reads), seconds."""
    token_s: float
    """Per token of the slice, per sequence."""
    context_s: float
    """Per token of context, per sequence (reading the earlier slices' keys and values)."""
    token_context_s: float
    """Per (slice token × context token): attention of the slice over its context."""
    token_squared_s: float = 0.0
    """Per (slice token)²: attention of the slice over itself."""
    source: str = "fit"
    """Where the coefficients came from: ``"cost-model"`` or ``"measured"``; for messages."""
    fit_error: float = 0.0
    """Largest relative error of the fit over the samples it was fitted to. The form is smooth; a
    roofline is not (an op turns from memory- to compute-bound as slices grow), so a cost-model
    fit misses by this much somewhere on its grid."""

    def __post_init__(self) -> None:
        problems = _coefficient_problems({name: getattr(self, name) for name in (*_COEFFICIENTS, "fit_error")})
        if problems:
            raise LatencyFormatError("; ".join(problems))

    def time_s(self, slice_len: int, context_len: int, batch_size: int = 1) -> float:
        """Predicted time of one slice of ``slice_len`` tokens after ``context_len``, ``batch_size``
        sequences."""
        s, c = slice_len, context_len
        per_sequence = (
            self.token_s * s + self.context_s * c + self.token_context_s * s * c + self.token_squared_s * s * s
        )
        return self.fixed_s + batch_size * per_sequence

    __call__ = time_s

    @classmethod
    def fit(cls, samples: Iterable[LatencySample], key: LatencyKey, *, source: str = "measured") -> SliceLatency:
        """Least-squares fit of the five coefficients to ``samples`` (of relative error), none negative.

        A coefficient the data would make negative (noise in a term that barely matters) is set to
        zero and the rest fitted again, one at a time, so the model stays monotone in ``s`` and
        ``c`` as the slicing DP expects. Needs samples at several slice and context lengths.
        """
        # Relative least squares (each row over its own time): short slices, where the fixed cost
        # decides, count as much as long ones; a timing's noise is about proportional to it too.
        kept = [x for x in samples if x.time_s > 0]
        rows = [([f / x.time_s for f in _features(x)], 1.0) for x in kept]
        if len(rows) < len(_COEFFICIENTS):
            raise ValueError(
                f"fit needs at least {len(_COEFFICIENTS)} samples, got {len(rows)}; time a grid of lengths"
            )
        active = list(range(len(_COEFFICIENTS)))
        while True:
            solution = _least_squares([[f[i] for i in active] for f, _ in rows], [t for _, t in rows])
            coefficients = dict.fromkeys(_COEFFICIENTS, 0.0)
            for i, value in zip(active, solution, strict=True):
                coefficients[_COEFFICIENTS[i]] = value
            worst = min(active, key=lambda i: coefficients[_COEFFICIENTS[i]])
            if coefficients[_COEFFICIENTS[worst]] >= 0:
                fitted = cls(key=key, source=source, **coefficients)
                error = max(abs(fitted(x.slice_len, x.context_len, x.batch_size) / x.time_s - 1) for x in kept)
                return replace(fitted, fit_error=error)
            active.remove(worst)

    @classmethod
    def from_cost_model(cls, exact: RooflineSliceTime) -> SliceLatency:
        """The five coefficients fitted to ``exact``, the cost model's own slice time
        (`RooflineSliceTime.from_graph`), on a grid of ``(s, c, b)``; ``fit_error`` says how closely."""
        return cls.fit(exact.samples(), exact.key, source="cost-model")

    def to_dict(self) -> dict[str, object]:
        data = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
        data.update(asdict(self))
        return data

    def save(self, path: str | os.PathLike) -> None:
        """Write the model as JSON (see `load`)."""
        _strict_json.write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike, expected_key: LatencyKey | None = None) -> SliceLatency:
        """Read a file written by `save`; every defect (and a key other than ``expected_key``) is a
        `LatencyFormatError` naming the file, the field and the fix."""
        return _strict_json.read_versioned(
            path, SliceLatency, format_name=FORMAT_NAME, format_version=FORMAT_VERSION, what="latency file",
            error=LatencyFormatError, max_bytes=MAX_FILE_BYTES, fix=_REFIT, check=_check_key,
            expected_key=expected_key, made="fitted",
        )  # fmt: skip


_REFIT = "fit the latency model again for this setup (or pass the file written for it)"


def _check_key(latency: SliceLatency) -> None:
    key = latency.key
    if key.seq_len < 1 or key.num_stages < 1:
        raise LatencyFormatError(
            f"fields 'key.seq_len' and 'key.num_stages' must be ≥ 1, got {key.seq_len}, {key.num_stages}"
        )


def _coefficient_problems(values: dict[str, float]) -> list[str]:
    return [
        f"field '{name}' must be a finite number ≥ 0, got {value!r}"
        for name, value in values.items()
        if isinstance(value, bool) or not (math.isfinite(value) and value >= 0)
    ]


def _features(x: LatencySample) -> list[float]:
    s, c, b = x.slice_len, x.context_len, x.batch_size
    return [1.0, b * s, b * c, b * s * c, b * s * s]


def _least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """Solve the normal equations by Gaussian elimination with partial pivoting; columns are
    scaled first, since ``s·c`` is millions of times ``1``."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    scaled = [[r[j] / scale[j] for j in range(n)] for r in rows]
    a = [[sum(r[i] * r[j] for r in scaled) for j in range(n)] for i in range(n)]
    y = [sum(r[i] * t for r, t in zip(scaled, targets, strict=True)) for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for row in a for v in row)):
            raise ValueError("the samples cannot tell the coefficients apart; time more slice and context lengths")
        a[col], a[pivot], y[col], y[pivot] = a[pivot], a[col], y[pivot], y[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            a[r] = [v - factor * w for v, w in zip(a[r], a[col], strict=True)]
            y[r] -= factor * y[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return [v / s for v, s in zip(x, scale, strict=True)]
