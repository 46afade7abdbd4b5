"""What ``run_summarization_pipe.py`` does to (document, summary) pairs: columns, tokens, and ROUGE of decoded text.

As ``run_summarization.py`` does inline: the text and summary columns (the flags, a known Hub
dataset's, else the first two), tokenized pairs (pairs missing a side left out), and
``compute_metrics`` that decodes generated ids, puts one sentence per line and scores ROUGE.
"""

from __future__ import annotations

from collections.abc import Callable

import evaluate
import numpy as np
from transformers import EvalPrediction, PreTrainedTokenizerBase

from hf_ftpipe.metrics import load_metric, split_sentences

# (text, summary) columns of a few Hub datasets, by the last part of their name; other data: its
# first two columns, as run_summarization.py reads local files.
SUMMARY_COLUMNS = {
    "xsum": ("document", "summary"),
    "cnn_dailymail": ("article", "highlights"),
    "samsum": ("dialogue", "summary"),
    "multi_news": ("document", "summary"),
}


def columns(
    names: list[str], dataset_name: str | None = None, text_column: str | None = None, summary_column: str | None = None
) -> tuple[str, str]:
    """The (text, summary) columns of data with columns ``names``: those given, else the Hub dataset's
    known ones, else the first two."""
    known = SUMMARY_COLUMNS.get((dataset_name or "").rsplit("/", 1)[-1])
    chosen = []
    for flag, given, index in (("text_column", text_column, 0), ("summary_column", summary_column, 1)):
        name = given or (known[index] if known else (names[index] if len(names) > index else None))
        if name not in names:
            raise ValueError(f"`--{flag}` {name!r} is not a column of the data; its columns are {names}")
        chosen.append(name)
    return chosen[0], chosen[1]


def tokenize_pairs(
    batch: dict[str, list],
    tokenizer: PreTrainedTokenizerBase,
    text_column: str,
    summary_column: str,
    prefix: str,
    max_source_length: int,
    max_target_length: int,
    pad_to_max_length: bool,
    ignore_pad_token_for_loss: bool,
) -> dict[str, list]:
    """Tokenize each (document, summary) pair of a ``map`` batch; pairs missing either are left out.

    ``labels`` are the summary's ids; padded to the length with ``--pad_to_max_length``, their
    padding is -100 when ``ignore_pad_token_for_loss`` (else the pad token, which the loss counts).
    """
    pairs = [(text, summary) for text, summary in zip(batch[text_column], batch[summary_column]) if text and summary]
    padding = "max_length" if pad_to_max_length else False
    inputs = tokenizer(
        [prefix + text for text, _ in pairs], max_length=max_source_length, padding=padding, truncation=True
    )
    labels = tokenizer(
        text_target=[summary for _, summary in pairs], max_length=max_target_length, padding=padding, truncation=True
    ).input_ids
    if pad_to_max_length and ignore_pad_token_for_loss:
        labels = [[-100 if token == tokenizer.pad_token_id else token for token in row] for row in labels]
    return {**inputs, "labels": labels}


def decoded(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray) -> list[str]:
    """Token ids (-100 for padding) as stripped text, one sentence per line, as ROUGE-Lsum reads it.

    run_summarization.py splits sentences with nltk's punkt, which needs a download; offline,
    `hf_ftpipe.metrics.split_sentences` cuts after ``.``, ``!`` and ``?`` (also after abbreviations).
    """
    texts = tokenizer.batch_decode(np.where(ids != -100, ids, tokenizer.pad_token_id), skip_special_tokens=True)
    return ["\n".join(split_sentences(text.strip())) for text in texts]


def rouge_metrics(
    tokenizer: PreTrainedTokenizerBase, rouge: evaluate.EvaluationModule | None = None
) -> Callable[[EvalPrediction], dict[str, float]]:
    """compute_metrics: ROUGE-1/2/L/Lsum F-measures ×100 (rounded to 4 decimals) of the generated
    summaries against the labels, Porter-stemmed, and ``gen_len``, the mean count of generated
    tokens that are not padding, as run_summarization.py reports them.

    ``rouge`` defaults to ``load_metric("rouge")``: the Hub's module, else the shipped ``rouge_mean``.
    """
    if rouge is None:
        rouge = load_metric("rouge", keep_in_memory=True)  # no cache files shared by ranks

    def compute(prediction: EvalPrediction) -> dict[str, float]:
        predictions = prediction.predictions
        if isinstance(predictions, tuple):
            predictions = predictions[0]
        predictions = np.where(predictions != -100, predictions, tokenizer.pad_token_id)
        scores = rouge.compute(
            predictions=decoded(tokenizer, predictions),
            references=decoded(tokenizer, prediction.label_ids),
            use_stemmer=True,
        )
        result = {name: round(float(value) * 100, 4) for name, value in scores.items()}
        result["gen_len"] = float(np.mean(np.count_nonzero(predictions != tokenizer.pad_token_id, axis=-1)))
        return result

    return compute
