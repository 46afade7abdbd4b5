"""`hf-ftpipe compare --nodes N --gpus-per-node G`: every P × D layout of a cluster, on a tiny GPT-2."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from transformers import GPT2Config

from hf_ftpipe.cli import parser as cli
from hf_ftpipe.costmodel.topology import Topology

SETUP = [
    "--batch-size",
    "1",
    "--seq-len",
    "16",
    "--num-microbatches",
    "4",
    "--schedule",
    "1f1b",
    "--time-budget-s",
    "2",
]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt2") / "config.json"
    GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=128, n_positions=32).to_json_file(path)
    return str(path)


def test_every_layout_of_two_machines_is_priced_and_the_fastest_chosen(tiny_gpt2: str) -> None:
    cluster = [
        "--gpu-profile",
        "a100-40gb",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--inter-node-link",
        "ethernet-10g",
    ]
    code, out, _ = run("compare", tiny_gpt2, *cluster, *SETUP, "--json")
    assert code == 0
    rows = json.loads(out)
    assert [row["layout"] for row in rows] == ["1x4", "2x2", "4x1"]
    assert [row["pipelines"] for row in rows] == [[[0], [1], [2], [3]], [[0, 1], [2, 3]], [[0, 1, 2, 3]]]
    assert all(row["feasible"] for row in rows)
    chosen = [row for row in rows if row["planner_choice"]]
    assert len(chosen) == 1 and chosen[0]["samples_per_s"] == max(row["samples_per_s"] for row in rows)
    assert rows[2]["crosses_nodes"] and not rows[1]["crosses_nodes"]
    for row in rows:  # the step is the pipeline's plus what the all-reduce leaves exposed
        assert row["step_time_s"] == pytest.approx(row["pipeline_step_s"] + row["exposed_allreduce_s"])
        assert row["samples_per_s"] == pytest.approx(4 / row["step_time_s"])


def test_a_topology_file_names_its_gpus_and_a_half_given_cluster_is_refused(tiny_gpt2: str, tmp_path) -> None:
    two_boxes = Topology.uniform(
        "two-l4", "l4", nodes=2, gpus_per_node=1, intra_node="pcie4", inter_node="ethernet-25g"
    )
    two_boxes.to_json(tmp_path / "two.json")
    code, out, _ = run("compare", tiny_gpt2, "--topology", str(tmp_path / "two.json"), *SETUP)
    assert code == 0
    assert "on two-l4: 2 machines, 1 × l4 in the first, ethernet-25g between" in out
    assert "1x2" in out and "2x1" in out and "the planner chooses" in out
    code, _, err = run("compare", tiny_gpt2, "--gpu-profile", "l4", "--nodes", "2", *SETUP)
    assert code != 0 and "--nodes needs --gpus-per-node, both at least 1 (got 2 and None)" in err


def test_a_box_with_two_generations_of_cards_prints_its_layouts(tiny_gpt2: str) -> None:
    code, out, _ = run("compare", tiny_gpt2, "--topology", "rtx3090+rtx2080ti", *SETUP)
    assert code == 0
    assert "on rtx3090+rtx2080ti: 1 machines, 2 × rtx3090 + 2 × rtx2080ti in the first" in out
    assert all(layout in out for layout in ("1x4", "2x2", "4x1")) and "the planner chooses" in out
