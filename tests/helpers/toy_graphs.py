"""Hand-built CostGraphs and a round-number profile for the partition tests."""

from __future__ import annotations

import random

import networkx as nx
from hypothesis import strategies as st

from hf_ftpipe.costmodel import GPUProfile
from hf_ftpipe.graph.cost_graph import CostGraph, InputInfo, ParamInfo

# 1 FLOP/s and 1 B/s with no latency or efficiency discount: an op of f FLOPs takes f seconds
# forward (bytes_accessed is 0), a parameter-free op as long again backward, b bytes take b seconds.
UNIT = GPUProfile(
    name="unit",
    count=4,
    memory_bytes=10_000,
    peak_flops={"float32": 1.0},
    memory_bandwidth_bytes_per_s=1e12,
    link_bandwidth_bytes_per_s=1.0,
    link_latency_s=0.0,
    compute_efficiency=1.0,
    memory_efficiency=1.0,
)


def make_graph(
    nodes: dict[str, float | dict],
    edges: list[tuple[str, str]],
    *,
    params: dict[str, ParamInfo] | None = None,
    outputs: tuple[str, ...] | None = None,
    fingerprint: str = "toy-fingerprint",
) -> CostGraph:
    """Nodes in execution order: name → FLOPs, or → a dict of attributes to override."""
    graph = nx.DiGraph()
    for order, (name, spec) in enumerate(nodes.items()):
        attrs = {
            "order": order,
            "op": "aten.mm.default",
            "scope": "",
            "scope_types": (),
            "output_shapes": ((4,),),
            "output_dtypes": ("torch.float32",),
            "output_bytes": 16,
            "params": (),
            "batch_inputs": (),
            "flops": 0.0,
            "bytes_accessed": 0,
            "requires_grad": True,
        }
        attrs.update(spec if isinstance(spec, dict) else {"flops": float(spec)})
        graph.add_node(name, **attrs)
    for u, v in edges:
        graph.add_edge(u, v, bytes=graph.nodes[u]["output_bytes"])
    names = list(nodes)
    return CostGraph(
        graph=graph,
        params=params or {},
        inputs={"input_ids": InputInfo("input_ids", (2, 8), "torch.int64")},
        outputs=outputs if outputs is not None else (names[-1],),
        output_names=("loss",),
        model_class="ToyModel",
        fingerprint=fingerprint,
    )


def chain(flops: list[float], **kwargs) -> CostGraph:
    """n0 → n1 → ... with the given FLOPs."""
    names = [f"n{i}" for i in range(len(flops))]
    return make_graph(dict(zip(names, flops)), list(zip(names, names[1:])), **kwargs)


def param(name: str, shape: tuple[int, ...], *, trainable: bool = True, itemsize: int = 4) -> ParamInfo:
    numel = 1
    for size in shape:
        numel *= size
    return ParamInfo(name, (name,), shape, "torch.float32", numel * itemsize, trainable)


def random_dag(seed: int, num_ops: int) -> CostGraph:
    """A random DAG of ``num_ops`` ops from a seed, each reading one to three of the six before
    it, with FLOPs and output bytes from a few round values (many ties) and some shared weights."""
    rng = random.Random(seed)
    nodes: dict[str, dict] = {}
    params: dict[str, ParamInfo] = {}
    for i in range(num_ops):
        attrs: dict = {"flops": float(rng.choice([0, 1, 2, 2, 4, 4])), "output_bytes": rng.choice([0, 16, 16, 64])}
        if rng.random() < 0.3:
            name = f"w{rng.randrange(6)}"
            params[name] = param(name, (4, 4))
            attrs["params"] = (name,)
        nodes[f"op{i}"] = attrs
    edges = []
    for j in range(1, num_ops):
        earlier = range(max(0, j - 6), j)
        edges += [(f"op{i}", f"op{j}") for i in rng.sample(earlier, k=min(len(earlier), rng.choice([1, 1, 2, 3])))]
    return make_graph(nodes, edges, params=params)


@st.composite
def random_dags(draw, max_nodes: int = 12, max_stages: int = 3, multi_output: bool = True) -> CostGraph:
    """A random DAG in execution order: FLOPs, output and saved bytes, (shared) parameters, ops
    outside backward, now and then a multi-output op with its ``getitem`` parts, and maybe
    repeated blocks (scopes ``layers.<i>``) between a first and a last op."""
    n = draw(st.integers(max_stages, max_nodes))
    layer_size = draw(st.sampled_from([0, 1, 2, 3]))  # ops per repeated block; 0: no blocks
    params = {f"w{i}": param(f"w{i}", (draw(st.integers(1, 8)), 4), trainable=i != 2) for i in range(3)}
    nodes: dict[str, dict] = {}
    edges: list[tuple[str, str]] = []
    names: list[str] = []
    for i in range(n):
        name = f"op{i}"
        attrs = {
            "flops": float(draw(st.integers(0, 50))),
            "output_bytes": draw(st.integers(0, 40)),
            "saved_bytes": draw(st.integers(0, 60)),
            "params": tuple(sorted(draw(st.sets(st.sampled_from(sorted(params)), max_size=2)))),
            "requires_grad": draw(st.booleans()) or i > 0,
        }
        if layer_size and 0 < i < n - 1:
            attrs.update(scope=f"layers.{(i - 1) // layer_size}.mlp", scope_types=("Toy", "Block", "MLP"))
        producers = draw(st.sets(st.sampled_from(names), max_size=2)) if names else set()
        nodes[name] = attrs
        edges += [(u, name) for u in sorted(producers)]
        names.append(name)
        if multi_output and i < n - 1 and draw(st.integers(0, 5)) == 0:
            attrs["output_shapes"] = ((2,), (2,))
            for part in range(2):
                getitem = f"op{i}_part{part}"
                nodes[getitem] = {"op": "getitem", "flops": 0.0, "output_bytes": 8, "saved_bytes": 0}
                edges.append((name, getitem))
            names = [*names, f"op{i}_part0", f"op{i}_part1"]
            names.remove(name)  # later ops read the parts, never the tuple
    last = names[-1]
    for u in names[:-1]:
        if not any(e[0] == u for e in edges) and draw(st.booleans()):
            edges.append((u, last))
    return make_graph(nodes, edges, params=params, outputs=(last,))
