"""What a GPU holds while it trains, term by term: the rules every memory figure follows.

Plans are priced by ``estimate`` (finished stages), ``seq_dp`` (candidate stages, from tables) and
``mixed`` (blocks while they are assigned, atoms while they move). Each computes the same
per-stage terms from these rules and combines them the same way, so that a plan's figure does not
depend on which of them made it. For a GPU::

    weights × versions + optimizer state + gradients that persist      (each tensor once per GPU)
    + Σ over its stages  kept per micro-batch × micro-batches in flight (``in_flight``)
    + max over its stages  what one backward adds while it runs        (``backward_bytes``)

A split backward (``zb-h1``, ``zbv``) also keeps, for each micro-batch whose ``B`` ran and ``W``
has not (``awaiting_weight_gradients`` of them), what its ``W`` reads (``weight_gradient_bytes``).

Kept per micro-batch until its backward: what autograd saves (``saved_bytes``) and the values
that leave the stage (``kept_output_bytes``: the runtime holds every value it sends, and the
model's outputs, until the backward that reads their gradients). With recomputation the saved
part is replaced by the stage's inputs, and the backward recomputes one micro-batch's saved
activations in full.

A backward adds its working tensors (the gradient arriving at an op and the one leaving it: twice
the largest tensor an op of the stage handles, ``operand_bytes``) and, where gradients do not
persist (``gradients_persist``), the gradients it creates beyond the activations it frees.
A GPU runs one backward at a time, so only the largest of its stages counts.

Checked against the runtime (``benchmarks/runtime.py``, GPT-2 8 layers, d_model 256, 2 stages,
4 micro-batches of 2, SGD; peak tensor bytes per rank): the last stage's backward starts with the
loss's gradient, two tensors the size of the logits, on top of the kept logits and every saved
activation, while its gradients, applied at once under ``async``, never all coexist with them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hf_ftpipe.graph.cost_graph import CostGraph
from hf_ftpipe.schedules.rules import awaiting_weight_gradients, gradients_persist, in_flight, weight_versions

__all__ = [
    "StageRules",
    "attention_nodes",
    "DEFERRED_PRODUCTS",
    "backward_bytes",
    "defers_weight_gradient",
    "kept_output_bytes",
    "kv_buffer_bytes",
    "largest_operand_bytes",
    "operand_bytes",
    "optimizer_state_bytes",
    "saved_bytes",
    "sliced_saved_bytes",
    "stage_rules",
    "weight_gradient_bytes",
    "weight_versions_of",
    "weights_only_w_computes",
]

_ATTENTION_OP = "aten.scaled_dot_product_attention"
_VIEW_OPS = frozenset(
    (
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "permute",
        "t",
        "split",
        "split_with_sizes",
        "getitem",
        "select",
        "slice",
        "unsqueeze",
        "squeeze",
        "expand",
        "alias",
        "unflatten",
        "as_strided",
        "contiguous",
    )
)
"""Ops whose output shares its input's storage (``contiguous`` of a contiguous tensor included)."""


def weight_versions_of(requires_grad: bool, is_buffer: bool, versions: int) -> int:
    """How many versions of one weight a stage keeping ``versions`` holds.

    A frozen parameter (``requires_grad=False``: a LoRA model's base weights) is never updated, so
    no update copies it while a micro-batch still reads it (`hf_ftpipe.runtime.versions` copies on
    write): one version under every schedule. Buffers are charged as trainable weights are, as
    before frozen weights were planned for (a few bytes in the models we plan).
    """
    return versions if requires_grad or is_buffer else 1


def optimizer_state_bytes(optimizer: str, shape: tuple[int, ...], num_bytes: int) -> int:
    """Optimizer state of one trainable tensor of ``shape`` taking ``num_bytes``.

    SGD keeps none, momentum one buffer, Adam(W) two (first and second moments). Adafactor (as in
    transformers, without first moment) keeps a row and a column vector per matrix — factored
    second moments, ``(rows + cols) / (rows × cols)`` of the tensor — and a full vector for 1-D
    tensors.
    """
    if optimizer == "sgd":
        return 0
    if optimizer == "sgd-momentum":
        return num_bytes
    if optimizer in ("adam", "adamw"):
        return 2 * num_bytes
    numel = 1
    for size in shape:
        numel *= size
    if len(shape) < 2 or numel == 0:
        return num_bytes
    rows, cols = shape[-2], shape[-1]
    return num_bytes * (rows + cols) // (rows * cols)


def saved_bytes(graph: CostGraph, node: str) -> int:
    """Activation bytes ``node`` keeps per micro-batch: ``saved_bytes``, else ``output_bytes``
    (hand-built graphs)."""
    attrs = graph.node(node)
    value = attrs.get("saved_bytes")
    return attrs["output_bytes"] if value is None else value


def kept_output_bytes(graph: CostGraph, nodes: Iterable[str], node_stage: Mapping[str, int]) -> int:
    """Bytes of a stage's values that leave it: read by another stage, or outputs of the model.

    The runtime keeps each of them per micro-batch until the backward that reads its gradient.
    """
    outputs = set(graph.outputs)
    total = 0
    for node in nodes:
        stage = node_stage[node]
        if node in outputs or any(node_stage[v] != stage for v in graph.graph.successors(node)):
            total += graph.node(node)["output_bytes"]
    return total


def operand_bytes(graph: CostGraph, node: str) -> int:
    """The largest tensor a backward through ``node`` handles: its output or an input, among those
    that carry a gradient."""
    sizes = [graph.node(node)["output_bytes"]] if graph.node(node)["requires_grad"] else []
    sizes += [graph.node(u)["output_bytes"] for u in graph.graph.predecessors(node) if graph.node(u)["requires_grad"]]
    return max(sizes, default=0)


def largest_operand_bytes(graph: CostGraph, nodes: Iterable[str]) -> int:
    """The largest ``operand_bytes`` of ``nodes`` (0 for none)."""
    return max((operand_bytes(graph, n) for n in nodes), default=0)


DEFERRED_PRODUCTS = ("aten.linear", "aten.addmm")
"""The ops whose weight gradient a split backward defers to ``W`` (`hf_ftpipe.runtime.split_backward`
swaps exactly these where their weight is a parameter); every other op's gradients come in ``B``."""


def defers_weight_gradient(graph: CostGraph, node: str) -> bool:
    """Whether ``node`` is a product whose weight gradient waits for ``W``: a `DEFERRED_PRODUCTS` op
    with a trainable matrix among its parameters (a layer norm's or an embedding's weight trains in ``B``)."""
    if not str(graph.node(node)["op"]).startswith(DEFERRED_PRODUCTS):
        return False
    params = (graph.params[name] for name in graph.node(node)["params"] if name in graph.params)
    return any(info.requires_grad and len(info.shape) >= 2 for info in params)


def weights_only_w_computes(graph: CostGraph) -> set[str]:
    """The trainable weights every reader of which is a product that defers its weight gradient
    (`defers_weight_gradient`): their gradients come from ``W`` alone, so they do not exist before
    the first ``W`` of a step on the stage that holds every reader."""
    only_deferred: dict[str, bool] = {}
    for n in graph.graph.nodes:
        defers = defers_weight_gradient(graph, n)
        for name in graph.node(n)["params"]:
            only_deferred[name] = only_deferred.get(name, True) and defers
    trainable = {name for name, info in graph.params.items() if info.requires_grad}
    return {name for name, only in only_deferred.items() if only} & trainable


def weight_gradient_bytes(graph: CostGraph, nodes: Iterable[str]) -> int:
    """What a split backward keeps of one micro-batch between its ``B`` and its ``W``: for every
    product that defers its weight gradient (`defers_weight_gradient`), the gradient of its output
    (the size of the output) and its input x (dW = gᵀ·x), an input read by several products once.

    ``B`` frees the rest of the micro-batch's activations, and computes the gradients of every other
    weight (layer norms, embeddings, biases). A linear layer of 4 tokens × 8 features in and 16
    out, float32: 4·8·4 + 4·16·4 = 384 bytes.
    """
    total, inputs = 0, set()
    for node in nodes:
        if defers_weight_gradient(graph, node):
            total += graph.node(node)["output_bytes"]
            inputs.update(graph.graph.predecessors(node))
    return total + sum(graph.node(u)["output_bytes"] for u in inputs)


@dataclass(frozen=True)
class StageRules:
    """What the schedule makes a stage keep: `in_flight`, `weight_versions`, `gradients_persist`,
    and `awaiting_weight_gradients` (micro-batches whose ``W`` is still to run beside those in flight)."""

    in_flight: int
    versions: int
    persist: bool
    awaiting_weights: int = 0


def stage_rules(
    schedule: str,
    stage_index: int,
    stage_device: Sequence[int],
    num_microbatches: int,
    *,
    gradient_accumulation_steps: int = 1,
    recompute: bool = False,
) -> StageRules:
    """The schedule rules of one stage, for the memory models that each need them all."""
    return StageRules(
        in_flight=in_flight(schedule, stage_index, stage_device, num_microbatches),
        awaiting_weights=awaiting_weight_gradients(schedule, stage_index, stage_device, num_microbatches),
        versions=weight_versions(
            schedule,
            stage_index,
            stage_device,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
        ),
        persist=gradients_persist(
            schedule,
            stage_index,
            stage_device,
            num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
            recompute=recompute,
        ),
    )


def backward_bytes(*, persist: bool, largest_operand: int, gradients: int, saved: int, recomputed: int) -> int:
    """What one backward of a stage adds to what its GPU holds, while it runs.

    Its working tensors, the gradient arriving at an op and the one it passes on: twice the
    largest ``operand_bytes`` of the stage (a loss over logits: the gradients of the
    log-probabilities and of the logits). Where gradients do not persist, also the gradients it
    creates beyond the activations it frees: once the first backward of a step is done they stay
    for the next one, which starts with all its activations and needs its working tensors.

    Args:
        persist: ``gradients_persist`` for the stage (then its gradients are charged with the
            weights, not here).
        largest_operand: the largest ``operand_bytes`` of the stage's ops.
        gradients: bytes of the stage's trainable parameters (its gradients, once each).
        saved: the saved activations of one micro-batch, which the backward frees as it goes.
        recomputed: under recomputation the saved activations it rebuilds first, else 0.
    """
    created = 0 if persist else max(0, gradients - saved)
    return recomputed + 2 * largest_operand + created


# -- token slices (TeraPipe): `hf_ftpipe.runtime.prefix_attention` ----------------------------


def attention_nodes(graph: CostGraph, nodes: Iterable[str]) -> list[str]:
    """The ``scaled_dot_product_attention`` calls among ``nodes``: what a sliced stage replaces."""
    return [n for n in nodes if str(graph.node(n)["op"]).startswith(_ATTENTION_OP)]


def _qkv_inputs(graph: CostGraph, node: str) -> list[str]:
    """An attention call's query, key and value: its floating inputs ending in the head size (not the mask)."""
    head = graph.node(node)["output_shapes"][0][-1]
    return [
        u
        for u in graph.graph.predecessors(node)
        if graph.node(u)["output_shapes"]
        and graph.node(u)["output_shapes"][0][-1] == head
        and not str(graph.node(u)["output_dtypes"][0]).startswith("bool")
    ]


def _storage_bytes(graph: CostGraph, node: str) -> int:
    """Bytes of the storage behind ``node``'s output: up through views to the op that made it."""
    while _op_name(graph, node) in _VIEW_OPS:
        producers = list(graph.graph.predecessors(node))
        if len(producers) != 1:
            break
        node = producers[0]
    return graph.node(node)["output_bytes"]


def _op_name(graph: CostGraph, node: str) -> str:
    op = str(graph.node(node)["op"])  # "aten.view.default", "<built-in function getitem>"
    if op.startswith("aten."):
        return op.split(".")[1]
    return "getitem" if "getitem" in op else op


def kv_buffer_bytes(graph: CostGraph, nodes: Iterable[str]) -> int:
    """One sequence's keys and values on a stage: ``SequenceKV``'s buffers for its attention layers.

    Read from the whole-sequence graph: each call's key and value inputs, (batch, kv_heads,
    seq_len, head_dim) each, so 2 × layers × batch × kv_heads × seq_len × head_dim × dtype bytes
    in all (the query, the size of the call's output, is left out). The gradient buffers a
    sequence gets at its first backward are the same size again.
    """
    return sum(
        sum(graph.node(u)["output_bytes"] for u in _qkv_inputs(graph, n)) - graph.node(n)["output_bytes"]
        for n in attention_nodes(graph, nodes)
    )


def sliced_saved_bytes(graph: CostGraph, nodes: Iterable[str]) -> int:
    """What one token slice of a stage keeps until its backward, from the slice-length graph.

    ``saved_bytes`` of every op, but for attention: ``PrefixAttention`` saves the slice's query,
    which keeps alive the storage it is a view of (GPT-2's fused q/k/v projection: three times the
    query), and its output and log-sum-exp for the CPU flash kernel's backward (elsewhere it
    recomputes them, so this counts them for a GPU too, by the size of one output); its keys and
    values live in the sequence's buffer (`kv_buffer_bytes`).
    """
    nodes = list(nodes)
    attention = set(attention_nodes(graph, nodes))
    total = sum(saved_bytes(graph, n) for n in nodes if n not in attention)
    for n in attention:
        total += max((_storage_bytes(graph, u) for u in _qkv_inputs(graph, n)), default=0)
        total += graph.node(n)["output_bytes"] + _logsumexp_bytes(graph, n)
    return total


def _logsumexp_bytes(graph: CostGraph, node: str) -> int:
    """The flash kernel's log-sum-exp of an attention call: one value per query row and head, in
    float32 (float64 for float64 inputs)."""
    shape = graph.node(node)["output_shapes"][0]
    rows = math.prod(shape[:-1])
    return rows * (8 if str(graph.node(node)["output_dtypes"][0]).endswith("float64") else 4)
