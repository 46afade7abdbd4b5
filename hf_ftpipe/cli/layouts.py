"""``hf-ftpipe compare --nodes N --gpus-per-node G`` (or ``--topology``): the P × D layouts of a cluster.

::

    hf-ftpipe compare gpt2-xl --gpu-profile a100-40gb --nodes 4 --gpus-per-node 8 \\
        --inter-node-link infiniband-100g --batch-size 1 --seq-len 1024 --num-microbatches 32 \\
        --schedule 1f1b --recompute

Every layout of D replicas of a P-GPU pipeline that fills the machines, planned and priced by
`hf_ftpipe.partitioners.layouts.compare_layouts`; ``--num-microbatches`` is the global mini-batch's.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_layout_arguments", "run_layouts", "topology_of"]


def add_layout_arguments(command: argparse.ArgumentParser) -> None:
    """The flags that turn ``compare`` into a comparison of P × D layouts."""
    from hf_ftpipe.costmodel.topology import BUILTIN_LINKS, BUILTIN_TOPOLOGIES

    group = command.add_argument_group("several machines (pipeline × data parallel layouts)")
    group.add_argument("--nodes", type=int, help="machines of --gpus-per-node GPUs of --gpu-profile each")
    group.add_argument("--gpus-per-node", type=int, help="with --nodes: GPUs per machine")
    group.add_argument(
        "--inter-node-link",
        default="ethernet-10g",
        choices=sorted(BUILTIN_LINKS),
        help="with --nodes: the network between machines (default: ethernet-10g, the safe side)",
    )
    group.add_argument(
        "--topology",
        help=f"a built-in topology ({', '.join(sorted(BUILTIN_TOPOLOGIES))}) or a JSON file (Topology.to_json), "
        "in place of --nodes",
    )


def topology_of(args: argparse.Namespace) -> Any:
    """The `Topology` the flags describe, or ``None`` when they ask for one machine's partitioners."""
    from hf_ftpipe.costmodel import get_profile
    from hf_ftpipe.costmodel.topology import Link, Topology, get_topology
    from hf_ftpipe.errors import PartitionError

    if args.topology and args.nodes:
        raise PartitionError("give --topology or --nodes with --gpus-per-node, not both")
    if args.topology:
        return get_topology(args.topology)
    if args.nodes is None:
        if args.gpus_per_node is not None:
            raise PartitionError("--gpus-per-node needs --nodes")
        return None
    if args.gpus_per_node is None or args.nodes < 1 or args.gpus_per_node < 1:
        raise PartitionError(
            f"--nodes needs --gpus-per-node, both at least 1 (got {args.nodes} and {args.gpus_per_node})"
        )
    gpu = get_profile(args.gpu_profile, count=1)
    inside = Link.of_profile(gpu)
    name = f"{gpu.name}-{args.nodes}x{args.gpus_per_node}"
    return Topology.uniform(
        name,
        gpu,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        intra_node=inside,
        inter_node=args.inter_node_link,
    )


def run_layouts(args: argparse.Namespace, topology: Any, graph: Any, options: dict[str, Any]) -> int:
    """Print every layout's predicted figures and the planner's choice (``--json``: a list of them)."""
    from hf_ftpipe.partitioners.layouts import best_layout, compare_layouts, format_layouts

    results = compare_layouts(graph, topology, time_budget_s=args.time_budget_s, **options)
    best = best_layout(results)
    rows = [{**r.to_dict(), "planner_choice": r is best} for r in results]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    runs: list[list[Any]] = []  # the first machine's GPUs, kind by kind: [[name, count], ...]
    for gpu in topology.nodes[0].gpus:
        if runs and runs[-1][0] == gpu.name:
            runs[-1][1] += 1
        else:
            runs.append([gpu.name, 1])
    print(
        f"{args.model} ({graph.model_class}) on {topology.name}: {len(topology.nodes)} machines, "
        f"{' + '.join(f'{n} × {name}' for name, n in runs)} in the first, {topology.inter_node.name} between; "
        f"{options['num_microbatches']} micro-batches of {options['microbatch_size']} per step, {options['schedule']}"
    )
    print(format_layouts(results, best))
    print(f"the planner chooses {best.layout}" if best else "no layout fits: see each one's reason")
    return 0
