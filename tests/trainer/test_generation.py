"""The generation driver on one process, over an eager twin of the model standing in for the pipeline:
``model.generate`` with the forward replaced equals ``model.generate`` itself (greedy, beams,
sampling), feeds T5's decoder tokens as labels and GPT-2's left-padded rows with their real tokens
first, and puts the model's own forward back. Through a real pipeline: test_parity.py and
test_any_batch.py (``PipeTrainer.generate``)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.cost_graph import InputInfo
from hf_ftpipe.trainer.generation import pipeline_generate

from generation_cases import CASES, generate_cases, prompts
from models import TARGET, tiny_model

CPU = torch.device("cpu")


def traced_inputs(kind: str, label_length: int | None = None) -> dict[str, InputInfo]:
    """What a pipeline traced on ``kind``'s training batches takes; ``label_length``: labels of that fixed length."""
    names = ["input_ids", "attention_mask", "labels"]
    inputs = {name: InputInfo(name, (4, 8), "int64", varying=(0, 1)) for name in names}
    if label_length is not None:
        inputs["labels"] = InputInfo("labels", (4, label_length), "int64", varying=(0,))
    return inputs


class Twin:
    """The pipeline's stand-in: a copy of the model, recording each batch it is fed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.batches = copy.deepcopy(model), []

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.batches.append({name: value.clone() for name, value in batch.items()})
        return self.model(**batch).logits


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
    with pytest.raises(PipelineError, match="`position_ids` other than each row's real tokens numbered from 0"):
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
