"""Topologies: where each rank sits, what its messages cross, and what an all-reduce costs there."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hf_ftpipe.costmodel.profiles import get_profile
from hf_ftpipe.costmodel.topology import BUILTIN_LINKS, BUILTIN_TOPOLOGIES, Link, Node, Topology, get_topology
from hf_ftpipe.errors import ProfileError

NVLINK = Link(name="fast", bandwidth_bytes_per_s=100.0, latency_s=1.0)
NETWORK = Link(name="slow", bandwidth_bytes_per_s=10.0, latency_s=2.0)


def two_by_two() -> Topology:
    return Topology.uniform("t", "a100-40gb", nodes=2, gpus_per_node=2, intra_node=NVLINK, inter_node=NETWORK)


def test_ranks_are_numbered_node_by_node_and_messages_cross_the_link_between_their_nodes() -> None:
    topology = two_by_two()
    assert topology.world_size == 4
    assert [topology.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert topology.link_between(0, 1) is NVLINK
    assert topology.link_between(1, 2) is NETWORK
    assert topology.link_between(3, 3) is None
    # latency + bytes / bandwidth: 1 + 500 / 100 inside a node, 2 + 500 / 10 between nodes
    assert topology.transfer_s(0, 1, 500) == pytest.approx(6.0)
    assert topology.transfer_s(3, 0, 500) == pytest.approx(52.0)
    assert topology.transfer_s(2, 2, 500) == 0.0
    assert topology.transfer_s(0, 1, 0) == 0.0


def test_a_ring_all_reduce_runs_at_its_slowest_link() -> None:
    topology = two_by_two()
    # Inside one node, 2 ranks: 2(n-1) = 2 steps of latency 1, and 2(n-1)/n = 1 buffer over 100 B/s.
    assert topology.allreduce_s([0, 1], 1000) == pytest.approx(2 * 1.0 + 1000 / 100)
    # Across nodes, 2 ranks: the same over the network.
    assert topology.allreduce_s([1, 2], 1000) == pytest.approx(2 * 2.0 + 1000 / 10)
    # 4 ranks over 2 nodes: 6 steps at the slower latency, 1.5 buffers over the network.
    assert topology.allreduce_s([0, 1, 2, 3], 1000) == pytest.approx(6 * 2.0 + 1.5 * 1000 / 10)
    assert topology.allreduce_s([2], 1000) == 0.0
    assert topology.allreduce_s([0, 2], 0) == 0.0


def test_a_box_with_two_generations_of_cards_knows_each_ranks_gpu() -> None:
    topology = BUILTIN_TOPOLOGIES["rtx3090+rtx2080ti"]
    assert not topology.homogeneous
    assert [topology.profile_of(r).name for r in range(4)] == ["rtx3090", "rtx3090", "rtx2080ti", "rtx2080ti"]
    assert topology.profile_of(0).memory_bytes == get_profile("rtx3090").memory_bytes
    assert BUILTIN_TOPOLOGIES["a100-40gb-4x8"].homogeneous


def test_a_topology_with_a_profile_per_rank_round_trips_through_json(tmp_path) -> None:
    # Kinds interleaved rank by rank, one of them not built in: each rank keeps its own GPU.
    own = replace(get_profile("l4"), name="my-l4", memory_bytes=20 * 2**30)
    topology = Topology(
        name="grown",
        nodes=(
            Node(gpus=(get_profile("rtx3090"), own, get_profile("rtx3090")), link=BUILTIN_LINKS["pcie4"]),
            Node(gpus=(get_profile("rtx2080ti"),), link=BUILTIN_LINKS["pcie3"]),
        ),
        inter_node=BUILTIN_LINKS["ethernet-25g"],
    )
    topology.to_json(tmp_path / "grown.json")
    back = Topology.from_json(tmp_path / "grown.json")
    assert back == topology
    assert [back.profile_of(r).name for r in range(4)] == ["rtx3090", "my-l4", "rtx3090", "rtx2080ti"]
    assert back.profile_of(1).memory_bytes == 20 * 2**30 and not back.homogeneous


def test_one_profile_is_one_box_behind_its_own_link() -> None:
    profile = get_profile("rtx2080ti", count=8)
    topology = Topology.single_node(profile)
    assert topology.world_size == 8
    assert topology.transfer_s(0, 7, 12e6) == pytest.approx(profile.link_latency_s + 12e6 / 12e9)


def test_the_issues_clusters_are_built_in() -> None:
    a100 = get_topology("a100-40gb-4x8")
    assert (a100.world_size, a100.nodes[0].link.name, a100.inter_node.name) == (32, "nvlink-a100", "infiniband-100g")
    lab = get_topology("rtx2080ti-2x8")
    assert (lab.world_size, lab.nodes[0].link.name, lab.inter_node.name) == (16, "pcie3", "ethernet-10g")
    # 100 Gb/s InfiniBand is ~27x slower than NVLink, 10 GbE ~11x slower than PCIe 3.0.
    assert BUILTIN_LINKS["nvlink-a100"].bandwidth_bytes_per_s / a100.inter_node.bandwidth_bytes_per_s > 20


def test_a_topology_file_round_trips_and_may_name_built_ins(tmp_path) -> None:
    for topology in BUILTIN_TOPOLOGIES.values():
        path = tmp_path / f"{topology.name}.json"
        topology.to_json(path)
        assert Topology.from_json(path) == topology
    written = json.loads((tmp_path / "rtx3090+rtx2080ti.json").read_text())
    assert written["nodes"][0]["gpus"] == [{"profile": "rtx3090", "count": 2}, {"profile": "rtx2080ti", "count": 2}]
    by_hand = {
        "name": "mine",
        "nodes": [{"gpus": [{"profile": "l4", "count": 4}], "link": "pcie4"}] * 3,
        "inter_node": "ethernet-25g",
    }
    topology = get_topology(by_hand)
    assert topology.world_size == 12 and topology.link_between(3, 4).name == "ethernet-25g"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"name": "x", "nodes": [], "inter_node": "pcie3"}, "has no nodes"),
        ({"name": "x", "nodes": [{"gpus": [], "link": "pcie3"}], "inter_node": "pcie3"}, "at least one GPU"),
        (
            {
                "name": "x",
                "nodes": [{"gpus": [{"profile": "tpu", "count": 1}], "link": "pcie3"}],
                "inter_node": "pcie3",
            },
            "nodes[0].gpus[0].profile: unknown GPU profile 'tpu'",
        ),
        (
            {"name": "x", "nodes": [{"gpus": [{"profile": "l4", "count": 0}], "link": "pcie3"}], "inter_node": "pcie3"},
            "count must be a positive integer, got 0",
        ),
        (
            {
                "name": "x",
                "nodes": [{"gpus": [{"profile": "l4", "count": 1}], "link": "carrier-pigeon"}],
                "inter_node": "pcie3",
            },
            "nodes[0].link: unknown link 'carrier-pigeon'",
        ),
        (
            {"name": "x", "nodes": [{"gpus": [{"profile": "l4", "count": 1}], "link": "pcie3"}]},
            "missing keys ['inter_node']",
        ),
        (
            {
                "name": "x",
                "nodes": [{"gpus": [{"profile": "l4", "count": 1}], "link": "pcie3"}],
                "inter_node": {"name": "n", "bandwidth_bytes_per_s": -1, "latency_s": 0},
            },
            "inter_node: link 'n': `bandwidth_bytes_per_s` must be a finite number > 0, got -1",
        ),
    ],
)
def test_a_bad_topology_names_what_is_wrong(data, message) -> None:
    with pytest.raises(ProfileError) as caught:
        Topology.from_dict(data)
    assert message in str(caught.value)


def test_a_corrupt_or_foreign_file_is_refused_with_its_path(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"name": "x", "nodes": [')
    with pytest.raises(ProfileError, match="not valid JSON"):
        Topology.from_json(path)
    path.write_text(json.dumps({"format_version": 9, **two_by_two().to_dict()}))
    with pytest.raises(ProfileError, match="format_version 9"):
        Topology.from_json(path)
    with pytest.raises(ProfileError, match="rank 4 is not in topology 't', whose ranks are 0..3"):
        two_by_two().node_of(4)


def test_nodes_hold_single_devices() -> None:
    node = Node(gpus=(get_profile("l4", count=4),), link=BUILTIN_LINKS["pcie4"])
    assert node.gpus[0].count == 1
