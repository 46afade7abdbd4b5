"""Write a small WikiText-like corpus, in ``wikitext-2-raw-v1``'s layout, for offline demos and tests.

The Hub's ``Salesforce/wikitext`` (``wikitext-2-raw-v1``) has one ``text`` column with one row per
line of ``wiki.{train,valid,test}.raw``: article titles ``" = Title = "``, section headings
``" = = Heading = = "``, paragraphs, and blank lines between them. These files keep that shape as
plain text, one line per row (``load_dataset("text", ...)`` gives the same single ``text``
column), and WikiText's spacing: a space before every line, punctuation split off with spaces.

Each article describes an invented town from a handful of sentence templates, so a tiny GPT-2
trained from scratch on CPU drops its perplexity quickly. The data is small on purpose (a few
hundred lines); it is not a benchmark.

Run from anywhere; it rewrites ``wikitext_{train,validation,test}.txt`` beside itself:

    python examples/data/make_wikitext.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

SEED = 2021
ARTICLES = {"train": 24, "validation": 6, "test": 6}

TOWNS = ["Aldmere", "Brackwater", "Colbury", "Dunholm", "Elmsford", "Farrowby", "Glenmoor", "Harwick"]
RIVERS = ["Avon", "Tamar", "Wye", "Ouse", "Eden", "Tees"]
TRADES = ["wool", "salt", "timber", "copper", "grain", "glass"]
PEOPLE = ["Thomas Bell", "Mary Hale", "John Carver", "Alice Moore", "Henry Ward", "Edith Lowe"]
BUILDINGS = ["church", "bridge", "market hall", "mill", "school", "library"]

HISTORY = [
    "{town} was founded in {year} on the banks of the River {river} .",
    "In {year} , {person} built the first {building} in {town} .",
    "The {trade} trade made {town} one of the richest towns in the county by {year} .",
    "A fire in {year} destroyed the old {building} , which was rebuilt two years later .",
    "During the {century} century the population of {town} grew to {population} @,@ 000 .",
]
GEOGRAPHY = [
    "{town} lies {distance} miles north of the River {river} .",
    "The town is known for its {building} , which stands near the {river} .",
    "Most of the land around {town} is used for farming and {trade} .",
    "The {river} floods the lower streets of {town} every few years .",
]


def _fill(template: str, town: str, rng: random.Random) -> str:
    return template.format(
        town=town,
        river=rng.choice(RIVERS),
        trade=rng.choice(TRADES),
        person=rng.choice(PEOPLE),
        building=rng.choice(BUILDINGS),
        year=rng.randrange(1100, 1900),
        century=rng.choice(["twelfth", "fifteenth", "eighteenth", "nineteenth"]),
        population=rng.randrange(2, 40),
        distance=rng.randrange(2, 30),
    )


def _paragraph(templates: list[str], town: str, rng: random.Random) -> str:
    return " " + " ".join(_fill(rng.choice(templates), town, rng) for _ in range(rng.randrange(3, 6))) + " "


def article(rng: random.Random) -> list[str]:
    """One article as WikiText lines (no line breaks): title, sections, paragraphs, blanks."""
    town = rng.choice(TOWNS)
    lines = ["", f" = {town} = ", "", _paragraph(HISTORY, town, rng)]
    for heading, templates in (("History", HISTORY), ("Geography", GEOGRAPHY)):
        lines += ["", f" = = {heading} = = ", ""]
        lines += [_paragraph(templates, town, rng) for _ in range(rng.randrange(1, 3))]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    for split, count in ARTICLES.items():
        lines = [line for _ in range(count) for line in article(rng)]
        path = out_dir / f"wikitext_{split}.txt"
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        print(f"{path}: {len(lines)} lines")


if __name__ == "__main__":
    main()
