"""estimate / estimate_memory: the memory of a GPU (weights, gradients, optimizer state,
activations, weight versions, recomputation, token slices) on hand-computed examples."""

from __future__ import annotations

import pytest

from hf_ftpipe.costmodel import (
    MemoryOptions,
    TokenSlices,
    estimate,
    estimate_memory,
    in_flight,
    optimizer_state_bytes,
)
from hf_ftpipe.errors import PartitionError
from hf_ftpipe.graph.cost_graph import CostGraph

from toy_graphs import UNIT, chain, make_graph, param


def test_memory_gpipe_with_tied_weight_and_adamw():
    params = {"emb": param("emb", (10, 10)), "buf": param("buf", (5,), trainable=False)}
    graph = make_graph(
        {
            "e": {"flops": 1.0, "params": ("emb", "buf")},
            "m": 1.0,
            "head": {"flops": 1.0, "params": ("emb",)},
        },
        [("e", "m"), ("m", "head")],
        params=params,
    )
    # tied weight on two stages of GPU 0: stored once; GPU 1 has no weights. Every op saves its
    # 16 B output and every output leaves its stage (head's is the model's), so each stage keeps
    # 32 B per micro-batch, all 3 in flight; a backward works with 2 × 16 B.
    node_stage = {"e": 0, "m": 1, "head": 2}
    plan = estimate(graph, node_stage, [0, 1, 0], UNIT, num_microbatches=3, microbatch_size=1)
    gpu0 = plan.gpus[0]
    # GPU 0 runs two stages: under gpipe their backwards interleave, so the gradients persist
    assert (gpu0.weights_bytes, gpu0.gradient_bytes, gpu0.optimizer_bytes) == (420, 400, 800)
    assert gpu0.activation_bytes == 2 * 32 * 3 + 2 * 16
    assert gpu0.memory_bytes == 420 + 400 + 800 + 224 and gpu0.capacity_bytes == UNIT.memory_bytes
    assert plan.gpus[1].memory_bytes == 32 * 3 + 2 * 16
    # On two GPUs each keeps its copy. A stage alone under gpipe runs every forward before its
    # first backward: its gradients replace the activations the backward frees, and only what
    # they exceed those by counts (400 B of gradients against 32 B and 16 B saved), beside the
    # backward's working tensors.
    node_stage = {"e": 0, "m": 0, "head": 1}
    split = estimate_memory(graph, node_stage, [0, 1], num_microbatches=3, optimizer="sgd")
    assert split == [420 + (16 + 16 + 16) * 3 + 32 + (400 - 32), 400 + (16 + 16) * 3 + 32 + (400 - 16)]


def test_1f1b_holds_fewer_microbatches():
    graph = chain([1, 1, 1])
    plan = estimate(
        graph, {"n0": 0, "n1": 1, "n2": 2}, [0, 1, 2], UNIT, num_microbatches=8, microbatch_size=1, schedule="1f1b"
    )
    # per micro-batch: 16 B saved and the 16 B output kept; plus 2 × 16 B for the backward
    assert [g.activation_bytes for g in plan.gpus] == [32 * 3 + 32, 32 * 2 + 32, 32 * 1 + 32]
    assert in_flight("1f1b", 0, [0, 1, 2], 2) == 2 and in_flight("gpipe", 2, [0, 1, 2], 8) == 8


def test_stages_sharing_a_gpu_hold_what_they_hold_on_their_own_gpus():
    # Four stages of one op each, one 16 B weight, 16 B saved and its 16 B output kept per op;
    # async, SGD: gradients applied right after each backward (no more than what it frees).
    params = {f"w{i}": param(f"w{i}", (2, 2)) for i in range(4)}
    nodes = {f"n{i}": {"flops": 1.0, "params": (f"w{i}",)} for i in range(4)}
    graph = make_graph(nodes, [("n0", "n1"), ("n1", "n2"), ("n2", "n3")], params=params)
    node_stage = {f"n{i}": i for i in range(4)}
    args = {"num_microbatches": 8, "schedule": "async", "optimizer": "sgd"}
    # One stage per GPU: 4 3 2 1 micro-batches in flight and as many weight versions.
    alone = estimate_memory(graph, node_stage, [0, 1, 2, 3], **args)
    assert alone == [16 * k + 32 * k + 2 * 16 for k in (4, 3, 2, 1)]
    # GPUs [0, 1, 1, 0]: still 4 3 2 1 (the depth is in stages); GPU 0 = stages 0 and 3, which
    # run one backward at a time.
    mixed = estimate_memory(graph, node_stage, [0, 1, 1, 0], **args)
    assert mixed == [alone[0] + alone[3] - 32, alone[1] + alone[2] - 32]


def test_recompute_charges_a_gpu_one_stage_recomputed_at_a_time():
    # a → b → c → d, one stage each, on GPUs [0, 1, 1, 0]; 1F1B, 8 micro-batches: 4 3 2 1 in flight.
    graph = make_graph(
        {
            "a": {"flops": 1.0, "output_bytes": 10, "saved_bytes": 500},
            "b": {"flops": 1.0, "output_bytes": 20, "saved_bytes": 300},
            "c": {"flops": 1.0, "output_bytes": 30, "saved_bytes": 700},
            "d": {"flops": 1.0, "output_bytes": 40, "saved_bytes": 100},
        },
        [("a", "b"), ("b", "c"), ("c", "d")],
    )
    node_stage = {"a": 0, "b": 1, "c": 2, "d": 3}
    sizes = {"num_microbatches": 8, "microbatch_size": 1, "schedule": "1f1b"}
    plan = estimate(graph, node_stage, [0, 1, 1, 0], UNIT, **sizes, memory=MemoryOptions(recompute=True))
    # Each stage keeps its inputs and its output per micro-batch in flight (stage 0 reads only the
    # batch); the GPU runs one backward at a time, which recomputes one micro-batch of its stage
    # and works with twice its largest tensor: the largest of those, not the sum.
    kept = [(0 + 10) * 4, (10 + 20) * 3, (20 + 30) * 2, (30 + 40) * 1]
    backward = [500 + 2 * 10, 300 + 2 * 20, 700 + 2 * 30, 100 + 2 * 40]
    gpu0 = kept[0] + kept[3] + max(backward[0], backward[3])
    gpu1 = kept[1] + kept[2] + max(backward[1], backward[2])
    assert [g.activation_bytes for g in plan.gpus] == [gpu0, gpu1]
    # A stage alone still needs its own full micro-batch.
    assert [s.memory_bytes for s in plan.stages] == [k + b for k, b in zip(kept, backward)]
    # Without recomputation every stage keeps all it saves, per micro-batch in flight.
    plain = estimate(graph, node_stage, [0, 1, 1, 0], UNIT, **sizes)
    gpu0 = (500 + 10) * 4 + (100 + 40) * 1 + 2 * 40
    gpu1 = (300 + 20) * 3 + (700 + 30) * 2 + 2 * 30
    assert [g.activation_bytes for g in plain.gpus] == [gpu0, gpu1]


def test_async_stashes_weight_versions():
    params = {"w": param("w", (2, 2))}
    a = {"flops": 1.0, "params": ("w",)}
    graph = make_graph({"a": a, "b": 1.0}, [("a", "b")], params=params)
    plan = estimate(
        graph, {"a": 0, "b": 1}, [0, 1], UNIT, num_microbatches=4, microbatch_size=1, schedule="async", optimizer="sgd"
    )
    assert plan.gpus[0].weights_bytes == 2 * 16  # stage 0 of 2: two versions in flight


def test_optimizer_state():
    assert optimizer_state_bytes("sgd", (4, 4), 64) == 0
    assert optimizer_state_bytes("sgd-momentum", (4, 4), 64) == 64
    assert optimizer_state_bytes("adam", (4, 4), 64) == 128
    assert optimizer_state_bytes("adafactor", (100, 50), 20_000) == 600  # (100 + 50) × 4 B
    assert optimizer_state_bytes("adafactor", (7,), 28) == 28


def test_activations_are_saved_bytes_and_output_bytes_only_without_them():
    graph = make_graph(
        {"a": {"flops": 1.0, "output_bytes": 100, "saved_bytes": 7}, "b": {"flops": 1.0, "output_bytes": 5}},
        [("a", "b")],
    )
    plan = estimate(graph, {"a": 0, "b": 0}, [0], UNIT, num_microbatches=2, microbatch_size=1)
    # b has no saved_bytes: its output; b's output is the model's, kept too; a backward through b
    # works with twice a's 100 B output
    assert plan.gpus[0].activation_bytes == (7 + 5) * 2 + 5 * 2 + 2 * 100


def test_recompute_keeps_stage_inputs_per_microbatch_and_runs_forward_twice():
    # a → b → c, a → c; stage 0 = {a}, stage 1 = {b, c}; 1F1B with 4 micro-batches: stage 0
    # holds 2 in flight, stage 1 one.
    graph = make_graph(
        {
            "a": {"flops": 3.0, "output_bytes": 10, "saved_bytes": 50},
            "b": {"flops": 2.0, "output_bytes": 20, "saved_bytes": 60},
            "c": {"flops": 1.0, "output_bytes": 30, "saved_bytes": 70},
        },
        [("a", "b"), ("b", "c"), ("a", "c")],
    )
    sizes = {"num_microbatches": 4, "microbatch_size": 1, "schedule": "1f1b"}
    plain = estimate(graph, {"a": 0, "b": 1, "c": 1}, [0, 1], UNIT, **sizes)
    # each stage also keeps the output that leaves it; backward working tensors 2 × 10, 2 × 30
    assert [g.activation_bytes for g in plain.gpus] == [(50 + 10) * 2 + 20, (60 + 70 + 30) * 1 + 60]
    again = estimate(graph, {"a": 0, "b": 1, "c": 1}, [0, 1], UNIT, **sizes, memory=MemoryOptions(recompute=True))
    # stage 0 reads only the batch; stage 1 keeps a's output (once, though two ops read it)
    assert [g.activation_bytes for g in again.gpus] == [(0 + 10) * 2 + 50 + 20, (10 + 30) * 1 + (60 + 70) + 60]
    assert [s.backward_s for s in again.stages] == [3.0 + 3.0, 3.0 + 3.0]  # backward + forward again
    assert [g.compute_s for g in again.gpus] == [9.0, 9.0]
    assert again.ideal_step_time_s == 18.0 / UNIT.count


def test_async_with_gradient_accumulation_stashes_fewer_versions():
    params = {"w": param("w", (2, 2))}
    a = {"flops": 1.0, "params": ("w",)}
    graph = make_graph({"a": a, "b": 1.0, "c": 1.0}, [("a", "b"), ("b", "c")], params=params)
    args = {"num_microbatches": 8, "microbatch_size": 1, "schedule": "async", "optimizer": "sgd"}
    node_stage = {"a": 0, "b": 1, "c": 2}
    each = estimate(graph, node_stage, [0, 1, 2], UNIT, **args)
    grouped = estimate(graph, node_stage, [0, 1, 2], UNIT, **args, memory=MemoryOptions(gradient_accumulation_steps=2))
    assert each.gpus[0].weights_bytes == 3 * 16 and grouped.gpus[0].weights_bytes == 2 * 16


def test_estimate_memory_takes_memory_options():
    graph = make_graph({"a": {"flops": 1.0, "saved_bytes": 40}, "b": {"flops": 1.0, "saved_bytes": 40}}, [("a", "b")])
    plain = estimate_memory(graph, {"a": 0, "b": 1}, [0, 1], num_microbatches=3)
    again = estimate_memory(graph, {"a": 0, "b": 1}, [0, 1], num_microbatches=3, memory=MemoryOptions(recompute=True))
    # per micro-batch 40 B saved (recomputed: the stage's input) and the 16 B output; 2 × 16 B
    assert plain == [(40 + 16) * 3 + 32] * 2 and again == [16 * 3 + 40 + 32, (16 + 16) * 3 + 40 + 32]


def test_gradients_that_do_not_persist_count_beyond_the_activations_a_backward_frees():
    # a (a 400 B weight, 16 B saved) → b; async updates right after each backward, 1f1b keeps the
    # gradients for the whole step. Stage 0 holds 2 micro-batches (saved + kept output: 32 B each).
    params = {"w": param("w", (10, 10))}
    graph = make_graph({"a": {"flops": 1.0, "params": ("w",)}, "b": 1.0}, [("a", "b")], params=params)
    args = {"num_microbatches": 4, "microbatch_size": 1, "optimizer": "sgd"}
    streamed = estimate(graph, {"a": 0, "b": 1}, [0, 1], UNIT, schedule="async", **args).gpus[0]
    assert (streamed.weights_bytes, streamed.gradient_bytes) == (2 * 400, 0)  # two versions in flight
    assert streamed.activation_bytes == 32 * 2 + 2 * 16 + (400 - 16)  # the gradient beyond the 16 B it frees
    flushed = estimate(graph, {"a": 0, "b": 1}, [0, 1], UNIT, schedule="1f1b", **args).gpus[0]
    assert (flushed.weights_bytes, flushed.gradient_bytes) == (400, 400)
    assert flushed.activation_bytes == 32 * 2 + 2 * 16  # backward working tensors only


def test_a_loss_stage_keeps_the_logits_and_works_with_two_of_their_size():
    # logits (800 B, saved by nobody) → loss (scalar, saves 800 B of log-probabilities); the
    # model returns both. Its backward holds the gradients of the log-probabilities and of the
    # logits at once: on top of 800 saved + 800 kept logits + 4 B loss, 2 × 800.
    graph = make_graph(
        {
            "h": {"flops": 1.0, "output_bytes": 100},
            "logits": {"flops": 1.0, "output_bytes": 800, "saved_bytes": 100},
            "loss": {"flops": 1.0, "output_bytes": 4, "saved_bytes": 800},
        },
        [("h", "logits"), ("logits", "loss")],
        outputs=("loss", "logits"),
    )
    args = {"num_microbatches": 2, "optimizer": "sgd", "schedule": "async"}
    assert estimate_memory(graph, {"h": 0, "logits": 1, "loss": 1}, [0, 1], **args)[1] == (
        (100 + 800) + (800 + 4) + 2 * 800
    )


def _attention_layer_graph(length: int) -> CostGraph:
    """Stage 0: a fused q/k/v projection, views for q, k, v (batch 1, 4 heads, head size 2), one
    attention call with a boolean mask, an output projection sent on; stage 1: a head with the loss."""
    head = (1, 4, length, 2)  # 8·length floats = 32·length bytes

    def view(shape: tuple[int, ...]) -> dict:
        return {"op": "aten.view.default", "output_shapes": (shape,), "output_bytes": 32 * length, "saved_bytes": 0}

    nodes = {
        "qkv": {"output_shapes": ((1, length, 24),), "output_bytes": 96 * length, "saved_bytes": 10, "params": ("w0",)},
        "q": view(head),
        "k": view(head),
        "v": view(head),
        "mask": {
            "output_shapes": ((1, 1, length, length),),
            "output_dtypes": ("torch.bool",),
            "output_bytes": length * length,
            "saved_bytes": 0,
            "requires_grad": False,
        },
        "attn": {
            "op": "aten.scaled_dot_product_attention.default",
            "output_shapes": (head,),
            "output_bytes": 32 * length,
            "saved_bytes": 1000,  # what sdpa itself saves: PrefixAttention saves its own
        },
        "out": {"output_bytes": 32 * length, "saved_bytes": 32 * length},
        "loss": {"output_bytes": 4, "saved_bytes": 16 * length, "params": ("w1",)},
    }
    edges = [("qkv", "q"), ("qkv", "k"), ("qkv", "v"), ("q", "attn"), ("k", "attn"), ("v", "attn")]
    edges += [("mask", "attn"), ("attn", "out"), ("out", "loss")]
    return make_graph(nodes, edges, params={"w0": param("w0", (4, 24)), "w1": param("w1", (4, 4))})


def test_memory_of_token_slices_hand_computed():
    # One sequence of 8 tokens cut into slices [4, 4], gpipe, SGD, one stage per GPU.
    whole = _attention_layer_graph(8)
    node_stage = {"qkv": 0, "q": 0, "k": 0, "v": 0, "mask": 0, "attn": 0, "out": 0, "loss": 1}
    slices = TokenSlices(slice_lengths=(4, 4), graphs={4: _attention_layer_graph(4)}, node_stages={4: node_stage})
    predicted = estimate_memory(
        whole, node_stage, [0, 1], num_microbatches=1, optimizer="sgd", schedule="gpipe", token_slices=slices
    )
    # Stage 0, per 4-token slice: saved 10 (qkv) + 128 (out) + the query's storage, the whole fused
    # projection (96·4 = 384), and attention's output (128) and log-sum-exp (4 heads × 4 rows × 4
    # bytes = 64), instead of attention's 1000; plus `out`, kept until its gradient comes back
    # (128): 842. Both slices are in flight under gpipe: 1684. Keys and values of the
    # sequence, from the whole graph: 3 × 256 − the query's 256 = 512, and as much again for their
    # gradients during backward. The backward's working tensors: 2 × the largest operand (qkv's
    # 384); the gradients it creates (384) are fewer than the activations it frees: none extra.
    stage0 = 384 + 1684 + 512 + (2 * 384 + 512)
    # Stage 1, per slice: saved 64 + the loss kept (4) = 68, twice; working tensors 2 × 128.
    stage1 = 64 + 2 * 68 + 2 * 128
    assert predicted == [stage0, stage1]

    # Without slices the same stage keeps attention's own saved bytes and no key/value buffer.
    unsliced = estimate_memory(whole, node_stage, [0, 1], num_microbatches=1, optimizer="sgd", schedule="gpipe")
    assert unsliced[0] == 384 + (10 + 1000 + 256 + 256) + 2 * 768


def test_token_slices_need_a_graph_per_length():
    graph = _attention_layer_graph(4)
    with pytest.raises(PartitionError, match=r"slice lengths \[2\]"):
        TokenSlices(slice_lengths=(4, 2), graphs={4: graph}, node_stages={4: {}})


def test_a_split_backward_keeps_what_w_reads_for_the_micro_batches_awaiting_w():
    # n0 (weight w0) → n1 | n2 (weight w2), 16 B outputs; 2 stages on 2 GPUs, 4 micro-batches.
    # zb-h1 keeps min(M, S + 1) = 3 micro-batches between F and W; 1F1B's 2 and 1 hold activations,
    # so 1 and 2 await W. W reads a weighted op's inputs and its output's gradient: n0 16 B (its
    # input is the model's, no op's); n2 16 B + n1's 16 B. GPU 0: 1 × 16 B more, GPU 1: 2 × 32 B.
    # Linear layers: the split backward defers only products' weight gradients (`DEFERRED_PRODUCTS`).
    linear = "aten.linear.default"
    graph = make_graph(
        {
            "n0": {"flops": 1.0, "params": ("w0",), "op": linear},
            "n1": 1.0,
            "n2": {"flops": 1.0, "params": ("w2",), "op": linear},
        },
        [("n0", "n1"), ("n1", "n2")],
        params={"w0": param("w0", (2, 2)), "w2": param("w2", (2, 2))},
    )
    sizes = {"num_microbatches": 4, "microbatch_size": 1}
    plans = {
        schedule: estimate(graph, {"n0": 0, "n1": 0, "n2": 1}, [0, 1], UNIT, schedule=schedule, **sizes)
        for schedule in ("1f1b", "zb-h1", "interleaved-1f1b")
    }
    split = [g.activation_bytes for g in plans["zb-h1"].gpus]
    whole = [g.activation_bytes for g in plans["1f1b"].gpus]
    # Both GPUs peak before their first W of the step, when the products' weight gradients (16 B
    # each, charged with the weights) do not exist yet: 16 - 16 and 64 - 16.
    assert [a - b for a, b in zip(split, whole, strict=True)] == [0, 48]
    assert [g.activation_bytes for g in plans["interleaved-1f1b"].gpus] == whole  # one stage per GPU: 1F1B
