"""Fine-tune T5 text-to-text on a SuperGLUE task as a pipeline; run with no arguments, the Quickstart's job.

Tasks: BoolQ, CB, COPA, MultiRC, RTE (SuperGLUE's or GLUE's columns) and WiC, each example
written as T5 wrote it (``examples/super_glue_tasks.py``: ``"rte hypothesis: ... premise: ..."``
-> ``"not_entailment"``), truncated to the task's lengths and padded per batch to its longest
input and label (``DataCollatorForSeq2Seq``, as ``run_summarization.py``), or to the lengths with
``--pad_to_max_length``. Evaluation generates each label greedily through the pipeline
(``predict_with_generate``), decodes it and scores it with T5's SuperGLUE metric
(``hf_ftpipe.metrics.load_metric("t5_super_glue", task)``, ×100).

Offline (2 CPU processes, one pipeline stage each): without ``--model_name_or_path`` a tiny T5 is
built from a config, its tokenizer is trained on the task's training text, and the data is the
task's fixture in ``examples/data/``. With no arguments at all this is the Quickstart job (RTE,
``--do_train --do_eval``)::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/run_glue_pipe.py
    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/run_glue_pipe.py \\
        --task_name multirc --do_train --do_eval --output_dir pipe_output/multirc

FTPipe's T5-3B on BoolQ, 8 GPUs: the Hub's data padded to the task's lengths (512/4), Adafactor lr
1e-3 with ``scale_parameter=True`` (``--adafactor_scale_parameter``), constant schedule after warm-up::

    accelerate launch --num_processes 8 examples/run_glue_pipe.py --model_name_or_path t5-3b \\
        --task_name boolq --dataset_name aps/super_glue --pad_to_max_length --do_train --do_eval \\
        --use_cpu false --adafactor_scale_parameter --learning_rate 1e-3 --lr_scheduler_type constant_with_warmup \\
        --warmup_steps 200 --max_steps 3200 --per_device_train_batch_size 20 --num_microbatches 10 \\
        --output_dir pipe_output/boolq --gpu_profile rtx2080ti

A lone ``.json`` argument is read as a preset of the same arguments. Any
`PipeTrainingArguments` / `TrainingArguments` flag works.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    Adafactor,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    EvalPrediction,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    T5Config,
    T5ForConditionalGeneration,
    default_data_collator,
    set_seed,
)

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.metrics import load_metric

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    checkpoint_to_resume,
    pad_to_multiple_of,
    parse_arguments,
    record_metrics,
    set_up_logging,
)
from super_glue_tasks import Task, get_task, tokenize_batch  # noqa: E402

from local_tokenizer import build_t5_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"
SPLITS = ("train", "validation", "test")
TaskName = Literal["boolq", "cb", "copa", "multirc", "rte", "wic"]


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A T5 checkpoint (Hub id or folder). Default: a tiny T5 built from a config."},
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer (Hub id or folder), if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloads from the Hub."})
    adafactor_scale_parameter: bool = field(
        default=False,
        metadata={
            "help": "Train with FTPipe's optimizer: Adafactor at `--learning_rate`, scale_parameter=True, "
            "relative_step=False (`--optim adafactor` fixes scale_parameter=False). Replaces `--optim`."
        },
    )


@dataclass
class DataTrainingArguments:
    task_name: TaskName = field(
        default="rte", metadata={"help": "The SuperGLUE task; rte reads SuperGLUE's or GLUE's columns."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. aps/super_glue."})
    dataset_config_name: str | None = field(
        default=None, metadata={"help": "Its config. Default: the task's (e.g. boolq)."}
    )
    train_file: str | None = field(
        default=None, metadata={"help": "JSONL in the Hub's layout. Default: the task's fixture in examples/data."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same layout as `train_file`."})
    test_file: str | None = field(
        default=None, metadata={"help": "Same layout; `--do_predict` generates its labels (label -1: unlabelled)."}
    )
    max_source_length: int | None = field(
        default=None,
        metadata={
            "help": "The most input tokens (EOS included): longer inputs are truncated. Default: the task's "
            "(FTPipe's, e.g. 512 for BoolQ); for the tiny T5, the longest input of the data rounded up to a "
            "multiple of 8."
        },
    )
    max_target_length: int | None = field(
        default=None,
        metadata={
            "help": "The most target tokens (EOS included). Default: the task's; for the tiny T5, the longest label's."
        },
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={
            "help": "Pad every input to `max_source_length` and every label to `max_target_length`, as FTPipe did "
            "(the presets do). Default: pad each batch to its own longest input and label (DataCollatorForSeq2Seq)."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N validation examples."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Keep the first N test examples."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Preprocess again instead of using the cache."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for preprocessing."})

    def __post_init__(self) -> None:
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            self.train_file = str(DATA / f"{self.task_name}_train.jsonl")  # the offline fixture
            self.validation_file = str(DATA / f"{self.task_name}_validation.jsonl")
        if self.dataset_name is not None and self.dataset_config_name is None:
            self.dataset_config_name = get_task(self.task_name).dataset_config_name


def default_arguments() -> dict[str, object]:
    """The Quickstart's settings where they differ from `TrainingArguments`' own; flags override them."""
    return {
        "output_dir": "pipe_output/glue",
        "use_cpu": not torch.cuda.is_available(),
        "num_train_epochs": 12,
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 16,
        "num_microbatches": 4,
        "learning_rate": 3e-3,
        "warmup_steps": 20,
        "logging_steps": 50,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 42,
        "predict_with_generate": True,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Run the job on ``argv`` (default ``sys.argv[1:]``); returns the evaluation metrics, if any."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, PipeTrainingArguments))
    model_args, data_args, training_args = parse_arguments(parser, default_arguments(), argv)
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        training_args.do_train = training_args.do_eval = True  # the Quickstart's job
    set_up_logging(training_args, logger)
    set_seed(training_args.seed)

    raw = load_raw(data_args, model_args)
    task = get_task(data_args.task_name, next(iter(raw.values())).column_names)
    limits = (data_args.max_train_samples, data_args.max_eval_samples, data_args.max_predict_samples)
    raw = DatasetDict({split: _first(raw[split], limit) for split, limit in zip(SPLITS, limits) if split in raw})
    tokenizer, model = load_model(model_args, training_args, raw, task)
    source_length, target_length = _lengths(data_args, task, tokenizer, raw, tiny=model_args.model_name_or_path is None)
    padding = "padded to" if data_args.pad_to_max_length else "up to"
    with training_args.main_process_first(desc="tokenizing"):
        features = raw.map(
            functools.partial(
                tokenize_batch,
                tokenizer,
                task,
                max_source_length=source_length,
                max_target_length=target_length,
                pad_to_max_length=data_args.pad_to_max_length,
            ),
            batched=True,
            num_proc=data_args.preprocessing_num_workers,
            remove_columns=next(iter(raw.values())).column_names,
            load_from_cache_file=not data_args.overwrite_cache,
            desc=f"tokenizing ({padding} {source_length} / {target_length} tokens)",
        )
    train_data = _split(features, "train") if training_args.do_train else None
    eval_data = _split(features, "validation") if training_args.do_eval else None

    trainer = PipeTrainer(
        model=model,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        data_collator=data_collator(data_args, training_args, tokenizer),
        compute_metrics=t5_scores(task, tokenizer, raw["validation"]) if training_args.do_eval else None,
        optimizer_cls_and_kwargs=ftpipe_adafactor(model_args, training_args),
    )
    metrics: dict[str, float] = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
        trainer.save_model()  # and the tokenizer: the folder loads with from_pretrained
        record_metrics(trainer, "train", {**result.metrics, "train_samples": len(train_data)})
    if training_args.do_eval:
        metrics = {**trainer.evaluate(), "eval_samples": len(eval_data)}
        record_metrics(trainer, "eval", metrics)
    if training_args.do_predict:
        predict(trainer, task, tokenizer, raw, features)
    if trainer.is_world_process_zero():
        if training_args.do_eval:
            scores = "  ".join(f"eval {key}: {metrics[f'eval_{key}'] / 100:.3f}" for key in _score_keys(task))
            print(f"{scores}  eval loss: {metrics['eval_loss']:.4f}")
        if training_args.do_train:
            print(f"model saved to {os.path.abspath(training_args.output_dir)}")
    return metrics


def load_raw(data_args: DataTrainingArguments, model_args: ModelArguments) -> DatasetDict:
    """The raw splits in the Hub's layout: from the Hub, or from JSONL files."""
    if data_args.dataset_name is not None:
        return load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=model_args.cache_dir)
    paths = (data_args.train_file, data_args.validation_file, data_args.test_file)
    files = {split: path for split, path in zip(SPLITS, paths) if path}
    return load_dataset("json", data_files=files, cache_dir=model_args.cache_dir)


def load_model(
    model_args: ModelArguments, args: PipeTrainingArguments, raw: DatasetDict, task: Task
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    if model_args.model_name_or_path is not None:
        path = model_args.model_name_or_path
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or path, cache_dir=model_args.cache_dir)
        return tokenizer, AutoModelForSeq2SeqLM.from_pretrained(path, cache_dir=model_args.cache_dir)
    if "train" not in raw:
        raise ValueError(
            "the tiny T5 trains its tokenizer on the training text: pass a `train_file` or `--model_name_or_path`"
        )
    tokenizer_dir = Path(args.output_dir) / "tokenizer"
    with args.main_process_first(desc="training the tokenizer"):
        if args.process_index == 0:
            texts = [text for key in task.input_keys for text in raw["train"][key]] + list(task.label_names)
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


def _lengths(
    data_args: DataTrainingArguments, task: Task, tokenizer: PreTrainedTokenizerBase, raw: DatasetDict, tiny: bool
) -> tuple[int, int]:
    """Input and target lengths: the flags, else the task's, else (tiny T5) what the data needs."""
    source, target = data_args.max_source_length, data_args.max_target_length
    if not tiny:
        return source or task.max_source_length, target or task.max_target_length
    # A model trained from scratch on a small sample gains nothing from padding to FTPipe's 320 or 512.
    if source is None:
        texts = [task.format_input(example) for split in raw.values() for example in split]
        longest = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids) + 1  # + EOS
        source = -(-longest // 8) * 8
    if target is None:
        target = max(len(ids) for ids in tokenizer(list(task.label_names), add_special_tokens=False).input_ids) + 1
    return source, target


def data_collator(
    data_args: DataTrainingArguments, args: PipeTrainingArguments, tokenizer: PreTrainedTokenizerBase
) -> Callable:
    """`default_data_collator` for rows padded to the lengths, else `DataCollatorForSeq2Seq`: inputs
    padded per batch with the pad token, labels with -100, as ``run_summarization.py`` collates.

    Without ``model=``: T5 builds its decoder inputs by shifting ``labels``, and generation through
    the pipeline feeds the tokens so far as ``labels``, so the batch must carry no
    ``decoder_input_ids`` of its own.
    """
    if data_args.pad_to_max_length:
        return default_data_collator
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, pad_to_multiple_of=pad_to_multiple_of(args))


def ftpipe_adafactor(model_args: ModelArguments, args: PipeTrainingArguments) -> tuple[type, dict] | None:
    """``optimizer_cls_and_kwargs`` for FTPipe's Adafactor, or ``None`` (``--optim`` decides).

    `PipeTrainer` builds the optimizer over the pipeline's stages, after planning, so it takes a
    class and its arguments rather than an optimizer built here over the whole model.
    """
    if not model_args.adafactor_scale_parameter:
        return None
    args.optim = "adafactor"  # what the planner's memory model and checkpoints read
    return Adafactor, {"lr": args.learning_rate, "scale_parameter": True, "relative_step": False, "warmup_init": False}


def _score_keys(task: Task) -> tuple[str, ...]:
    return {"cb": ("accuracy", "f1"), "multirc": ("exact_match", "f1_a")}.get(task.metric_config, ("accuracy",))


def generated_labels(tokenizer: PreTrainedTokenizerBase, task: Task, predictions: np.ndarray | tuple) -> list[str]:
    """Generated ids (or logits, read by argmax) as text; text that decodes like a label is that label.

    The local tokenizer lowercases (``True`` decodes as ``true``): a label is recognised by its
    own tokens decoded, so T5's tokenizer and the local one score alike.
    """
    if isinstance(predictions, tuple):  # predict_with_generate off: (logits, encoder states)
        predictions = predictions[0].argmax(-1)
    pad = tokenizer.pad_token_id
    texts = tokenizer.batch_decode(np.where(predictions < 0, pad, predictions), skip_special_tokens=True)
    as_decoded = {
        tokenizer.decode(tokenizer(name, add_special_tokens=False).input_ids, skip_special_tokens=True).strip(): name
        for name in task.label_names
    }
    return [as_decoded.get(text.strip(), text.strip()) for text in texts]


def t5_scores(
    task: Task, tokenizer: PreTrainedTokenizerBase, examples: Dataset
) -> Callable[[EvalPrediction], dict[str, float]]:
    """compute_metrics: T5's SuperGLUE scores of the generated labels of ``examples``, in order.

    Evaluation keeps every sample in order, so prediction ``i`` is that of ``examples[i]``,
    whose label name (and MultiRC's ``idx``) the metric takes.
    """
    metric = load_metric("t5_super_glue", task.metric_config, keep_in_memory=True)  # no cache files shared by ranks
    references = [task.label_names[label] for label in examples["label"]]  # the metric takes names or ids, not both
    idx = examples["idx"] if task.metric_config == "multirc" else None

    def compute(prediction: EvalPrediction) -> dict[str, float]:
        predicted: list = generated_labels(tokenizer, task, prediction.predictions)
        if len(predicted) != len(references):
            raise ValueError(f"{len(predicted)} predictions for {len(references)} examples")
        if idx is not None:
            predicted = [{"idx": i, "prediction": p} for i, p in zip(idx, predicted)]
        return metric.compute(predictions=predicted, references=references)

    return compute


def predict(
    trainer: PipeTrainer, task: Task, tokenizer: PreTrainedTokenizerBase, raw: DatasetDict, features: DatasetDict
) -> None:
    """Generate the test split's labels into ``predict_results_<task>.txt`` (``index<TAB>label``), as run_glue.py."""
    test_data = _split(features, "test")
    labelled = all(label != -1 for label in raw["test"]["label"])
    # Hub test splits carry label -1: nothing to score, only the loss of no label tokens.
    trainer.compute_metrics = t5_scores(task, tokenizer, raw["test"]) if labelled else None
    output = trainer.predict(test_data, metric_key_prefix="predict")
    metrics = {**output.metrics, "predict_samples": len(test_data)}
    if not labelled:
        metrics.pop("predict_loss", None)  # NaN: no label tokens
    record_metrics(trainer, "predict", metrics)
    if trainer.is_world_process_zero():
        path = Path(trainer.args.output_dir) / f"predict_results_{task.name}.txt"
        lines = [f"{i}\t{label}" for i, label in enumerate(generated_labels(tokenizer, task, output.predictions))]
        path.write_text("\n".join(["index\tprediction", *lines]) + "\n", encoding="utf-8")
        logger.info("predictions written to %s", path)


def _first(data: Dataset, limit: int | None) -> Dataset:
    return data.select(range(min(limit, len(data)))) if limit is not None else data


def _split(features: DatasetDict, split: str) -> Dataset:
    if split not in features:
        raise ValueError(
            f"no `{split}` split: pass `--{split}_file` or a dataset that has one (it has {sorted(features)})"
        )
    return features[split]


if __name__ == "__main__":
    main()
