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

    The pipeline decodes greedily: ``generation_num_beams`` above 1 is refused here, and what a
    ``generation_config`` asks for is checked when the trainer generates
    (`hf_ftpipe.trainer.generation_settings`). ``sortish_sampler`` is accepted and, as in
    transformers' `Seq2SeqTrainer`, unused.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.generation_num_beams is not None and self.generation_num_beams > 1:
            raise ValueError(
                f"`generation_num_beams={self.generation_num_beams}`: generation through the pipeline is greedy "
                "only (beam search is not implemented yet); use generation_num_beams=1 or leave it unset"
            )
