"""Write a small synthetic news summarization set, in the Hub's ``xsum`` columns, for offline demos and tests.

Each document is a short news item of five sentences about one person: what they opened or
started, where and when, a detail, what people said, and a plan. Its summary is two sentences
that keep the who, what, where and the plan, in the document's words, so a tiny T5 trained
for a few seconds learns to copy the right spans and ROUGE has something to measure; the summary
has two sentences, so ROUGE-Lsum scores it sentence by sentence (equal to ROUGE-L while the
generated sentences come in the reference's order).

Rows as ``xsum`` has them, ``document`` then ``summary`` (``run_summarization.py`` reads a file's
first column as the text and the second as the summary unless told otherwise).

Run from anywhere; it rewrites ``news_train.jsonl``, ``news_validation.jsonl`` and
``news_test.jsonl`` beside itself:

    python examples/data/make_news.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 2026
SIZES = {"train": 256, "validation": 16, "test": 16}

NAMES = ["Anna Weber", "Ben Ortiz", "Clara Novak", "David Kim", "Emma Rossi", "Felix Berg", "Greta Lind",
         "Hugo Silva", "Ines Costa", "Jonas Meyer", "Karla Horvat", "Leon Dubois"]  # fmt: skip
CITIES = ["Paris", "Berlin", "Madrid", "Vienna", "Lisbon", "Oslo", "Prague", "Dublin", "Rome", "Warsaw"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
# what was opened: (the thing, a detail sentence about it)
VENTURES = [
    ("bakery", "It sells bread baked in a wood oven before dawn."),
    ("bookshop", "Its shelves hold old maps and second-hand novels."),
    ("cafe", "It serves coffee roasted on the premises."),
    ("bike shop", "It repairs old bicycles for half the usual price."),
    ("flower market", "Its stalls open at six every morning."),
    ("music school", "It teaches piano and guitar to children."),
    ("repair cafe", "Volunteers fix broken lamps and radios for free."),
    ("cinema", "It shows silent films with live music."),
]
REACTIONS = ["welcomed the idea", "queued outside on the first day", "asked for longer opening hours",
             "said the street feels busier"]  # fmt: skip
PLANS = ["open a second shop", "hire more staff", "start a delivery service", "move to a larger building",
         "run evening classes"]  # fmt: skip


def make_row(rng: random.Random) -> dict[str, str]:
    name, city, day = rng.choice(NAMES), rng.choice(CITIES), rng.choice(DAYS)
    venture, detail = rng.choice(VENTURES)
    reaction, plan = rng.choice(REACTIONS), rng.choice(PLANS)
    first = name.split()[0]
    document = (
        f"{name} opened a {venture} in {city} on {day}. {detail} "
        f"Local people {reaction}. {first} said the {venture} had taken two years to prepare. "
        f"Next year {first} hopes to {plan}."
    )
    summary = f"{name} opened a {venture} in {city}. {first} hopes to {plan}."
    return {"document": document, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    for split, size in SIZES.items():
        path = out_dir / f"news_{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(size):
                f.write(json.dumps(make_row(rng)) + "\n")
        print(f"wrote {size} rows to {path}")


if __name__ == "__main__":
    main()
