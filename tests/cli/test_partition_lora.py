"""`hf-ftpipe partition --lora-r` / `--lora-targets`: a LoRA model planned from a config, and the
mistakes in asking for one."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from hf_ftpipe.cli import parser as cli

from models import tiny_model

SETUP = ["--gpus", "2", "--gpu-profile", "rtx2080ti", "--batch-size", "2", "--seq-len", "8", "--json"]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_a_lora_plan_is_of_the_peft_model_a_script_makes(tmp_path: Path) -> None:
    """The class a causal LM's ``task_type="CAUSAL_LM"`` makes (it is part of the plan's key); what the
    plan charges for it: tests/costmodel/test_frozen_weights.py."""
    config = tmp_path / "tiny-gpt2.json"
    config.write_text(tiny_model("gpt2").config.to_json_string())
    argv = ["partition", str(config), *SETUP, "--partitioner", "seq-dp", "--lora-r", "4", "--lora-targets", "c_attn"]
    code, out, err = run(*argv)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["model_class"] == "PeftModelForCausalLM" and summary["num_gpus"] == len(summary["gpus"]) == 2


def test_lora_targets_without_a_rank_is_exit_status_2() -> None:
    code, out, err = run("partition", "gpt2-xl", *SETUP, "--lora-targets", "c_attn")
    assert code == 2 and out == "" and "--lora-targets needs --lora-r" in err


def test_lora_targets_the_model_lacks_are_exit_status_2_naming_them(tmp_path: Path) -> None:
    config = tmp_path / "tiny-gpt2.json"
    config.write_text(tiny_model("gpt2").config.to_json_string())
    code, out, err = run("partition", str(config), *SETUP, "--lora-r", "4", "--lora-targets", "q_proj")
    assert code == 2 and out == "", err
    assert "cannot put LoRA adapters on GPT2LMHeadModel" in err and "q_proj" in err and "--lora-targets" in err
