"""Frozen weights (a LoRA model's base) in the memory model: no gradient, no optimizer state, one version.

Hand-worked on a toy graph whose only difference is a weight's ``requires_grad``, then on a tiny
GPT-2 with LoRA adapters traced for real: its plan charges gradients and AdamW state for the
adapter's weights alone.
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_ftpipe.costmodel import estimate

from toy_graphs import UNIT, make_graph, param


def _graph(frozen: bool):
    """a (w1: 8 × 8) → b (w2: 8 × 8); w2 frozen or not, every node and activation the same."""
    params = {"w1": param("w1", (8, 8)), "w2": param("w2", (8, 8), trainable=not frozen)}
    nodes = {"a": {"flops": 1.0, "params": ("w1",)}, "b": {"flops": 1.0, "params": ("w2",)}}
    return make_graph(nodes, [("a", "b")], params=params)


def test_a_frozen_weight_has_no_gradient_and_no_optimizer_state():
    # Both stages on GPU 0 under gpipe: their backwards interleave, so gradients persist and are
    # charged in full. Freezing w2 (256 B) saves its gradient (256 B) and its AdamW moments (2 × 256 B).
    def gpu(frozen: bool):
        return estimate(_graph(frozen), {"a": 0, "b": 1}, [0, 0], UNIT, num_microbatches=2, microbatch_size=1).gpus[0]

    trained, lora = gpu(False), gpu(True)
    assert (trained.weights_bytes, trained.gradient_bytes, trained.optimizer_bytes) == (512, 512, 1024)
    assert (lora.weights_bytes, lora.gradient_bytes, lora.optimizer_bytes) == (512, 256, 512)
    assert lora.activation_bytes == trained.activation_bytes
    assert trained.memory_bytes - lora.memory_bytes == 256 + 2 * 256


def test_async_keeps_one_version_of_a_frozen_weight():
    # Stage 0 of 2 under async keeps two versions of its weights in flight; a frozen weight is
    # never updated, so never copied: one version, and no optimizer state (SGD: none anyway).
    def weights_bytes(frozen: bool) -> int:
        graph = make_graph(
            {"a": {"flops": 1.0, "params": ("w",)}, "b": 1.0},
            [("a", "b")],
            params={"w": param("w", (2, 2), trainable=not frozen)},
        )
        plan = estimate(graph, {"a": 0, "b": 1}, [0, 1], UNIT, num_microbatches=4, microbatch_size=1, schedule="async")
        return plan.gpus[0].weights_bytes

    assert (weights_bytes(False), weights_bytes(True)) == (2 * 16, 16)


@pytest.mark.slow
def test_lora_gpt2_plan_charges_the_adapter_alone():
    from hf_ftpipe.graph import trace_model
    from hf_ftpipe.partitioners import partition_seq_dp

    from lora_runs import lora_model
    from models import tiny_batch

    graph = trace_model(lora_model("gpt2"), tiny_batch("gpt2", 2))
    # n_embd 32, rank 4, on c_attn (32 → 96) and c_fc (32 → 128) of 2 layers:
    # lora_A 4 × 32 and lora_B 96 × 4, lora_A 4 × 32 and lora_B 128 × 4 per layer, float32.
    adapter_bytes = 2 * (4 * 32 + 96 * 4 + 4 * 32 + 128 * 4) * 4
    trainable = [info for info in graph.params.values() if info.requires_grad]
    assert sum(info.bytes for info in trainable) == adapter_bytes == 9216 and len(trainable) == 8
    profile = dataclasses.replace(UNIT, count=2, memory_bytes=10**9)
    plan = partition_seq_dp(graph, profile, num_microbatches=2, microbatch_size=2)
    gpus = plan.predicted.gpus
    assert sum(g.optimizer_bytes for g in gpus) == 2 * adapter_bytes  # AdamW: two moments of the adapter only
    assert sum(g.weights_bytes for g in gpus) >= graph.param_bytes() > 10 * adapter_bytes
    # Full fine-tuning of the same model would also charge the base weights' moments: 2 × 4 B × 29,568.
    assert graph.param_bytes(trainable_only=True) == adapter_bytes
    assert graph.param_bytes() - adapter_bytes == 29_568 * 4
