"""slicing: `WholeSequences` and `TokenSlicing` answer the executor's and `StepInputs`' questions alike."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_ftpipe.errors import PipelineError
from hf_ftpipe.graph.token_slices import capture_token_slices
from hf_ftpipe.runtime import build_stage_module, plan_stages
from hf_ftpipe.runtime.slicing import WholeSequences
from hf_ftpipe.runtime.state import MicrobatchState
from hf_ftpipe.runtime.step_inputs import StepInputs
from hf_ftpipe.runtime.token_slicing import TokenSlicing

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sliced_model():
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (1, 32))  # one micro-batch
    sliced = capture_token_slices(model, {"input_ids": ids, "labels": ids.clone()}, [4, 8, 4, 16], dynamic=False)
    whole = sliced.full
    node_stage = dict.fromkeys(whole.cost_graph.topological_order(), 0)  # one stage: slicing, not placement
    specs = plan_stages(whole.cost_graph, node_stage)
    modules = {0: build_stage_module(whole.graph_module, specs[0], whole.canonical_names, whole.tensors, CPU)}
    return sliced, TokenSlicing(sliced, specs, node_stage, modules, CPU)


def _inputs(sliced, slicing) -> StepInputs:
    graph = sliced.full.cost_graph
    return StepInputs(graph, sliced.full.shapes, values=[], sizes=[], num_microbatches=2, device=CPU, slicing=slicing)


def _microbatches() -> list[dict[str, torch.Tensor]]:
    ids = torch.arange(64).reshape(2, 32) % 64
    return [{"input_ids": ids[m : m + 1], "labels": ids[m : m + 1].clone()} for m in range(2)]


def test_whole_sequences_is_one_unit_per_microbatch_on_its_own_stages():
    whole = WholeSequences()
    microbatch = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
    assert whole.num_slices == 1
    assert [whole.unit(5, None), whole.unit(5, 0)] == [5, 5]
    assert whole.variant(None) is None
    assert whole.split(5, microbatch)[0] is microbatch and whole.evaluation_inputs(microbatch) is microbatch
    assert whole.begin_batches([microbatch]) is None


def test_token_slices_key_units_by_microbatch_and_slice_and_a_whole_action_by_its_microbatch(sliced_model):
    _, slicing = sliced_model
    assert slicing.begin_batches(_microbatches()) == 4
    assert [slicing.unit(2, i) for i in (None, 0, 3)] == [2, 8, 11]
    assert slicing.variant(None) is None  # an evaluation runs whole sequences on the planned stages
    assert slicing.variant(0) is slicing.variant(2) is not slicing.variant(1)  # lengths 4, 4 and 8
    with pytest.raises(PipelineError, match=r"\[16, 32\] tokens"):
        slicing.begin_batches([{"input_ids": torch.zeros(1, 16)}, {"input_ids": torch.zeros(1, 32)}])


def test_step_inputs_store_each_unit_with_its_weight(sliced_model):
    sliced, slicing = sliced_model
    for cut, lengths in ((WholeSequences(), [32, 32]), (slicing, [4, 8, 4, 16] * 2)):
        state = MicrobatchState(actions_per_microbatch=2)
        inputs = _inputs(sliced, cut)
        inputs.begin_slices(_microbatches())
        assert inputs.store(state, _microbatches(), first=0, weights=[0.25, 0.75]) == len(lengths)
        assert [state.data[u]["input_ids"].shape[1] for u in sorted(state.data)] == lengths
        assert [state.loss_weight[u] for u in sorted(state.data)] == [0.25] * (len(lengths) // 2) + [0.75] * (
            len(lengths) // 2
        )
