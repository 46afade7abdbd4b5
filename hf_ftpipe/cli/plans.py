"""``hf-ftpipe show``, ``profiles``, ``regenerate-partitions`` and ``publish-partitions``: commands
that read plans and profiles rather than trace a model.

::

    hf-ftpipe show t5-3b-8x2080ti.json [--json] [--plot load.png]
    hf-ftpipe profiles [--json]
    hf-ftpipe regenerate-partitions [--folder partitions] [--only t5-3b/rtx2080ti-x8-rte ...]
    hf-ftpipe publish-partitions USER/hf-ftpipe-partitions [--folder partitions] [--private]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hf_ftpipe.cli.options import add_command, add_json_option, add_plan_argument

__all__ = ["add_plan_commands", "repriced"]


def add_plan_commands(commands: Any) -> None:
    """Add ``show``, ``profiles``, ``regenerate-partitions`` and ``publish-partitions`` to ``commands``."""
    show = add_command(
        commands, "show", run_show, "print a plan's per-GPU and per-stage predictions; --plot draws them"
    )
    add_plan_argument(show)
    add_json_option(show, "print JSON instead of tables")
    show.add_argument("--plot", metavar="PNG", help="also draw the per-GPU load and the stage graph to this image")
    show.add_argument(
        "--costs",
        metavar="TABLE",
        help="predict compute from this measured cost table (hf-ftpipe profile) instead of the plan's roofline",
    )
    profiles = add_command(commands, "profiles", run_profiles, "list the built-in GPU profiles")
    add_json_option(profiles)
    regenerate = add_command(
        commands,
        "regenerate-partitions",
        run_regenerate,
        "recompute the shipped plans in partitions/ with their index and card",
    )
    publish = add_command(
        commands, "publish-partitions", run_publish, "upload the partitions/ folder to a Hub dataset repository"
    )
    for command in (regenerate, publish):
        command.add_argument("--folder", default="partitions", help="default: partitions")
    regenerate.add_argument("--only", nargs="+", metavar="NAME", help="only these plans, e.g. t5-3b/rtx2080ti-x8-rte")
    publish.add_argument("repo_id", help="the dataset repository, e.g. USER/hf-ftpipe-partitions")
    publish.add_argument("--private", action="store_true", help="create the repository private")
    publish.add_argument("--revision", help="branch to commit to (default: main)")


def run_show(args: argparse.Namespace) -> int:
    """Print what the cost model predicts for a partition file: per GPU and per stage compute,
    communication, memory, and the predicted throughput."""
    from hf_ftpipe.cli.format import format_plan, plan_summary
    from hf_ftpipe.plan.partition import Partition, user_file_fix, with_fix

    with with_fix(user_file_fix(args.plan)):
        plan = Partition.from_json(args.plan)
    source = args.plan
    if args.costs:
        plan = repriced(plan, args.costs)
        source = f"{args.plan}, compute from {args.costs}"
    if args.json:
        print(json.dumps(plan_summary(plan), indent=1))
    else:
        print(format_plan(plan, source=source))
    if args.plot:
        from hf_ftpipe.cli.plot import plot_plan

        plot_plan(plan, args.plot, title=args.plan)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def repriced(plan: Any, costs: str) -> Any:
    """``plan`` with its stages' compute from the cost table at ``costs``, which must be the plan's graph's."""
    from dataclasses import replace

    from hf_ftpipe.costmodel.estimate import reprice
    from hf_ftpipe.costmodel.measured import CostTable
    from hf_ftpipe.errors import CostTableError

    table = CostTable.load(costs)
    expected = replace(table.key, model_fingerprint=plan.key.model_fingerprint, input_shapes=plan.key.input_shapes)
    if plan.anchors is not None:
        expected = replace(expected, graph_digest=plan.anchors.digest)
    table.check_key(expected, costs)
    node_costs = table.node_costs()
    missing = sorted(set(plan.node_stage) - set(node_costs))
    if missing:
        raise CostTableError(f"{costs} has no time for {len(missing)} ops of the plan, e.g. {missing[:3]}; reprofile")
    return replace(plan, predicted=reprice(plan.predicted, plan.node_stage, node_costs))


def run_profiles(args: argparse.Namespace) -> int:
    """The built-in GPU profiles (datasheet speeds) that --gpu-profile names."""
    from hf_ftpipe.cli.format import format_profiles, profile_rows

    print(json.dumps(profile_rows(), indent=1) if args.json else format_profiles())
    return 0


def run_regenerate(args: argparse.Namespace) -> int:
    """Trace each shipped setup's model (meta device) and rewrite its plan, index.json and
    README.md."""
    from hf_ftpipe.hub.catalog import count_line, regenerate

    entries = regenerate(args.folder, args.only)
    fits = sum(1 for e in entries if e["file"])
    print(f"{args.folder}: {count_line(fits, len(entries) - fits)} Wrote index.json and README.md.")
    return 0


def run_publish(args: argparse.Namespace) -> int:
    """Upload the plans, index and card to a Hub dataset repository (created when missing)."""
    from hf_ftpipe.hub.catalog import publish

    url = publish(args.folder, args.repo_id, private=args.private, revision=args.revision)
    print(f"published {args.folder} to dataset {args.repo_id}: {url}")
    return 0
