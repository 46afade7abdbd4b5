"""The runs compared in tests/trainer/test_parity.py: a tiny GPT-2, T5 and BERT with the same data,
arguments and seed, trained by PipeTrainer (in parity_job.py, 2 ranks) or plain `Trainer` (in the test).

``gpt2-sliced`` is the GPT-2 run with each sequence cut into uneven token slices (TeraPipe); plain
`Trainer` has no such thing, so its reference is the ``gpt2`` run (`base_kind`).
``gpt2-sliced-accumulate`` is that with ``gradient_accumulation_steps=2`` (its reference: plain
`Trainer`'s GPT-2 run with it, `reference_key`). The BERT run plans from costs measured on rank 0
(``cost_table="measured"``, `COST_TABLES`); each rank then has its own HF_HOME, so the test sees
which ranks profiled (a profile is cached there) and that they ran one plan (``plan-rank{r}.json``)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset

from generation_cases import generate_on_every_rank
from models import SEQ, TARGET, VOCAB, tiny_model

KINDS = ("gpt2", "t5", "bert", "gpt2-sliced", "gpt2-sliced-accumulate")
TOKEN_SLICES = {"gpt2-sliced": [3, 1, 4], "gpt2-sliced-accumulate": [3, 1, 4]}  # uneven, adding up to SEQ
ACCUMULATION = {"gpt2-sliced-accumulate": 2}
"""``gradient_accumulation_steps`` of a kind (default 1), for PipeTrainer and its `Trainer` reference alike."""
COST_TABLES = {"bert": "measured"}
"""``cost_table`` of a kind's PipeTrainer run (default: the roofline)."""
STEPS = 4
OPTIMIZERS = {"gpt2": "adamw_torch", "t5": "adafactor", "bert": "sgd"}  # Trainer's `optim` names


def base_kind(kind: str) -> str:
    """The model, data and `Trainer` run that ``kind`` compares with (``gpt2-sliced``: ``gpt2``)."""
    return kind.removesuffix("-accumulate").removesuffix("-sliced")


def reference_key(kind: str) -> tuple[str, int]:
    """What tells apart `Trainer` runs: the model and data, and the gradient accumulation."""
    return base_kind(kind), ACCUMULATION.get(kind, 1)


def make_data(kind: str, rows: int, seed: int) -> Dataset:
    """Random tokens whose labels have different numbers of ``-100`` per row, so micro-batches
    hold different numbers of label tokens. T5 learns to copy the first two tokens then EOS."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, SEQ), generator=generator)
    attention_mask = torch.ones(rows, SEQ, dtype=torch.long)
    for row in range(rows):
        attention_mask[row, SEQ - row % 4 :] = 0
    if kind == "gpt2":
        labels = input_ids.masked_fill(attention_mask == 0, -100)
    elif kind == "t5":
        labels = torch.full((rows, TARGET), -100)
        labels[:, :2] = input_ids[:, :2]
        labels[:, 2] = 1  # EOS
        labels[::3, 3] = input_ids[::3, 2]  # some rows one token longer
    else:
        labels = (input_ids[:, 0] > VOCAB // 2).long()
    data = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return Dataset.from_dict({k: v.tolist() for k, v in data.items()})


def compute_metrics(eval_pred: Any) -> dict[str, float]:
    """Accuracy: of the class (BERT), of each label token (teacher-forced logits), or of whole
    target sequences (generated ids: the decoder start token, then the tokens)."""
    predictions, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(predictions, tuple):
        predictions = predictions[0]
    if predictions.ndim == 2 and labels.ndim == 1:  # classification logits
        return {"accuracy": float((predictions.argmax(-1) == labels).mean())}
    if predictions.ndim == 3:  # token logits
        mask = labels != -100
        return {"accuracy": float((predictions.argmax(-1) == labels)[mask].mean())}
    generated = predictions[:, 1 : 1 + labels.shape[1]]  # generated token ids
    match = (generated == labels) | (labels == -100)
    return {"accuracy": float(np.all(match, axis=1).mean())}


def setup(kind: str, output_dir: str, pipe: bool) -> dict[str, Any]:
    """Model, arguments and data of one run; ``pipe`` picks PipeTrainingArguments over TrainingArguments."""
    from transformers import TrainingArguments

    from hf_ftpipe import PipeTrainingArguments

    base = base_kind(kind)
    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=STEPS,
        gradient_accumulation_steps=ACCUMULATION.get(kind, 1),
        optim=OPTIMIZERS[base],
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        data_seed=0,
    )
    if pipe:
        args = PipeTrainingArguments(
            num_microbatches=2,
            pipeline_schedule="gpipe",
            token_slices=TOKEN_SLICES.get(kind),
            cost_table=COST_TABLES.get(kind),
            **common,
        )
    else:
        args = TrainingArguments(**common)
    return {
        "model": tiny_model(base),
        "args": args,
        "train_dataset": make_data(base, 16, seed=1),
        "eval_dataset": make_data(base, 6, seed=2),  # a short last batch
        "compute_metrics": None if base == "gpt2" else compute_metrics,
    }


@contextmanager
def rank_hf_home(output_dir: str) -> Iterator[None]:
    """``HF_HOME`` of this rank alone (``OUTPUT/hf_home-rank{r}``) while inside: the caches a rank writes."""
    previous = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = str(Path(output_dir) / f"hf_home-rank{os.environ['RANK']}")
    try:
        yield
    finally:
        if previous is None:
            del os.environ["HF_HOME"]
        else:
            os.environ["HF_HOME"] = previous


def run(kind: str, output_dir: str, trainer_class: type) -> dict[str, Any]:
    """Train, evaluate, predict; the results of one run as plain data."""
    pipe = trainer_class.__name__ == "PipeTrainer"
    parts = setup(kind, output_dir, pipe=pipe)
    trainer = trainer_class(**parts)
    if pipe and kind in COST_TABLES:
        with rank_hf_home(output_dir):  # the plan is made (and the costs measured) in the first train step
            trainer.train()
        plan = Path(output_dir) / f"plan-rank{os.environ['RANK']}.json"
        plan.write_text(json.dumps({"partition": trainer.partition.to_dict(), "source": trainer.partition_source}))
    else:
        trainer.train()
    result: dict[str, Any] = {"history": trainer.state.log_history, "evaluate": trainer.evaluate()}
    slicing = getattr(getattr(trainer, "engine", None), "token_slicing", None)
    result["token_slices"] = None if slicing is None else list(slicing.slice_lengths)  # what the pipeline ran
    predicted = trainer.predict(parts["eval_dataset"])
    result["predict"] = (predicted.predictions, predicted.label_ids, predicted.metrics)
    if kind == "t5" and trainer_class.__name__ == "PipeTrainer":
        trainer.args.predict_with_generate = True
        generated = trainer.predict(parts["eval_dataset"])
        result["generate"] = (generated.predictions, generated.metrics)
        # A second end-of-sequence id, the commonest first token generated: rows now finish at
        # different steps (padding after EOS, stopping early), and the saved generation config keeps it.
        first = int(np.bincount(generated.predictions[:, 1]).argmax())
        trainer.model.generation_config.eos_token_id = [1, first]
        stopped = trainer.predict(parts["eval_dataset"])
        result["generate_eos"] = (stopped.predictions, stopped.metrics, first)
    if kind in ("t5", "gpt2") and trainer_class.__name__ == "PipeTrainer":  # PipeTrainer.generate: every case
        generate_on_every_rank(trainer, kind, output_dir)
    trainer.save_model(output_dir)
    return result
