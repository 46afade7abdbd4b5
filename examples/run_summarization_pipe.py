"""Fine-tune a sequence-to-sequence model (T5 style) to summarize as a pipeline, as ``run_summarization.py`` does.

Hugging Face's ``examples/pytorch/summarization/run_summarization.py`` with `PipeSeq2SeqTrainer`:
each document (after ``--source_prefix``, e.g. ``"summarize: "`` for T5's checkpoints) is truncated
to ``--max_source_length`` tokens and its summary to ``--max_target_length`` (``--val_max_target_length``
for evaluation and prediction); batches are padded to their longest input and label
(``DataCollatorForSeq2Seq``, labels with -100). With ``--predict_with_generate`` (on by default)
evaluation generates each summary through the pipeline (up to ``--generation_max_length`` tokens,
else ``--val_max_target_length``; ``--num_beams`` / ``--generation_num_beams``), decodes it and
reports ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures ×100 (Porter-stemmed, ROUGE-Lsum over
one sentence per line) and ``gen_len``, the mean length of the generated tokens, as
``run_summarization.py`` names them. ROUGE is ``hf_ftpipe.metrics.load_metric("rouge")``: the Hub's
``rouge`` module when it can be reached, else the shipped ``rouge_mean`` (the same scores averaged
exactly, where the Hub's takes a bootstrap median of the mean).

Offline (2 CPU processes, one pipeline stage each): without ``--model_name_or_path`` a tiny T5 is
built from a config, its tokenizer is trained on the training text, and the data is the synthetic
news sample in ``examples/data/`` (``make_news.py``)::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/run_summarization_pipe.py

T5-small on XSum from the Hub, on 2 GPUs (the recipe of ``run_summarization.py``'s README)::

    accelerate launch --num_processes 2 examples/run_summarization_pipe.py --model_name_or_path google-t5/t5-small \\
        --dataset_name EdinburghNLP/xsum --source_prefix "summarize: " --do_train --do_eval \\
        --per_device_train_batch_size 16 --num_microbatches 4 --use_cpu false --output_dir pipe_output/xsum

A lone ``.json`` argument is read as a preset of the same arguments. Any
`PipeSeq2SeqTrainingArguments` / `Seq2SeqTrainingArguments` flag works.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    T5Config,
    T5ForConditionalGeneration,
    set_seed,
)

from hf_ftpipe import PipeSeq2SeqTrainer, PipeSeq2SeqTrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    checkpoint_to_resume,
    pad_to_multiple_of,
    parse_arguments,
    record_metrics,
    set_up_logging,
)
from summarization_pairs import columns, rouge_metrics, tokenize_pairs  # noqa: E402

from local_tokenizer import build_t5_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"
SPLITS = ("train", "validation", "test")


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A seq2seq checkpoint (Hub id or folder). Default: a tiny T5 built from a config."},
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer (Hub id or folder), if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloads from the Hub."})


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. EdinburghNLP/xsum."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its config, e.g. 3.0.0."})
    text_column: str | None = field(
        default=None, metadata={"help": "The column of the documents. Default: the dataset's, else the first."}
    )
    summary_column: str | None = field(
        default=None, metadata={"help": "The column of the summaries. Default: the dataset's, else the second."}
    )
    train_file: str | None = field(
        default=None, metadata={"help": "JSON lines or CSV. Default: examples/data/news_train.jsonl."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same layout as `train_file`."})
    test_file: str | None = field(default=None, metadata={"help": "Same layout; `--do_predict` summarizes it."})
    max_source_length: int | None = field(
        default=None,
        metadata={
            "help": "The most input tokens (EOS included): longer documents are truncated. Default: 1024; for the "
            "tiny T5, the longest document of the data rounded up to a multiple of 8."
        },
    )
    max_target_length: int | None = field(
        default=None,
        metadata={"help": "The most summary tokens for training (EOS included). Default: 128; tiny T5: the longest."},
    )
    val_max_target_length: int | None = field(
        default=None,
        metadata={
            "help": "The most summary tokens for evaluation and prediction, and the generated length when "
            "`--generation_max_length` is not given. Default: `max_target_length`."
        },
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every sample to the lengths. Default: pad each batch to its own longest."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N validation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test examples."})
    num_beams: int | None = field(
        default=None,
        metadata={"help": "Beams for evaluation and prediction (`generation_num_beams`). Default: the arguments'."},
    )
    ignore_pad_token_for_loss: bool = field(
        default=True, metadata={"help": "Pad labels with -100, so that padding adds nothing to the loss."}
    )
    source_prefix: str | None = field(
        default=None, metadata={"help": 'Text put before every document, e.g. "summarize: " for T5 checkpoints.'}
    )
    overwrite_cache: bool = field(default=False, metadata={"help": "Preprocess again instead of using the cache."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for preprocessing."})

    def __post_init__(self) -> None:
        if self.dataset_name is None and not (self.train_file or self.validation_file):
            self.train_file = str(DATA / "news_train.jsonl")  # the offline sample (a --test_file adds to it)
            self.validation_file = str(DATA / "news_validation.jsonl")
        for path in (self.train_file, self.validation_file, self.test_file):
            if path is not None and _file_format(path) is None:
                raise ValueError(f"{path}: a data file must be JSON lines (.json, .jsonl) or CSV (.csv)")


def default_arguments() -> dict[str, object]:
    """The offline demo's settings where they differ from `Seq2SeqTrainingArguments`' own; flags override them."""
    return {
        "output_dir": "pipe_output/summarization",
        "use_cpu": not torch.cuda.is_available(),
        "num_train_epochs": 4,
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 16,
        "num_microbatches": 4,
        "learning_rate": 3e-3,
        "warmup_steps": 8,
        "logging_steps": 16,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 42,
        "predict_with_generate": True,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the job on ``argv`` (default ``sys.argv[1:]``); returns the evaluation metrics, if any."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, PipeSeq2SeqTrainingArguments))
    model_args, data_args, training_args = parse_arguments(parser, default_arguments(), argv)
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        training_args.do_train = training_args.do_eval = True  # the offline demo
    set_up_logging(training_args, logger)
    set_seed(training_args.seed)

    raw = load_raw(data_args, model_args)
    limits = (data_args.max_train_samples, data_args.max_eval_samples, data_args.max_predict_samples)
    raw = DatasetDict({split: _first(raw[split], limit) for split, limit in zip(SPLITS, limits) if split in raw})
    text_column, summary_column = columns(
        next(iter(raw.values())).column_names, data_args.dataset_name, data_args.text_column, data_args.summary_column
    )
    tokenizer, model = load_model(model_args, training_args, raw, text_column, summary_column)
    tiny = model_args.model_name_or_path is None
    source_length, target_length = lengths(data_args, tokenizer, raw, text_column, summary_column, tiny)
    val_target_length = data_args.val_max_target_length or target_length
    features = {}
    for split in [s for s, wanted in zip(SPLITS, _wanted(training_args)) if wanted]:
        data = _split(raw, split)
        with training_args.main_process_first(desc=f"tokenizing {split}"):
            features[split] = data.map(
                functools.partial(
                    tokenize_pairs,
                    tokenizer=tokenizer,
                    text_column=text_column,
                    summary_column=summary_column,
                    prefix=data_args.source_prefix or "",
                    max_source_length=source_length,
                    max_target_length=target_length if split == "train" else val_target_length,
                    pad_to_max_length=data_args.pad_to_max_length,
                    ignore_pad_token_for_loss=data_args.ignore_pad_token_for_loss,
                ),
                batched=True,
                num_proc=data_args.preprocessing_num_workers,
                remove_columns=data.column_names,
                load_from_cache_file=not data_args.overwrite_cache,
                desc=f"tokenizing {split} (up to {source_length} / {target_length} tokens)",
            )
    # as run_summarization.py: generate up to the evaluation summaries' length, with its beams
    if training_args.generation_max_length is None:
        training_args.generation_max_length = val_target_length
    if data_args.num_beams is not None:
        training_args.generation_num_beams = data_args.num_beams

    trainer = PipeSeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=features.get("train"),
        eval_dataset=features.get("validation"),
        processing_class=tokenizer,
        data_collator=data_collator(data_args, training_args, tokenizer, model),
        compute_metrics=rouge_metrics(tokenizer) if training_args.predict_with_generate else None,
    )
    metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
        trainer.save_model()  # and the tokenizer: the folder loads with from_pretrained
        record_metrics(trainer, "train", {**result.metrics, "train_samples": len(features["train"])})
    if training_args.do_eval:
        metrics = {**trainer.evaluate(metric_key_prefix="eval"), "eval_samples": len(features["validation"])}
        record_metrics(trainer, "eval", metrics)
    if training_args.do_predict:
        predict(trainer, tokenizer, features["test"])
    if trainer.is_world_process_zero():
        if "eval_rouge1" in metrics:
            scores = "  ".join(f"{key}: {metrics[f'eval_{key}']:.2f}" for key in ("rouge1", "rouge2", "rougeL"))
            print(f"eval {scores}  rougeLsum: {metrics['eval_rougeLsum']:.2f}  loss: {metrics['eval_loss']:.4f}")
        if training_args.do_train:
            print(f"model saved to {os.path.abspath(training_args.output_dir)}")
    return metrics


def load_raw(data_args: DataTrainingArguments, model_args: ModelArguments) -> DatasetDict:
    """The raw splits: from the Hub, or from JSON-lines / CSV files (one format for all)."""
    if data_args.dataset_name is not None:
        return load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=model_args.cache_dir)
    paths = (data_args.train_file, data_args.validation_file, data_args.test_file)
    files = {split: path for split, path in zip(SPLITS, paths) if path}
    formats = {_file_format(path) for path in files.values()}
    if len(formats) > 1:
        raise ValueError(f"the data files mix JSON lines and CSV ({files}): convert them to one format")
    return load_dataset(formats.pop(), data_files=files, cache_dir=model_args.cache_dir)


def _file_format(path: str) -> str | None:
    return {".json": "json", ".jsonl": "json", ".csv": "csv"}.get(Path(path).suffix.lower())


def load_model(
    model_args: ModelArguments, args: PipeSeq2SeqTrainingArguments, raw: DatasetDict, text_column: str, summary: str
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """The checkpoint and its tokenizer, or a tiny T5 and a tokenizer trained on the training text."""
    if model_args.model_name_or_path is not None:
        path = model_args.model_name_or_path
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or path, cache_dir=model_args.cache_dir)
        model = AutoModelForSeq2SeqLM.from_pretrained(path, cache_dir=model_args.cache_dir)
        if model.config.decoder_start_token_id is None:
            raise ValueError(f"{path} has no `decoder_start_token_id` in its config: set it to generate summaries")
        return tokenizer, model
    if "train" not in raw:
        raise ValueError(
            "the tiny T5 trains its tokenizer on the training text: pass a `train_file` or `--model_name_or_path`"
        )
    tokenizer_dir = Path(args.output_dir) / "tokenizer"
    with args.main_process_first(desc="training the tokenizer"):
        if args.process_index == 0:
            texts = list(raw["train"][text_column]) + list(raw["train"][summary])
            build_t5_tokenizer(texts, vocab_size=512).save_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer, tiny_t5(tokenizer, args.seed)


def tiny_t5(tokenizer: PreTrainedTokenizerBase, seed: int) -> T5ForConditionalGeneration:
    """A 2+2-layer T5 of width 64 over ``tokenizer``'s vocabulary, initialised from ``seed``."""
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
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config)


def lengths(
    data_args: DataTrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    raw: DatasetDict,
    text_column: str,
    summary_column: str,
    tiny: bool,
) -> tuple[int, int]:
    """Input and summary lengths: the flags, else run_summarization.py's 1024 / 128, else (tiny T5)
    what the data needs: a model trained from scratch on a small sample gains nothing from padding."""
    source, target = data_args.max_source_length, data_args.max_target_length
    if not tiny:
        return source or 1024, target or 128

    def longest(column: str) -> int:
        texts = [text for split in raw.values() for text in split[column] if text]
        return max(len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids) + 1  # + EOS

    if source is None:
        source = -(-longest(text_column) // 8) * 8
    return source, target or longest(summary_column)


def data_collator(
    data_args: DataTrainingArguments,
    args: PipeSeq2SeqTrainingArguments,
    tokenizer: PreTrainedTokenizerBase,
    model: torch.nn.Module,
) -> DataCollatorForSeq2Seq:
    """`DataCollatorForSeq2Seq` as run_summarization.py builds it: inputs padded per batch with the pad
    token, labels with -100 (or the pad token), and ``decoder_input_ids`` made from the labels by the
    model, which label smoothing needs (it takes the labels away from the forward)."""
    label_pad = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    return DataCollatorForSeq2Seq(
        tokenizer, model=model, label_pad_token_id=label_pad, pad_to_multiple_of=pad_to_multiple_of(args)
    )


def predict(trainer: PipeSeq2SeqTrainer, tokenizer: PreTrainedTokenizerBase, test_data: Dataset) -> None:
    """Summarize the test split: ``predict_results.json`` (ROUGE with the test summaries, ``predict_``
    keys) and, with ``--predict_with_generate``, ``generated_predictions.txt``, one summary per line."""
    output = trainer.predict(test_data, metric_key_prefix="predict")
    record_metrics(trainer, "predict", {**output.metrics, "predict_samples": len(test_data)})
    if trainer.is_world_process_zero() and trainer.args.predict_with_generate:
        ids = np.where(output.predictions != -100, output.predictions, tokenizer.pad_token_id)
        texts = [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
        path = Path(trainer.args.output_dir) / "generated_predictions.txt"
        path.write_text("\n".join(texts) + "\n", encoding="utf-8")
        logger.info("summaries written to %s", path)


def _wanted(args: PipeSeq2SeqTrainingArguments) -> tuple[bool, bool, bool]:
    return args.do_train, args.do_eval, args.do_predict


def _first(data: Dataset, limit: int | None) -> Dataset:
    return data.select(range(min(limit, len(data)))) if limit is not None else data


def _split(raw: DatasetDict, split: str) -> Dataset:
    if split not in raw:
        raise ValueError(f"no `{split}` split: pass `--{split}_file` or a dataset that has one (it has {sorted(raw)})")
    return raw[split]


if __name__ == "__main__":
    main()
