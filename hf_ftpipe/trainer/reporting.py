"""`PipeTrainer`'s logs and counts: what `Trainer` reports, for one model rather than one per rank.

`Trainer` sums token and FLOP counts over the ranks and all-gathers the loss to log it, as
data-parallel replicas need. Here every rank runs one model's pipeline on the same batch and holds
the whole loss already, so each counts once, with no collective (which a stopped rank would hang).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["PipeReporting"]


class PipeReporting:
    """`PipeTrainer`'s logging and counting, as a mixin placed before `Trainer`."""

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        # Trainer sums the count over ranks; every rank here reads the same batch, so count it once.
        setting = self.args.include_num_input_tokens_seen
        if setting in (False, "no", None):
            return
        name = getattr(self.model, "main_input_name", "input_ids")
        if name not in inputs:
            return
        if setting == "non_padding" and "attention_mask" in inputs:
            tokens = int(torch.as_tensor(inputs["attention_mask"]).sum())
        elif setting == "non_padding" and getattr(self.processing_class, "pad_token_id", None) is not None:
            tokens = int((torch.as_tensor(inputs[name]) != self.processing_class.pad_token_id).sum())
        else:
            tokens = int(torch.as_tensor(inputs[name]).numel())
        self.state.num_input_tokens_seen += tokens

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        # Every rank counts the whole model once, by Trainer's own formula; `store_flos` adds no other rank's.
        return super().floating_point_ops(inputs)

    def store_flos(self) -> None:
        # Trainer sums the count over ranks as if they were replicas, in a collective of its own.
        self.state.total_flos += self.current_flos
        self.current_flos = 0

    def _maybe_log_save_evaluate(
        self,
        tr_loss: torch.Tensor,
        grad_norm: torch.Tensor | float | None,
        model: nn.Module,
        trial: Any,
        epoch: float,
        ignore_keys_for_eval: list[str] | None,
        start_time: float,
        learning_rate: float | None = None,
    ) -> None:
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            self._log_training_loss(tr_loss, grad_norm, start_time, learning_rate)
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate
        )

    def _log_training_loss(
        self, tr_loss: torch.Tensor, grad_norm: torch.Tensor | float | None, start_time: float, learning_rate: Any
    ) -> None:
        """Trainer's logging step without its all-gather of the loss: every rank holds the pipeline's
        whole loss already, and a gather that a stopped rank never joins would hang the others."""
        tr_loss_scalar = tr_loss.item()
        tr_loss -= tr_loss
        logs: dict[str, float] = {"loss": tr_loss_scalar / (self.state.global_step - self._globalstep_last_logged)}
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
        self._total_loss_scalar += tr_loss_scalar
        self._globalstep_last_logged = self.state.global_step
        self.store_flos()
        self.log(logs, start_time)
