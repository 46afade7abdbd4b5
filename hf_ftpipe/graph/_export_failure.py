"""Why ``torch.export`` failed on a model, in a sentence that names the cause and the fix.

Export errors come from deep inside torch and carry its own advice (``TORCH_LOGS``, draft export);
a user of hf_ftpipe needs the line of their model that cannot be traced and what to change there.
"""

from __future__ import annotations

import io
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr

from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode


@contextmanager
def without_partial_graph() -> Iterator[None]:
    """Keep the partial graph torch.export prints on a failed export out of stderr.

    On a data-dependent failure ``torch.export`` prints the whole graph traced so far to stderr
    (``e.partial_fx_graph``: ~27 KB for a two-layer toy model, megabytes for a real one), once per
    nested export wrapper, and every rank traces: a log of hundreds of KB around one error. The
    `TraceError` names the failing line instead. Whatever else reaches stderr meanwhile (warnings)
    is written out when the export ends.
    """
    captured = io.StringIO()
    try:
        with redirect_stderr(captured):
            yield
    except Exception as error:
        graph = getattr(error, "partial_fx_graph", None)
        text = captured.getvalue()
        sys.stderr.write(text.replace(f"{graph}\n", "") if graph else text)
        raise
    sys.stderr.write(captured.getvalue())


def explain_export_failure(model: nn.Module, error: Exception) -> str:
    model_class = type(model).__name__
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    frames = traceback.extract_tb(error.__traceback__)
    user_frames = [f for f in frames if "/torch/" not in f.filename]
    where = f" at {user_frames[-1].filename}:{user_frames[-1].lineno} ({user_frames[-1].line})" if user_frames else ""
    if user_frames and _branches_on_labels(error, user_frames[-1].line or ""):
        return _explain_label_branch(model, where)
    return (
        f"cannot trace {model_class}: torch.export failed{where}: {type(error).__name__}: {first_line}\n"
        "What to try: pass fixed-shape tensors for every input (pad to a fixed length), "
        "use_cache=False, attn_implementation='eager' or 'sdpa' in the config, and replace "
        "data-dependent Python control flow (`if tensor.sum() > 0`, `.item()`, `.tolist()`) "
        "in the model's forward with tensor operations."
    )


def _branches_on_labels(error: Exception, line: str) -> bool:
    """Whether export stopped at Python control flow on a value computed from the labels.

    Classification heads without ``config.problem_type`` look at the labels to choose their loss
    (DeBERTa-v2: ``if label_index.size(0) > 0``); the failing line of the model's code names them.
    """
    data_dependent = isinstance(error, GuardOnDataDependentSymNode) or "data-dependent" in str(error)
    return data_dependent and "label" in line.lower()


def _explain_label_branch(model: nn.Module, where: str) -> str:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "problem_type") and config.problem_type is None:
        fix = (
            "It chooses its loss by looking at the labels because `config.problem_type` is not set: set it, "
            'e.g. `model.config.problem_type = "single_label_classification"` (integer class labels; '
            '"multi_label_classification" for multi-hot float labels, "regression" for float targets), '
            "or pass `problem_type=...` to from_pretrained."
        )
    else:
        fix = "Compute the loss without Python control flow on label values (no `if` on a tensor of labels)."
    return (
        f"cannot trace {type(model).__name__}: its forward branches on the values of the labels{where}, "
        f"which a trace cannot follow (the graph is fixed once, for any labels). {fix}"
    )
