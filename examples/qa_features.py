"""SQuAD features and answers for ``run_qa_pipe.py``: questions and contexts into windows, logits back into text.

Hugging Face's ``run_qa.py`` keeps this in ``utils_qa.py`` beside the script; here too, so that the
script holds only its arguments, the model and the `PipeTrainer` run, and these two halves of the
data's round trip (tokens out, answer spans back) can be read and tested on their own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from datasets import Dataset
from transformers import PreTrainedTokenizerBase


def prepare_features(
    examples: dict[str, list],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    doc_stride: int,
    keep_offsets: bool,
    pad_to_max_length: bool = False,
) -> dict[str, list]:
    """Tokenize a batch of examples into features: ``[CLS] question [SEP] window of the context [SEP]``.

    Questions lose their leading spaces (a few SQuAD questions start with many, which would eat
    into the window); only the context is truncated (``only_second``), into windows of at most
    ``max_seq_length`` tokens that overlap by ``doc_stride`` tokens. With ``pad_to_max_length``
    every feature is padded to ``max_seq_length``; otherwise the collator pads each batch.

    Every feature gets ``start_positions`` and ``end_positions``: the tokens of the first gold
    answer, or the ``[CLS]`` token when the answer is not wholly inside the window (or the example
    has no answers). Evaluation features carry them too, so that ``eval_loss`` is reported, the
    loss on the first gold answer.

    With ``keep_offsets`` (evaluation and prediction), a feature also keeps ``example_id`` and
    ``offset_mapping``, the latter ``None`` for every token outside the context, which is how
    `postprocess_predictions` tells context tokens from question, special and padding tokens.
    """
    if tokenizer.padding_side != "right":
        raise ValueError("the features put the question first and pad on the right: use a right-padding tokenizer")
    encoded = tokenizer(
        [question.lstrip() for question in examples["question"]],
        examples["context"],
        truncation="only_second",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length" if pad_to_max_length else False,
    )
    example_of = encoded.pop("overflow_to_sample_mapping")  # feature -> index of its example in the batch
    offsets_of = encoded.pop("offset_mapping")
    starts, ends, example_ids, kept_offsets = [], [], [], []
    for index, offsets in enumerate(offsets_of):
        sequence_ids = encoded.sequence_ids(index)
        example = example_of[index]
        cls_index = encoded["input_ids"][index].index(tokenizer.cls_token_id)
        answers = examples["answers"][example] if "answers" in examples else None
        if answers and answers["answer_start"]:
            start_char = answers["answer_start"][0]
            span = answer_positions(offsets, sequence_ids, start_char, start_char + len(answers["text"][0]))
        else:
            span = None
        start, end = span if span is not None else (cls_index, cls_index)
        starts.append(start)
        ends.append(end)
        if keep_offsets:
            example_ids.append(examples["id"][example])
            kept_offsets.append([pair if sid == 1 else None for pair, sid in zip(offsets, sequence_ids)])
    features = {**encoded, "start_positions": starts, "end_positions": ends}
    if keep_offsets:
        features.update(example_id=example_ids, offset_mapping=kept_offsets)
    return features


def answer_positions(
    offsets: Sequence[tuple[int, int]], sequence_ids: Sequence[int | None], start_char: int, end_char: int
) -> tuple[int, int] | None:
    """The first and last tokens of the context span ``[start_char, end_char)``, or ``None`` when the
    span is not wholly inside this window's part of the context (``sequence_ids`` 1)."""
    context = [index for index, sid in enumerate(sequence_ids) if sid == 1]
    if not context or offsets[context[0]][0] > start_char or offsets[context[-1]][1] < end_char:
        return None
    # the last token starting at or before the answer, the first one ending at or after it
    start = max(index for index in context if offsets[index][0] <= start_char)
    end = min(index for index in context if offsets[index][1] >= end_char)
    return start, end


def postprocess_predictions(
    examples: Dataset,
    features: Dataset,
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    n_best_size: int = 20,
    max_answer_length: int = 30,
) -> dict[str, str]:
    """Each example's answer text: the best span over all of its features (windows).

    Per feature, every pair of the ``n_best_size`` highest start logits and the ``n_best_size``
    highest end logits is a candidate, unless a token is outside the context (``None`` offsets),
    the end comes before the start, or the span is longer than ``max_answer_length`` tokens. A
    candidate scores start logit + end logit; the best one over the example's features gives
    ``context[start_char:end_char]``. An example without any candidate gets ``""``.

    Args:
        examples: rows with ``id`` and ``context``.
        features: rows with ``example_id`` and ``offset_mapping`` (see `prepare_features`), in
            the order of the logits.
        start_logits, end_logits (`np.ndarray`): ``(features, longest feature)``; a feature's
            logits past its own tokens (padding, -100 where batches were concatenated) are never read.

    Returns:
        `dict[str, str]`: example id to answer text, for every example.
    """
    if len(features) != len(start_logits) or len(start_logits) != len(end_logits):
        raise ValueError(f"{len(features)} features but {len(start_logits)} start and {len(end_logits)} end logit rows")
    features_of = defaultdict(list)
    for index, example_id in enumerate(features["example_id"]):
        features_of[example_id].append(index)
    all_offsets = features["offset_mapping"]
    answers = {}
    for example in examples:
        best_score, best_text = -np.inf, ""
        for index in features_of[example["id"]]:
            offsets = all_offsets[index]
            starts = np.argsort(start_logits[index])[::-1][:n_best_size]
            ends = np.argsort(end_logits[index])[::-1][:n_best_size]
            for start in starts:
                for end in ends:
                    if start >= len(offsets) or end >= len(offsets) or offsets[start] is None or offsets[end] is None:
                        continue
                    if end < start or end - start + 1 > max_answer_length:
                        continue
                    score = start_logits[index][start] + end_logits[index][end]
                    if score > best_score:
                        best_score, best_text = score, example["context"][offsets[start][0] : offsets[end][1]]
        answers[example["id"]] = best_text
    return answers
