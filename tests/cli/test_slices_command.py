"""`hf-ftpipe slices` on a tiny GPT-2 config, offline: the table, the JSON, the latency file, and
the models token slicing refuses."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import huggingface_hub.constants
import pytest

from hf_ftpipe.cli import parser as cli
from hf_ftpipe.cli import slices as slices_command

TINY_GPT2 = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "n_positions": 128,
    "vocab_size": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
TINY_T5 = {
    "model_type": "t5",
    "architectures": ["T5ForConditionalGeneration"],
    "d_model": 16,
    "d_ff": 32,
    "d_kv": 8,
    "num_heads": 2,
    "num_layers": 1,
    "vocab_size": 64,
}
TINY_BERT = {
    "model_type": "bert",
    "architectures": ["BertForMaskedLM"],
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "vocab_size": 64,
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Config files of tiny models; offline, and each traced once for the module."""
    folder = tmp_path_factory.mktemp("configs")
    paths = {}
    deep = {**TINY_GPT2, "n_layer": 4}
    for name, config in (("gpt2", TINY_GPT2), ("gpt2-deep", deep), ("t5", TINY_T5), ("bert", TINY_BERT)):
        paths[name] = str(folder / f"{name}.json")
        Path(paths[name]).write_text(json.dumps(config))
    cache: dict = {}
    trace = slices_command._trace_causal

    def cached(args):
        key = (args.model, args.seq_len)
        if key not in cache:
            cache[key] = trace(args)
        return cache[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(slices_command, "_trace_causal", cached)
        yield paths


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_prints_the_chosen_slicing_against_unsliced_and_uniform(configs: dict[str, str]) -> None:
    code, out, err = run("slices", configs["gpt2"], "--seq-len", "64", "--gpus", "4", "--gpu-profile", "a100-80gb")
    assert code == 0, err
    lines = out.splitlines()
    assert "64 tokens × 1 on 4 stages of a100-80gb; latency from the cost model (its five-term fit" in lines[0]
    assert lines[1].split() == ["slicing", "slices", "step", "time", "(ms)", "vs", "unsliced"]
    names = [line.split("  ")[0].strip() for line in lines[3:8]]
    assert names == ["unsliced", "uniform 2", "uniform 4", "uniform 8", "TeraPipe DP"]
    assert lines[8] == "chosen slicing"


def test_json_is_one_object_whose_slices_add_up(configs: dict[str, str], tmp_path: Path) -> None:
    latency_file = tmp_path / "latency.json"
    argv = ["slices", configs["gpt2"], "--seq-len", "64", "--gpus", "2", "--gpu-profile", "a100-80gb"]
    code, out, err = run(*argv, "--batch-size", "2", "--json", "--save-latency", str(latency_file))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["model_class"] == "GPT2LMHeadModel" and summary["num_stages"] == 2
    chosen = summary["chosen"]
    assert sum(size for size, _ in chosen["microbatches"]) == 2
    assert all(sum(slices) == 64 for _, slices in chosen["microbatches"])
    assert [row["slicing"] for row in summary["rows"]][:2] == ["unsliced", "2 micro-batches of 1"]
    assert chosen["step_time_s"] <= min(row["step_time_s"] for row in summary["rows"]) * 1.001

    # The saved model reads back for the same setup, and is refused for another.
    code, again, err = run(*argv, "--batch-size", "2", "--json", "--latency", str(latency_file))
    assert code == 0, err
    from_file = json.loads(again)
    assert from_file["latency_source"] == f"{latency_file} (cost-model)"
    assert from_file["latency_fit"] == summary["latency_fit"]
    assert all(sum(slices) == 64 for _, slices in from_file["chosen"]["microbatches"])
    code, _, err = run(
        "slices",
        configs["gpt2"],
        "--seq-len",
        "64",
        "--gpus",
        "4",
        "--gpu-profile",
        "a100-80gb",
        "--latency",
        str(latency_file),
    )
    assert code == 2 and "fitted for another setup: key.num_stages is 2, expected 4" in err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("t5", "is an encoder-decoder (T5ForConditionalGeneration): token slicing needs a causal decoder"),
        ("bert", "is not a causal LM (BertForMaskedLM): token slicing needs a causal decoder"),
    ],
)
def test_refuses_models_whose_tokens_see_later_ones(configs: dict[str, str], model: str, message: str) -> None:
    code, out, err = run("slices", configs[model], "--seq-len", "16", "--gpus", "2", "--gpu-profile", "a100-80gb")
    assert code == 2 and out == ""
    assert message in err and "use micro-batches (`--num-microbatches`" in err and "Traceback" not in err


def test_a_length_off_the_step_says_what_to_change(configs: dict[str, str]) -> None:
    code, _, err = run("slices", configs["gpt2"], "--seq-len", "60", "--gpus", "2", "--gpu-profile", "a100-80gb")
    assert code == 2 and "--seq-len 60 is not a multiple of --step 8" in err


def test_measure_fits_this_machines_timings_and_the_file_reads_back(configs: dict[str, str], tmp_path: Path) -> None:
    latency_file = tmp_path / "measured.json"
    argv = ["slices", configs["gpt2"], "--seq-len", "64", "--gpus", "2", "--measure", "--json"]
    code, out, err = run(*argv, "--save-latency", str(latency_file))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["latency_source"].startswith("timings on this machine (cpu;")
    assert summary["latency_fit"]["source"] == "measured"
    assert sum(summary["chosen"]["microbatches"][0][1]) == 64
    # 8, 16 and 32 tokens after 0, 16, 32 or 48 of context: the 11 points within 64 tokens, 2 stages
    assert "timed 11 slices on 2 stages" in err
    # one layer cannot be cut on layer boundaries into 2 stages: the stages are timed whole
    assert "timing 2 of 2 stages (the others repeat one) at 11 (slice, context) points" in err
    code, out, err = run("slices", configs["gpt2"], "--seq-len", "64", "--gpus", "2", "--latency", str(latency_file))
    assert code == 0 and "latency from " + str(latency_file) + " (measured)" in out, err
    code, _, err = run(*argv, "--gpu-profile", "a100-80gb")
    assert code == 2 and "--measure times this machine" in err


def test_measure_makes_only_the_timed_blocks_weights(configs: dict[str, str]) -> None:
    # 4 layers on 2 stages: the embeddings, one layer and the head are timed; the model stays on meta.
    code, out, err = run("slices", configs["gpt2-deep"], "--seq-len", "64", "--gpus", "2", "--measure", "--json")
    assert code == 0, err
    assert "capturing GPT2LMHeadModel on the meta device for slices of 8, 16, 32 tokens" in err
    assert "(one graph for every length)" in err
    # wte 64×32 + wpe 128×32; a layer: 2 layer norms 2×64, c_attn 32×96 + 96, c_proj 32×32 + 32, c_fc 32×128 + 128,
    # c_proj 128×32 + 32 = 12704; ln_f 64 (lm_head is wte, made once): made 6144 + 12704 + 64 = 18912 of
    # 6144 + 4 × 12704 + 64 = 57024. The layer at all 11 points, the embeddings and head once per length (3).
    assert "timing 3 of 6 blocks (the others repeat one) at 11 (slice, context) points" in err
    assert ": 17 timings of 1 warm-up + 3 runs, on 18,912 of the model's 57,024 parameters" in err
    assert sum(json.loads(out)["chosen"]["microbatches"][0][1]) == 64
