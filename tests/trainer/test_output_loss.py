"""`ModelOutputsOnly`: `Trainer.compute_loss` run on a model's outputs alone gives the loss it computes on
the model, and a ``compute_loss`` that needs more of the model than its outputs is an error naming it.

No processes: the stand-in is given the outputs of the real model's forward, as the pipeline's last
stage gives it a micro-batch's; the multi-process comparisons with `Trainer` are in test_any_batch.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.errors import PipelineError
from hf_ftpipe.trainer.output_loss import ModelOutputsOnly, computes_loss_from_outputs, method_name

from models import tiny_model


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 64, (3, 7), generator=generator)
    labels = input_ids.clone()
    labels[1, 4:] = -100  # a padded row: the count and the mean differ from a plain mean
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def _stand_in(trainer: Trainer, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> ModelOutputsOnly:
    with torch.no_grad():
        outputs = model(**batch)
    tokens = int(batch["labels"][:, 1:].ne(-100).sum())  # GPT-2's own mean is over the shifted labels
    named = {"loss": outputs.loss, "logits": outputs.logits}
    return ModelOutputsOnly(model, named, batch, method_name(trainer), tokens)


@pytest.mark.parametrize("num_items", [None, 11])
@pytest.mark.parametrize("options", [{"label_smoothing_factor": 0.1}, {}])
def test_trainer_compute_loss_on_the_outputs_equals_it_on_the_model(
    tmp_path: Path, options: dict, num_items: int | None
) -> None:
    model = tiny_model("gpt2").eval()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **options)

    class Subclass(Trainer):  # an override that post-processes super()'s outputs (with labels: the model's loss)
        def compute_loss(self, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            return 2 * loss + outputs.logits.float().pow(2).mean() * 1e-3

    trainer = Subclass(model=model, args=args)
    batch = _batch()
    items = None if num_items is None else torch.tensor(num_items)
    stand_in = _stand_in(trainer, model, batch)
    with torch.no_grad():
        expected = trainer.compute_loss(model, dict(batch), num_items_in_batch=items)
        got = trainer.compute_loss(stand_in, dict(batch), num_items_in_batch=items)
    torch.testing.assert_close(got, expected)
    assert stand_in.calls == 1
    assert computes_loss_from_outputs(trainer)


def _trainer_with(tmp_path: Path, compute_loss: Any) -> Trainer:
    subclass = type("MyTrainer", (Trainer,), {"compute_loss": compute_loss})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    return subclass(model=tiny_model("gpt2"), args=args)


def _reads_a_layer(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    return model.transformer.wte(inputs["input_ids"]).sum()


def _calls_twice(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    return model(**inputs).loss + model(**inputs).loss


def _changes_inputs(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    noisy = {**inputs, "input_ids": inputs["input_ids"].flip(1), "output_hidden_states": True}
    return model(**noisy).loss


@pytest.mark.parametrize(
    ("compute_loss", "error", "message"),
    [
        (_reads_a_layer, AttributeError, "MyTrainer.compute_loss read `model.transformer`, but PipeTrainer runs it"),
        (_calls_twice, PipelineError, "MyTrainer.compute_loss called the model again"),
        (_changes_inputs, PipelineError, "other inputs than the batch's (['input_ids', 'output_hidden_states'])"),
    ],
)
def test_a_compute_loss_that_needs_the_model_is_an_error_naming_it(
    tmp_path: Path, compute_loss: Any, error: type, message: str
) -> None:
    trainer = _trainer_with(tmp_path, compute_loss)
    batch = _batch()
    stand_in = _stand_in(trainer, trainer.model, batch)
    with pytest.raises(error) as raised:
        trainer.compute_loss(stand_in, dict(batch))
    assert message in str(raised.value)


def test_a_loss_from_outputs_with_token_slices_is_refused(tmp_path: Path) -> None:
    args = PipeTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", token_slices=[4, 4], label_smoothing_factor=0.1
    )
    with pytest.raises(PipelineError, match="each token slice computes its share of the loss inside the traced graph"):
        PipeTrainer(model=tiny_model("gpt2"), args=args)


def _token_mean(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    labels = inputs.pop("labels")
    logits = model(**inputs).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)


def _token_sum(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    labels = inputs.pop("labels")
    logits = model(**inputs).logits[:, :-1]
    total = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="sum")
    return total / num_items_in_batch


def test_a_loss_that_ignores_num_items_in_batch_is_an_error_naming_it(tmp_path: Path) -> None:
    """Added up over micro-batches, a mean of its own would count once per micro-batch: refused, with the fix."""
    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    batch = _batch()
    for compute_loss, fails in ((_token_sum, False), (_token_mean, True)):
        trainer = type("MeanTrainer", (PipeTrainer,), {"compute_loss": compute_loss})(
            model=tiny_model("gpt2"), args=args
        )
        with torch.no_grad():
            outputs = {"logits": trainer.model(**batch).logits}
        items = torch.tensor(int(batch["labels"].ne(-100).sum()))
        loss = trainer._loss_from_outputs(batch, outputs, items)
        if not fails:
            trainer._check_loss_scaling(batch, outputs, items, loss)
            continue
        with pytest.raises(PipelineError, match="MeanTrainer.compute_loss returned .* not half") as error:
            trainer._check_loss_scaling(batch, outputs, items, loss)
        assert "divide a sum by num_items_in_batch" in str(error.value)


def _doubled(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    return 2 * super(type(self), self).compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)


def _row_mean(self: Trainer, model: Any, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    labels = inputs.pop("labels")
    return torch.nn.functional.cross_entropy(model(**inputs).logits, labels)


def test_a_model_loss_that_ignores_num_items_in_batch_is_shared_out_by_its_batch_count(tmp_path: Path) -> None:
    """BERT's classification loss is its batch's mean whatever the count `Trainer` passes: an override
    post-processing it gets each micro-batch's share of that mean, which add up to `Trainer`'s loss;
    the scaling check takes it, and still refuses a mean the override takes of its own."""
    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    generator = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, 64, (5, 6), generator=generator), "labels": torch.tensor([0, 1, 1, 0, 1])}
    items = torch.tensor(11)  # the window's count: two batches' rows, which BERT's mean ignores
    trainer = type("DoubledTrainer", (PipeTrainer,), {"compute_loss": _doubled})(model=tiny_model("bert"), args=args)
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=items)
        pieces = [{name: value[rows] for name, value in batch.items()} for rows in (slice(0, 3), slice(3, 5))]
        losses, outputs = [], []
        for piece in pieces:
            out = trainer.model(**piece)
            outputs.append({"loss": out.loss, "logits": out.logits})
            losses.append(trainer._loss_from_outputs(piece, outputs[-1], items, batch_count=5))
    torch.testing.assert_close(sum(losses), expected)
    trainer._check_loss_scaling(pieces[0], outputs[0], items, losses[0], batch_count=5)

    trainer = type("MeanTrainer", (PipeTrainer,), {"compute_loss": _row_mean})(model=tiny_model("bert"), args=args)
    loss = trainer._loss_from_outputs(pieces[0], outputs[0], items, batch_count=5)
    with pytest.raises(PipelineError, match="MeanTrainer.compute_loss returned .* not half"):
        trainer._check_loss_scaling(pieces[0], outputs[0], items, loss, batch_count=5)
