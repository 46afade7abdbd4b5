"""Masked-LM training with a random collator, under `accelerate launch` (2 ranks), for `test_same_batch.py`.

Three runs in one launch, each a fresh PipeTrainer on a tiny BERT with Hugging Face's
`DataCollatorForLanguageModeling` (masks drawn from torch's global generator):

- ``digests``: dropout 0.1, 100 steps; every rank records the digest of every batch it trained on.
- ``workers``: the same with two data loader workers, which collate in their own processes.
- ``losses``: dropout 0 (the model draws nothing random): the logged losses, for the comparison
  with plain `Trainer` in the test process.
- ``seeds``: each rank shuffles with its own ``data_seed``; the error each rank raised.
- ``small_eval``: an evaluation set of one sample, fewer than a micro-batch: `evaluate()` before
  `train()` (the pipeline is traced on it), then after.

Each rank writes ``OUTPUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.errors import PipelineError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from models import VOCAB, tiny_model  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LENGTH = 16
DIGEST_STEPS = 100
LOSS_STEPS = 12


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``t5 … t95`` (the tiny models' vocabulary), made here (nothing to download)."""
    vocab = {token: i for i, token in enumerate(SPECIALS + [f"t{i}" for i in range(len(SPECIALS), VOCAB)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def model(dropout: float) -> transformers.BertForMaskedLM:
    return tiny_model("bert-mlm", dropout=dropout)


def dataset(rows: int = 48) -> Dataset:
    """``[CLS] tokens [SEP]`` rows of one length (the pipeline is traced for one shape)."""
    generator = torch.Generator().manual_seed(1)
    body = torch.randint(len(SPECIALS), VOCAB, (rows, LENGTH - 2), generator=generator)
    ids = torch.cat([torch.full((rows, 1), 2), body, torch.full((rows, 1), 3)], dim=1)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def arguments(output_dir: str, steps: int, **overrides: Any) -> dict[str, Any]:
    """Shared by the pipeline and the plain `Trainer` reference (which drops ``num_microbatches``)."""
    return {
        "output_dir": output_dir,
        "use_cpu": True,
        "per_device_train_batch_size": 8,
        "num_microbatches": 2,
        "max_steps": steps,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        **overrides,
    }


class RecordingTrainer(PipeTrainer):
    """Records the digest of each batch this rank trained on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.digests: list[str] = []

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.digests.append(self.batch_digest)
        return loss


def make_trainer(output_dir: str, dropout: float, steps: int, **overrides: Any) -> RecordingTrainer:
    return RecordingTrainer(
        model=model(dropout),
        args=PipeTrainingArguments(**arguments(output_dir, steps, **overrides)),
        train_dataset=dataset(),
        eval_dataset=dataset(rows=1),
        data_collator=DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.25),
    )


def train(output_dir: str, dropout: float, steps: int, **overrides: Any) -> RecordingTrainer:
    trainer = make_trainer(output_dir, dropout, steps, **overrides)
    trainer.train()
    return trainer


def evaluate_train_evaluate(trainer: Any) -> list[float]:
    """Shared with the plain `Trainer` reference."""
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return [before, trainer.evaluate()["eval_loss"]]


def main(output_dir: str) -> None:
    digests = train(output_dir, dropout=0.1, steps=DIGEST_STEPS).digests
    worker_digests = train(output_dir, dropout=0.1, steps=LOSS_STEPS, dataloader_num_workers=2).digests
    rank = torch.distributed.get_rank()
    losses = train(output_dir, dropout=0.0, steps=LOSS_STEPS).state.log_history
    try:
        train(output_dir, dropout=0.0, steps=LOSS_STEPS, data_seed=100 + rank)
        seeds_error = None
    except PipelineError as error:
        seeds_error = str(error)
    small_eval = evaluate_train_evaluate(make_trainer(output_dir, dropout=0.0, steps=LOSS_STEPS))
    record = {
        "digests": digests,
        "worker_digests": worker_digests,
        "log_history": losses,
        "seeds_error": seeds_error,
        "small_eval": small_eval,
    }
    (Path(output_dir) / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
