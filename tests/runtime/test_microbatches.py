"""`batch_losses`: one flush of several mini-batches' micro-batches gives each mini-batch its own loss."""

from __future__ import annotations

import torch

from hf_ftpipe.runtime.microbatches import batch_losses


def test_each_batch_sums_its_own_weighted_losses_and_leaves_out_weight_zero() -> None:
    # Two batches of 2 and 3 micro-batches in one flush; micro-batch 3 had no label (weight 0, NaN loss).
    # The losses arrive in the order the schedule finishes them, not by micro-batch.
    losses = [(m, torch.tensor(value)) for m, value in [(1, 3.0), (0, 2.0), (4, 5.0), (3, float("nan")), (2, 1.0)]]
    weights = {0: 0.25, 1: 0.75, 2: 0.5, 3: 0.0, 4: 0.5}
    got = batch_losses(losses, weights, [2, 3], torch.device("cpu"))
    # batch 0: 0.25 * 2 + 0.75 * 3 = 2.75; batch 1: 0.5 * 1 + 0.5 * 5 = 3.0 (micro-batch 3 left out)
    torch.testing.assert_close(got, torch.tensor([2.75, 3.0]))
    assert weights == {}, "the weights of the micro-batches given are taken out"
