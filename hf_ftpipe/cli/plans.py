"""``hf-ftpipe show``, ``profiles``, ``regenerate-partitions`` and ``publish-partitions``: commands
that read plans and profiles rather than trace a model (the parser lives in ``cli.py``)."""

from __future__ import annotations

import argparse
import json
import sys


def run_show(args: argparse.Namespace) -> int:
    from hf_ftpipe.cli.format import format_plan, plan_summary
    from hf_ftpipe.plan.partition import Partition, user_file_fix, with_fix

    with with_fix(user_file_fix(args.plan)):
        plan = Partition.from_json(args.plan)
    if args.json:
        print(json.dumps(plan_summary(plan), indent=1))
    else:
        print(format_plan(plan, source=args.plan))
    if args.plot:
        from hf_ftpipe.cli.plot import plot_plan

        plot_plan(plan, args.plot, title=args.plan)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def run_profiles(args: argparse.Namespace) -> int:
    from hf_ftpipe.cli.format import format_profiles, profile_rows

    print(json.dumps(profile_rows(), indent=1) if args.json else format_profiles())
    return 0


def run_regenerate(args: argparse.Namespace) -> int:
    from hf_ftpipe.hub.catalog import count_line, regenerate

    entries = regenerate(args.folder, args.only)
    fits = sum(1 for e in entries if e["file"])
    print(f"{args.folder}: {count_line(fits, len(entries) - fits)} Wrote index.json and README.md.")
    return 0


def run_publish(args: argparse.Namespace) -> int:
    from hf_ftpipe.hub.catalog import publish

    url = publish(args.folder, args.repo_id, private=args.private, revision=args.revision)
    print(f"published {args.folder} to dataset {args.repo_id}: {url}")
    return 0
