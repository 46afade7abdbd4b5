"""Topology: which GPUs share a machine, what joins them, and what each one is.

A `GPUProfile` describes a set of identical devices behind one kind of link, which is all a single
pipeline inside one box needs. Across machines that is no longer true: a stage boundary between two
GPUs of one node crosses NVLink or PCIe, one between nodes crosses InfiniBand or Ethernet, ten to a
hundred times slower, and an all-reduce of a stage's gradients over its replicas is as slow as the
slowest link of its ring. Clusters also grow over years, so one plan may span two generations of
cards. A `Topology` lists the nodes in rank order, each with its GPUs (a profile per GPU) and its
link, plus the link between nodes; the cost model asks it for the price of a transfer or an
all-reduce by where the ranks sit.

Ranks are numbered node by node, as ``torchrun``/``accelerate launch`` number them with
``--nnodes N --nproc_per_node G``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hf_ftpipe._strict_json import read_json, write_json
from hf_ftpipe.costmodel.checks import check_float, check_str
from hf_ftpipe.costmodel.profiles import BUILTIN_PROFILES, GPUProfile, get_profile
from hf_ftpipe.errors import ProfileError

__all__ = ["BUILTIN_LINKS", "BUILTIN_TOPOLOGIES", "Link", "Node", "Topology", "get_link", "get_topology"]

_JSON_VERSION = 1
_MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of connection between two GPUs: bandwidth per direction and the fixed cost of a message."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        check_str("name", self.name)
        try:  # the profile's own checks, named for this link
            check_float("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
            check_float("latency_s", self.latency_s, allow_zero=True)
        except ProfileError as error:
            raise ProfileError(f"link {self.name!r}: {error}") from None

    @classmethod
    def of_profile(cls, profile: GPUProfile) -> Link:
        """The link a `GPUProfile` describes between its devices (named after the profile)."""
        return cls(
            name=f"{profile.name}-link",
            bandwidth_bytes_per_s=profile.link_bandwidth_bytes_per_s,
            latency_s=profile.link_latency_s,
        )

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds to send ``num_bytes`` one way (nothing to send costs nothing)."""
        return 0.0 if num_bytes <= 0 else self.latency_s + num_bytes / self.bandwidth_bytes_per_s


# Achieved bandwidth per direction (REFERENCE.md, "Links"; network links at line rate / 8 less ~10%),
# and the rough start-up of one NCCL message over each.
BUILTIN_LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link(name="pcie3", bandwidth_bytes_per_s=12e9, latency_s=20e-6),
        Link(name="pcie4", bandwidth_bytes_per_s=24e9, latency_s=20e-6),
        Link(name="pcie5", bandwidth_bytes_per_s=48e9, latency_s=20e-6),
        Link(name="nvlink-v100", bandwidth_bytes_per_s=150e9, latency_s=10e-6),
        Link(name="nvlink-a100", bandwidth_bytes_per_s=300e9, latency_s=10e-6),
        Link(name="nvlink-h100", bandwidth_bytes_per_s=450e9, latency_s=10e-6),
        Link(name="ethernet-10g", bandwidth_bytes_per_s=1.1e9, latency_s=50e-6),
        Link(name="ethernet-25g", bandwidth_bytes_per_s=2.8e9, latency_s=30e-6),
        Link(name="ethernet-100g", bandwidth_bytes_per_s=11e9, latency_s=20e-6),
        Link(name="infiniband-100g", bandwidth_bytes_per_s=11e9, latency_s=5e-6),
        Link(name="infiniband-200g", bandwidth_bytes_per_s=22e9, latency_s=5e-6),
        Link(name="infiniband-400g", bandwidth_bytes_per_s=45e9, latency_s=5e-6),
        Link(name="loopback", bandwidth_bytes_per_s=5e9, latency_s=50e-6),  # gloo between CPU processes
    )
}


def get_link(spec: str | dict[str, Any] | Link) -> Link:
    """A built-in link by name, or one given as ``{"name", "bandwidth_bytes_per_s", "latency_s"}``."""
    if isinstance(spec, Link):
        return spec
    if isinstance(spec, str):
        if spec not in BUILTIN_LINKS:
            raise ProfileError(
                f"unknown link {spec!r}; use one of {sorted(BUILTIN_LINKS)} or give its figures as a dict"
            )
        return BUILTIN_LINKS[spec]
    if isinstance(spec, dict):
        expected = {"name", "bandwidth_bytes_per_s", "latency_s"}
        if set(spec) != expected:
            raise ProfileError(f"a link must have exactly the keys {sorted(expected)}, got {sorted(spec)}")
        return Link(**spec)
    raise ProfileError(f"a link is a name or a dict, got {type(spec).__name__} {spec!r}")


@dataclass(frozen=True, kw_only=True)
class Node:
    """One machine: its GPUs in local rank order (a profile each, ``count`` 1) and the link between them."""

    gpus: tuple[GPUProfile, ...]
    link: Link

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ProfileError("a node needs at least one GPU")
        object.__setattr__(self, "gpus", tuple(gpu.with_count(1) for gpu in self.gpus))


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The machines of a run in rank order and the link between machines."""

    name: str
    nodes: tuple[Node, ...]
    inter_node: Link

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError(f"a topology needs a non-empty `name`, got {self.name!r}")
        if not self.nodes:
            raise ProfileError(f"topology {self.name!r} has no nodes")
        object.__setattr__(self, "nodes", tuple(self.nodes))

    @classmethod
    def uniform(
        cls,
        name: str,
        gpu: str | GPUProfile,
        *,
        nodes: int,
        gpus_per_node: int,
        intra_node: str | Link,
        inter_node: str | Link,
    ) -> Topology:
        """``nodes`` identical machines of ``gpus_per_node`` GPUs each."""
        if nodes < 1 or gpus_per_node < 1:
            raise ProfileError(f"a topology needs nodes >= 1 and gpus_per_node >= 1, got {nodes} and {gpus_per_node}")
        node = Node(gpus=(get_profile(gpu),) * gpus_per_node, link=get_link(intra_node))
        return cls(name=name, nodes=(node,) * nodes, inter_node=get_link(inter_node))

    @classmethod
    def single_node(cls, profile: GPUProfile) -> Topology:
        """One box of ``profile.count`` GPUs behind the profile's own link: what a `GPUProfile` alone means."""
        link = Link.of_profile(profile)
        return cls(
            name=f"{profile.name}-x{profile.count}",
            nodes=(Node(gpus=(profile,) * profile.count, link=link),),
            inter_node=link,
        )

    @property
    def world_size(self) -> int:
        return sum(len(node.gpus) for node in self.nodes)

    @property
    def homogeneous(self) -> bool:
        """Every GPU of the same kind (the partitioners' single-profile case)."""
        first = self.nodes[0].gpus[0]
        return all(gpu == first for node in self.nodes for gpu in node.gpus)

    def node_of(self, rank: int) -> int:
        """The index of the node that holds ``rank``."""
        self._check_rank(rank)
        for index, node in enumerate(self.nodes):
            if rank < len(node.gpus):
                return index
            rank -= len(node.gpus)
        raise AssertionError("unreachable: _check_rank bounds the rank")

    def profile_of(self, rank: int) -> GPUProfile:
        """The GPU that ``rank`` runs on."""
        node = self.node_of(rank)
        first = sum(len(n.gpus) for n in self.nodes[:node])
        return self.nodes[node].gpus[rank - first]

    def link_between(self, a: int, b: int) -> Link | None:
        """What a message from rank ``a`` to rank ``b`` crosses (``None`` for the same rank)."""
        if a == b:
            self._check_rank(a)
            return None
        node_a, node_b = self.node_of(a), self.node_of(b)
        return self.nodes[node_a].link if node_a == node_b else self.inter_node

    def transfer_s(self, a: int, b: int, num_bytes: float) -> float:
        """Seconds to send ``num_bytes`` from rank ``a`` to rank ``b``."""
        link = self.link_between(a, b)
        return 0.0 if link is None else link.transfer_s(num_bytes)

    def allreduce_s(self, ranks: list[int] | tuple[int, ...], num_bytes: float) -> float:
        """Seconds for a ring all-reduce of ``num_bytes`` over ``ranks`` (a stage's replicas).

        A ring of n ranks sends 2(n − 1)/n of the buffer over each of its links in 2(n − 1) steps,
        all links at once, so it runs at the pace of its slowest link: the network between nodes
        as soon as the ring leaves one machine (NCCL's rings visit each node's GPUs together, so
        each node is entered and left once).
        """
        ranks = sorted(set(ranks))
        for rank in ranks:
            self._check_rank(rank)
        n = len(ranks)
        if n < 2 or num_bytes <= 0:
            return 0.0
        ring = [self.link_between(ranks[i], ranks[(i + 1) % n]) for i in range(n)]
        slowest = min((link for link in ring if link is not None), key=lambda link: link.bandwidth_bytes_per_s)
        latency = max(link.latency_s for link in ring if link is not None)
        return 2 * (n - 1) * latency + 2 * (n - 1) / n * num_bytes / slowest.bandwidth_bytes_per_s

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ProfileError(
                f"rank {rank!r} is not in topology {self.name!r}, whose ranks are 0..{self.world_size - 1}"
            )

    # -- files ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: runs of equal GPUs per node (a built-in by name), links in full."""
        nodes = []
        for node in self.nodes:
            groups: list[dict[str, Any]] = []
            for gpu in node.gpus:
                written = gpu.name if BUILTIN_PROFILES.get(gpu.name) == gpu else gpu.to_dict()
                if groups and groups[-1]["profile"] == written:
                    groups[-1]["count"] += 1
                else:
                    groups.append({"profile": written, "count": 1})
            nodes.append({"gpus": groups, "link": _link_dict(node.link)})
        return {"name": self.name, "nodes": nodes, "inter_node": _link_dict(self.inter_node)}

    @classmethod
    def from_dict(cls, data: object, where: str = "topology") -> Topology:
        """Build and validate a topology from plain data; GPUs and links may be built-in names."""
        data = _object(data, where, {"name", "nodes", "inter_node"})
        if not isinstance(data["nodes"], list):
            raise ProfileError(f"{where}: `nodes` must be a list of nodes, got {type(data['nodes']).__name__}")
        nodes = []
        for i, node in enumerate(data["nodes"]):
            node = _object(node, f"{where}: nodes[{i}]", {"gpus", "link"})
            if not isinstance(node["gpus"], list):
                raise ProfileError(f"{where}: nodes[{i}].gpus must be a list of {{'profile', 'count'}} objects")
            gpus: list[GPUProfile] = []
            for j, group in enumerate(node["gpus"]):
                group = _object(group, f"{where}: nodes[{i}].gpus[{j}]", {"profile", "count"})
                count = group["count"]
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise ProfileError(f"{where}: nodes[{i}].gpus[{j}].count must be a positive integer, got {count!r}")
                gpus += [_profile(group["profile"], f"{where}: nodes[{i}].gpus[{j}].profile")] * count
            nodes.append(Node(gpus=tuple(gpus), link=_named(get_link, node["link"], f"{where}: nodes[{i}].link")))
        inter = _named(get_link, data["inter_node"], f"{where}: inter_node")
        return cls(name=data["name"], nodes=tuple(nodes), inter_node=inter)

    def to_json(self, path: str | os.PathLike) -> None:
        write_json(path, {"format_version": _JSON_VERSION, **self.to_dict()})

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Topology:
        where = os.fspath(path)
        data = read_json(where, error=ProfileError, what="topology file", max_bytes=_MAX_FILE_BYTES)
        if isinstance(data, dict):
            version = data.pop("format_version", None)
            if version != _JSON_VERSION:
                raise ProfileError(
                    f"{where}: format_version {version!r}, this hf_ftpipe reads version {_JSON_VERSION}; "
                    "write the file with Topology.to_json or upgrade hf_ftpipe"
                )
        return cls.from_dict(data, where)


def _link_dict(link: Link) -> dict[str, Any]:
    return {"name": link.name, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}


def _object(data: object, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ProfileError(f"{where} must be an object with the keys {sorted(keys)}, got {type(data).__name__}")
    if set(data) != keys:
        missing, unknown = sorted(keys - set(data)), sorted(set(data) - keys)
        raise ProfileError(f"{where}: missing keys {missing}, unknown keys {unknown}; expected exactly {sorted(keys)}")
    return dict(data)


def _profile(spec: object, where: str) -> GPUProfile:
    if isinstance(spec, str) and spec.endswith(".json"):
        raise ProfileError(
            f"{where}: a topology file names built-in GPUs or holds a profile's fields, not a path ({spec!r})"
        )
    return _named(get_profile, spec, where)


def _named(resolve: Any, spec: object, where: str) -> Any:
    if not isinstance(spec, str | dict):
        raise ProfileError(f"{where} must be a built-in name or an object, got {type(spec).__name__} {spec!r}")
    try:
        return resolve(spec)
    except ProfileError as e:
        raise ProfileError(f"{where}: {e}") from e


BUILTIN_TOPOLOGIES: dict[str, Topology] = {
    topology.name: topology
    for topology in (
        # The two clusters: a training cluster and a lab's grown box pair.
        Topology.uniform(
            "a100-40gb-4x8",
            "a100-40gb",
            nodes=4,
            gpus_per_node=8,
            intra_node="nvlink-a100",
            inter_node="infiniband-100g",
        ),
        Topology.uniform(
            "rtx2080ti-2x8", "rtx2080ti", nodes=2, gpus_per_node=8, intra_node="pcie3", inter_node="ethernet-10g"
        ),
        Topology.uniform(
            "h100-2x8", "h100", nodes=2, gpus_per_node=8, intra_node="nvlink-h100", inter_node="infiniband-400g"
        ),
        Topology(
            name="rtx3090+rtx2080ti",  # one box, two generations of cards
            nodes=(
                Node(gpus=(get_profile("rtx3090"),) * 2 + (get_profile("rtx2080ti"),) * 2, link=BUILTIN_LINKS["pcie3"]),
            ),
            inter_node=BUILTIN_LINKS["ethernet-10g"],
        ),
    )
}


def get_topology(spec: str | os.PathLike | dict[str, Any] | Topology) -> Topology:
    """A built-in topology by name, a JSON file, a dict, or a topology."""
    if isinstance(spec, Topology):
        return spec
    if isinstance(spec, dict):
        return Topology.from_dict(spec)
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and spec.endswith(".json")):
        return Topology.from_json(spec)
    if isinstance(spec, str) and spec in BUILTIN_TOPOLOGIES:
        return BUILTIN_TOPOLOGIES[spec]
    raise ProfileError(
        f"unknown topology {spec!r}; use one of {sorted(BUILTIN_TOPOLOGIES)}, a JSON file (Topology.to_json), or a dict"
    )
