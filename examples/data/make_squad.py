"""Write a small synthetic SQuAD 1.1, in the Hub's ``rajpurkar/squad`` layout, for offline demos and tests.

Each context is a short paragraph of facts about people, one sentence each: where they live,
what they work as, when they were born, what their pet is called. Each question asks for one
fact of one person in the context ("Where does Anna live?") and the answer is the span that the
sentence names ("Paris"): a pattern a tiny BERT can start to learn from a few hundred steps.
Contexts run from 3 to 14 sentences, so at ``--max_seq_length 64`` the longer ones are split
into several overlapping windows, as long Wikipedia paragraphs are at 384 tokens.

Rows as on the Hub: ``id`` (24 hex digits), ``title``, ``context``, ``question``, ``answers``
(``{"text": [...], "answer_start": [...]}``). A training row has one answer; a validation row
has three, as SQuAD's validation split does (annotators who agree, and one who took a few more
words, e.g. "in Paris"). A few questions start with spaces, as some of SQuAD's do.

Run from anywhere; it rewrites ``squad_train.jsonl`` and ``squad_validation.jsonl`` beside itself:

    python examples/data/make_squad.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 2020
QUESTIONS_PER_CONTEXT = 4
NUM_TRAIN_CONTEXTS = 24  # 96 rows
NUM_VALIDATION_CONTEXTS = 8  # 32 rows

NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Greta", "Hugo", "Ines", "Jonas", "Karla", "Leon",
         "Mia", "Noah", "Olga", "Paul"]  # fmt: skip
CITIES = ["Paris", "Berlin", "Madrid", "Vienna", "Lisbon", "Oslo", "Prague", "Dublin", "Rome", "Warsaw"]
JOBS = ["baker", "teacher", "pilot", "nurse", "farmer", "painter", "doctor", "lawyer", "tailor", "miner"]
PETS = ["dog", "cat", "parrot", "horse", "rabbit"]
PET_NAMES = ["Rex", "Luna", "Max", "Bella", "Coco", "Milo", "Daisy", "Oscar"]

# kind: (the sentence, the question, the words before the answer that a third annotator kept)
FACTS = {
    "city": ("{name} lives in {value}.", "Where does {name} live?", "in "),
    "job": ("{name} works as a {value}.", "What does {name} work as?", "a "),
    "year": ("{name} was born in {value}.", "When was {name} born?", "in "),
    "pet": ("{name} has a {pet} called {value}.", "What is the name of {name}'s {pet}?", "called "),
}


def _value(kind: str, rng: random.Random) -> str:
    if kind == "city":
        return rng.choice(CITIES)
    if kind == "job":
        return rng.choice(JOBS)
    if kind == "year":
        return str(rng.randint(1900, 2010))
    return rng.choice(PET_NAMES)


def _context(rng: random.Random) -> tuple[str, list[tuple[str, str, int, str]]]:
    """A paragraph and its facts: (question, answer, answer_start, the words before the answer)."""
    num_sentences = rng.choice([4, 6, 8, 10, 12, 14])
    sentences, facts, offset = [], [], 0
    for name in rng.sample(NAMES, num_sentences):  # one fact per person: every question has one answer
        kind = rng.choice(list(FACTS))
        sentence, question, before = FACTS[kind]
        fields = {"name": name, "value": _value(kind, rng), "pet": rng.choice(PETS)}
        text = sentence.format(**fields)
        start = offset + len(text) - len(".") - len(fields["value"])  # every sentence ends with its answer
        sentences.append(text)
        facts.append((question.format(**fields), fields["value"], start, before))
        offset += len(text) + 1  # joined by one space
    return " ".join(sentences), facts


def make_split(num_contexts: int, rng: random.Random, validation: bool) -> list[dict]:
    rows = []
    for number in range(num_contexts):
        context, facts = _context(rng)
        for question, answer, start, before in rng.sample(facts, min(QUESTIONS_PER_CONTEXT, len(facts))):
            if context[start : start + len(answer)] != answer:  # guards the offsets computed above
                raise RuntimeError(f"answer {answer!r} is not at {start} in {context!r}")
            answers = {"text": [answer], "answer_start": [start]}
            if validation:
                longer = before + answer
                answers = {"text": [answer, answer, longer], "answer_start": [start, start, start - len(before)]}
            rows.append(
                {
                    "id": f"{rng.getrandbits(96):024x}",
                    "title": f"Town_{number}",
                    "context": context,
                    "question": ("  " if rng.random() < 0.1 else "") + question,
                    "answers": answers,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    for split, num_contexts in (("train", NUM_TRAIN_CONTEXTS), ("validation", NUM_VALIDATION_CONTEXTS)):
        rows = make_split(num_contexts, rng, validation=split == "validation")
        with open(out_dir / f"squad_{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {out_dir / f'squad_{split}.jsonl'}")


if __name__ == "__main__":
    main()
