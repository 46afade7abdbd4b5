"""`hf_ftpipe.trainer.per_shape`: a model whose export fixes the length buckets lengths to the trainer's
collator's ``pad_to_multiple_of`` and pads with its tokenizer's pad token."""

from __future__ import annotations

from types import SimpleNamespace

from transformers import DataCollatorWithPadding, default_data_collator

from hf_ftpipe.runtime.per_shape import PerShapeOptions
from hf_ftpipe.trainer.per_shape import per_shape_options

from mlm_runs import tokenizer


def test_buckets_follow_the_collator_and_padding_its_tokenizer() -> None:
    model = SimpleNamespace(config=SimpleNamespace(pad_token_id=5))
    collator = DataCollatorWithPadding(tokenizer(), pad_to_multiple_of=16)
    assert per_shape_options(collator, None, model) == PerShapeOptions(multiple_of=16, pad_token_id=0)
    # no multiple, no tokenizer: the default bucket, the model's pad token
    assert per_shape_options(default_data_collator, None, model) == PerShapeOptions(multiple_of=8, pad_token_id=5)
    assert per_shape_options(DataCollatorWithPadding(tokenizer()), None, None) == PerShapeOptions()
