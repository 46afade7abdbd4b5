"""Greedy decoding over a fixed-shape, labels-driven forward equals `generate`."""

from __future__ import annotations

import pytest
import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.trainer.generation import greedy_decode

from models import TARGET, tiny_batch, tiny_model

EOS, PAD, START = 1, 0, 0


@pytest.mark.parametrize("max_new_tokens", [1, 3, TARGET])
def test_equals_generate_on_an_eager_t5(max_new_tokens: int) -> None:
    model = tiny_model("t5").eval()
    batch = tiny_batch("t5", 5)
    with torch.no_grad():
        expected = model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
        )
        generated = greedy_decode(
            lambda inputs: model(**inputs).logits,
            batch,
            label_length=TARGET,
            max_new_tokens=max_new_tokens,
            decoder_start_token_id=START,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
    assert generated.tolist() == expected.tolist()


def scripted(tokens: list[list[int]], vocab: int = 8):
    """A fake model whose argmax at step t of row r is ``tokens[r][t]``, checking what it is fed."""
    calls = []

    def logits_of(inputs: dict) -> torch.Tensor:
        labels = inputs["labels"]
        step = len(calls)
        calls.append(labels.clone())
        logits = torch.zeros(labels.shape[0], labels.shape[1], vocab)
        for row, row_tokens in enumerate(tokens):
            logits[row, step, row_tokens[step]] = 1.0
        return logits

    return logits_of, calls


def test_pads_after_eos_and_stops_when_every_real_row_finished() -> None:
    # row 0 ends at step 1, row 1 at step 2; row 2 only pads a short batch and never ends
    logits_of, calls = scripted([[5, EOS, 6, 6], [4, 3, EOS, 6], [7, 7, 7, 7]])
    batch = {"input_ids": torch.ones(3, 2, dtype=torch.long)}
    generated = greedy_decode(
        logits_of,
        batch,
        label_length=4,
        max_new_tokens=4,
        decoder_start_token_id=START,
        pad_token_id=PAD,
        eos_token_id=[EOS],
        rows=2,
    )
    assert generated[:2].tolist() == [[START, 5, EOS, PAD], [START, 4, 3, EOS]]
    assert len(calls) == 3  # no fourth forward: both real rows are done
    # step t sees the tokens so far as labels, padding after them
    assert calls[2][:2].tolist() == [[5, EOS, PAD, PAD], [4, 3, PAD, PAD]]


def test_cannot_generate_past_the_traced_label_length() -> None:
    with pytest.raises(PipelineError, match="traced with labels of length 4, so it can generate 1 to 4 tokens, not 5"):
        greedy_decode(
            lambda inputs: torch.zeros(1),
            {"input_ids": torch.ones(1, 2, dtype=torch.long)},
            label_length=4,
            max_new_tokens=5,
            decoder_start_token_id=START,
            pad_token_id=PAD,
            eos_token_id=EOS,
        )
