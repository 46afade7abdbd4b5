"""ROUGE-1/2/L/Lsum F-measures with Google's ``rouge_score``, averaged exactly: the Hub ``rouge`` module, offline.

A drop-in for the ``rouge`` module on the Hub (same inputs, same keys, fractions in ``[0, 1]``)
that loads offline:

    >>> import evaluate
    >>> rouge = evaluate.load("path/to/rouge_mean")
    >>> rouge.compute(predictions=["the cat sat"], references=["the cat ran"])
    {'rouge1': 0.6666666666666666, 'rouge2': 0.5, 'rougeL': 0.6666666666666666, 'rougeLsum': 0.6666666666666666}

Each pair is scored by ``rouge_score`` (the package the Hub module wraps, a port of ROUGE-1.5.5):
lowercased, every run of characters outside ``[a-z0-9]`` a word break, optionally Porter-stemmed;
ROUGE-N is the F-measure of the shared n-grams counted with multiplicity; ROUGE-L that of the
longest common subsequence of the two texts; ROUGE-Lsum the summary-level LCS over sentences, which
``rouge_score`` takes as the text's lines (put one sentence per line: :func:`split_sentences`).
With several references a prediction takes its best reference per type.

One difference from the Hub module: the aggregate is the plain mean of the per-pair F-measures.
The Hub module reports the median of 1,000 bootstrap resamples of that mean
(``rouge_score.scoring.BootstrapAggregator``, drawn from numpy's global generator), which differs
from the mean by resampling noise, usually in the 4th decimal of a percentage on a few hundred pairs.

Self-contained on purpose (the standard library, ``datasets``, ``evaluate`` and ``rouge_score``),
so the folder can be pushed to the Hub as it is. ``rouge_score`` is imported when scoring, so that
:func:`split_sentences` works without it.
"""

import re
from collections.abc import Callable, Sequence

import datasets
import evaluate

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    year = "2004",
    pages = "74--81",
}
"""

_DESCRIPTION = """\
ROUGE-N, ROUGE-L and ROUGE-Lsum F-measures from Google's rouge_score package, averaged over the
pairs (the plain mean, where the Hub `rouge` module reports a bootstrap median of it). Same inputs
and outputs as the Hub module, but self-contained so it loads offline.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of predicted texts.
    references: list of reference texts, one per prediction, or a list of references per prediction.
    rouge_types: the types to score, default ["rouge1", "rouge2", "rougeL", "rougeLsum"]; "rouge{n}"
        for any n; "rougeLsum" reads sentences as lines ("\\n"-separated).
    use_aggregator: True (default): the mean F-measure per type; False: the list of per-pair F-measures.
    use_stemmer: strip word suffixes with the Porter stemmer before matching (run_summarization.py: True).
    tokenizer: a callable from text to tokens, in place of rouge_score's tokenizer.
Returns:
    one entry per type: the F-measure (fraction), or per pair with use_aggregator=False.
Examples:
    >>> rouge = evaluate.load("path/to/rouge_mean")
    >>> rouge.compute(predictions=["hello there", "general kenobi"], references=["hello there", "general kenobi"])
    {'rouge1': 1.0, 'rouge2': 1.0, 'rougeL': 1.0, 'rougeLsum': 1.0}
"""

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")

# A sentence ends at ".", "!" or "?" (a run of them, then any closing quotes or brackets) before
# whitespace. punkt (what run_summarization.py calls through nltk.sent_tokenize) also learns
# abbreviations, initials and ordinals from text and does not split after them ("Dr. Smith",
# "J. R. R. Tolkien", "U.S. troops"); this rule splits there too. It needs no data download.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+")


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text``: cut after ``.``, ``!`` or ``?`` (and closing quotes or brackets) and
    whitespace, each stripped, empty ones dropped.

    ROUGE-Lsum scores sentence by sentence; ``"\\n".join(split_sentences(text))`` is the form it
    takes. Unlike nltk's punkt it also splits after abbreviations ("Dr. Smith" is two sentences).

    >>> split_sentences("Anna opened a bakery. It sells bread!  Ben said: \\"great.\\" ok")
    ['Anna opened a bakery.', 'It sells bread!', 'Ben said: "great."', 'ok']
    """
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        pieces.append(text[start : match.start() + len(match.group(0).rstrip())])
        start = match.end()
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


class _CallableTokenizer:
    """rouge_score calls ``tokenizer.tokenize(text)``; the Hub module takes a plain callable."""

    def __init__(self, function: Callable[[str], list[str]]):
        self.function = function

    def tokenize(self, text: str) -> list[str]:
        return self.function(text)


def rouge_scores(
    predictions: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    rouge_types: Sequence[str] | None = None,
    use_aggregator: bool = True,
    use_stemmer: bool = False,
    tokenizer: Callable[[str], list[str]] | None = None,
) -> dict[str, float] | dict[str, list[float]]:
    """ROUGE F-measures of ``predictions`` against ``references``: per type, their mean (fractions),
    or the per-pair values with ``use_aggregator=False``.

    Args:
        predictions (`Sequence[str]`):
            One text per pair.
        references (`Sequence[str]` or `Sequence[Sequence[str]]`):
            One text per pair, or a non-empty list of texts per pair (the best one counts).
        rouge_types (`Sequence[str]`, *optional*):
            Default ``("rouge1", "rouge2", "rougeL", "rougeLsum")``.
        use_aggregator (`bool`, defaults to `True`):
            The mean per type; else the list of per-pair F-measures.
        use_stemmer (`bool`, defaults to `False`):
            Porter-stem words longer than 3 characters before matching.
        tokenizer (`Callable[[str], list[str]]`, *optional*):
            Replaces rouge_score's tokenizer.

    Returns:
        `dict`: type -> mean F-measure, or type -> list of F-measures.
    """
    try:
        from rouge_score import rouge_scorer
    except ImportError as e:
        raise ImportError(
            "ROUGE needs Google's rouge_score package: pip install 'rouge_score>=0.1.2,<0.2' "
            "(or install hf_ftpipe with its `examples` extra)"
        ) from e
    if len(predictions) != len(references):
        raise ValueError(
            f"metric inputs must have one entry per pair, but `predictions` has {len(predictions)}, "
            f"`references` has {len(references)}"
        )
    if not references:
        raise ValueError("metric inputs are empty (predictions, references): nothing to score")
    types = list(ROUGE_TYPES if rouge_types is None else rouge_types)
    scorer = rouge_scorer.RougeScorer(
        types, use_stemmer=use_stemmer, tokenizer=_CallableTokenizer(tokenizer) if tokenizer else None
    )
    per_pair: dict[str, list[float]] = {name: [] for name in types}
    for i, (prediction, reference) in enumerate(zip(predictions, references)):
        if isinstance(reference, str):
            scores = scorer.score(reference, prediction)
        elif len(reference) == 0:
            raise ValueError(f"`references[{i}]` is an empty list: every prediction needs at least one reference")
        else:
            scores = scorer.score_multi(list(reference), prediction)
        for name in types:
            per_pair[name].append(scores[name].fmeasure)
    if not use_aggregator:
        return per_pair
    return {name: sum(values) / len(values) for name, values in per_pair.items()}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RougeMean(evaluate.Metric):
    """ROUGE F-measures in the Hub `rouge` module's input format, averaged exactly."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence")),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
            codebase_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
            reference_urls=["https://aclanthology.org/W04-1013"],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list,
        rouge_types: list[str] | None = None,
        use_aggregator: bool = True,
        use_stemmer: bool = False,
        tokenizer: Callable[[str], list[str]] | None = None,
    ) -> dict:
        return rouge_scores(predictions, references, rouge_types, use_aggregator, use_stemmer, tokenizer)
