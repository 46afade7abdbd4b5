"""The text of ``benchmarks/variable_length.py``: English sentences with their natural lengths, and a tokenizer.

Offline and the same on every machine: the sentences come from the Python language reference
that ships with CPython (``pydoc_data.topics``, the text ``help()`` prints), prose paragraphs only
(indented code, interpreter sessions and grammar blocks are left out), split at sentence ends.
Their lengths are skewed as real sentence data is: most are short, a few are long (BERT
WordPiece tokens, [CLS] and [SEP] included: mean ~29, median ~24, 90th percentile ~47, a few
past 128), which is the case dynamic padding exists for.
"""

from __future__ import annotations

import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from local_tokenizer import build_bert_tokenizer  # noqa: E402

__all__ = ["LengthStats", "build_tokenizer", "label_of", "length_stats", "sample_sentences", "sentences"]

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_NEGATION = re.compile(r"\b(not|no|never|cannot|none|nothing)\b|n't\b", re.IGNORECASE)


def sentences() -> list[str]:
    """Every prose sentence of the language reference, in its order (~1,400)."""
    from pydoc_data.topics import topics

    found = []
    for body in topics.values():
        for paragraph in re.split(r"\n\s*\n", body):
            lines = [line for line in paragraph.split("\n") if line.strip()]
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # code and grammar are indented
            if ">>>" in paragraph or "::" in paragraph or paragraph.count("*") > 3:
                continue
            for sentence in _SENTENCE_END.split(" ".join(line.strip() for line in lines)):
                sentence = sentence.strip()
                if len(sentence.split()) >= 3 and sentence[0].isupper() and sentence[-1] in ".!?:":
                    found.append(sentence)
    return found


def sample_sentences(count: int, seed: int) -> list[str]:
    """``count`` sentences drawn without replacement (all of them, shuffled, if there are fewer)."""
    every = sentences()
    return random.Random(seed).sample(every, min(count, len(every)))


def label_of(sentence: str) -> int:
    """A binary label with some signal in the text: whether the sentence negates (not, no, never, n't...)."""
    return int(_NEGATION.search(sentence) is not None)


def build_tokenizer(texts: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    """A BERT WordPiece tokenizer trained on ``texts`` (`examples/local_tokenizer.py`)."""
    return build_bert_tokenizer(texts, vocab_size=vocab_size)


@dataclass(frozen=True)
class LengthStats:
    """Token lengths of the rows after truncation."""

    count: int
    mean: float
    median: float
    p90: int
    longest: int
    truncated: int
    """Rows cut at the maximum length."""

    @classmethod
    def of(cls, lengths: list[int], max_length: int, untruncated: list[int]) -> LengthStats:
        ordered = sorted(lengths)
        return cls(
            count=len(lengths),
            mean=statistics.mean(lengths),
            median=statistics.median(lengths),
            p90=ordered[int(0.9 * (len(ordered) - 1))],
            longest=ordered[-1],
            truncated=sum(n > max_length for n in untruncated),
        )


def length_stats(tokenizer, texts: list[str], max_length: int) -> LengthStats:
    """The token lengths of ``texts`` truncated at ``max_length``."""
    untruncated = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    return LengthStats.of([min(n, max_length) for n in untruncated], max_length, untruncated)
