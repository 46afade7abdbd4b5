"""Fine-tune a BERT-style model for extractive question answering on SQuAD 1.1 as a pipeline, as ``run_qa.py`` does.

Hugging Face's ``examples/pytorch/question-answering/run_qa.py`` with `PipeTrainer`: each
question and its context become one or more features of at most ``--max_seq_length`` tokens (a
long context is cut into windows overlapping by ``--doc_stride`` tokens), padded per batch to its
longest (``DataCollatorWithPadding``), or to that length with ``--pad_to_max_length``; the model predicts start
and end logits per token; the best span over all windows of an example is its answer, scored
with the official SQuAD v1.1 exact match and F1.

Offline (2 CPU processes, one pipeline stage each): without ``--model_name_or_path`` a tiny BERT
is built from a config, its WordPiece tokenizer is trained on the training questions and
contexts, and the data is the synthetic SQuAD in ``examples/data/`` (``make_squad.py``)::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/run_qa_pipe.py \\
        --do_train --do_eval

FTPipe's BERT-large run (the classic Hugging Face recipe) on 8 GPUs: features padded to 384 tokens,
stride 128, Adam lr 3e-5, no weight decay, linear decay without warm-up, 2 epochs, batch 24::

    accelerate launch --num_processes 8 examples/run_qa_pipe.py \\
        --model_name_or_path google-bert/bert-large-uncased-whole-word-masking \\
        --dataset_name rajpurkar/squad --dataset_config_name plain_text --do_train --do_eval \\
        --max_seq_length 384 --pad_to_max_length --doc_stride 128 --learning_rate 3e-5 --num_train_epochs 2 \\
        --per_device_train_batch_size 24 --per_device_eval_batch_size 24 --num_microbatches 4 \\
        --gpu_profile rtx2080ti

A lone ``.json`` argument is read as a preset of the same arguments. Any
`PipeTrainingArguments` / `TrainingArguments` flag works.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    BertConfig,
    BertForQuestionAnswering,
    DataCollatorWithPadding,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    default_data_collator,
    set_seed,
)

from hf_ftpipe import PipeTrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    checkpoint_to_resume,
    pad_to_multiple_of,
    parse_arguments,
    record_metrics,
    set_up_logging,
)
from qa_features import postprocess_predictions, prepare_features  # noqa: E402
from qa_trainer import QuestionAnsweringPipeTrainer  # noqa: E402

from local_tokenizer import build_bert_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"
# the tiny default BERT reads short windows, so the fixture's longer contexts need several
TINY_MAX_SEQ_LENGTH, TINY_DOC_STRIDE = 64, 16


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A model with a QA head, or a BERT to add one to. Default: a tiny BERT from scratch."},
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "A fast tokenizer (Hub id or folder), if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloads from the Hub."})


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. rajpurkar/squad."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "E.g. plain_text."})
    train_file: str | None = field(
        default=None,
        metadata={"help": "JSONL in the Hub's layout: id, title, context, question, answers{text, answer_start}."},
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same layout as `train_file`."})
    test_file: str | None = field(
        default=None,
        metadata={"help": "Same layout (`answers` optional), for --do_predict. Default: the validation split."},
    )
    max_seq_length: int | None = field(
        default=None,
        metadata={"help": f"The most tokens per feature. Default: 384 ({TINY_MAX_SEQ_LENGTH} for the tiny BERT)."},
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "Pad every feature to `max_seq_length`, as FTPipe did (the presets do). Default: pad each batch "
            "to its longest feature (DataCollatorWithPadding)."
        },
    )
    doc_stride: int | None = field(
        default=None,
        metadata={"help": f"Tokens shared by consecutive windows of a context. Default: 128 ({TINY_DOC_STRIDE} tiny)."},
    )
    n_best_size: int = field(default=20, metadata={"help": "Start and end candidates per feature."})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test examples."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Preprocess again instead of using the cache."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for preprocessing."})

    def __post_init__(self) -> None:
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            self.train_file = str(DATA / "squad_train.jsonl")  # the offline sample
            self.validation_file = str(DATA / "squad_validation.jsonl")


def default_arguments() -> dict[str, object]:
    """Settings for a quick run that differ from `TrainingArguments`' own; flags override them."""
    return {
        "output_dir": "pipe_output/qa",
        "use_cpu": not torch.cuda.is_available(),
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 16,
        "num_microbatches": 2,
        "learning_rate": 1e-3,
        "num_train_epochs": 30,
        "logging_steps": 10,
        "report_to": "none",
        "seed": 42,
    }


def main() -> None:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, PipeTrainingArguments))
    model_args, data_args, training_args = parse_arguments(parser, default_arguments())
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        raise SystemExit("nothing to do: pass --do_train, --do_eval and/or --do_predict")
    set_up_logging(training_args, logger)
    set_seed(training_args.seed)

    raw = load_raw(data_args, model_args)
    tokenizer, model = load_model(model_args, data_args, training_args, raw)
    if data_args.doc_stride >= data_args.max_seq_length:
        raise ValueError(
            f"`doc_stride` ({data_args.doc_stride}) must be below `max_seq_length` ({data_args.max_seq_length})"
        )
    settings = {
        "tokenizer": tokenizer,
        "max_seq_length": data_args.max_seq_length,
        "doc_stride": data_args.doc_stride,
        "pad_to_max_length": data_args.pad_to_max_length,
    }
    cache = {"num_proc": data_args.preprocessing_num_workers, "load_from_cache_file": not data_args.overwrite_cache}

    def featurize(examples: Dataset, keep_offsets: bool) -> Dataset:
        with training_args.main_process_first(desc="tokenizing into windows"):
            return examples.map(
                prepare_features,
                batched=True,
                remove_columns=examples.column_names,
                fn_kwargs={**settings, "keep_offsets": keep_offsets},
                desc="tokenizing into windows",
                **cache,
            )

    train_features = eval_examples = eval_features = None
    if training_args.do_train:
        train_features = featurize(_first(raw, "train", data_args.max_train_samples), keep_offsets=False)
    if training_args.do_eval:
        eval_examples = _first(raw, "validation", data_args.max_eval_samples)
        eval_features = featurize(eval_examples, keep_offsets=True)

    def post_process(examples: Dataset, features: Dataset, start_logits: np.ndarray, end_logits: np.ndarray) -> dict:
        return postprocess_predictions(
            examples, features, start_logits, end_logits, data_args.n_best_size, data_args.max_answer_length
        )

    trainer = QuestionAnsweringPipeTrainer(
        model=model,
        args=training_args,
        train_dataset=train_features,
        eval_dataset=eval_features,
        eval_examples=eval_examples,
        post_process_function=post_process,
        processing_class=tokenizer,
        data_collator=default_data_collator
        if data_args.pad_to_max_length
        else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_to_multiple_of(training_args)),
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
        trainer.save_model()  # and the tokenizer, so the output folder loads with from_pretrained
        record_metrics(trainer, "train", {**result.metrics, "train_samples": len(train_features)})
    if training_args.do_eval:
        metrics = trainer.evaluate()
        record_metrics(trainer, "eval", {**metrics, "eval_samples": len(eval_examples)})
    if training_args.do_predict:
        split = "test" if "test" in raw else "validation"  # SQuAD's test answers are hidden: its validation split
        predict_examples = _first(raw, split, data_args.max_predict_samples)
        output = trainer.predict(featurize(predict_examples, keep_offsets=True), test_examples=predict_examples)
        record_metrics(trainer, "predict", {**output.metrics, "predict_samples": len(predict_examples)})
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / "predict_predictions.json"
            path.write_text(json.dumps(output.predictions, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            logger.info("wrote %d answers to %s", len(output.predictions), path)


def load_raw(data_args: DataTrainingArguments, model_args: ModelArguments) -> DatasetDict:
    """The raw splits with SQuAD's columns: from the Hub, or from JSONL files in its layout."""
    if data_args.dataset_name is not None:
        return load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=model_args.cache_dir)
    paths = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    files = {split: path for split, path in paths.items() if path}
    return load_dataset("json", data_files=files, cache_dir=model_args.cache_dir)


def load_model(
    model_args: ModelArguments, data_args: DataTrainingArguments, args: PipeTrainingArguments, raw: DatasetDict
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """The tokenizer and model; sets ``max_seq_length`` and ``doc_stride`` when left to the model."""
    if model_args.model_name_or_path is None:
        if "train" not in raw:
            raise ValueError("the tiny BERT trains its tokenizer on the training split: pass `--train_file`")
        # trained once and read by every rank: WordPiece may number tied pieces differently per process
        tokenizer_dir = Path(args.output_dir) / "tokenizer"
        with args.main_process_first(desc="training the tokenizer"):
            if args.process_index == 0:
                texts = (text for row in raw["train"] for text in (row["question"], row["context"]))
                build_bert_tokenizer(texts, vocab_size=512).save_pretrained(tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        data_args.max_seq_length = data_args.max_seq_length or TINY_MAX_SEQ_LENGTH
        data_args.doc_stride = data_args.doc_stride or TINY_DOC_STRIDE
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=max(128, data_args.max_seq_length),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(args.seed)
        return tokenizer, BertForQuestionAnswering(config)
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
    )
    if not tokenizer.is_fast:
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast tokenizer; the windows need its offsets mapping: "
            "pass a model or `--tokenizer_name` with a tokenizer.json"
        )
    data_args.max_seq_length = min(data_args.max_seq_length or 384, tokenizer.model_max_length)
    data_args.doc_stride = data_args.doc_stride or 128
    model = AutoModelForQuestionAnswering.from_pretrained(model_args.model_name_or_path, cache_dir=model_args.cache_dir)
    return tokenizer, model


def _first(raw: DatasetDict, split: str, limit: int | None) -> Dataset:
    if split not in raw:
        raise ValueError(f"no `{split}` split: pass `--{split}_file` or a dataset that has one (it has {sorted(raw)})")
    data = raw[split]
    return data.select(range(min(limit, len(data)))) if limit is not None else data


if __name__ == "__main__":
    main()
