"""The generation driver on one process, over an eager twin of the model standing in for the pipeline:
``model.generate`` with the forward replaced equals ``model.generate`` itself (greedy, beams,
sampling), feeds T5's decoder tokens as labels and GPT-2's left-padded rows with their real tokens
first, and puts the model's own forward back. Through a real pipeline: test_parity.py and
test_any_batch.py (``PipeTrainer.generate``)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import DynamicCache

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import InputInfo
from hf_ftpipe.trainer.generation import pipeline_generate

from generation_cases import CASES, generate_cases, prompts
from models import TARGET, tiny_batch, tiny_model

CPU = torch.device("cpu")


def traced_inputs(kind: str, label_length: int | None = None) -> dict[str, InputInfo]:
    """What a pipeline traced on ``kind``'s training batches takes; ``label_length``: labels of that fixed length."""
    names = ["input_ids", "attention_mask", "labels"]
    inputs = {name: InputInfo(name, (4, 8), "int64", varying=(0, 1)) for name in names}
    if label_length is not None:
        inputs["labels"] = InputInfo("labels", (4, label_length), "int64", varying=(0,))
    return inputs


class EagerDecoder:
    """The stages' key/value cache's stand-in (`KVDecoder`'s contract): a copy of the model with a
    `DynamicCache`, recording the shapes of each call and the beam reorders."""

    def __init__(self, model: torch.nn.Module, rows: int, max_length: int) -> None:
        self.model, self.rows, self.max_length = copy.deepcopy(model), rows, max_length
        self.cache, self.seq_length, self.calls, self.kept = DynamicCache(), 0, [], []
        self.reorders, self.closed = 0, False

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int = 0
    ):
        assert (
            attention_mask.shape == (self.rows, self.seq_length + input_ids.shape[1])
            and input_ids.shape[0] == self.rows
        )
        self.calls.append(tuple(input_ids.shape))
        self.kept.append(logits_to_keep)
        cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **{cache_name: self.cache},
        )
        self.seq_length += input_ids.shape[1]
        return output.logits[:, -logits_to_keep:]  # 0: all

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self.cache.reorder_cache(beam_idx)
        self.reorders += 1

    def close(self) -> None:
        self.closed = True


class Twin:
    """The pipeline's stand-in: a copy of the model, recording each batch it is fed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.batches = copy.deepcopy(model), []

    def __call__(self, batch: dict[str, torch.Tensor], position: int | None = None) -> torch.Tensor:
        self.batches.append({name: value.clone() for name, value in batch.items()})
        logits = self.model(**batch).logits
        return logits if position is None else logits[:, position : position + 1]


def test_gpt2_decodes_through_the_stages_cache_one_token_a_step() -> None:
    model = tiny_model("gpt2").eval()
    decoders = []

    def decoder_for(rows: int, max_length: int) -> EagerDecoder:
        decoders.append(EagerDecoder(model, rows, max_length))
        return decoders[-1]

    expected = generate_cases("gpt2", model.generate)
    twin = Twin(model)
    got = generate_cases(
        "gpt2", lambda **kw: pipeline_generate(model, twin, traced_inputs("gpt2"), CPU, decoder_for, **kw)
    )
    for name in [*CASES, "after_sampling"]:
        assert torch.equal(got[name], expected[name]), name
    # whole sequences only for the `uncached` case (2 beams of 3 prompts); the others through the cache
    assert twin.batches and {b["input_ids"].shape[0] for b in twin.batches} == {6}
    greedy, beams, sampling = decoders
    assert (greedy.rows, greedy.max_length, beams.rows, sampling.rows) == (3, 6 + 5, 3 * 3, 3)
    assert greedy.calls == [(3, 6)] + [(3, 1)] * 4  # the prompt, then one token a step (the 5th ends it)
    assert set(greedy.kept) == {1}  # generate reads the last position's logits only: only they cross ranks
    assert beams.reorders == len(beams.calls) and all(d.closed for d in decoders)  # after every step


@pytest.mark.parametrize("kind", ["t5", "gpt2"])
def test_generate_through_the_driver_equals_generate(kind: str) -> None:
    model = tiny_model(kind).eval()
    expected = generate_cases(kind, model.generate)
    twin = Twin(model)
    got = generate_cases(kind, lambda **kw: pipeline_generate(model, twin, traced_inputs(kind), CPU, **kw))
    for name in [*CASES, "after_sampling"]:
        assert torch.equal(got[name], expected[name]), name
    assert got["beams"].shape[0] == 6 and len({tuple(r) for r in got["sampling"].tolist()}) > 1
    assert "forward" not in model.__dict__  # the model's own forward again


def test_t5_decoder_tokens_are_fed_as_labels_padded_to_a_fixed_length() -> None:
    model = tiny_model("t5").eval()
    twin = Twin(model)
    generated = pipeline_generate(
        model, twin, traced_inputs("t5", TARGET), CPU, **prompts("t5"), max_new_tokens=TARGET, eos_token_id=None
    )
    assert generated.shape == (3, 1 + TARGET)  # the decoder start token, then 4 tokens
    assert [tuple(b["labels"].shape) for b in twin.batches] == [(3, TARGET)] * TARGET
    # step 3 saw labels [y1, y2, pad, pad]: their right shift is [start, y1, y2, pad], the tokens so far
    assert twin.batches[2]["labels"].tolist() == [[*row[1:3].tolist(), 0, 0] for row in generated]
    assert torch.equal(twin.batches[0]["input_ids"], prompts("t5")["input_ids"])
    with pytest.raises(PipelineError, match="traced with labels of length 4, so it can feed the decoder at most 4"):
        pipeline_generate(model, twin, traced_inputs("t5", TARGET), CPU, **prompts("t5"), max_new_tokens=TARGET + 1)
    assert "forward" not in model.__dict__


def test_gpt2_rows_are_fed_with_their_real_tokens_first() -> None:
    model = tiny_model("gpt2").eval()
    twin = Twin(model)
    batch = prompts("gpt2")
    pipeline_generate(model, twin, traced_inputs("gpt2"), CPU, **batch, max_new_tokens=1)
    fed = twin.batches[0]
    assert fed["attention_mask"].tolist() == [[1] * 6, [1] * 5 + [0], [1] * 3 + [0] * 3]
    assert fed["input_ids"][2, :3].tolist() == batch["input_ids"][2, 3:].tolist()


def test_positions_a_graph_without_position_ids_cannot_take_are_refused() -> None:
    model = tiny_model("gpt2").eval()
    batch = prompts("gpt2")
    with pytest.raises(
        PipelineError, match="generate numbers some tokens at other positions than the count of real tokens"
    ):
        pipeline_generate(
            model,
            Twin(model),
            traced_inputs("gpt2"),
            CPU,
            **batch,
            max_new_tokens=1,
            position_ids=torch.arange(6).expand(3, 6),
        )
    assert "forward" not in model.__dict__


def test_a_training_batch_as_seq2seq_trainer_passes_it_generates_as_generate_does() -> None:
    """`Seq2SeqTrainer.prediction_step` on a decoder-only model: ``generate(**batch)`` with the labels and the
    collator's right padding (the tokens returned begin with the prompt); through the stages' cache, which
    takes generate's positions as they are."""
    model = tiny_model("gpt2").eval()
    batch = tiny_batch("gpt2", 3)  # row 0 right-padded by 2, labels -100 there
    with torch.no_grad():
        expected = model.generate(**batch, max_length=12, num_beams=2)
        got = pipeline_generate(
            model,
            Twin(model),
            traced_inputs("gpt2"),
            CPU,
            lambda r, n: EagerDecoder(model, r, n),
            **batch,
            max_length=12,
            num_beams=2,
        )
    assert torch.equal(got, expected) and torch.equal(got[:, :8], batch["input_ids"])


def test_a_t5_the_stages_cannot_cache_generates_without_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager attention: `check_cacheable` refuses it (as `EncoderDecoderKV` would), and generate warns and runs
    every step on the whole decoder prefix instead, as one process does."""
    from hf_ftpipe.runtime.decoding_stages import check_cacheable
    from hf_ftpipe.trainer import generation

    model = tiny_model("t5").eval()
    model.config._attn_implementation = "eager"
    warnings = []
    monkeypatch.setattr(generation.logger, "warning", lambda message, *args: warnings.append(message % args))
    twin = Twin(model)
    settings = {"max_new_tokens": 3, "do_sample": False}
    got = pipeline_generate(
        model, twin, traced_inputs("t5"), CPU, lambda rows, length: check_cacheable(model), **prompts("t5"), **settings
    )
    assert torch.equal(got, model.generate(**prompts("t5"), **settings))
    assert len(twin.batches) == got.shape[1] - 1  # a whole forward per new token
    assert warnings == [
        "generating without a key/value cache (each new token reruns the whole sequence): T5ForConditionalGeneration "
        "runs attention with 'eager'; the pipeline's key/value cache replaces each scaled_dot_product_attention call, "
        'so load the model with `attn_implementation="sdpa"`, or generate without the pipeline\'s key/value cache '
        "(every new token then runs the whole prefix again)"
    ]
