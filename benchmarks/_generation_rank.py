"""One runner of ``benchmarks/generation.py``: time ``generate`` for each number of new tokens.

``pipeline_cache`` and ``pipeline_no_cache`` run on 2 ranks started by torchrun (one torch thread
each), ``single_process`` on this one process (``--single-process-threads``, 1 by default)::

    torchrun --standalone --nproc_per_node 2 benchmarks/_generation_rank.py CONFIG RUNNER RESULT
    python benchmarks/_generation_rank.py CONFIG single_process RESULT

``CONFIG`` is the JSON `generation.py` writes (model size, prompts, lengths, repeats); rank 0 (or the
one process) writes the timings and the generated tokens to ``RESULT`` (JSON).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import transformers
from datasets import Dataset


def build_model(config: dict[str, Any]) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if config["model"] == "t5":
        t5_config = transformers.T5Config(
            vocab_size=config["vocab"],
            d_model=config["d_model"],
            d_ff=4 * config["d_model"],
            d_kv=config["d_model"] // config["heads"],
            num_layers=config["layers"],
            num_decoder_layers=config["layers"],
            num_heads=config["heads"],
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        return transformers.T5ForConditionalGeneration(t5_config).eval()  # sdpa attention by default
    model_config = transformers.GPT2Config(
        vocab_size=config["vocab"],
        n_positions=config["prompt_length"] + max(config["new_tokens"]) + 8,
        n_embd=config["d_model"],
        n_layer=config["layers"],
        n_head=config["heads"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(model_config).eval()  # sdpa attention by default


def prompts(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Prompts of ``prompt_length`` tokens, each row one real token shorter than the one before: padded on
    the left for GPT-2, on the right (the encoder's source) for T5."""
    rows, length = config["rows"], config["prompt_length"]
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, config["vocab"], (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        if config["model"] == "t5":
            attention_mask[row, length - row :] = 0
        else:
            attention_mask[row, :row] = 0
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


def timed(generate: Any, config: dict[str, Any]) -> dict[str, Any]:
    """``generate`` once untimed (building what it builds on first use), then each length ``repeats`` times."""
    batch = prompts(config)
    settings = {"do_sample": False, "num_beams": 1}
    generate(**batch, max_new_tokens=4, min_new_tokens=4, **settings)
    figures: dict[str, Any] = {}
    for new_tokens in config["new_tokens"]:
        seconds, tokens = [], None
        for _ in range(config["repeats"]):
            started = time.perf_counter()
            tokens = generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **settings)
            seconds.append(time.perf_counter() - started)
        figures[str(new_tokens)] = {
            "seconds": seconds,
            "median_s": statistics.median(seconds),
            "tokens": tokens.tolist(),
        }
    return figures


def pipeline(config: dict[str, Any], use_cache: bool) -> dict[str, Any] | None:
    import torch.distributed as dist

    from hf_ftpipe import PipeTrainer, PipeTrainingArguments

    torch.set_num_threads(1)
    model = build_model(config)
    batch = prompts(config)
    rows = [  # T5's targets: the source again (a length the plan covers; only the shapes matter here)
        {"input_ids": ids, "attention_mask": mask, "labels": ids} for ids, mask in zip(*batch.values(), strict=True)
    ]
    with tempfile.TemporaryDirectory() as folder:
        args = PipeTrainingArguments(
            output_dir=folder,
            use_cpu=True,
            per_device_train_batch_size=config["rows"],
            num_microbatches=config["microbatches"],
            partitioner="seq-dp",
            plan_max_length=config["prompt_length"] + max(config["new_tokens"]),  # without the cache: whole sequences
            report_to="none",
            save_strategy="no",
        )
        trainer = PipeTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
        figures = timed(lambda **kw: trainer.generate(**kw, use_cache=use_cache), config)
        figures["stages"] = trainer.partition.stage_device if trainer.partition is not None else None
    return figures if dist.get_rank() == 0 else None


def single_process(config: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(config["single_process_threads"])
    model = build_model(config)
    with torch.no_grad():
        return timed(model.generate, config)


def main(config_path: str, runner: str, result: str) -> None:
    logging.disable(logging.WARNING)
    transformers.logging.set_verbosity_error()
    with open(config_path) as file:
        config = json.load(file)
    if runner == "single_process":
        figures = single_process(config)
    else:
        figures = pipeline(config, use_cache=runner == "pipeline_cache")
    if figures is not None:
        with open(result, "w") as file:
            json.dump(figures, file)
    if runner != "single_process":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(*sys.argv[1:])
