"""PipeTrainer and what it adds to transformers' Trainer: arguments, the launch (one writer), plan
sharing, the run's log lines, evaluation, generation, checkpoints, float16 and loss weighting; and
PipeSeq2SeqTrainer, the counterpart of Seq2SeqTrainer."""

from hf_ftpipe._lazy import lazy_getattr

_HOMES = {
    "PipeTrainer": "hf_ftpipe.trainer.pipe_trainer",
    "PipeTrainingArguments": "hf_ftpipe.trainer.arguments",
    "PipeSeq2SeqTrainer": "hf_ftpipe.trainer.seq2seq_trainer",
    "PipeSeq2SeqTrainingArguments": "hf_ftpipe.trainer.seq2seq_arguments",
}
__all__ = sorted(_HOMES)
__getattr__ = lazy_getattr(__name__, _HOMES)
