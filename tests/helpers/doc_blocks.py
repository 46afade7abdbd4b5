"""The fenced blocks of the documentation, the markers above them, and the commands in them.

tests/test_docs.py runs every ```bash and ```python block of README.md, docs/*.md and
benchmarks/README.md that carries no marker; a block that cannot run here says why in an HTML
comment on the line just above its fence (several comment lines may stand there):

    <!-- docs-test: skip GPU: needs 8 GPUs -->          not run: GPU, Hub, multi-machine, long or fragment
    <!-- docs-test: run-by tests/cli/test_partition.py -->   run by that test, inside a launch or trace it
                                                         makes anyway; it reads the command from the page
    <!-- docs-test: preset t5-3b_boolq_async -->         a GPU command of an example script: it must set
                                                         what examples/presets/<name>.json sets; planned on CPU
    <!-- docs-test: output -->                           on a ```text block: lines the block above prints,
                                                         checked wherever that block runs

Tests that run a page's command in their own launch (``run-by``) take it from here
(``page_command``), so the page and what runs cannot drift apart.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNABLE = ("bash", "python")
"""The languages of blocks that run; ```text, ```json and bare fences are shown, not run."""
SKIP_REASONS = ("GPU", "Hub", "multi-machine", "long", "fragment")
"""Why a block may not run here. ``fragment``: Python that shows arguments in context (it must still
compile, and the `PipeTrainingArguments` fields it names must exist)."""
KINDS = ("skip", "run-by", "preset", "output")

_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
_OPTIONAL = re.compile(r"\s*\[[^\[\]]*\]")


def pages() -> list[str]:
    """Every page whose blocks are checked, relative to the repository."""
    docs = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    return ["README.md", *docs, "benchmarks/README.md"]


@dataclass(frozen=True)
class Marker:
    """``<!-- docs-test: KIND [ARGUMENT][: WHY] -->``."""

    kind: str
    argument: str = ""
    why: str = ""

    @classmethod
    def parse(cls, body: str) -> Marker:
        head, _, why = body.partition(":")
        kind, _, argument = head.strip().partition(" ")
        return cls(kind, argument.strip(), why.strip())


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str
    line: int
    """1-based line of the opening fence."""
    language: str
    text: str
    """The block's lines, without the fences and without the indentation of the fence."""
    markers: tuple[Marker, ...]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def marker(self, kind: str) -> Marker | None:
        return next((m for m in self.markers if m.kind == kind), None)

    @property
    def runs_here(self) -> bool:
        """Run by tests/test_docs.py itself: a bash or python block with no marker that says otherwise."""
        return self.language in RUNNABLE and not any(m.kind in ("skip", "run-by", "preset") for m in self.markers)

    def command_lines(self) -> list[str]:
        """A bash block's commands: continuation lines joined, blank lines and ``#`` comments dropped."""
        lines, pending = [], ""
        for raw in self.text.splitlines():
            line = pending + raw.strip()
            if line.endswith("\\"):
                pending = line[:-1].rstrip() + " "
                continue
            pending = ""
            line = _strip_comment(line)
            if line:
                lines.append(line)
        return lines


def blocks(page: str) -> list[Block]:
    """The fenced blocks of ``page`` (relative to the repository), with their markers."""
    return parse_blocks(page, (REPO / page).read_text(encoding="utf-8"))


def parse_blocks(page: str, text: str) -> list[Block]:
    """The fenced blocks of the Markdown ``text`` of ``page``, with their markers."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
        markers, k = [], i - 1
        while k >= 0 and _COMMENT.match(lines[k]):
            if marked := _MARKER.match(lines[k]):
                markers.insert(0, Marker.parse(marked.group("body")))
            k -= 1
        found.append(Block(page, i + 1, language, "\n".join(body) + "\n", tuple(markers)))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def argv(command_line: str) -> list[str]:
    """A command line as its words, with ``[optional]`` synopsis groups left out."""
    return shlex.split(_OPTIONAL.sub("", command_line))


def page_block(page: str, containing: str) -> Block:
    """The one runnable block of ``page`` whose text contains ``containing``."""
    matches = [b for b in blocks(page) if b.language in RUNNABLE and containing in b.text]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} blocks of {page} contain {containing!r}; expected exactly one")
    return matches[0]


def page_command(page: str, containing: str) -> list[str]:
    """The words of the one command line of ``page``'s bash blocks that contains ``containing``."""
    matches = [line for b in blocks(page) if b.language == "bash" for line in b.command_lines() if containing in line]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} command lines of {page} contain {containing!r}; expected exactly one")
    return argv(matches[0])


CPU_LAUNCH = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0"]
"""How the pages start an example on 2 CPU processes (what `distributed.accelerate_launch` runs)."""


def cpu_launch_arguments(page: str, script: str) -> list[str]:
    """The arguments ``page`` gives ``examples/<script>`` in its one 2-process CPU launch of it."""
    words = page_command(page, f"--main_process_port 0 examples/{script}")
    at = words.index(f"examples/{script}")
    if words[:at] != CPU_LAUNCH:
        raise ValueError(f"{page} launches {script} with {words[:at]}, not {CPU_LAUNCH}")
    return words[at + 1 :]


def expected_output(block: Block) -> list[str]:
    """The lines of the ```text block marked ``output`` just after ``block`` (none: no such block)."""
    following = [b for b in blocks(block.page) if b.line > block.line]
    if not following or following[0].marker("output") is None:
        return []
    return [line for line in following[0].text.splitlines() if line.strip()]


def missing_output(expected: list[str], printed: str) -> list[str]:
    """The lines of ``expected`` that ``printed`` does not print, in that order (lines compared whole,
    trailing spaces aside); empty when all are there."""
    printed_lines = [line.rstrip() for line in printed.splitlines()]
    missing, position = [], 0
    for line in expected:
        try:
            position = printed_lines.index(line.rstrip(), position) + 1
        except ValueError:
            missing.append(line)
    return missing


def _strip_comment(line: str) -> str:
    """``cmd --flag  # why`` → ``cmd --flag`` (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.strip()
