"""`hf-ftpipe publish-partitions`: the shipped folder becomes a Hub dataset whose plans PartitionStore
(and so PipeTrainer's ``partition_repo``) finds by key."""

from __future__ import annotations

from pathlib import Path

from hf_ftpipe.hub import PartitionStore, path_for
from hf_ftpipe.hub.catalog import INDEX_FILE, publish, read_index
from hf_ftpipe.plan import Partition

FOLDER = Path(__file__).resolve().parents[2] / "partitions"


def test_published_plans_are_in_the_folder_layout_and_found_by_key(hub) -> None:
    assert publish(FOLDER, "ftpipe/shipped")
    files = hub.repo("ftpipe/shipped").resolve("main").files
    assert files["README.md"] == (FOLDER / "README.md").read_bytes()  # the dataset card
    assert files[INDEX_FILE] == (FOLDER / INDEX_FILE).read_bytes()
    assert files["configs/t5-3b.json"] == (FOLDER / "configs" / "t5-3b.json").read_bytes()
    planned = [entry["file"] for entry in read_index(FOLDER) if entry["file"]]
    plans = {name: Partition.from_json(FOLDER / name) for name in planned}
    for name, plan in plans.items():
        assert files[name] == files[path_for(plan.key)] == (FOLDER / name).read_bytes()

    store = PartitionStore("ftpipe/shipped")
    assert [entry.path for entry in store.list()] == sorted({path_for(plan.key) for plan in plans.values()})
    name, plan = next(iter(plans.items()))
    assert store.pull(plan.key).partition.to_dict() == plan.to_dict()
