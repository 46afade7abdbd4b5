"""``hf-ftpipe push``, ``pull`` and ``list``: share plans through a Hub dataset repo.

::

    hf-ftpipe push t5-3b-8x2080ti.json --repo my-org/ftpipe-partitions
    hf-ftpipe list --repo my-org/ftpipe-partitions [--model T5ForConditionalGeneration] \\
        [--gpu-profile rtx2080ti] [--json]
    hf-ftpipe pull --repo my-org/ftpipe-partitions --model T5ForConditionalGeneration --gpu-profile rtx2080ti \\
        --gpus 8 --schedule async -o plan.json
    hf-ftpipe pull --repo my-org/ftpipe-partitions --key 869c3778 [--revision COMMIT] -o plan.json

``pull`` takes the one plan that matches the filters (or ``--path`` in the repo) and refuses to
guess between several. Environment: ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from hf_ftpipe.cli.options import add_command, add_json_option

__all__ = ["add_hub_commands"]


def add_hub_commands(commands: Any) -> None:
    """Add ``push``, ``pull`` and ``list`` to the ``hf-ftpipe`` subparsers ``commands``."""
    push = add_command(commands, "push", _run_push, "push a plan to a Hub dataset repo")
    push.add_argument("plan", help="a partition JSON (from `hf-ftpipe partition -o` or a training run's cache)")
    push.add_argument("--message", help="commit message (default: model, GPUs, schedule and predicted figures)")
    push.add_argument("--branch", help="branch to commit to (default: main)")
    pull = add_command(commands, "pull", _run_pull, "pull a plan from a Hub dataset repo")
    pull.add_argument("--path", help="the plan's path in the repo")
    pull.add_argument("--key", help="the plan's key digest (or a prefix of it), as `list` shows")
    pull.add_argument("--gpus", type=int, help="number of GPUs")
    pull.add_argument("--schedule", help="pipeline schedule, e.g. gpipe or async")
    pull.add_argument("--num-microbatches", type=int, help="micro-batches per step")
    pull.add_argument("-o", "--output", help="write the plan here (default: print it)")
    listing = add_command(commands, "list", _run_list, "list the plans in a Hub dataset repo")
    add_json_option(listing)
    for command in (push, pull, listing):
        command.add_argument("--repo", required=True, help="the dataset repo, 'namespace/name'")
    for command in (pull, listing):
        command.add_argument("--revision", help="branch or commit id (default: main)")
        command.add_argument("--model", help="model class (e.g. T5ForConditionalGeneration) or fingerprint prefix")
        command.add_argument("--gpu-profile", help="GPU profile name, e.g. rtx2080ti")


def _run_push(args: argparse.Namespace) -> int:
    """Commit a partition file to a Hub dataset repo."""
    from hf_ftpipe.hub.store import PartitionStore
    from hf_ftpipe.plan.partition import Partition, user_file_fix, with_fix

    with with_fix(user_file_fix(args.plan)):
        plan = Partition.from_json(args.plan)
    path, commit = PartitionStore(args.repo).push(plan, commit_message=args.message, branch=args.branch)
    print(f"pushed hf://datasets/{args.repo}/{path} (commit {commit})")
    return 0


def _run_pull(args: argparse.Namespace) -> int:
    """Download one plan, chosen by model and profile filters, by --key or by --path."""
    from hf_ftpipe.errors import PartitionError
    from hf_ftpipe.hub.store import PartitionStore

    store = PartitionStore(args.repo, revision=args.revision)
    path = args.path
    if path is None:
        filters = _filters(args, "schedule", "num_microbatches", "key")
        entries = store.list(**filters)
        if len(entries) != 1:
            raise PartitionError(_no_single_match(args.repo, filters, entries, store.offline))
        path = entries[0].path
    pulled = store.pull_path(path)
    if args.output:
        pulled.partition.to_json(args.output)
        print(f"pulled {pulled.location} (commit {pulled.commit}) to {args.output}")
    else:
        print(pulled.partition.to_text(), end="")
    return 0


def _run_list(args: argparse.Namespace) -> int:
    """List the plans of a Hub dataset repo."""
    from hf_ftpipe.cli.format import table
    from hf_ftpipe.hub.store import PartitionStore

    store = PartitionStore(args.repo, revision=args.revision)
    entries = store.list(**_filters(args))
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=1))
        return 0
    rows = [["model", "fingerprint", "GPUs", "schedule", "micro-batches", "dtype", "key", "KiB"]]
    for e in entries:
        size = f"{e.size_bytes / 1024:.1f}" if e.size_bytes is not None else "?"
        gpus = f"{e.num_gpus} × {e.gpu_profile}"
        rows.append(
            [e.model_class, e.model_fingerprint, gpus, e.schedule, str(e.num_microbatches), e.dtype, e.key_digest, size]
        )
    print(table(rows))
    print(f"{len(entries)} plan(s) in {args.repo}" + (f" {_OFFLINE}" if store.offline else ""))
    return 0


_OFFLINE = "in the local download cache: HF_HUB_OFFLINE is set, so the Hub was not asked"


def _no_single_match(repo: str, filters: dict[str, Any], entries: list[Any], offline: bool) -> str:
    """Why ``pull`` took no plan: none matches (say where it looked and how to see what there is),
    or several do (list them, and how to narrow it down)."""
    described = ", ".join(f"{k}={v}" for k, v in filters.items()) or "no filter"
    where = f" {_OFFLINE}" if offline else ""
    if not entries:
        lines = [f"no plan in {repo} matches {described}{where}"]
        lines.append(
            f"`hf-ftpipe list --repo {repo}` shows the plans there: pull one by its --key, or drop a filter."
            if filters
            else f"{repo} holds no plan yet: `hf-ftpipe push PLAN.json --repo {repo}` adds one."
        )
        return "\n".join(lines)
    lines = [f"{len(entries)} plans in {repo} match {described}{where}"]
    lines += [f"  {e.path}" for e in entries[:20]]
    lines.append("Narrow it down with --model, --gpu-profile, --gpus, --schedule, --key or --path.")
    return "\n".join(lines)


def _filters(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    """``PlanEntry.matches`` keywords from the command line (``--gpus`` is ``num_gpus``)."""
    names = {"model": "model", "gpu_profile": "gpu_profile", "gpus": "num_gpus"}
    names |= {name: name for name in extra if name != "gpus"}
    return {field: getattr(args, name) for name, field in names.items() if getattr(args, name, None) is not None}
