"""peft_models: what a `peft` model exports, and the methods PipeTrainer refuses with the reason."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
from peft import IA3Config, LoraConfig, PromptTuningConfig, get_peft_model

from hf_ftpipe.errors import TraceError
from hf_ftpipe.graph.peft_models import check_peft_model, export_target, naming_untested_peft, peft_version_note

from models import tiny_model


def test_a_lora_model_exports_the_model_holding_its_adapters() -> None:
    model = get_peft_model(tiny_model("gpt2"), LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    inner = export_target(model)
    assert inner is model.base_model.model and type(inner).__name__ == "GPT2LMHeadModel"
    assert any("lora_A" in name for name, _ in inner.named_parameters())
    plain = tiny_model("gpt2")
    assert export_target(plain) is plain


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2), "PROMPT_TUNING: .*virtual tokens change"),
        (IA3Config(task_type="CAUSAL_LM", target_modules=["c_attn"], feedforward_modules=[]), "IA3: .*not tested"),
        (LoraConfig(r=2, target_modules=["c_attn"], use_dora=True), "DoRA"),
    ],
)
def test_methods_not_tested_through_the_pipeline_are_refused_with_the_reason(config: object, message: str) -> None:
    model = get_peft_model(tiny_model("gpt2"), config)
    with pytest.raises(TraceError, match=message):
        check_peft_model(model)


def test_pipe_trainer_refuses_them_before_building_anything(tmp_path: Path) -> None:
    from hf_ftpipe import PipeTrainer, PipeTrainingArguments

    model = get_peft_model(tiny_model("gpt2"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    args = PipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(TraceError, match="PipeTrainer trains LoRA adapters only"):
        PipeTrainer(model=model, args=args)


def test_a_peft_release_outside_the_tested_range_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peft_version_note() == ""  # the installed one is tested
    monkeypatch.setattr(peft, "__version__", "0.13.0")
    note = peft_version_note()
    assert "peft 0.13.0 is outside the releases hf_ftpipe is tested with, peft>=0.21.2,<1" in note
    assert "hf_ftpipe[peft]" in note
    model = get_peft_model(tiny_model("gpt2"), LoraConfig(r=2, target_modules=["c_attn"]))
    with pytest.raises(TraceError, match=r"cannot trace X: it failed \(peft 0\.13\.0 is outside"):
        with naming_untested_peft(model):  # what a failing capture of this model raises through
            raise TraceError("cannot trace X: it failed")
