"""PipeTrainer trains a LoRA (``peft``) model as plain `Trainer` does, and saves the adapter as peft writes it.

One torchrun launch (lora_job.py) trains a tiny GPT-2 with LoRA adapters under 1f1b and a tiny T5
under gpipe on 2 ranks (each schedule, each model once: the two schedules make the same update,
tests/runtime/test_engine.py); this process trains the same models with plain `Trainer` and
compares every logged loss and gradient norm, every adapter weight, `evaluate()`, the frozen base
weights (unchanged), what has a gradient and optimizer state (the adapter's weights only), and the
saved folder (the same files; ``PeftModel.from_pretrained`` loads it and its tensors equal
`Trainer`'s). A run resumed from the GPT-2 1f1b run's checkpoint-2 ends where the uninterrupted run
ended.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer

from distributed import REPO, torchrun
from lora_runs import CASES, RESUMED, STEPS, model_of, setup
from models import tiny_model
from trainer_comparison import TOLERANCE, assert_metrics_close, assert_steps_close, logged_steps

ADAPTER = "adapter_model.safetensors"


def _ranks(folder: Path) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("lora-pipe")
    torchrun(str(REPO / "tests" / "trainer" / "lora_job.py"), str(output))
    return output


@pytest.fixture(scope="module")
def trainer_results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """Plain `Trainer` on a case's model, run once per model: history, trainable weights, optimizer, saved folder."""
    done: dict[str, dict] = {}

    def results(case: str) -> dict:
        kind = model_of(case)
        if kind not in done:
            output = tmp_path_factory.mktemp(f"lora-trainer-{kind}")
            parts = setup(case, str(output), pipe=False)
            parts["args"].save_strategy = "no"
            trainer = Trainer(**parts)
            trainer.train()
            trainer.save_model(str(output / "model"))
            params = dict(trainer.model.named_parameters())
            done[kind] = {
                "history": trainer.state.log_history,
                "adapter": {n: p.detach().clone() for n, p in params.items() if p.requires_grad},
                "with_state": sum(1 for p in params.values() if trainer.optimizer.state.get(p)),
                "model": output / "model",
                "evaluate": trainer.evaluate(),
            }
        return done[kind]

    return results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_lora_pipeline_equals_trainer(
    pipeline_results: Path, trainer_results: Callable[[str], dict], case: str
) -> None:
    ranks = _ranks(pipeline_results / case)
    reference = trainer_results(case)
    assert len(logged_steps(reference["history"])) == STEPS
    assert_steps_close(ranks[0]["history"], reference["history"])
    assert_metrics_close(ranks[0]["evaluate"], reference["evaluate"], "evaluate()")

    # Every adapter weight once (no weight is shared across ranks), equal to Trainer's.
    adapter = {name: value for rank in ranks for name, value in rank["adapter"].items()}
    assert sum(len(rank["adapter"]) for rank in ranks) == len(adapter) == len(reference["adapter"])
    for name, value in reference["adapter"].items():
        torch.testing.assert_close(adapter[name], value, **TOLERANCE, msg=name)
    # B starts at zero: trained, every B moved (else the comparison above could hold for untrained adapters)
    assert all(value.abs().sum() > 0 for n, value in adapter.items() if "lora_B" in n)

    for rank in ranks:
        assert rank["frozen"] > 0 and rank["frozen_change"] == 0.0, "a frozen base weight changed"
        trainable = sorted(rank["adapter"])
        # Only the adapter has gradient buffers and optimizer state (AdamW: after the first step, each its own).
        assert rank["with_grad"] == trainable
        assert rank["in_optimizer"] == trainable
        assert rank["with_state"] == len(trainable)
    assert sum(rank["with_state"] for rank in ranks) == reference["with_state"] == len(reference["adapter"])

    _assert_same_saved_adapter(pipeline_results / case / "model", reference["model"], model_of(case))


def _config(folder: Path) -> dict:
    """``adapter_config.json``, its ``target_modules`` sorted (peft keeps them in a set: their order is a hash's)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    return {**config, "target_modules": sorted(config["target_modules"])}


def _assert_same_saved_adapter(saved: Path, expected: Path, kind: str) -> None:
    """The same files as Trainer's; equal tensors and config; PeftModel.from_pretrained loads it."""
    from peft import PeftModel

    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in expected.iterdir())
    assert _config(saved) == _config(expected)
    tensors, want = load_file(saved / ADAPTER), load_file(expected / ADAPTER)
    assert tensors.keys() == want.keys() and tensors
    for name, value in want.items():
        torch.testing.assert_close(tensors[name], value, **TOLERANCE, msg=name)
    loaded = PeftModel.from_pretrained(tiny_model(kind), saved)
    reloaded = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert len(reloaded) == len(want)
    for name, value in reloaded.items():
        stored = name.replace(".default", "")
        torch.testing.assert_close(value, want[stored], **TOLERANCE, msg=name)


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_run_resumed_from_its_adapter_checkpoint_ends_as_the_whole_run(pipeline_results: Path) -> None:
    checkpoint = pipeline_results / RESUMED / "checkpoint-2"
    assert (checkpoint / ADAPTER).is_file() and not (checkpoint / "model.safetensors").exists()
    whole, resumed = _ranks(pipeline_results / RESUMED), _ranks(pipeline_results / f"{RESUMED}-resumed")

    def after_checkpoint(history: list[dict]) -> list[dict]:  # a resumed run's history starts with the checkpoint's
        return [entry for entry in logged_steps(history) if entry["step"] > 2]

    assert len(after_checkpoint(whole[0]["history"])) == STEPS - 2
    assert_steps_close(after_checkpoint(resumed[0]["history"]), after_checkpoint(whole[0]["history"]))
    for done, again in zip(whole, resumed):
        for name, value in done["adapter"].items():
            torch.testing.assert_close(again["adapter"][name], value, **TOLERANCE, msg=name)
