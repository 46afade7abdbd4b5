"""Fine-tune a causal language model (GPT-2 style) on WikiText-2 as a pipeline, as ``run_clm.py`` does.

Hugging Face's ``examples/pytorch/language-modeling/run_clm.py`` with `PipeTrainer`: the text
is tokenized, cut into non-overlapping blocks of ``--block_size`` tokens (labels = inputs; the
model shifts them), and evaluation reports ``perplexity = exp(eval_loss)``.

Offline (2 CPU processes, one pipeline stage each): without ``--model_name_or_path`` a tiny GPT-2
is built from a config, its tokenizer is trained on the training text, and the data is the
WikiText-like sample in ``examples/data/`` (``make_wikitext.py``)::

    accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/run_clm_pipe.py \\
        --do_train --do_eval

FTPipe's GPT2-XL run on 8 GPUs: WikiText-2 from the Hub, the whole split tokenized as one text,
blocks of 1024, AdamW lr 5e-5, weight decay 0.01, batch 1 (here one micro-batch per step would
leave the pipeline idle: use a larger batch split into micro-batches), perplexity on the test split::

    accelerate launch --num_processes 8 examples/run_clm_pipe.py --model_name_or_path gpt2-xl \\
        --dataset_name Salesforce/wikitext --dataset_config_name wikitext-2-raw-v1 \\
        --group_whole_split --block_size 1024 --eval_split test --do_train --do_eval \\
        --per_device_train_batch_size 8 --num_microbatches 8 --learning_rate 5e-5 \\
        --weight_decay 0.01 --num_train_epochs 1 --gpu_profile rtx2080ti

A lone ``.json`` argument is read as a preset of the same arguments. Any
`PipeTrainingArguments` / `TrainingArguments` flag works.
"""

from __future__ import annotations

import itertools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    default_data_collator,
    set_seed,
)

from hf_ftpipe import PipeTrainer, PipeTrainingArguments
from hf_ftpipe.metrics import perplexity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import checkpoint_to_resume, parse_arguments, record_metrics, set_up_logging  # noqa: E402

from local_tokenizer import build_gpt2_tokenizer  # noqa: E402

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"
SPLITS = ("train", "validation", "test")
# run_clm groups the rows of each `map` batch on its own (datasets' default batch: 1,000 rows),
# dropping a partial block per batch.
ROWS_PER_GROUP = 1000
TINY_BLOCK_SIZE = 64


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A causal LM (Hub id or folder). Default: a tiny GPT-2 built from a config, trained from scratch."
        },
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Tokenizer (Hub id or folder), if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to store downloads from the Hub."})


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset with a `text` column, e.g. Salesforce/wikitext."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "E.g. wikitext-2-raw-v1."})
    train_file: str | None = field(
        default=None, metadata={"help": "A text file (one row per line) or JSONL with `text`."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same layout as `train_file`."})
    test_file: str | None = field(default=None, metadata={"help": "Same layout as `train_file`."})
    block_size: int | None = field(
        default=None,
        metadata={"help": "Tokens per sample. Default: the model's limit, at most 1024 (64 for the tiny GPT-2)."},
    )
    group_whole_split: bool = field(
        default=False,
        metadata={
            "help": "Tokenize each split as one text and cut it into blocks, dropping one partial block per "
            "split, as FTPipe did. Default: run_clm's way, rows tokenized one by one and grouped per "
            f"{ROWS_PER_GROUP} rows, dropping a partial block per group."
        },
    )
    eval_split: Literal["validation", "test"] = field(
        default="validation", metadata={"help": "The split --do_eval (and eval_strategy) evaluates on."}
    )
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks in text files' rows."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep the first N training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep the first N evaluation blocks."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Preprocess again instead of using the cache."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for preprocessing."})

    def __post_init__(self) -> None:
        if self.dataset_name is None and not (self.train_file or self.validation_file or self.test_file):
            self.train_file = str(DATA / "wikitext_train.txt")  # the offline sample
            self.validation_file = str(DATA / "wikitext_validation.txt")
            self.test_file = str(DATA / "wikitext_test.txt")


def default_arguments() -> dict[str, object]:
    """Settings for a quick run that differ from `TrainingArguments`' own; flags override them."""
    return {
        "output_dir": "pipe_output/clm",
        "use_cpu": not torch.cuda.is_available(),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "num_microbatches": 2,
        "learning_rate": 1e-3,
        "num_train_epochs": 20,
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
    with training_args.main_process_first(desc="tokenizing and grouping"):
        blocks = lm_blocks(
            raw,
            tokenizer,
            data_args.block_size,
            rows_per_group=None if data_args.group_whole_split else ROWS_PER_GROUP,
            num_proc=data_args.preprocessing_num_workers,
            load_from_cache_file=not data_args.overwrite_cache,
        )
    train_data = _first(blocks, "train", data_args.max_train_samples) if training_args.do_train else None
    eval_data = _first(blocks, data_args.eval_split, data_args.max_eval_samples) if training_args.do_eval else None

    # transformers 5 finds GPT-2's loss by its class name, which lacks "ForCausalLM": Trainer then
    # divides the summed token losses by every label, the first of each block too, which nothing
    # predicts, and eval_loss comes out (block_size - 1) / block_size of the mean token loss.
    # Naming the loss makes eval_loss that mean, and perplexity exp of it, as FTPipe reports it.
    if getattr(model, "loss_type", None) is None:
        model.loss_type = "ForCausalLM"
    trainer = PipeTrainer(
        model=model,
        args=training_args,
        train_dataset=train_data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        data_collator=default_data_collator,  # every block has block_size tokens: nothing to pad
    )
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
        trainer.save_model()  # and the tokenizer, so the output folder loads with from_pretrained
        record_metrics(trainer, "train", {**result.metrics, "train_samples": len(train_data)})
    if training_args.do_eval:
        metrics = trainer.evaluate()
        # run_clm's key: "perplexity" (not "eval_perplexity") beside eval_loss
        record_metrics(
            trainer, "eval", {**metrics, "eval_samples": len(eval_data), "perplexity": perplexity(metrics["eval_loss"])}
        )
    if training_args.do_predict:
        test_data = _first(blocks, "test", data_args.max_eval_samples)
        metrics = trainer.evaluate(eval_dataset=test_data, metric_key_prefix="test")
        record_metrics(
            trainer,
            "test",
            {**metrics, "test_samples": len(test_data), "test_perplexity": perplexity(metrics["test_loss"])},
        )


def load_raw(data_args: DataTrainingArguments, model_args: ModelArguments) -> DatasetDict:
    """The raw splits, each with one ``text`` column: from the Hub, or from text / JSONL files."""
    if data_args.dataset_name is not None:
        return load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=model_args.cache_dir)
    paths = (data_args.train_file, data_args.validation_file, data_args.test_file)
    files = {split: path for split, path in zip(SPLITS, paths) if path}
    suffixes = {Path(path).suffix for path in files.values()}
    if len(suffixes) > 1:
        raise ValueError(f"the data files must share one format, got {sorted(suffixes)}")
    if suffixes <= {".json", ".jsonl"}:
        return load_dataset("json", data_files=files, cache_dir=model_args.cache_dir)
    return load_dataset(
        "text", data_files=files, keep_linebreaks=data_args.keep_linebreaks, cache_dir=model_args.cache_dir
    )


def load_model(
    model_args: ModelArguments, data_args: DataTrainingArguments, args: PipeTrainingArguments, raw: DatasetDict
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """The tokenizer and model; sets ``data_args.block_size`` when it was left to the model."""
    if model_args.model_name_or_path is None:
        return _tiny_gpt2(data_args, args, raw)
    path = model_args.model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or path, cache_dir=model_args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, cache_dir=model_args.cache_dir)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))  # as run_clm: room for tokens the tokenizer added
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 1024)
    data_args.block_size = data_args.block_size or min(1024, tokenizer.model_max_length, limit)
    if data_args.block_size > limit:
        raise ValueError(
            f"`block_size={data_args.block_size}` exceeds the model's {limit} positions; pass at most {limit}"
        )
    return tokenizer, model


def _tiny_gpt2(
    data_args: DataTrainingArguments, args: PipeTrainingArguments, raw: DatasetDict
) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    if "train" not in raw:
        raise ValueError(
            "the tiny GPT-2 trains its tokenizer on the training text: pass a `train_file` or `--model_name_or_path`"
        )
    tokenizer_dir = Path(args.output_dir) / "tokenizer"
    with args.main_process_first(desc="training the tokenizer"):
        if args.process_index == 0:
            build_gpt2_tokenizer(raw["train"]["text"], vocab_size=512).save_pretrained(tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data_args.block_size = data_args.block_size or TINY_BLOCK_SIZE
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=data_args.block_size,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(args.seed)
    return tokenizer, GPT2LMHeadModel(config)


def group_into_blocks(token_rows: list[list[int]], block_size: int) -> list[list[int]]:
    """Concatenate ``token_rows`` and cut them into non-overlapping blocks of ``block_size``.

    The last partial block is dropped: ``[[1, 2, 3], [4, 5]]`` in blocks of 2 is ``[[1, 2], [3, 4]]``.
    """
    tokens = list(itertools.chain.from_iterable(token_rows))
    usable = len(tokens) // block_size * block_size
    return [tokens[start : start + block_size] for start in range(0, usable, block_size)]


def lm_blocks(
    raw: DatasetDict | Dataset,
    tokenizer: PreTrainedTokenizerBase,
    block_size: int,
    rows_per_group: int | None = ROWS_PER_GROUP,
    num_proc: int | None = None,
    load_from_cache_file: bool = True,
) -> DatasetDict | Dataset:
    """Tokenize the ``text`` column and cut it into blocks: ``input_ids`` and ``labels`` (equal).

    Args:
        raw (`DatasetDict` or `Dataset`):
            Splits with a ``text`` column (else their first column), e.g. WikiText's lines.
        tokenizer (`PreTrainedTokenizerBase`):
            Adds no special tokens for GPT-2 (none for the local one either).
        block_size (`int`):
            Tokens per block.
        rows_per_group (`int` or `None`, defaults to 1000):
            Rows are tokenized one by one and concatenated this many at a time, each group
            dropping its own partial block (``run_clm.py``). ``None``: the whole split is joined
            into one text (its rows keep their line breaks), tokenized at once and cut, dropping
            one partial block per split (FTPipe, which tokenized ``wiki.*.raw`` whole).
        num_proc (`int`, *optional*):
            Processes for `datasets.map`; with ``rows_per_group=None`` one split is one map
            batch, so one process tokenizes it.
        load_from_cache_file (`bool`, defaults to `True`):
            Reuse `datasets`' cache of an earlier run.
    """
    columns = raw.column_names if isinstance(raw, Dataset) else next(iter(raw.values())).column_names
    text = "text" if "text" in columns else columns[0]
    cache = {"load_from_cache_file": load_from_cache_file}

    def _labelled(blocks: list[list[int]]) -> dict[str, list[list[int]]]:
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    if rows_per_group is None:

        def tokenize_whole(batch: dict) -> dict:
            # verbose=False: the split is far longer than model_max_length, which is expected here
            tokens = tokenizer("".join(batch[text]), verbose=False)["input_ids"]
            return _labelled(group_into_blocks([tokens], block_size))

        return raw.map(
            tokenize_whole,
            batched=True,
            batch_size=None,
            remove_columns=columns,
            desc="tokenizing whole splits",
            **cache,
        )

    def tokenize_rows(batch: dict) -> dict:
        return {"input_ids": tokenizer(batch[text], verbose=False)["input_ids"]}

    def group(batch: dict) -> dict:
        return _labelled(group_into_blocks(batch["input_ids"], block_size))

    tokenized = raw.map(
        tokenize_rows, batched=True, num_proc=num_proc, remove_columns=columns, desc="tokenizing", **cache
    )
    # group's output replaces input_ids, so the row count may change
    return tokenized.map(
        group,
        batched=True,
        batch_size=rows_per_group,
        num_proc=num_proc,
        desc=f"grouping in blocks of {block_size}",
        **cache,
    )


def _first(blocks: DatasetDict, split: str, limit: int | None) -> Dataset:
    if split not in blocks:
        raise ValueError(
            f"no `{split}` split: pass `--{split}_file` or a dataset that has one (it has {sorted(blocks)})"
        )
    data = blocks[split]
    if len(data) == 0:
        raise ValueError(f"the `{split}` split does not fill one block: pass a smaller `--block_size`")
    return data.select(range(min(limit, len(data)))) if limit is not None else data


if __name__ == "__main__":
    main()
