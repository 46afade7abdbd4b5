"""The masked-LM runs of tests/faults/test_same_batch.py: a tiny BERT, a word-level tokenizer made here,
fixed-length rows and the arguments, shared by the PipeTrainer job (mlm_job.py) and the plain `Trainer`
reference in the test."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

from models import VOCAB, tiny_model

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LENGTH = 16
DIGEST_STEPS = 100
LOSS_STEPS = 12
SEEDED_EVAL_ROWS = 7
SEEDED_OVERRIDES = {"num_microbatches": 4, "per_device_eval_batch_size": 3}
"""The seeded run's: eval batches of 3 rows, then 1, against 4 micro-batches (fewer than them, and not a multiple)."""


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


def evaluate_train_evaluate(trainer: Any) -> list[float]:
    """Shared with the plain `Trainer` reference."""
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return [before, trainer.evaluate()["eval_loss"]]


def seeded_collator() -> DataCollatorForLanguageModeling:
    """run_mlm.py's collator under transformers 5 (``seed=training_args.seed``): it masks from a generator of
    its own, made on its first call and advanced by every call, not from the global generators."""
    return DataCollatorForLanguageModeling(tokenizer(), mlm_probability=0.25, seed=0)


def evaluate_train_predict(trainer: Any) -> dict[str, Any]:
    """The seeded run, shared with the plain `Trainer` reference: every number depends on which of the
    collator's draws masked which batch."""
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    prediction = trainer.predict(trainer.eval_dataset)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "eval_losses": [before, after],
        "losses": losses,
        "test_loss": prediction.metrics["test_loss"],
        "predictions": prediction.predictions.tolist(),
        "label_ids": prediction.label_ids.tolist(),
    }
