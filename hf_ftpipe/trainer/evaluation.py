"""Evaluation, prediction and generation of `PipeTrainer`: `Trainer`'s numbers, through the pipeline.

`Trainer.evaluation_loop` stays in charge (metrics, callbacks, padding across batches); what
changes is the step. An eval batch runs through the pipeline in pieces of at most the planned
mini-batch, any length; the loss is recombined the way the model computes it on the whole batch
on one process, micro-batch by micro-batch, weighted by label tokens (see
`hf_ftpipe.trainer.loss_weighting`); predictions are the model's outputs less ``loss`` and
``keys_to_ignore_at_inference``, or, with ``predict_with_generate``, tokens ``model.generate``
makes through the pipeline (`generate`, `hf_ftpipe.trainer.generation`). Every rank gets the same
whole outputs, so nothing is gathered. With ``data_parallel_size`` replicas, an eval batch holds one
replica's ``per_device_eval_batch_size`` rows for each, and the engine splits it among them and
gathers their outputs.
A loss computed from the outputs (label smoothing, ``compute_loss_func``, an overridden
``compute_loss``: `hf_ftpipe.trainer.output_loss`) is computed from the whole batch's, as `Trainer` does.

A batch without the labels the model was traced with (a test split, ``run_qa.py``'s evaluation
features) gives no loss and no labels, as with `Trainer`: the graph still computes its loss, on
placeholder labels that every loss ignores (`_placeholder_labels`), and that loss is dropped.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from transformers.trainer_pt_utils import find_batch_size, nested_truncate

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.padding import IGNORE_INDEX
from hf_ftpipe.runtime.encoder_decoder_decoding import EncoderDecoderKV
from hf_ftpipe.runtime.kv_decoding import KVDecoder
from hf_ftpipe.runtime.microbatches import microbatch_rows
from hf_ftpipe.trainer.generation import pipeline_generate
from hf_ftpipe.trainer.generation_randomness import rank0_random_state
from hf_ftpipe.trainer.generation_settings import check_pipeline_generation, resolved_generation_config
from hf_ftpipe.trainer.loss_weighting import label_counts
from hf_ftpipe.trainer.output_loss import computes_loss_from_outputs
from hf_ftpipe.trainer.replicas import global_batch_size

__all__ = ["PipeEvaluation"]


class PipeEvaluation:
    """`PipeTrainer`'s evaluation steps, as a mixin placed before `Trainer` (it needs the
    pipeline engine, `_ensure_engine`, `_trainer_count` and `_model_loss_shifts` of `PipeTrainer`)."""

    def evaluation_loop(self, dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        self._ensure_engine(self._first_batch(dataloader))
        # Outputs are already whole and identical on every rank: gathering would duplicate them. Like
        # gather_for_metrics on one process, keep only the batch's real rows of what is "gathered":
        # the loop repeats a short last batch's loss `eval_batch_size` times. Padding across ranks
        # has nothing to even out either, and it is a collective that a stopped rank would hang.
        self.gather_function = self._keep_batch_rows
        self.accelerator.pad_across_processes = _unpadded
        # The loop repeats each batch's loss `args.eval_batch_size` times, one replica's rows: with replicas a
        # batch holds every replica's, so it must repeat that many, or a full batch would count for fewer rows
        # than a short last one keeps (Trainer's eval_loss is a mean over rows of their batch's loss).
        per_device = self.args.per_device_eval_batch_size
        self.args.per_device_eval_batch_size = global_batch_size(per_device, self.args)
        try:
            # Batches (a random collator's masks too) come from the data's own random state, as in training.
            with self.data_randomness.active():
                return super().evaluation_loop(dataloader, *args, **kwargs)
        finally:
            del self.accelerator.pad_across_processes  # the Accelerator's own method again
            self.args.per_device_eval_batch_size = per_device

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """`Trainer.prediction_step` through the pipeline: the model's loss over this eval batch (its
        mean over the batch's label tokens, as the model computes it on the whole batch), the model's
        outputs less ``loss`` and ``ignore_keys`` (or, with ``predict_with_generate``, generated
        tokens), and the labels. Identical on every rank."""
        engine = self._ensure_engine(inputs)
        inputs = self._prepare_inputs(inputs)
        self._batch_rows = find_batch_size(inputs)
        has_labels = bool(self.label_names) and all(inputs.get(name) is not None for name in self.label_names)
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", None) or []) if config else []
        generating = self.args.predict_with_generate and not prediction_loss_only
        from_outputs = has_labels and computes_loss_from_outputs(self)  # needs the outputs for its loss
        names = ["loss"] if has_labels else []
        if (not prediction_loss_only and not generating) or from_outputs:
            names += [n for n in engine.graph.output_names if n != "loss" and n not in ignore_keys]
        losses, counts, pieces = [], [], {name: [] for name in names if name != "loss"}
        if names:
            for chunk in self._chunks(inputs if has_labels else self._placeholder_labels(inputs)):
                real = find_batch_size(chunk)
                chunk = self._fixed_rows(chunk)
                outputs = engine.eval_step(chunk, output_names=tuple(names))
                if outputs.get("loss") is not None:
                    losses.append(outputs["loss"])
                    counts.append(self._microbatch_counts(chunk, real))
                for name in pieces:
                    if outputs.get(name) is not None:
                        pieces[name].append(outputs[name][:real])
        loss = _weighted_mean(torch.cat(losses), torch.cat(counts), self._trainer_count(inputs)) if losses else None
        if from_outputs and losses:  # Trainer's compute_loss on the whole batch's outputs, on every rank alike
            mean = _weighted_mean(torch.cat(losses), torch.cat(counts), None)
            outputs = {"loss": mean, **{name: torch.cat(parts) for name, parts in pieces.items() if parts}}
            count = self._trainer_count(inputs)
            items = None if count is None else torch.tensor(count, device=self.args.device)
            with torch.no_grad():
                loss, returned = self._loss_from_outputs(
                    inputs, outputs, items, return_outputs=True, label_count=int(torch.cat(counts).sum())
                )
            loss = loss.detach().mean()
            if isinstance(returned, dict):
                pieces = {k: [v] for k, v in returned.items() if k not in [*ignore_keys, "loss"]}
        if prediction_loss_only:
            return loss, None, None
        labels = inputs.get("labels") if has_labels else None
        if generating:
            return loss, self._generated_for_predictions(inputs), labels
        predictions = tuple(torch.cat(parts) for parts in pieces.values() if parts)
        return loss, (predictions[0] if len(predictions) == 1 else predictions or None), labels

    def _keep_batch_rows(self, value: Any) -> Any:
        rows = getattr(self, "_batch_rows", None)
        return value if rows is None else nested_truncate(value, rows)

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``model.generate`` through the pipeline: the same arguments, the same result, on every rank
        (every rank must call it alike). Greedy and beam search, sampling (from rank 0's random state,
        so the tokens one process seeded alike draws), logits processors and stopping criteria are
        ``generate``'s own; see `hf_ftpipe.trainer.generation` for how, and what a new token costs.
        Before the pipeline exists it is traced on a training (else evaluation) batch."""
        with self.failing_together("generating"):
            check_pipeline_generation(self.model, kwargs)
            if self.engine is None:
                if self.train_dataset is None and self.eval_dataset is None:
                    raise PipelineError(
                        "generate builds the pipeline from a training batch (the shapes it is planned for), but the "
                        "trainer has no `train_dataset` or `eval_dataset`: pass one, or train or evaluate first"
                    )
                data = self.get_train_dataloader() if self.train_dataset is not None else self.get_eval_dataloader()
                self._ensure_engine(self._first_batch(data))
            kwargs = {name: self._prepare_input(v) if isinstance(v, torch.Tensor) else v for name, v in kwargs.items()}
            if inputs is not None:
                kwargs["inputs"] = self._prepare_input(inputs)
            if self.engine.rank != 0:
                kwargs.pop("streamer", None)  # rank 0 streams the tokens every rank generates
            with rank0_random_state(self.args.device, self.watchdog):
                return pipeline_generate(
                    self.model,
                    self._pipeline_logits,
                    self.engine.graph.inputs,
                    self.args.device,
                    decoder_for=self._key_value_cache,
                    **kwargs,
                )

    def _key_value_cache(self, rows: int, max_length: int) -> KVDecoder:
        """The model's keys and values kept on each stage's rank, for generation (`hf_ftpipe.runtime.kv_decoding`;
        an encoder-decoder's: `hf_ftpipe.runtime.encoder_decoder_decoding`)."""
        kind = EncoderDecoderKV if self.model.config.is_encoder_decoder else KVDecoder
        return kind(self.engine, model=self.model, rows=rows, max_length=max_length)

    def _generated_tokens(self, inputs: dict[str, Any], gen_kwargs: dict[str, Any]) -> torch.Tensor:
        """`Seq2SeqTrainer.prediction_step`'s ``model.generate(**inputs, **gen_kwargs)``: a batch's
        ``decoder_input_ids`` (and mask) made from its labels are left out, else every step would be
        teacher-forced; a decoder-only model generates after its ``input_ids`` (returned with them)."""
        labels, decoder = inputs.get("labels"), inputs.get("decoder_input_ids")
        if isinstance(labels, torch.Tensor) and isinstance(decoder, torch.Tensor) and labels.shape == decoder.shape:
            inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
        return self.generate(**inputs, **gen_kwargs)

    def _generated_for_predictions(self, inputs: dict[str, Any]) -> torch.Tensor:
        """PipeTrainer's ``predict_with_generate``: tokens up to ``generation_max_length`` (an encoder-decoder's
        default: the traced label length + 1; else the model's generation config), padded to it."""
        max_length = self.args.generation_max_length
        labels = self.engine.graph.inputs.get("labels")
        if max_length is None and self.model.config.is_encoder_decoder and labels is not None and labels.shape:
            max_length = int(labels.shape[-1]) + 1
        tokens = self._generated_tokens(inputs, {} if max_length is None else {"max_length": max_length})
        settings = resolved_generation_config(self.model, {})
        pad = next((t for t in (settings.pad_token_id, self.model.config.pad_token_id) if t is not None), IGNORE_INDEX)
        return nn.functional.pad(tokens, (0, max(0, (max_length or 0) - tokens.shape[1])), value=pad)

    def _pipeline_logits(self, batch: dict[str, torch.Tensor], position: int | None = None) -> torch.Tensor:
        """The model's logits for ``batch`` (the traced inputs it lacks filled as every loss ignores
        them), in pieces of at most the planned mini-batch: ``(rows, length, vocab)`` on every rank, or
        with ``position`` only that position's, ``(rows, 1, vocab)`` (only those cross between ranks)."""
        pieces = []
        for chunk in self._chunks(self._placeholder_labels(batch)):
            real = find_batch_size(chunk)
            outputs = self.engine.eval_step(self._fixed_rows(chunk), output_names=("logits",), position=position)
            pieces.append(outputs["logits"][:real])
        return torch.cat(pieces)

    def _chunks(self, inputs: dict[str, Any]) -> Any:
        """``inputs`` in pieces of at most the planned mini-batch (the memory the plan allows): of fewer
        rows where they are longer than planned (`_evaluation_rows`)."""
        size = self._evaluation_rows(inputs)
        rows = find_batch_size(inputs)
        for start in range(0, rows, size):
            yield {k: v[start : start + size] if _is_batched(v, rows) else v for k, v in inputs.items()}

    def _evaluation_rows(self, inputs: dict[str, Any]) -> int:
        """Rows per piece: the planned mini-batch's, or for rows longer than planned (a test split's
        longest sentence) as many as keep each micro-batch within the planned micro-batch's tokens.
        A forward without backward keeps no activations, so that fits in the memory planned for
        training; `Trainer` evaluates such rows, so PipeTrainer does too."""
        size = self._train_batch_size  # every replica's planned mini-batch: eval_step splits it among them
        ratio, planned_rows = 1.0, None
        for name, info in self.engine.graph.inputs.items():
            value = inputs.get(name)
            if info.shape is None or not isinstance(value, torch.Tensor) or value.dim() < 2 or 1 not in info.varying:
                continue
            ratio = min(ratio, info.shape[1] / value.shape[1])
            planned_rows = info.shape[0]
        if ratio >= 1 or planned_rows is None:
            return size
        return max(1, math.floor(planned_rows * ratio)) * self.engine.microbatches_per_batch

    def _placeholder_labels(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``inputs`` with each traced input it lacks (labels, answer positions) filled with a value every
        Hugging Face loss ignores: ``-100`` for integers (cross-entropy's ``ignore_index``), and where a
        loss clamps positions to the sequence length (question answering), past it; zeros for floats.
        Shaped as traced, with the batch's rows and (for a sequence) the length of ``input_ids``."""
        graph = self.engine.graph
        rows = find_batch_size(inputs)
        filled = dict(inputs)
        for name, info in graph.inputs.items():
            if name in inputs or info.shape is None:
                continue
            shape = [rows, *info.shape[1:]]
            length = next((v.shape[1] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 1), None)
            if len(shape) > 1 and 1 in info.varying and length is not None:
                shape[1] = int(length)
            dtype = getattr(torch, info.dtype or "long")
            if dtype.is_floating_point:
                filled[name] = torch.zeros(shape, dtype=dtype, device=self.args.device)
            else:
                ignored = IGNORE_INDEX if name == "labels" or len(shape) > 1 else 2**30  # positions: clamped, ignored
                filled[name] = torch.full(shape, ignored, dtype=dtype, device=self.args.device)
        return filled

    def _fixed_rows(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A graph traced with fixed shapes (token slicing, or a model that cannot vary them) takes
        only whole mini-batches: a short chunk is padded with copies of its last row, whose labels
        are ignored (their outputs are cut off again)."""
        graph = self.engine.graph
        if any(info.varying for info in graph.inputs.values()):
            return chunk
        size, real = self._train_batch_size, find_batch_size(chunk)  # a whole mini-batch for every replica
        if real >= size:
            return chunk
        padded = {}
        for name, value in chunk.items():
            if isinstance(value, torch.Tensor) and value.shape[:1] == (real,):
                filler = value[-1:].expand(size - real, *value.shape[1:]).clone()
                if name == "labels":
                    filler.fill_(IGNORE_INDEX)
                value = torch.cat([value, filler])
            padded[name] = value
        return padded

    def _microbatch_counts(self, chunk: dict[str, Any], real: int) -> torch.Tensor:
        """What each micro-batch's loss is a mean over: its label tokens, or (no labels to count) its
        rows, of which the first ``real`` are the batch's own."""
        num_microbatches = self.engine.microbatches_per_batch  # the replicas' losses, gathered in order
        labels = chunk.get("labels")
        if isinstance(labels, torch.Tensor) and labels.dim() > 0:
            counts = label_counts(labels, num_microbatches, shifted=self._model_loss_shifts)
        else:
            sizes = microbatch_rows(find_batch_size(chunk), num_microbatches)
            starts = [sum(sizes[:m]) for m in range(len(sizes))]
            counts = [min(size, max(0, real - start)) for size, start in zip(sizes, starts, strict=True)]
        return torch.tensor(counts, dtype=torch.float64)


def _unpadded(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


def _is_batched(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def _weighted_mean(losses: torch.Tensor, counts: torch.Tensor, total: int | None) -> torch.Tensor:
    """sum(count * loss) / total (default: sum(count)); a micro-batch of count 0 (NaN loss: nothing
    to average) is left out."""
    counts = counts.to(losses.device, torch.float64)
    terms = torch.where(counts > 0, losses.double() * counts, torch.zeros_like(counts))
    return (terms.sum() / (total or counts.sum())).to(losses.dtype)
