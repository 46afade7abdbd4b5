"""What every example script shares: argument parsing with presets, padding, resuming, and saving metrics.

The scripts follow Hugging Face's ``examples/pytorch`` conventions, so these helpers do what
``run_clm.py`` and ``run_glue.py`` do inline::

    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, PipeTrainingArguments))
    model_args, data_args, training_args = parse_arguments(parser, DEFAULTS)
    ...
    result = trainer.train(resume_from_checkpoint=checkpoint_to_resume(training_args))
    record_metrics(trainer, "train", result.metrics)
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import transformers
from transformers import HfArgumentParser, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)


def parse_arguments(parser: HfArgumentParser, defaults: dict[str, Any], argv: Sequence[str] | None = None) -> tuple:
    """Parse the command line into the parser's dataclasses, over a script's own defaults.

    A lone argument ending in ``.json`` is a preset: a JSON object of field names and values, as
    in Hugging Face's examples (``python run_clm_pipe.py preset.json``); keys that start with
    ``_`` are notes for people and for ``reproduce_paper.py`` (``_source``, ``_num_processes``)
    and are left out. Otherwise the arguments
    are flags; either way they override ``defaults``, which hold the values a script wants that
    differ from the dataclasses' own (e.g. ``use_cpu`` on a machine without a GPU).

    Args:
        parser (`HfArgumentParser`):
            The parser over the script's dataclasses.
        defaults (`dict[str, Any]`):
            Field name to value; booleans and numbers are written as flags the parser reads back.
        argv (`Sequence[str]`, *optional*):
            The arguments; defaults to ``sys.argv[1:]``.

    Returns:
        `tuple`: one instance per dataclass of the parser, in its order.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        path = Path(argv[0])
        try:
            preset = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the preset {path}: {e}") from e
        if not isinstance(preset, dict):
            raise ValueError(
                f"the preset {path} must hold a JSON object of argument names, got {type(preset).__name__}"
            )
        arguments = {name: value for name, value in preset.items() if not name.startswith("_")}
        return parser.parse_dict({**defaults, **arguments})
    flags = [item for name, value in defaults.items() for item in (f"--{name}", _flag_value(value))]
    return parser.parse_args_into_dataclasses(args=flags + argv)  # later flags win


def _flag_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def set_up_logging(args: TrainingArguments, script_logger: logging.Logger) -> None:
    """Log as the Hugging Face examples do: the main process at info, the others at warning.

    The levels are `TrainingArguments`' (``--log_level``, ``--log_level_replica``), applied to
    the script's logger, this module's, `datasets`' and `transformers`'.
    """
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.WARNING)
    level = args.get_process_log_level()
    for each in (script_logger, logger):
        each.setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


def pad_to_multiple_of(args: TrainingArguments) -> int | None:
    """What a dynamically padded batch's length is rounded up to: 8 under fp16 or bf16, else ``None``.

    As Hugging Face's scripts pass it to their collators: half-precision matrix multiplies run
    fastest on tensor cores with sizes that are multiples of 8; in float32 rounding up only adds
    padding.
    """
    return 8 if args.fp16 or args.bf16 else None


def checkpoint_to_resume(args: TrainingArguments) -> str | bool | None:
    """The checkpoint ``trainer.train`` should resume from, as ``run_clm.py`` picks it.

    ``--resume_from_checkpoint`` when given; else, when training, the last ``checkpoint-N``
    folder in ``output_dir`` (transformers' `get_last_checkpoint`), so a job started again after
    a crash continues where it stopped; else ``None`` (a fresh start).
    """
    if args.resume_from_checkpoint is not None:
        return args.resume_from_checkpoint
    if not (args.do_train and os.path.isdir(args.output_dir)):
        return None
    last = get_last_checkpoint(args.output_dir)
    if last is not None:
        logger.info(
            "resuming from %s, the last checkpoint in %s (pass another --output_dir to start afresh)",
            last,
            args.output_dir,
        )
    return last


def record_metrics(trainer: Any, split: str, metrics: dict[str, float]) -> None:
    """Print ``metrics`` and write ``{split}_results.json`` and ``all_results.json`` in ``output_dir``.

    ``trainer.log_metrics`` and ``save_metrics`` (which act on the main process only); after
    training, also ``trainer_state.json`` (``save_state``), as the Hugging Face examples do.
    """
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)
    if split == "train":
        trainer.save_state()
