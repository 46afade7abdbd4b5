"""Plain-text tables: one look for what the CLI prints and what the trainer logs."""

from __future__ import annotations

__all__ = ["table"]


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns under a dashed rule (the style of ``hf-ftpipe compare``)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
