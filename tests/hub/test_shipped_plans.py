"""The plans shipped in ``partitions/``: every one serves its model's graph as traced by the installed
transformers, and is what the current partitioner computes for its key; the index and the card
describe exactly them.

A plan is exact for the installed graph (it was made under this transformers), or re-anchors onto
it within the tolerance (`plan.reanchor`): a user on another release than the plans were made
under still gets them. Only an exact plan can be compared with what the partitioner makes now; a
re-anchored one is checked for its placement and prediction only.

The full check traces T5-3B (two shapes), GPT2-XL and BERT-large on the meta device, each once,
and re-runs the winning partitioner of the plans it re-plans in seconds (`REMADE`): every model's
plan on 4 × RTX 4090 and BERT-large's on each set of 8 GPUs, so that each model, 4 and 8 GPUs
and each GPU profile are planned again. The T5-3B and GPT2-XL plans on 8 GPUs take the mixed
partitioner 2-10 s each on 2 cores (half a minute together); they are checked for the prediction
instead: the cost model prices their placement on today's graph as it did when they were made.
When the check fails after a change to tracing, costs or a partitioner, run
``hf-ftpipe regenerate-partitions`` and commit the result (its README table shows what changed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hf_ftpipe.partitioners  # noqa: F401  (registers the partitioners)
from hf_ftpipe.costmodel.estimate import usable_capacity
from hf_ftpipe.errors import FtpipeError
from hf_ftpipe.hub.catalog import (
    INDEX_FILE,
    GraphCache,
    partitioner_options,
    plan_request,
    plan_spec,
    profile_of,
    read_index,
    render_card,
)
from hf_ftpipe.hub.setups import SHIPPED_PLANS
from hf_ftpipe.partitioners.registry import get_partitioner
from hf_ftpipe.plan.keys import resolve_key
from hf_ftpipe.plan.partition import Partition
from hf_ftpipe.plan.reanchor import fit_to_graph
from hf_ftpipe.plan.validate import validate_partition

from planning_graphs import SessionGraphs

FOLDER = Path(__file__).resolve().parents[2] / "partitions"
ENTRIES = read_index(FOLDER)
PLANNED = [e for e in ENTRIES if e["file"]]


def test_index_lists_every_shipped_spec_with_its_options() -> None:
    assert [e["name"] for e in ENTRIES] == [s.name for s in SHIPPED_PLANS]
    for entry in ENTRIES:
        spec = plan_spec(entry["name"])
        assert (entry["model"], entry["task"], entry["gpu_profile"], entry["num_gpus"]) == (
            spec.setup.model,
            spec.setup.name,
            spec.gpu_profile,
            spec.num_gpus,
        )
        assert (entry["seq_len"], entry["target_len"], entry["microbatch_size"], entry["optimizer"]) == (
            spec.setup.seq_len,
            spec.setup.target_len,
            spec.setup.microbatch_size,
            spec.setup.optimizer,
        )
        assert (entry["schedule"], entry["num_microbatches"], entry["recompute"], entry["headroom"]) == (
            spec.schedule,
            spec.num_microbatches,
            spec.recompute,
            spec.headroom,
        )
        assert (entry["file"] is None) == (entry["predicted"] is None) == (entry["does_not_fit"] is not None)


def test_folder_holds_exactly_the_indexed_plans_and_the_generated_card() -> None:
    plan_files = {p.relative_to(FOLDER).as_posix() for p in FOLDER.glob("*/*.json") if p.parent.name != "configs"}
    assert plan_files == {e["file"] for e in PLANNED}
    assert (FOLDER / "README.md").read_text(encoding="utf-8") == render_card(ENTRIES)


def test_the_card_names_what_does_not_fit_and_what_would() -> None:
    card = (FOLDER / "README.md").read_text(encoding="utf-8")
    assert card.startswith("---\n") and "\n---\n" in card  # YAML front matter of a Hub dataset card
    for entry in ENTRIES:
        if entry["file"] is None:
            # e.g. T5-3B WiC on 8 × 11 GB: the GPU memory or the GPU count that would fit.
            assert entry["would_fit"] and "GiB" in entry["would_fit"] and entry["gpu_profile"] in entry["would_fit"]
            assert f"needs {entry['would_fit']}" in card
        else:
            assert entry["file"] in card


@pytest.fixture(scope="module")
def graphs() -> GraphCache:
    return SessionGraphs()  # type: ignore[return-value]  # GraphCache's interface; traces shared with other tests


@pytest.mark.slow
def test_every_shipped_plan_validates_is_priced_as_made_and_the_remade_ones_match_the_partitioner(
    graphs: GraphCache,
) -> None:
    problems: list[str] = []
    for entry in PLANNED:
        try:
            problem = _check_plan(entry, graphs)
        except FtpipeError as error:  # another model, a graph it cannot re-anchor onto, or it no longer fits
            problem = str(error)
        if problem:
            problems.append(f"{entry['name']}: {problem}")
    assert not problems, "run `hf-ftpipe regenerate-partitions` and commit the result:\n" + "\n".join(problems)


REMADE = {
    "t5-3b/rtx4090-x4-boolq",
    "gpt2-xl/rtx4090-x4-wikitext2",
    "bert-large/rtx4090-x4-squad",
    "bert-large/rtx2080ti-x8-squad",
    "bert-large/a100-80gb-x8-squad",
    "bert-large/l4-x8-squad",
}
"""Plans whose partitioner is re-run (see the module docstring); the others' prediction is checked."""


def test_the_remade_plans_cover_every_model_gpu_profile_count_and_partitioner() -> None:
    """A change to a partitioner shows in a plan it makes (a partitioner a regenerated plan now
    names goes into `REMADE`), and each model's graph and each GPU are planned again."""
    by_name = {entry["name"]: entry for entry in PLANNED}
    assert REMADE <= by_name.keys()
    for aspect in ("model", "gpu_profile", "num_gpus", "partitioner"):
        assert {by_name[name][aspect] for name in REMADE} == {entry[aspect] for entry in PLANNED}, aspect


def _check_plan(entry: dict[str, Any], graphs: GraphCache) -> str | None:
    """What is wrong with the shipped plan of ``entry`` (None: nothing)."""
    spec = plan_spec(entry["name"])
    graph = graphs(spec.setup)
    profile, options = profile_of(spec), partitioner_options(spec)
    expected_key = resolve_key(
        graph, profile, None, schedule=spec.schedule, num_microbatches=spec.num_microbatches, dtype=None
    )
    plan = Partition.from_json(FOLDER / entry["file"], expected_key=expected_key)
    assert plan.key.digest() == entry["key_digest"] and plan.partitioner == entry["partitioner"]
    fitted, reanchored = fit_to_graph(plan, graph, profile, source=entry["file"])
    validate_partition(fitted, graph, memory_capacity_bytes=usable_capacity(profile, options["memory"]))
    if reanchored is not None:  # made under another transformers: what the partitioner makes here differs
        print(f"{entry['name']}: {reanchored.describe()}")
        return None

    if entry["name"] not in REMADE:
        again = plan_request(spec).estimate(graph, plan.node_stage, plan.stage_device)
        assert again.throughput_samples_per_s == pytest.approx(entry["predicted"]["throughput_samples_per_s"])
        assert again.stage_edges == plan.predicted.stage_edges
        return None
    again = get_partitioner(plan.partitioner)(graph, profile, **options)
    if (again.node_stage, again.stage_device) != (plan.node_stage, plan.stage_device):
        return f"{plan.partitioner} now makes another plan"
    assert again.predicted.throughput_samples_per_s == pytest.approx(entry["predicted"]["throughput_samples_per_s"])
    assert again.predicted.stage_edges == plan.predicted.stage_edges
    return None


def test_index_file_is_plain_json() -> None:
    data = json.loads((FOLDER / INDEX_FILE).read_text(encoding="utf-8"))
    assert data["format"] == "hf_ftpipe.partitions_index" and len(data["plans"]) == len(SHIPPED_PLANS)
