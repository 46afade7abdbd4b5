"""examples/presets/ and reproduce_paper.py: each preset is FTPipe's setting, and a dry run plans offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from hf_ftpipe import PipeTrainingArguments

from doc_blocks import argv, expected_output, missing_output, page_block
from example_modules import EXAMPLES, load_example

PRESETS = EXAMPLES / "presets"
common = load_example("common")
reproduce = load_example("reproduce_paper")

# FTPipe's T5-3B settings (notes/tasks.md, "How FTPipe ran T5-3B on SuperGLUE"): task ->
# (input, target tokens), length, warm-up, async (micro-batch, micro-batches), GPipe (same).
T5 = {
    "boolq": ((512, 4), {"max_steps": 3200}, 200, (4, 5), (2, 10)),
    "rte": ((320, 8), {"max_steps": 4200}, 200, (8, 5), (4, 10)),
    "wic": ((64, 4), {"num_train_epochs": 10}, 1000, (64, 2), (16, 8)),
    "multirc": ((512, 4), {"max_steps": 17000}, 1000, (4, 2), (1, 8)),
    # not FTPipe's: CB and COPA take its optimizer and schedule, lengths from the longest input
    "cb": ((256, 8), {"num_train_epochs": 20}, 20, (8, 4), (4, 8)),
    "copa": ((64, 8), {"num_train_epochs": 20}, 20, (16, 2), (4, 8)),
}
EXPECTED_PRESETS = sorted(
    [f"t5-3b_{task}_{schedule}" for task in T5 for schedule in ("async", "gpipe")]
    + [f"{row}_{schedule}" for row in ("bert-large_squad", "gpt2-xl_wikitext2") for schedule in ("async", "gpipe")]
)
_modules: dict[str, object] = {}


def parse(name: str) -> tuple:
    """The preset ``name`` through its own script's parser, as ``accelerate launch script preset`` would."""
    path = PRESETS / f"{name}.json"
    script = json.loads(path.read_text())["_script"].removesuffix(".py")
    module = _modules.get(script) or _modules.setdefault(script, load_example(script))
    parser = HfArgumentParser((module.ModelArguments, module.DataTrainingArguments, PipeTrainingArguments))
    return common.parse_arguments(parser, module.default_arguments(), [str(path)])


def check_pipeline(args, schedule: str, microbatch: int, num_microbatches: int) -> None:
    assert args.pipeline_schedule == schedule
    assert args.per_device_train_batch_size == microbatch * num_microbatches
    assert args.num_microbatches == num_microbatches
    assert args.async_update_interval == (num_microbatches if schedule == "async" else 1)
    assert (args.gpu_profile, args.partitioner, args.activation_checkpointing) == ("rtx2080ti", "auto", True)
    assert (args.seed, args.max_grad_norm, args.do_train, args.do_eval) == (42, 0.0, True, True)


def test_there_is_an_async_and_a_gpipe_preset_per_row_of_the_table():
    assert sorted(path.stem for path in PRESETS.glob("*.json")) == EXPECTED_PRESETS
    for name in EXPECTED_PRESETS:
        preset = json.loads((PRESETS / f"{name}.json").read_text())
        assert preset["_num_processes"] == 8 and name.rsplit("_", 1)[0] in reproduce.PAPER
        assert ("not from FTPipe" in preset["_source"]) == (name.split("_")[1] in ("cb", "copa"))


@pytest.mark.parametrize("task", list(T5))
@pytest.mark.parametrize("schedule", ["async", "gpipe"])
def test_t5_presets_are_ftpipes_settings(task, schedule):
    (source, target), length, warmup, async_, gpipe = T5[task]
    model_args, data_args, args = parse(f"t5-3b_{task}_{schedule}")
    assert (model_args.model_name_or_path, model_args.adafactor_scale_parameter) == ("t5-3b", True)
    assert (data_args.task_name, data_args.max_source_length, data_args.max_target_length) == (task, source, target)
    assert data_args.pad_to_max_length  # FTPipe padded every sample: samples/s that compare with the paper's
    assert data_args.dataset_name == ("nyu-mll/glue" if task == "rte" else "aps/super_glue")  # FTPipe's GLUE RTE
    assert (args.learning_rate, args.weight_decay, args.warmup_steps) == (1e-3, 0.0, warmup)
    assert args.lr_scheduler_type == "constant_with_warmup"
    for name, value in length.items():
        assert getattr(args, name) == value
    check_pipeline(args, schedule, *(async_ if schedule == "async" else gpipe))


@pytest.mark.parametrize("schedule, pipeline", [("async", (24, 1)), ("gpipe", (3, 8))])
def test_bert_large_squad_presets_are_the_classic_recipe(schedule, pipeline):
    model_args, data_args, args = parse(f"bert-large_squad_{schedule}")
    assert model_args.model_name_or_path == "google-bert/bert-large-uncased-whole-word-masking"
    assert (data_args.dataset_name, data_args.max_seq_length, data_args.doc_stride) == ("rajpurkar/squad", 384, 128)
    assert data_args.pad_to_max_length
    assert (args.learning_rate, args.adam_epsilon, args.weight_decay, args.warmup_steps) == (3e-5, 1e-8, 0.0, 0)
    assert (args.lr_scheduler_type, args.num_train_epochs, args.per_device_train_batch_size) == ("linear", 2, 24)
    check_pipeline(args, schedule, *pipeline)


@pytest.mark.parametrize("schedule, pipeline", [("async", (1, 1)), ("gpipe", (1, 8))])
def test_gpt2_xl_wikitext2_presets_are_ftpipes_settings(schedule, pipeline):
    model_args, data_args, args = parse(f"gpt2-xl_wikitext2_{schedule}")
    assert model_args.model_name_or_path == "gpt2-xl"
    assert (data_args.dataset_config_name, data_args.block_size) == ("wikitext-2-raw-v1", 1024)
    assert (data_args.group_whole_split, data_args.eval_split) == (True, "test")
    assert (args.learning_rate, args.weight_decay, args.lr_scheduler_type) == (5e-5, 0.01, "linear")
    check_pipeline(args, schedule, *pipeline)


def test_presets_select_by_name_or_glob():
    assert reproduce.select_presets(["t5-3b_wic_*", "bert-large_squad_async"]) == [
        "bert-large_squad_async",
        "t5-3b_wic_async",
        "t5-3b_wic_gpipe",
    ]
    assert reproduce.select_presets([]) == EXPECTED_PRESETS
    with pytest.raises(ValueError, match="no preset matches"):
        reproduce.select_presets(["t5-11b_*"])


def test_a_dry_run_plans_offline_and_writes_the_table(tmp_path: Path, capsys):
    # docs/reproducing-the-paper.md's dry run, shortened to the BERT-large presets (the quickest to trace)
    block = page_block("docs/reproducing-the-paper.md", "reproduce_paper.py --dry-run")
    assert argv(block.command_lines()[0]) == ["python", "examples/reproduce_paper.py", "--dry-run"]
    table = tmp_path / "table.md"
    assert reproduce.main(["--dry-run", "bert-large_squad_*", "--output", str(table)]) == 0
    lines = table.read_text().splitlines()
    shown = "\n".join(expected_output(block))
    assert not missing_output(lines, shown), "the page's table shows other rows than:\n" + "\n".join(lines)
    assert capsys.readouterr().out.splitlines() == lines
    assert lines[0].startswith("| preset | task | metric | reached | paper | measured samples/s | planned samples/s")
    for line, schedule in zip(lines[2:], ("async", "gpipe"), strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[:6] == [f"bert-large_squad_{schedule}", "BERT-large SQuAD 1.1", "F1 / EM", "—", "93.3 / 87.2", "—"]
        assert float(cells[6]) > 0 and cells[7] == schedule
        assert cells[8] in ("mixed", "seq-dp", "seq-greedy", "uniform", "params")


def test_a_run_launches_the_preset_with_accelerate_and_reads_its_results(tmp_path: Path, monkeypatch):
    preset = reproduce.read_preset("t5-3b_multirc_async", gpus=4, gpu_profile="a100-80gb")
    preset["output_dir"] = str(tmp_path / "multirc")
    launched = []

    def fake_run(command, check):  # what the run would leave in output_dir
        launched.append(command)
        results = {"eval_f1_a": 85.61, "eval_exact_match": 59.32, "train_samples_per_second": 11.5}
        (tmp_path / "multirc" / "all_results.json").write_text(json.dumps(results))
        return reproduce.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(reproduce.subprocess, "run", fake_run)
    row = reproduce.Row(preset="t5-3b_multirc_async", paper=reproduce.PAPER["t5-3b_multirc"], schedule="async")
    assert reproduce.run_preset("t5-3b_multirc_async", preset, row)
    written = tmp_path / "multirc" / "preset.json"
    assert launched == [
        ["accelerate", "launch", "--num_processes", "4", str(EXAMPLES / "run_glue_pipe.py"), str(written)]
    ]
    assert json.loads(written.read_text())["gpu_profile"] == "a100-80gb"
    assert (row.reached, row.measured) == ("85.61 / 59.32", "11.50")
