"""examples/run_clm_pipe.py: one real 2-process launch on the offline sample, and its grouping as pure code."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from distributed import accelerate_launch
from doc_blocks import cpu_launch_arguments
from example_modules import load_example, regenerate_fixtures

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DATA = EXAMPLES / "data"
BLOCK_SIZE = 32


@pytest.fixture(scope="module")
def clm() -> ModuleType:
    return load_example("run_clm_pipe")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train a tiny GPT-2 for 4 steps on 2 processes, evaluate on validation, predict on test: the
    arguments of docs/examples.md's CPU command, then this test's, which shorten it and add Trainer's
    gradient accumulation and label smoothing."""
    output_dir = tmp_path_factory.mktemp("clm")
    start = time.monotonic()
    accelerate_launch(
        str(EXAMPLES / "run_clm_pipe.py"),
        *cpu_launch_arguments("docs/examples.md", "run_clm_pipe.py"),
        *("--output_dir", str(output_dir), "--do_predict", "--group_whole_split"),
        *("--max_steps", "4", "--block_size", str(BLOCK_SIZE), "--logging_steps", "1", "--save_strategy", "no"),
        *("--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--num_microbatches", "2"),
        *("--gradient_accumulation_steps", "2", "--label_smoothing_factor", "0.1"),  # Trainer's loss options
        timeout_s=240,
    )
    print(f"run_clm_pipe.py launch: {time.monotonic() - start:.1f} s")
    return output_dir


def _results(run: Path, split: str) -> dict:
    return json.loads((run / f"{split}_results.json").read_text())


def test_trains_and_writes_run_clm_result_files(run):
    everything = json.loads((run / "all_results.json").read_text())
    train, evaluation, test = _results(run, "train"), _results(run, "eval"), _results(run, "test")
    assert everything == {**train, **evaluation, **test}
    assert math.isfinite(train["train_loss"]) and train["train_samples"] > 0
    assert json.loads((run / "trainer_state.json").read_text())["global_step"] == 4
    # run_clm's key is "perplexity", beside eval_loss
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["eval_loss"]), rel=1e-12)
    assert test["test_perplexity"] == pytest.approx(math.exp(test["test_loss"]), rel=1e-12)
    assert evaluation["perplexity"] < 512  # below a uniform guess over the 512-token vocabulary


def _blocks(tokenizer, path: Path) -> torch.Tensor:
    # FTPipe's preparation, written out: the file as one string, blocks, remainder dropped.
    ids = tokenizer(path.read_text(encoding="utf-8"), verbose=False).input_ids
    usable = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    return torch.tensor(ids[:usable]).view(-1, BLOCK_SIZE)


@pytest.mark.parametrize(("split", "file"), [("eval", "validation"), ("test", "test")])
def test_perplexity_is_that_of_the_saved_model_on_one_process(run, split, file, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(run)
    model = AutoModelForCausalLM.from_pretrained(run).eval()
    blocks = _blocks(tokenizer, DATA / f"wikitext_{file}.txt")
    # Plain Trainer's evaluation loss on one process, label-smoothed as the launch trains and evaluates.
    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to="none",
        per_device_eval_batch_size=4,
        label_smoothing_factor=0.1,
    )
    data = Dataset.from_dict({"input_ids": blocks.tolist(), "labels": blocks.tolist()})
    model.loss_type = "ForCausalLM"  # as run_clm_pipe.py names it (not saved in the config)
    loss = Trainer(model=model, args=args).evaluate(data)["eval_loss"]
    results = _results(run, split)
    assert results[f"{split}_samples"] == len(blocks)  # 4 per batch: the last batch is incomplete, kept
    assert len(blocks) % 4 != 0
    assert results[f"{split}_loss"] == pytest.approx(loss, rel=1e-5)
    key = "perplexity" if split == "eval" else "test_perplexity"
    assert results[key] == pytest.approx(math.exp(loss), rel=1e-5)


def test_group_into_blocks_drops_the_remainder(clm):
    assert clm.group_into_blocks([[1, 2, 3], [4, 5]], 2) == [[1, 2], [3, 4]]
    assert clm.group_into_blocks([[1, 2, 3], [4]], 2) == [[1, 2], [3, 4]]
    assert clm.group_into_blocks([[1]], 2) == []


@pytest.fixture(scope="module")
def byte_tokenizer():
    # 256 bytes + <|endoftext|>, no merges: one token per character, so tokenizing rows one by one
    # or joined gives the same tokens and only the grouping differs.
    return load_example("local_tokenizer").build_gpt2_tokenizer(["abcdefghij"], vocab_size=257)


def test_whole_split_grouping_keeps_what_per_group_grouping_drops(clm, byte_tokenizer):
    rows = Dataset.from_dict({"text": ["abcd", "e", "fgh", "ij"]})

    def texts(blocks: Dataset) -> list[str]:
        assert blocks["labels"] == blocks["input_ids"]
        return [byte_tokenizer.decode(ids) for ids in blocks["input_ids"]]

    # run_clm: "abcde" | "fghij", each cut in blocks of 3 on its own: "de" and "ij" are dropped
    per_group = clm.lm_blocks(rows, byte_tokenizer, 3, rows_per_group=2, load_from_cache_file=False)
    assert texts(per_group) == ["abc", "fgh"]
    # FTPipe: "abcdefghij" cut once: only the final "j" is dropped
    whole = clm.lm_blocks(rows, byte_tokenizer, 3, rows_per_group=None, load_from_cache_file=False)
    assert texts(whole) == ["abc", "def", "ghi"]


def test_sample_has_wikitext_layout():
    for split in ("train", "validation", "test"):
        lines = (DATA / f"wikitext_{split}.txt").read_text(encoding="utf-8").splitlines()
        assert 50 <= len(lines) <= 400
        assert any(line.startswith(" = ") and line.endswith(" = ") for line in lines)  # titles
        assert any(line.startswith(" = = ") for line in lines)  # headings
        assert "" in lines  # blank rows, as in wikitext-2-raw-v1


def test_make_wikitext_regenerates_the_shipped_files(tmp_path):
    regenerate_fixtures("make_wikitext.py", tmp_path)
    for split in ("train", "validation", "test"):
        name = f"wikitext_{split}.txt"
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} is stale: rerun make_wikitext.py"
