"""Fine-tune T5 text-to-text on RTE-format data as a pipeline: the Quickstart's main job.

By default a tiny T5 is built from a config, its tokenizer is trained on the shipped data, and
the data is ``examples/data/rte_{train,validation}.jsonl`` (SuperGLUE RTE columns), so nothing is
downloaded. On CPU (2 processes, one pipeline stage each)::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/run_glue_pipe.py

On GPUs, a real checkpoint and your own RTE files::

    accelerate launch --num_processes 8 examples/run_glue_pipe.py --model_name_or_path t5-3b \\
        --train_file rte_train.jsonl --validation_file rte_val.jsonl --use_cpu false \\
        --per_device_train_batch_size 32 --num_microbatches 4 --gpu_profile rtx2080ti

Any `PipeTrainingArguments` / `TrainingArguments` flag works on the command line.

The printed accuracy is text-to-text: each validation example's label is generated greedily
through the pipeline (``predict_with_generate``), decoded, and compared with the label string,
as single-process ``model.generate`` would do it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import load_dataset
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    EvalPrediction,
    HfArgumentParser,
    T5Config,
    T5ForConditionalGeneration,
    default_data_collator,
    set_seed,
)

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.metrics import accuracy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_tokenizer import build_t5_tokenizer  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
LABELS = ("entailment", "not_entailment")


@dataclass
class TaskArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A T5 checkpoint (Hub id or folder). Default: a tiny T5 built from a config."}
    )
    train_file: str = field(default=str(DATA / "rte_train.jsonl"), metadata={"help": "RTE-format JSONL."})
    validation_file: str = field(default=str(DATA / "rte_validation.jsonl"), metadata={"help": "RTE-format JSONL."})
    max_source_length: int = field(default=40, metadata={"help": "Inputs are padded/truncated to this many tokens."})
    max_target_length: int = field(default=4, metadata={"help": "Targets are padded/truncated to this many tokens."})


def default_arguments() -> list[str]:
    """The Quickstart's settings: CPU, a couple of minutes on 2 cores."""
    return [
        "--output_dir",
        "pipe_output/rte",
        "--use_cpu",
        "true",
        "--num_train_epochs",
        "12",
        "--per_device_train_batch_size",
        "16",
        "--per_device_eval_batch_size",
        "16",
        "--num_microbatches",
        "4",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "20",
        "--logging_steps",
        "50",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--seed",
        "42",
        "--dataloader_drop_last",
        "false",
        "--predict_with_generate",
        "true",
    ]


def main() -> None:
    parser = HfArgumentParser((TaskArguments, PipeTrainingArguments))
    argv = default_arguments() + sys.argv[1:]  # later flags win
    task, args = parser.parse_args_into_dataclasses(args=argv)
    set_seed(args.seed)
    raw = load_dataset("json", data_files={"train": task.train_file, "validation": task.validation_file})

    tokenizer, model = load_model(task, args, raw)

    def preprocess(batch: dict) -> dict:
        sources = [f"rte hypothesis: {h} premise: {p}" for h, p in zip(batch["hypothesis"], batch["premise"])]
        targets = [LABELS[label] for label in batch["label"]]
        features = tokenizer(sources, max_length=task.max_source_length, padding="max_length", truncation=True)
        labels = tokenizer(targets, max_length=task.max_target_length, padding="max_length", truncation=True)
        features["labels"] = [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in labels["input_ids"]]
        return features

    with args.main_process_first(desc="tokenizing"):
        data = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)

    trainer = PipeTrainer(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=default_data_collator,
        compute_metrics=text_accuracy(tokenizer),
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(f"eval accuracy: {metrics['eval_accuracy']:.3f}  eval loss: {metrics['eval_loss']:.4f}")
        print(f"model saved to {os.path.abspath(args.output_dir)}")


def load_model(task: TaskArguments, args: PipeTrainingArguments, raw) -> tuple:
    if task.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(task.model_name_or_path)
        return tokenizer, AutoModelForSeq2SeqLM.from_pretrained(task.model_name_or_path)
    tokenizer_dir = Path(args.output_dir) / "tokenizer"
    with args.main_process_first(desc="training the tokenizer"):
        if args.process_index == 0:
            texts = [*raw["train"]["premise"], *raw["train"]["hypothesis"], *LABELS]
            build_t5_tokenizer(texts, vocab_size=512).save_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=64,
        d_ff=128,
        d_kv=16,
        num_heads=4,
        num_layers=2,
        num_decoder_layers=2,
        dropout_rate=0.0,
        decoder_start_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(args.seed)
    return tokenizer, T5ForConditionalGeneration(config)


def text_accuracy(tokenizer) -> Callable[[EvalPrediction], dict[str, float]]:
    """compute_metrics: the share of examples whose generated text is the label text.

    With ``predict_with_generate`` the predictions are generated token ids (decoder start token
    first); without it, the model's logits, whose argmax is read as the generated tokens.
    """

    def compute(prediction: EvalPrediction) -> dict[str, float]:
        generated, labels = prediction.predictions, prediction.label_ids
        if isinstance(generated, tuple):  # (logits, encoder states): teacher-forced argmax
            generated = generated[0].argmax(-1)
        pad = tokenizer.pad_token_id
        texts = tokenizer.batch_decode(np.where(generated < 0, pad, generated), skip_special_tokens=True)
        targets = tokenizer.batch_decode(np.where(labels < 0, pad, labels), skip_special_tokens=True)
        return {"accuracy": accuracy([t.strip() for t in texts], [t.strip() for t in targets])}

    return compute


if __name__ == "__main__":
    main()
