"""PipeSeq2SeqTrainer: transformers' `Seq2SeqTrainer`, with the model run as a pipeline.

Swap ``Seq2SeqTrainer`` for ``PipeSeq2SeqTrainer`` and ``Seq2SeqTrainingArguments`` for
``PipeSeq2SeqTrainingArguments`` (``run_summarization.py``, ``run_translation.py``). Training is
`PipeTrainer`'s; with ``predict_with_generate``, ``evaluate`` and ``predict`` return generated tokens
as `Seq2SeqTrainer` does: settings from ``gen_kwargs`` (``max_length``, ``num_beams``, ...), else the
arguments' ``generation_max_length`` / ``generation_num_beams``, else the model's
``generation_config`` (`hf_ftpipe.trainer.generation_settings`), decoded greedily through the pipeline
(`hf_ftpipe.trainer.generation`), padded as `Seq2SeqTrainer` pads them, with the loss of the
teacher-forced forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Seq2SeqTrainer

from hf_ftpipe.trainer.generation_settings import greedy_settings, seq2seq_gen_kwargs
from hf_ftpipe.trainer.pipe_trainer import PipeTrainer
from hf_ftpipe.trainer.seq2seq_arguments import PipeSeq2SeqTrainingArguments

__all__ = ["PipeSeq2SeqTrainer"]


class PipeSeq2SeqTrainer(PipeTrainer):
    """`Seq2SeqTrainer` through the pipeline: `PipeTrainer` whose ``evaluate`` and ``predict`` take
    ``max_length``, ``num_beams`` and other ``gen_kwargs``. Generation is greedy: ``num_beams > 1``
    or sampling is refused with what to use instead."""

    def __init__(self, model: nn.Module | None = None, args: PipeSeq2SeqTrainingArguments | None = None, **kwargs: Any):
        if args is None:
            args = PipeSeq2SeqTrainingArguments(output_dir="trainer_output")
        super().__init__(model=model, args=args, **kwargs)
        self._gen_kwargs: dict[str, Any] = {}
        given = getattr(self.args, "generation_config", None)
        if given is not None:  # as Seq2SeqTrainer: the arguments' config replaces the model's
            self.model.generation_config = Seq2SeqTrainer.load_generation_config(given)

    def evaluate(
        self,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        self._use_gen_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(
        self,
        test_dataset: Dataset,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> Any:
        self._use_gen_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def _use_gen_kwargs(self, gen_kwargs: dict[str, Any]) -> None:
        """Keep the call's settings for its prediction steps; refuse what the pipeline cannot decode
        before any batch runs (every rank alike: the same arguments on each)."""
        self._gen_kwargs = seq2seq_gen_kwargs(gen_kwargs, self.args)
        if self.args.predict_with_generate and not self.args.prediction_loss_only:
            greedy_settings(self._gen_kwargs, self.model)

    def _keep_batch_rows(self, value: Any) -> Any:
        """`Seq2SeqTrainer.evaluate` and ``predict`` gather with ``accelerator.gather``, not
        ``gather_for_metrics``: a short last batch's loss, repeated ``eval_batch_size`` times, is kept
        whole, so its ``eval_loss`` is the mean of the batches' losses. Kept whole here too."""
        return value

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """`Seq2SeqTrainer.prediction_step`: the loss of the teacher-forced forward and, with
        ``predict_with_generate``, greedily generated tokens and the labels, both padded to the
        model's generation ``max_length`` as `Seq2SeqTrainer` pads them."""
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)
        settings = greedy_settings(gen_kwargs or self._gen_kwargs, self.model)
        tokens = self._greedy_tokens(
            inputs,
            settings.max_new_tokens,
            settings.decoder_start_token_id,
            settings.pad_token_id,
            settings.eos_token_id,
        )
        tokens = self._padded(tokens, settings.padded_width(tokens.shape[-1]))
        labels = inputs.get("labels")
        if labels is not None:
            labels = self._padded(labels.to(self.args.device), settings.padded_width(labels.shape[-1]))
        return loss, tokens, labels

    def _padded(self, tensor: torch.Tensor, width: int) -> torch.Tensor:
        """``tensor`` padded on the right to ``width`` with the tokenizer's pad token (its EOS if it has
        none; else the model's), as `Seq2SeqTrainer._pad_tensors_to_max_len` pads."""
        if tensor.shape[-1] >= width:
            return tensor
        tokenizer = self.processing_class
        if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        else:
            pad = getattr(self.model.config, "pad_token_id", None)
            if pad is None:
                raise ValueError(
                    "padding generated tokens needs a pad token: set `pad_token_id` in the model's config, or "
                    "pass the tokenizer as `processing_class`"
                )
        return nn.functional.pad(tensor, (0, width - tensor.shape[-1]), value=pad)
