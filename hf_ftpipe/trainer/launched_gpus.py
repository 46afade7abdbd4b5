"""The GPUs a run was launched on, rank by rank: what ``gpu_profile`` names or each rank detects.

``gpu_profile="auto"`` asks every rank for its own device (`device_of_this_rank`) and gathers them,
so a box with two generations of cards, or machines bought years apart, is planned GPU by GPU: the
plan's profile per pipeline position (`hf_ftpipe.partitioners.layouts.pipeline_gpus`). A built-in
profile or a profile's JSON file means the same GPU on every rank; a topology, as ``hf-ftpipe compare
--topology`` takes it (a built-in name such as ``"rtx3090+rtx2080ti"`` or a JSON file), lists each
rank's GPU and the links, and must hold as many GPUs as processes were launched.

Without a topology, the machines are the launcher's: ``LOCAL_WORLD_SIZE`` processes per machine
(`hf_ftpipe.trainer.replicas.launched_gpus_per_node`), each machine's GPUs behind the first one's
own link, and the network between machines priced as 10 Gb/s Ethernet, the safe side (as ``compare``
assumes without ``--inter-node-link``; give a topology file for a faster one).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_ftpipe.costmodel import get_profile
from hf_ftpipe.costmodel.profiles import BUILTIN_PROFILES, GPUProfile, profile_for_device
from hf_ftpipe.costmodel.topology import BUILTIN_LINKS, BUILTIN_TOPOLOGIES, Link, Node, Topology, get_topology
from hf_ftpipe.errors import ProfileError
from hf_ftpipe.partitioners.layouts import pipeline_gpus
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.trainer.replicas import launched_gpus_per_node

__all__ = ["DeviceName", "device_of_this_rank", "launched_topology", "named_pipeline_profile"]

DeviceName = tuple[str, int] | None
"""A rank's device as ``(torch.cuda.get_device_name(), total memory bytes)``; None for a CPU rank."""

INTER_NODE_LINK = "ethernet-10g"


def device_of_this_rank(device: torch.device) -> DeviceName:
    """The name and memory of ``device`` (the rank's ``args.device``), or None for a CPU."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_name(index), int(torch.cuda.get_device_properties(index).total_memory)


def launched_topology(spec: str, watchdog: Watchdog, device: DeviceName) -> Topology:
    """The launched job's machines and GPUs, rank by rank, for ``gpu_profile=spec``; every rank must call it
    (``"auto"`` gathers each rank's ``device``, `device_of_this_rank`).

    Raises:
        `ProfileError`: ``spec`` names neither a profile nor a topology, or a topology of another size.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = launched_gpus_per_node(world)
    if spec.strip().lower() == "auto":
        devices: list[DeviceName] = [None] * world
        with watchdog.waiting("gathering every rank's GPU", collective=True):
            dist.all_gather_object(devices, device)
        gpus = [BUILTIN_PROFILES["cpu"] if d is None else profile_for_device(*d) for d in devices]
        return _machines("launched", gpus, per_node)
    topology = _named_topology(spec)
    if topology is None:
        gpu = get_profile(spec, count=1)
        return _machines(f"{gpu.name}-{world // per_node}x{per_node}", [gpu] * world, per_node)
    if topology.world_size != world:
        raise ProfileError(
            f"[rank {rank}] `gpu_profile={spec!r}` is a topology of {topology.world_size} GPUs, but {world} "
            f"processes were launched; launch {topology.world_size}, or give a topology with a GPU per process"
        )
    return topology


def named_pipeline_profile(spec: str, num_gpus: int) -> GPUProfile:
    """The profile one pipeline of ``num_gpus`` is planned for, read from ``gpu_profile=spec`` alone (no
    other rank asked): a topology's (`pipeline_gpus`), else the profile (``"auto"``: this rank's GPUs)."""
    topology = _named_topology(spec)
    return get_profile(spec, count=num_gpus) if topology is None else pipeline_gpus(topology, num_gpus)[0]


def _named_topology(spec: str) -> Topology | None:
    """The topology ``spec`` names (one parser: `get_topology`), or None when it names a GPU profile."""
    if spec in BUILTIN_TOPOLOGIES:
        return get_topology(spec)
    if not os.path.isfile(spec):
        if "+" in spec:  # looks like a topology: say which exist rather than "unknown GPU profile"
            raise ProfileError(
                f"`gpu_profile={spec!r}` is neither a GPU profile nor a built-in topology; use one of the "
                f"topologies {sorted(BUILTIN_TOPOLOGIES)}, a topology JSON file (Topology.to_json), or a GPU "
                f"profile such as {sorted(BUILTIN_PROFILES)[:4]}..."
            )
        return None
    try:
        return get_topology(os.fspath(spec))
    except ProfileError as as_topology:
        try:
            get_profile(spec)
        except ProfileError as as_profile:
            raise ProfileError(
                f"`gpu_profile={spec!r}` is neither a topology file ({as_topology}) nor a GPU profile file "
                f"({as_profile})"
            ) from None
        return None


def _machines(name: str, gpus: list[GPUProfile], per_node: int) -> Topology:
    nodes = []
    for first in range(0, len(gpus), per_node):
        mine = tuple(gpus[first : first + per_node])
        nodes.append(Node(gpus=mine, link=Link.of_profile(mine[0])))
    return Topology(name=name, nodes=tuple(nodes), inter_node=BUILTIN_LINKS[INTER_NODE_LINK])
