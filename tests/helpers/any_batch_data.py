"""The rows test_any_batch.py's cases train and evaluate on: token rows of random lengths with what
each kind of model learns from, as the Hugging Face example scripts' datasets hold them."""

from __future__ import annotations

import torch
from datasets import Dataset

from mlm_runs import SPECIALS
from models import VOCAB

SHORTEST, LONGEST = 3, 12
"""Token rows are this long, or anything between (before the collator pads a batch)."""


def make_rows(kind: str, rows: int, seed: int, labelled: bool = True, longest: int = LONGEST) -> Dataset:
    """``rows`` token rows of random lengths, the first ``longest`` tokens long, with what ``kind``
    trains on: a class (``bert``), nothing beyond the tokens (causal LMs: the collator makes labels),
    a target of 2 to 5 tokens ending in EOS (``t5``), answer positions (``bert-qa``; without them,
    unless ``labelled``, the columns run_qa.py's evaluation features carry instead)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [longest, *torch.randint(SHORTEST, longest + 1, (rows - 1,), generator=generator).tolist()]
    tokens = [torch.randint(len(SPECIALS), VOCAB, (n,), generator=generator) for n in lengths]
    data: dict[str, list] = {"input_ids": [t.tolist() for t in tokens]}
    if kind == "bert" and labelled:
        data["labels"] = [int(t[0] > VOCAB // 2) for t in tokens]
    elif kind == "t5":
        data["labels"] = [t[: 1 + i % 4].tolist() + [1] for i, t in enumerate(tokens)]  # EOS = 1
    elif kind == "bert-qa" and labelled:
        data["start_positions"] = [int(t.argmax()) for t in tokens]
        data["end_positions"] = [min(int(t.argmax()) + 1, len(t) - 1) for t in tokens]
    elif kind == "bert-qa":
        data["example_id"] = [f"q{i}" for i in range(rows)]
        data["offset_mapping"] = [[[j, j + 1] for j in range(len(t))] for t in tokens]
    return Dataset.from_dict(data)


def evaluation_rows(kind: str) -> Dataset:
    """7 rows (batches of 4 + 3). Question answering's, as run_qa.py's evaluation features, have no
    answer positions and rows longer than any training row: the plan must come from them."""
    if kind == "bert-qa":
        return make_rows(kind, 7, seed=2, labelled=False, longest=LONGEST + 4)
    return make_rows(kind, 7, seed=2)
