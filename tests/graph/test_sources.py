"""Models for planning: shipped short names offline, folders, config files, Hub ids; sample inputs."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import transformers

from hf_ftpipe.errors import TraceError
from hf_ftpipe.graph.sources import load_model_for_planning, sample_inputs_for, shipped_models

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_positions": 32, "n_embd": 16, "n_layer": 2, "n_head": 2}


def test_shipped_configs_are_the_copies_in_partitions_configs() -> None:
    shipped = ROOT / "hf_ftpipe" / "model_configs"
    visible = ROOT / "partitions" / "configs"
    assert shipped_models() == ["bert-large", "gpt2-xl", "t5-3b"]
    assert sorted(p.name for p in visible.glob("*.json")) == sorted(p.name for p in shipped.glob("*.json"))
    for path in shipped.glob("*.json"):
        assert path.read_bytes() == (visible / path.name).read_bytes(), f"{path.name} differs; copy it over"


@pytest.mark.parametrize(
    ("name", "model_class", "params_b"),
    [
        ("t5-3b", "T5ForConditionalGeneration", 2.85),
        ("gpt2-xl", "GPT2LMHeadModel", 1.56),
        ("bert-large", "BertForQuestionAnswering", 0.335),
    ],
)
def test_shipped_names_build_the_papers_models_on_meta_offline(
    monkeypatch: pytest.MonkeyPatch, name: str, model_class: str, params_b: float
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = load_model_for_planning(name)
    assert type(model).__name__ == model_class
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(params_b, rel=0.02)


def test_a_folder_or_a_config_file_names_the_model(tmp_path: Path) -> None:
    config = transformers.T5Config(d_model=16, d_ff=32, d_kv=8, num_heads=2, num_layers=1, vocab_size=64)
    config.architectures = ["T5ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    assert type(load_model_for_planning(str(tmp_path))).__name__ == "T5ForConditionalGeneration"
    assert type(load_model_for_planning(str(tmp_path / "config.json"))).__name__ == "T5ForConditionalGeneration"


def test_without_architectures_the_task_or_the_config_picks_the_head(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(TINY_GPT2))
    assert type(load_model_for_planning(str(path))).__name__ == "GPT2LMHeadModel"  # decoder-only: causal LM
    classifier = load_model_for_planning(str(path), task="sequence-classification")
    assert type(classifier).__name__ == "GPT2ForSequenceClassification"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing-config.json", "no such config file 'missing-config.json'"),
        ("someone/some-model", "cannot find model 'someone/some-model' offline"),
    ],
)
def test_unknown_models_name_the_ones_that_work_offline(monkeypatch: pytest.MonkeyPatch, spec: str, message: str):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TraceError) as error:
        load_model_for_planning(spec)
    assert message in str(error.value)
    assert "bert-large, gpt2-xl, t5-3b" in str(error.value)


def test_a_file_that_is_no_config_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "hf_ftpipe.partition"}))
    with pytest.raises(TraceError, match="is not a model config"):
        load_model_for_planning(str(path))


def _shapes(inputs: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    assert all(t.is_meta and t.dtype == torch.long for t in inputs.values())
    return {name: tuple(t.shape) for name, t in inputs.items()}


def test_sample_inputs_carry_the_labels_each_head_needs() -> None:
    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=16, num_layers=1, num_heads=2))
        gpt2 = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k != "model_type"})
        )
        bert_config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
        qa = transformers.BertForQuestionAnswering(bert_config)
        classifier = transformers.BertForSequenceClassification(bert_config)
    assert _shapes(sample_inputs_for(t5, 4, 512, 4)) == {"input_ids": (4, 512), "labels": (4, 4)}
    assert _shapes(sample_inputs_for(gpt2, 1, 32)) == {"input_ids": (1, 32), "labels": (1, 32)}
    assert _shapes(sample_inputs_for(qa, 2, 8, attention_mask=True)) == {
        "input_ids": (2, 8),
        "attention_mask": (2, 8),
        "start_positions": (2,),
        "end_positions": (2,),
    }
    assert _shapes(sample_inputs_for(classifier, 2, 8)) == {"input_ids": (2, 8), "labels": (2,)}
    with pytest.raises(TraceError, match="longer than GPT2LMHeadModel allows"):
        sample_inputs_for(gpt2, 1, 33)
