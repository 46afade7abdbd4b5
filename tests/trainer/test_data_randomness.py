"""DataRandomness: data draws come from their own state, seeded as `set_seed` seeds the globals."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, set_seed
from transformers.trainer_utils import RemoveColumnsCollator

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


def _seeded_collator(return_tensors: str) -> DataCollatorForLanguageModeling:
    from mlm_runs import tokenizer

    return DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.5, seed=5, return_tensors=return_tensors)


@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_a_forked_look_leaves_a_collators_own_generator_where_it_was(return_tensors: str) -> None:
    # run_mlm.py's seeded collator masks from a generator it makes on its first call (torch's or numpy's).
    # Before: the look at the batch the pipeline is traced on made and advanced it, so the first trained
    # batch was masked with the second batch's draws.
    rows = [{"input_ids": list(range(5, 45))} for _ in range(4)]
    reference = _seeded_collator(return_tensors)
    expected = [reference(rows)["labels"].tolist() for _ in range(2)]

    collator, data = _seeded_collator(return_tensors), DataRandomness(0)
    wrapped = RemoveColumnsCollator(collator, signature_columns=["input_ids"])  # as a data loader holds it
    with data.forked(wrapped):
        wrapped(rows)  # before its first call: the generator is made here
    first = collator(rows)["labels"].tolist()
    with data.forked(collator):
        collator(rows)  # after: it exists and is advanced here
    assert [first, collator(rows)["labels"].tolist()] == expected


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
