"""Batch digests: equal for equal batches, different for any change of value, dtype or shape; the
cross-rank message names the step and the fields that differ."""

from __future__ import annotations

import numpy as np
import torch

from hf_ftpipe.trainer.batch_check import _difference, batch_digests, combined_digest


def batch() -> dict:
    return {"input_ids": torch.arange(12).reshape(3, 4), "labels": torch.tensor([0, 1, -100]), "flag": True}


def test_equal_batches_have_equal_digests_and_any_change_shows() -> None:
    reference = combined_digest(batch_digests(batch()))
    assert combined_digest(batch_digests(batch())) == reference
    changed = [
        {**batch(), "labels": torch.tensor([0, 1, 2])},  # a value
        {**batch(), "input_ids": torch.arange(12).reshape(4, 3)},  # a shape
        {**batch(), "input_ids": torch.arange(12, dtype=torch.int32).reshape(3, 4)},  # a dtype
        {**batch(), "flag": False},  # a plain value
        {k: v for k, v in batch().items() if k != "flag"},  # a field
        {**batch(), "pixels": np.zeros((2, 2))},
    ]
    assert len({combined_digest(batch_digests(b)) for b in changed} | {reference}) == len(changed) + 1


def test_difference_names_the_step_the_fields_and_each_rank() -> None:
    mine = batch_digests(batch())
    other = batch_digests({**batch(), "labels": torch.tensor([1, 1, 1])})
    message = _difference(4, [mine, other, mine])
    assert message.startswith(
        f"step 4: the ranks built different batches (`labels`: rank 0 {mine['labels'][:12]}, "
        f"rank 1 {other['labels'][:12]}, rank 2 {mine['labels'][:12]}; rank 0 has ['flag', 'input_ids', 'labels'])"
    )
    assert "same `seed` and `data_seed`" in message
