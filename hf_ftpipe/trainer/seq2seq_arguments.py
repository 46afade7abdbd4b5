"""PipeSeq2SeqTrainingArguments: `Seq2SeqTrainingArguments` for `PipeSeq2SeqTrainer`."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Seq2SeqTrainingArguments

from hf_ftpipe.trainer.arguments import PipeTrainingArguments

__all__ = ["PipeSeq2SeqTrainingArguments"]


@dataclass
class PipeSeq2SeqTrainingArguments(PipeTrainingArguments, Seq2SeqTrainingArguments):
    """`PipeTrainingArguments` with `Seq2SeqTrainingArguments`' fields, for `PipeSeq2SeqTrainer`.

    The fields come from the two bases, declared once each: ``sortish_sampler``, ``generation_num_beams``
    and ``generation_config`` from `Seq2SeqTrainingArguments` (same defaults and help), the pipeline's
    settings, ``predict_with_generate`` and ``generation_max_length`` from `PipeTrainingArguments`
    (same defaults). So ``HfArgumentParser((ModelArguments, DataTrainingArguments,
    PipeSeq2SeqTrainingArguments))`` in ``run_summarization.py`` or ``run_translation.py`` reads the
    same flags, and ``isinstance(args, Seq2SeqTrainingArguments)`` holds.

    ``generation_num_beams`` and what a ``generation_config`` asks for run through the pipeline as
    ``model.generate`` runs them (`hf_ftpipe.trainer.generation`). ``sortish_sampler`` is accepted
    and, as in transformers' `Seq2SeqTrainer`, unused.
    """
