"""The GPUs a run plans for: each rank's own device gathered under ``gpu_profile="auto"`` (gloo ranks that
report given device names, as ``torch.cuda.get_device_name`` spells them), a topology named in
``gpu_profile``, and the per-position profiles they give one pipeline's plan and its key."""

from __future__ import annotations

from hf_ftpipe.costmodel.topology import get_topology
from hf_ftpipe.errors import ProfileError
from hf_ftpipe.partitioners.layouts import pipeline_gpus
from hf_ftpipe.runtime.watchdog import Watchdog
from hf_ftpipe.trainer.launched_gpus import launched_topology

from distributed import run_ranks, values_or_raise

GIB = 2**30
DEVICES = [("NVIDIA GeForce RTX 3090", 24 * GIB), ("NVIDIA GeForce RTX 2080 Ti", 11 * GIB), None]
"""What each rank reports: two generations of cards and a CPU rank."""


def _gather(rank: int, world_size: int) -> dict:
    watchdog = Watchdog(rank, world_size, 60.0, run_id="launched-gpus")
    topology = launched_topology("auto", watchdog, device=DEVICES[rank])
    profile, gpus = pipeline_gpus(topology, world_size)
    errors = []
    for spec in ("rtx3090+rtx2080ti", "rtx3090+h100"):  # a built-in topology of 4 GPUs; none of that name
        try:
            launched_topology(spec, watchdog, DEVICES[rank])
        except ProfileError as error:
            errors.append(str(error))
    return {
        "ranks": [(gpu.name, gpu.memory_bytes) for gpu in (topology.profile_of(r) for r in range(world_size))],
        "nodes": len(topology.nodes),
        "profile": (profile.name, profile.count, profile.memory_bytes),
        "positions": [gpu.name for gpu in gpus or ()],
        "errors": errors,
    }


def test_auto_gathers_each_ranks_own_gpu_and_plans_a_profile_per_position() -> None:
    results = values_or_raise(run_ranks(_gather, 3))
    got = results[0]
    for rank, result in enumerate(results):  # the same GPUs on every rank; errors named by rank
        assert result | {"errors": None} == got | {"errors": None}, f"rank {rank} disagrees"
        assert result["errors"][0].startswith(f"[rank {rank}] ")
    cpu_memory = got["ranks"][2][1]
    assert got["ranks"] == [("rtx3090", 24 * GIB), ("rtx2080ti", 11 * GIB), ("cpu", cpu_memory)]  # memory measured
    assert got["nodes"] == 1  # no LOCAL_WORLD_SIZE: one machine
    # One pipeline of the 3: named position by position (the plan's cache and Hub key), the least memory.
    assert got["profile"] == ("rtx3090x1+rtx2080tix1+cpux1", 3, min(11 * GIB, cpu_memory))
    assert got["positions"] == ["rtx3090", "rtx2080ti", "cpu"]
    wrong_size, unknown = got["errors"]
    assert "`gpu_profile='rtx3090+rtx2080ti'` is a topology of 4 GPUs, but 3 processes were launched" in wrong_size
    assert "launch 4, or give a topology with a GPU per process" in wrong_size
    assert "'rtx3090+h100'` is neither a GPU profile nor a built-in topology" in unknown
    assert "'rtx3090+rtx2080ti'" in unknown  # the topologies there are


def test_a_topology_string_gives_each_position_its_gpu_and_the_replicas_the_weakest() -> None:
    topology = get_topology("rtx3090+rtx2080ti")  # what gpu_profile="rtx3090+rtx2080ti" plans for on 4 processes
    profile, gpus = pipeline_gpus(topology, 4)  # 4 x 1
    assert (profile.name, profile.count) == ("rtx3090x2+rtx2080tix2", 4)
    assert [gpu.name for gpu in gpus] == ["rtx3090", "rtx3090", "rtx2080ti", "rtx2080ti"]
    profile, gpus = pipeline_gpus(topology, 2)  # 2 x 2: each position over a 3090 and a 2080 Ti
    assert (profile.name, gpus) == ("min(rtx3090,rtx2080ti)", None)
    assert profile.memory_bytes == topology.profile_of(3).memory_bytes


def test_one_kind_of_gpu_plans_one_uniform_pipeline() -> None:
    """GPUs of one kind plan as one profile, keyed by its own name, behind the slowest link it crosses."""
    topology = get_topology("rtx2080ti-2x8")
    profile, gpus = pipeline_gpus(topology, 8)
    assert (profile.name, profile.count, gpus) == ("rtx2080ti", 8, None)
    profile, _ = pipeline_gpus(topology, 16)  # spans both machines: its boundaries at the network's pace
    assert profile.link_bandwidth_bytes_per_s == topology.inter_node.bandwidth_bytes_per_s
