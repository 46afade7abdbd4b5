"""Which models' own loss divides by the ``num_items_in_batch`` `Trainer` passes: read from real tiny
models' forwards, and checked against what each forward computes when given twice the count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from torch import nn

from hf_ftpipe.trainer.loss_weighting import model_loss_counts_items

from models import VOCAB, tiny_model


def _vit(num_labels: int) -> nn.Module:
    """A 5.x classification head whose forward passes its ``**kwargs`` to ``self.loss_function``."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=num_labels,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def _inputs(kind: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    if kind == "gpt2":
        tokens = torch.randint(4, VOCAB, (3, 6), generator=generator)
        return {"input_ids": tokens, "labels": tokens}
    if kind == "bert":
        return {"input_ids": torch.randint(4, VOCAB, (3, 6), generator=generator), "labels": torch.tensor([0, 1, 1])}
    pixels = torch.randn(3, 1, 8, 8, generator=generator)
    if kind == "vit":
        return {"pixel_values": pixels, "labels": torch.tensor([0, 1, 1])}
    return {"pixel_values": pixels, "labels": torch.randn(3, generator=generator)}  # regression


def _halves(model: nn.Module, inputs: dict[str, Any]) -> bool:
    """Whether the forward's loss halves when ``num_items_in_batch`` doubles: what the rule must foretell."""
    with torch.no_grad():
        once = model(**inputs, num_items_in_batch=torch.tensor(5)).loss
        twice = model(**inputs, num_items_in_batch=torch.tensor(10)).loss
    return bool(torch.allclose(once, 2 * twice))


@pytest.mark.parametrize(
    ("kind", "counts"),
    [("bert", False), ("gpt2", True), ("vit", True), ("vit-regression", False)],
)
def test_the_rule_says_what_the_forward_does(kind: str, counts: bool) -> None:
    """BERT's classification head takes a mean of its own; GPT-2's causal LM loss and ViT's
    ``self.loss_function(..., **kwargs)`` divide by the count, ViT's regression (a mean) does not."""
    model = {"vit": lambda: _vit(2), "vit-regression": lambda: _vit(1)}.get(kind, lambda: tiny_model(kind))()
    inputs = _inputs(kind.split("-")[0] if kind != "vit-regression" else kind)
    assert model_loss_counts_items(model, inputs["labels"]) is counts
    assert _halves(model, inputs) is counts


def test_the_rule_reads_through_peft_and_empty_weights() -> None:
    """A LoRA-wrapped model is its base model's forward; a model on the meta device is read, not run."""
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model

    labels = torch.tensor([0, 1])
    bert = get_peft_model(tiny_model("bert"), LoraConfig(r=2, target_modules=["query"], task_type="SEQ_CLS"))
    assert model_loss_counts_items(bert, labels) is False
    gpt2 = get_peft_model(tiny_model("gpt2"), LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    assert model_loss_counts_items(gpt2, labels) is True
    with init_empty_weights():
        empty = _vit(2)
    assert next(empty.parameters()).is_meta
    assert model_loss_counts_items(empty, labels) is True


def test_a_forward_that_names_the_count_uses_it() -> None:
    class Summed(nn.Module):
        def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return (x - labels).square().sum() / kwargs["num_items_in_batch"]

    class Meaned(nn.Module):
        def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return (x - labels).square().mean()

    assert model_loss_counts_items(Summed()) is True
    assert model_loss_counts_items(Meaned()) is False
