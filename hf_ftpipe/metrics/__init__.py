"""Task metrics: the project's `evaluate` modules, a loader, and plain functions over them.

Each rule lives once, in a self-contained `evaluate` metric module shipped in this folder
(``t5_super_glue/``, ``squad_v1/``, ``rouge_mean/``), so the modules load offline and could be pushed to the Hub as
they are. :func:`load_metric` returns an `evaluate` module; the plain functions below are the
modules' own functions (fractions in ``[0, 1]``, not percentages), for code that scores lists
directly, such as a ``compute_metrics``.

- :func:`load_metric`: ``"squad"``, ``"rouge"`` and ``"super_glue"`` are the Hub's official modules
  when they can be reached (online or cached); offline, ``"squad"`` falls back to the shipped
  ``squad_v1`` and ``"rouge"`` to ``rouge_mean`` with a warning, while ``"super_glue"`` fails naming
  ``t5_super_glue`` (its scores are ×100, the official ones fractions). ``"squad_v1"``,
  ``"rouge_mean"`` and ``"t5_super_glue"`` are always the shipped ones.
- SuperGLUE (Wang et al., 2019) as T5 scores it: :func:`accuracy`, :func:`macro_f1` (CB),
  :func:`multirc_f1a_em`.
- SQuAD v1.1 (Rajpurkar et al., 2016): :func:`normalize_answer`, :func:`squad_em_f1`.
- ROUGE (Lin, 2004) with Google's ``rouge_score``: :func:`rouge_scores`, and :func:`split_sentences`
  for ROUGE-Lsum's one sentence per line (a rule, not nltk's punkt: no download).
- Language modelling: :func:`perplexity`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from hf_ftpipe.errors import HubError
from hf_ftpipe.metrics.rouge_mean.rouge_mean import rouge_scores, split_sentences
from hf_ftpipe.metrics.squad_v1.squad_v1 import normalize_answer, squad_em_f1
from hf_ftpipe.metrics.t5_super_glue.t5_super_glue import accuracy, macro_f1, multirc_f1a_em

if TYPE_CHECKING:
    import evaluate

__all__ = [
    "accuracy",
    "load_metric",
    "macro_f1",
    "multirc_f1a_em",
    "normalize_answer",
    "perplexity",
    "rouge_scores",
    "shipped_metric_path",
    "split_sentences",
    "squad_em_f1",
]

logger = logging.getLogger(__name__)

_SHIPPED = ("rouge_mean", "squad_v1", "t5_super_glue")
# Official Hub module -> the shipped module that takes the same inputs and reports the same scale
# (rouge_mean: the exact mean where the Hub's rouge reports a bootstrap median of it).
_FALLBACKS = {"rouge": "rouge_mean", "squad": "squad_v1"}
_OFFICIAL = ("rouge", "squad", "super_glue")


def shipped_metric_path(name: str) -> Path:
    """Folder of a shipped `evaluate` module, for ``evaluate.load(str(path), config_name)``."""
    if name not in _SHIPPED:
        raise ValueError(f"no shipped metric module {name!r}; shipped: {list(_SHIPPED)}")
    return Path(__file__).resolve().parent / name


def load_metric(name: str, config_name: str | None = None, **kwargs: object) -> evaluate.EvaluationModule:
    """Load a task metric as an `evaluate` module, offline when it has to.

    Args:
        name (`str`):
            ``"squad"``, ``"rouge"`` or ``"super_glue"``: the official module from the Hub (or
            evaluate's cache). If it cannot be loaded (offline and not cached, or a dependency such
            as scikit-learn missing): ``squad`` gives the shipped drop-in ``squad_v1`` and ``rouge``
            gives ``rouge_mean``, with one warning; ``super_glue`` raises `HubError` naming
            ``t5_super_glue``, which scores on another scale.
            ``"squad_v1"``, ``"rouge_mean"`` or ``"t5_super_glue"``: the shipped module, by path.
        config_name (`str`, *optional*):
            The task for ``super_glue`` and ``t5_super_glue``: ``boolq``, ``cb``, ``copa``,
            ``multirc``, ``rte`` or ``wic``.
        kwargs:
            Passed to ``evaluate.load`` (``experiment_id``, ``keep_in_memory``...).

    Returns:
        `evaluate.EvaluationModule`: call ``.compute(predictions=..., references=...)``.

    Note: the shipped ``t5_super_glue`` takes the official ``super_glue`` inputs (label ids, and
    ``{"idx", "prediction"}`` for MultiRC) as well as label names, but scores ×100 as T5 reports
    them, where the official module gives fractions.
    """
    import evaluate

    if name in _SHIPPED:
        return evaluate.load(str(shipped_metric_path(name)), config_name, **kwargs)
    if name not in _OFFICIAL:
        raise ValueError(f"unknown metric {name!r}: pass one of {sorted([*_OFFICIAL, *_SHIPPED])}")
    try:
        return evaluate.load(name, config_name, **kwargs)
    except (ConnectionError, FileNotFoundError, ImportError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        fallback = _FALLBACKS.get(name)
        if fallback is None:  # t5_super_glue scores ×100 where super_glue gives fractions: no silent swap
            raise HubError(
                f"evaluate could not load the official {name!r} ({reason}); offline, use "
                f"load_metric('t5_super_glue', {config_name!r}): the same inputs, scored ×100 as T5 reports "
                "them (the official module gives fractions)"
            ) from e
        logger.warning("evaluate could not load %r (%s); using hf_ftpipe's shipped %r", name, reason, fallback)
        return evaluate.load(str(shipped_metric_path(fallback)), config_name, **kwargs)


def perplexity(mean_loss: float) -> float:
    """Perplexity ``exp(mean_loss)`` of a language model, from its mean token cross-entropy in nats.

    ``exp(eval_loss)`` is the corpus perplexity when every evaluation block has the same number of
    label tokens. Returns ``inf`` where the exponential overflows a float (losses above ~709).
    """
    if math.isnan(mean_loss):
        raise ValueError("`mean_loss` is NaN: the evaluation loss diverged, perplexity is undefined")
    try:
        return math.exp(mean_loss)
    except OverflowError:
        return math.inf
