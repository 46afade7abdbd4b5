"""The ``hf-ftpipe`` command: the argument parser and how its errors become exit statuses.

No GPU, no weights and (for the shipped models) no network: the model is built on the meta
device from its config, traced, and partitioned for the GPUs you name::

    hf-ftpipe partition t5-3b --gpus 8 --gpu-profile rtx2080ti --batch-size 4 --seq-len 512 \\
        --target-len 4 --schedule async --num-microbatches 8 -o t5-3b-8x2080ti.json
    hf-ftpipe compare t5-3b --gpus 8 --gpu-profile rtx2080ti --batch-size 4 --seq-len 512 \\
        --target-len 4 --schedule async [--json]

Each command group adds its own subcommands and runs them: ``partition`` and ``compare``
(``cli.partition``), ``schedule`` (``cli.schedule``), ``simulate`` (``cli.simulate``), ``slices``
(``cli.slices``), ``show``, ``profiles`` and the ``partitions/`` folder (``cli.plans``), ``profile``
(``cli.profile``), ``push``, ``pull`` and ``list`` (``cli.hub``). Errors a user can fix (unknown
model, profile or partitioner; nothing fits) print one message on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or argparse's own usage errors (status 2)
        return int(exit_.code or 0)
    from hf_ftpipe.errors import FtpipeError, PlanDoesNotFitError

    try:
        return args.run(args)
    except (FtpipeError, OSError) as error:
        message = error.message("cli") if isinstance(error, PlanDoesNotFitError) else str(error)
        print(f"hf-ftpipe {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    """Every subcommand, in the order ``--help`` lists them; each sets ``run`` to its function."""
    from hf_ftpipe.cli.hub import add_hub_commands
    from hf_ftpipe.cli.partition import add_partition_commands
    from hf_ftpipe.cli.plans import add_plan_commands
    from hf_ftpipe.cli.profile import add_profile_command
    from hf_ftpipe.cli.schedule import add_schedule_command
    from hf_ftpipe.cli.simulate import add_simulate_command
    from hf_ftpipe.cli.slices import add_slices_command

    parser = argparse.ArgumentParser(
        prog="hf-ftpipe",
        description="Plan FTPipe pipeline partitions for Hugging Face models (no GPU or weights needed).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_partition_commands(commands)
    add_schedule_command(commands)
    add_simulate_command(commands)
    add_slices_command(commands)
    add_plan_commands(commands)
    add_profile_command(commands)
    add_hub_commands(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
