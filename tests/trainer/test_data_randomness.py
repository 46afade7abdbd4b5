"""DataRandomness: data draws come from their own state, seeded as `set_seed` seeds the globals."""

from __future__ import annotations

import random

import numpy as np
import torch
from transformers import set_seed

from hf_ftpipe.trainer.data_randomness import DataRandomness


def draws() -> tuple[list[float], list[float], list[float]]:
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


def test_data_draws_continue_the_sequence_set_seed_starts_whatever_the_model_draws_between() -> None:
    set_seed(7)
    expected_first, expected_second = draws(), draws()

    data = DataRandomness(7)
    torch.manual_seed(123)  # the model's own state, e.g. after dropout
    with data.active():
        first = draws()
    model_draw = torch.rand(1)
    torch.rand(5), np.random.rand(5), random.random()  # dropout and friends, between two batches
    with data.active():
        second = draws()

    assert (first, second) == (expected_first, expected_second)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), model_draw)  # the model's state is put back after each batch


def test_forked_draws_do_not_advance_the_data_state() -> None:
    data = DataRandomness(3)
    with data.forked():
        looked = draws()
    with data.active():
        assert draws() == looked


def test_state_dict_round_trip_resumes_the_same_sequence() -> None:
    data = DataRandomness(11)
    with data.active():
        draws()
    np.random.randn()  # numpy's cached Gaussian is part of the state too
    state = data.state_dict()
    assert all(isinstance(value, torch.Tensor) for value in state.values())  # loads with weights_only=True
    with data.active():
        np.random.randn()
        expected = draws()

    resumed = DataRandomness(0)
    resumed.load_state_dict(state)
    with resumed.active():
        np.random.randn()
        assert draws() == expected


def test_a_checkpoint_with_a_batch_collated_ahead_resumes_the_collations_exactly() -> None:
    # accelerate's loader collates one batch ahead of the one it hands out: at a checkpoint after
    # step 2, batch 3 is collated but not trained on, and the data state has moved past it.
    data = DataRandomness(5)
    collate = data.collating(lambda samples: torch.rand(2))
    with data.active():
        batches = [collate([]), collate([])]  # batch 1, and batch 2 ahead
    data.trained(1)
    with data.active():
        batches.append(collate([]))  # batch 3 ahead
    data.trained(1)
    state = data.state_dict()
    with data.active():
        batches += [collate([]), collate([])]

    resumed = DataRandomness(0)
    resumed.load_state_dict(state)
    collate = resumed.collating(lambda samples: torch.rand(2))
    with resumed.active():
        torch.rand(3)  # a new data loader draws its own seed before its first batch
        again = [collate([]), collate([]), collate([])]  # batches 3, 4 and 5 of the resumed run
    assert all(torch.equal(a, b) for a, b in zip(again, batches[2:], strict=True))
    assert not torch.equal(batches[2], batches[3])
