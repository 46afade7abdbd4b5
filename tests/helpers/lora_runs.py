"""The runs compared in tests/trainer/test_lora.py: a tiny GPT-2 and T5 with LoRA adapters (``peft``),
trained by PipeTrainer (in lora_job.py, 2 ranks: GPT-2 under 1f1b, T5 under gpipe) or plain `Trainer` (in the test).

A case is ``"<model>-<schedule>"``. LoRA dropout is 0 so that the runs compare exactly; the
adapters' ``B`` starts at zero (peft's default), so the first step trains ``A`` not at all and
``B`` only: 4 steps train both. ``gpt2-1f1b`` also saves a checkpoint at step 2, and the job
resumes a second run from it (``RESUMED``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models import tiny_model
from parity_runs import make_data

CASES = ("gpt2-1f1b", "t5-gpipe")
RESUMED = "gpt2-1f1b"
"""The case that saves ``checkpoint-2``, and that a second run resumes from it (``<case>-resumed``)."""
STEPS = 4
TARGETS = {"gpt2": ["c_attn", "c_fc"], "t5": ["q", "v", "wi"]}
TASKS = {"gpt2": "CAUSAL_LM", "t5": "SEQ_2_SEQ_LM"}


def model_of(case: str) -> str:
    return case.split("-")[0]


def lora_model(kind: str) -> nn.Module:
    """The tiny ``kind`` model (seed 0) with LoRA adapters of rank 4 on ``TARGETS[kind]`` (seed 1)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_model(kind)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[kind], task_type=TASKS[kind])
    return get_peft_model(base, config)


def setup(case: str, output_dir: str, pipe: bool) -> dict[str, Any]:
    """Model, arguments and data of one run; ``pipe`` picks PipeTrainingArguments with the case's schedule."""
    from transformers import TrainingArguments

    from hf_ftpipe import PipeTrainingArguments

    kind, schedule = case.split("-")[:2]
    common = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=STEPS,
        optim="adamw_torch",
        learning_rate=3e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if case == RESUMED else "no",
        save_steps=2,
        report_to="none",
        seed=0,
        data_seed=0,
    )
    if pipe:
        args = PipeTrainingArguments(num_microbatches=2, pipeline_schedule=schedule, partitioner="params", **common)
    else:
        args = TrainingArguments(**common)
    return {
        "model": lora_model(kind),
        "args": args,
        "train_dataset": make_data(kind, 16, seed=1),
        "eval_dataset": make_data(kind, 6, seed=2),  # a short last batch
    }
