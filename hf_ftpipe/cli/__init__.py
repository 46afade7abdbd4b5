"""The ``hf-ftpipe`` command: plan, compare, show and share partitions from the shell."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf-ftpipe`` (imports the commands only when run)."""
    from hf_ftpipe.cli.parser import main as run

    return run(argv)


__all__ = ["main"]
