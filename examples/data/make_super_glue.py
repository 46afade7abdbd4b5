"""Write small synthetic SuperGLUE fixtures, in the Hub's column layouts, for offline demos and tests.

One file per task and split, ``{task}_{train,validation}.jsonl`` (64 / 32 rows), in the column
order and types of ``aps/super_glue`` (labels as ints, MultiRC's ``idx`` a nested dict), and
``glue_rte_*.jsonl`` in ``nyu-mll/glue`` rte's layout. RTE in SuperGLUE's layout is
``make_rte.py``'s data (600 / 200 rows), which this script rewrites too, so that one command
regenerates every fixture. Each task's label follows a simple rule over its text, on the word
lists of ``make_rte.py``; none is a benchmark. A 2+2-layer T5 (d_model 64) trained from scratch
(AdamW lr 3e-3, batch 16, 60 epochs, seconds on CPU) drives the training loss near 0 (MultiRC's
stays about 0.3); on validation it scores CB 1.0, MultiRC about 0.7, BoolQ about 0.65, and chance on
COPA, WiC and GLUE-layout RTE, whose rules compare two texts and need more rows than 64 (train on
``rte_*.jsonl`` for an RTE demo that learns). The fixtures are for running the pipeline and
checking formats offline, not for accuracy. The rules:

- boolq: the question asks about one fact of the passage, with the real object or place or another.
- cb: "X said that Y <did> the <thing>": restated (entailment), negated (contradiction), or a
  claim the premise does not make (neutral).
- copa: a fixed table of cause/effect pairs; the wrong choice comes from another pair.
- multirc: three numbered events in MultiRC's markup; "who" and "where" questions, 4 answer
  options each, 2 of them right.
- wic: ambiguous words with two senses, each told apart by its sentences' context words.

Run from anywhere; it rewrites the files beside itself:

    python examples/data/make_super_glue.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_rte  # noqa: E402
from make_rte import NAMES, OBJECTS, PLACES, VERBS, write_jsonl  # noqa: E402

NUM_TRAIN, NUM_VALIDATION = 64, 32
Row = dict[str, object]


def _rng(task: str) -> random.Random:
    # One stream per task: changing one task's generator leaves the other files as they are.
    return random.Random(f"{make_rte.SEED}-{task}")


def _splits(make: Callable[[random.Random, int], Row], rng: random.Random, num_labels: int) -> list[list[Row]]:
    """Train and validation rows of ``make(rng, label)``: labels balanced, no validation row in train."""
    seen: set[str] = set()
    splits = []
    for num_rows in (NUM_TRAIN, NUM_VALIDATION):
        labels = [i % num_labels for i in range(num_rows)]
        rng.shuffle(labels)
        rows = []
        for idx, label in enumerate(labels):
            for _ in range(1000):
                row = make(rng, label)
                if json.dumps(row) not in seen:
                    break
            else:  # the word lists hold fewer distinct rows of this label than asked for
                raise RuntimeError(f"{make.__name__} ran out of distinct rows with label {label}; lengthen its lists")
            seen.add(json.dumps(row))
            rows.append({**row, "idx": idx, "label": label})
        splits.append(rows)
    return splits


def _boolq(rng: random.Random, label: int) -> Row:
    name = rng.choice(NAMES)
    obj, place, other_place = rng.choice(OBJECTS), *rng.sample(PLACES, 2)
    verb, base = rng.choice(VERBS)
    passage = (
        f"{name} lives next to the {place}. Last year {name} {verb} a {obj} there, "
        f"and it is still the pride of the {place}."
    )
    if rng.randrange(2):
        asked = obj if label else make_rte._other(rng, OBJECTS, obj)
        question = f"did {name.lower()} {base} a {asked}"
    else:
        question = f"does {name.lower()} live next to the {place if label else other_place}"
    return {"question": question, "passage": passage}


def _cb(rng: random.Random, label: int) -> Row:
    speaker, actor = rng.sample(NAMES, 2)
    verb, base = rng.choice(VERBS)
    obj, place = rng.choice(OBJECTS), rng.choice(PLACES)
    premise = f"{speaker} said that {actor} {verb} the {obj} in the {place}. Nobody doubted it."
    hypothesis = [
        f"{actor} {verb} the {obj}.",  # 0 entailment
        f"{actor} did not {base} the {obj}.",  # 1 contradiction
        f"{actor} wanted to keep the {obj}.",  # 2 neutral
    ][label]
    return {"premise": premise, "hypothesis": hypothesis}


COPA_PAIRS = [  # (cause, effect)
    ("The glass fell off the table.", "It broke into pieces."),
    ("It rained all night.", "The streets were wet."),
    ("Anna forgot her umbrella.", "She got soaked."),
    ("Ben stayed up late.", "He was tired in the morning."),
    ("The oven was left on.", "The bread burned."),
    ("Clara practised the piano every day.", "She played well at the concert."),
    ("The car ran out of petrol.", "It stopped on the road."),
    ("David told a joke.", "Everybody laughed."),
    ("The lamp was unplugged.", "The room went dark."),
    ("Emma watered the garden.", "The flowers grew."),
    ("The boat hit a rock.", "Water came into the boat."),
    ("Felix lost his key.", "He could not open the door."),
]


def _copa(rng: random.Random, label: int) -> Row:
    right, wrong = rng.sample(range(len(COPA_PAIRS)), 2)
    question = rng.choice(["cause", "effect"])
    side = 0 if question == "cause" else 1  # the premise is the other side of the pair
    choices = [COPA_PAIRS[right][side], COPA_PAIRS[wrong][side]]
    if label == 1:
        choices.reverse()
    return {"premise": COPA_PAIRS[right][1 - side], "choice1": choices[0], "choice2": choices[1], "question": question}


def _multirc_split(rng: random.Random, num_paragraphs: int, counters: list[int]) -> list[Row]:
    """Rows of ``num_paragraphs`` paragraphs x 2 questions x 4 answers; ``counters`` keeps idx global."""
    rows: list[Row] = []
    for _ in range(num_paragraphs):
        names, objects = rng.sample(NAMES, 3), rng.sample(OBJECTS, 3)
        places, verbs = [rng.choice(PLACES) for _ in range(3)], [rng.choice(VERBS)[0] for _ in range(3)]
        paragraph = "".join(
            f"<b>Sent {i + 1}: </b>{n} {v} the {o} in the {p}.<br>"
            for i, (n, v, o, p) in enumerate(zip(names, verbs, objects, places))
        )
        who, where = rng.sample(range(3), 2)
        wrong_names = [n for n in NAMES if n != names[who]]
        wrong_places = rng.sample([p for p in PLACES if p != places[where]], 2)
        questions = [
            (
                f"Who {verbs[who]} the {objects[who]}?",
                [(names[who], 1), (f"It was {names[who]}", 1), *((n, 0) for n in rng.sample(wrong_names, 2))],
            ),
            (
                f"Where was the {objects[where]} {verbs[where]}?",
                [
                    (places[where], 1),
                    (f"In the {places[where]}", 1),
                    (wrong_places[0], 0),
                    (f"In the {wrong_places[1]}", 0),
                ],
            ),
        ]
        for question, answers in questions:
            rng.shuffle(answers)
            for answer, label in answers:
                idx = {"paragraph": counters[0], "question": counters[1], "answer": counters[2]}
                rows.append(
                    {"paragraph": paragraph, "question": question, "answer": answer, "idx": idx, "label": label}
                )
                counters[2] += 1
            counters[1] += 1
        counters[0] += 1
    return rows


def _multirc(rng: random.Random) -> list[list[Row]]:
    # Paragraphs are drawn at random, so a validation paragraph repeating a train one is unlikely
    # but possible; the ids start again at 0 in each split, as on the Hub.
    return [_multirc_split(rng, n // 8, [0, 0, 0]) for n in (NUM_TRAIN, NUM_VALIDATION)]


WIC_SENSES = {  # word -> two senses, each a few sentences using the word with that meaning
    "bank": (
        ["They sat on the bank of the river.", "The boat drifted to the muddy bank.", "Reeds grow on the bank."],
        ["She opened an account at the bank.", "The bank lent him money.", "He paid the bank every month."],
    ),
    "bat": (
        ["A bat flew out of the cave at night.", "The bat hung upside down.", "The bat ate insects."],
        ["He hit the ball with the bat.", "She bought a new cricket bat.", "The bat was made of willow."],
    ),
    "light": (
        ["Turn on the light in the kitchen.", "The light of the lamp was dim.", "Morning light filled the room."],
        ["The box was light enough to carry.", "She packed a light bag.", "The chair is light and easy to move."],
    ),
    "match": (
        ["He struck a match to light the candle.", "The match burned his fingers.", "Keep the match dry."],
        ["The team won the match.", "We watched the match in the park.", "The match ended in a draw."],
    ),
    "ring": (
        ["She wore a gold ring on her finger.", "He lost the ring in the garden.", "The ring was a gift."],
        ["I heard the phone ring twice.", "The bells ring at noon.", "Wait for the doorbell to ring."],
    ),
    "spring": (
        ["Flowers bloom in the spring.", "We plant seeds every spring.", "The birds return in spring."],
        ["The spring in the clock broke.", "A metal spring holds the lid.", "The mattress has a loose spring."],
    ),
}


def _span(sentence: str, word: str) -> tuple[int, int]:
    match = re.search(rf"\b{word}\b", sentence, flags=re.IGNORECASE)
    return match.start(), match.end()


def _wic(rng: random.Random, label: int) -> Row:
    word = rng.choice(sorted(WIC_SENSES))
    senses = WIC_SENSES[word]
    sense = rng.randrange(2)
    if label == 1:  # True: the same sense in both sentences
        sentence1, sentence2 = rng.sample(senses[sense], 2)
    else:
        sentence1, sentence2 = rng.choice(senses[sense]), rng.choice(senses[1 - sense])
    (start1, end1), (start2, end2) = _span(sentence1, word), _span(sentence2, word)
    return {
        "word": word,
        "sentence1": sentence1,
        "sentence2": sentence2,
        "start1": start1,
        "start2": start2,
        "end1": end1,
        "end2": end2,
    }


def _glue_rte(rng: random.Random) -> list[list[Row]]:
    seen: set[tuple[str, str]] = set()
    splits = [make_rte.make_rows(n, rng, seen) for n in (NUM_TRAIN, NUM_VALIDATION)]
    keys = {"premise": "sentence1", "hypothesis": "sentence2", "label": "label", "idx": "idx"}
    return [[{keys[k]: row[k] for k in keys} for row in rows] for rows in splits]


def make_all() -> dict[str, list[list[Row]]]:
    """Task name -> [train rows, validation rows], for every fixture but SuperGLUE RTE's."""
    # Hub column order (aps/super_glue): generators return the text columns in that order,
    # _splits appends idx and label.
    return {
        "boolq": _splits(_boolq, _rng("boolq"), 2),
        "cb": _splits(_cb, _rng("cb"), 3),
        "copa": _splits(_copa, _rng("copa"), 2),
        "multirc": _multirc(_rng("multirc")),
        "wic": _splits(_wic, _rng("wic"), 2),
        "glue_rte": _glue_rte(_rng("glue_rte")),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args(argv)
    make_rte.main(["--out-dir", str(args.out_dir)])
    for task, (train, validation) in make_all().items():
        write_jsonl(args.out_dir / f"{task}_train.jsonl", train)
        write_jsonl(args.out_dir / f"{task}_validation.jsonl", validation)


if __name__ == "__main__":
    main()
