"""examples/common.py: presets and flags over a script's defaults, and which checkpoint a run resumes from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import HfArgumentParser, TrainingArguments

from example_modules import load_example

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


common = load_example("common")


@dataclass
class DataArguments:
    block_size: int = 16
    group_whole_split: bool = False


DEFAULTS = {"block_size": 64, "use_cpu": True, "report_to": "none"}


@pytest.fixture
def parser() -> HfArgumentParser:
    return HfArgumentParser((DataArguments, TrainingArguments))


def test_flags_override_the_script_defaults(parser, tmp_path):
    data, args = common.parse_arguments(parser, {**DEFAULTS, "output_dir": str(tmp_path)}, ["--group_whole_split"])
    assert (data.block_size, data.group_whole_split, args.use_cpu) == (64, True, True)
    data, args = common.parse_arguments(parser, DEFAULTS, ["--block_size", "8", "--use_cpu", "false"])
    assert (data.block_size, args.use_cpu) == (8, False)


def test_a_lone_json_argument_is_a_preset(parser, tmp_path):
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({"block_size": 1024, "output_dir": str(tmp_path), "learning_rate": 5e-5}))
    data, args = common.parse_arguments(parser, DEFAULTS, [str(preset)])
    assert (data.block_size, args.learning_rate, args.use_cpu) == (1024, 5e-5, True)


def test_a_preset_leaves_out_keys_starting_with_an_underscore(parser, tmp_path):
    preset = tmp_path / "preset.json"
    notes = {"_source": "FTPipe's config", "_num_processes": 8, "_script": "run_clm_pipe.py"}
    preset.write_text(json.dumps({**notes, "block_size": 1024, "output_dir": str(tmp_path)}))
    data, _ = common.parse_arguments(parser, DEFAULTS, [str(preset)])
    assert data.block_size == 1024
    preset.write_text(json.dumps({"no_such_argument": 1, "output_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match="no_such_argument"):  # other unknown names still fail
        common.parse_arguments(parser, DEFAULTS, [str(preset)])


def test_a_preset_that_is_not_an_object_is_refused(parser, tmp_path):
    preset = tmp_path / "preset.json"
    preset.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        common.parse_arguments(parser, DEFAULTS, [str(preset)])


def test_training_resumes_from_the_last_checkpoint_in_output_dir(tmp_path):
    def args(**kwargs) -> TrainingArguments:
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)

    assert common.checkpoint_to_resume(args(do_train=True)) is None  # empty folder: a fresh start
    for step in (2, 10, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    assert common.checkpoint_to_resume(args(do_train=True)) == str(tmp_path / "checkpoint-10")
    assert common.checkpoint_to_resume(args(do_train=False, do_eval=True)) is None
    chosen = str(tmp_path / "checkpoint-2")
    assert common.checkpoint_to_resume(args(do_train=True, resume_from_checkpoint=chosen)) == chosen
