"""The toy world's `described` family: questions that name their person by a description, not by name.

Every other family names the person in full ("where was Gorar Figinis born?"), and a retriever that learns to copy
the name reaches R@1 100 given time (docs/toy_world.md): no gap is left at the end of training. A described question
names the person by first name and one other fact stated in the same passage ("where was the Gorar who works for
Feka Textiles born?"), as a real question names a rare entity by what it is known for. The retriever must match a
conjunction of attributes by meaning ("works for" in the question, "is employed by" / "holds a job at" in the
passage), against near-duplicates: the ~sqrt(people) other Gorars, everyone at Feka Textiles, and the few other
Gorars who work there, whom the question cannot tell apart from the gold. That last group sets a ceiling no
retriever passes: `ceiling` computes it (the mean of 1 / the number of people the question fits).
"""

from __future__ import annotations

import sys

import numpy as np

from rag_train.data.toy import (
    FACTS,
    FAMILY_MODULES,
    MENTOR,
    SECTIONS,
    ToyWorld,
    coprime_multiplier,
    seeded_key,
    seeded_uniform,
)

# asked fact -> the facts that may describe the person: stated in the same passage, from a large pool (a colour or
# an instrument would fit a crowd). The mentor is never asked: only colour / instrument could describe that person.
CLUES = {0: (1, 2), 1: (0, 2), 2: (0, 1), 3: (MENTOR,), 4: (MENTOR,)}
ASKED = tuple(CLUES)
# the description's verb phrases, worded unlike every passage template (which say "comes from", "is employed by", ...)
PHRASES = {0: ("is a native of {v}", "hails from {v}"), 1: ("was born back in {v}", "came into the world in {v}"),
           2: ("draws a salary from {v}", "is on the payroll of {v}"),
           MENTOR: ("studied under {v}", "is a pupil of {v}")}


def capacity(world: ToyWorld, split: str) -> int:
    """Distinct (person, asked fact) pairs of a split."""
    return world.split_size(split) * len(ASKED)


def _plan(world: ToyWorld, split: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(persons, asked facts, clue facts) of questions start..stop: distinct (person, fact) pairs, seeded order."""
    k = np.arange(start, stop, dtype=np.int64)
    n = world.split_size(split)
    key = seeded_key(world.seed, f"described-{split}")
    persons = world.split_persons(split, (coprime_multiplier(key, n) * (k % n) + key % n) % n)
    facts = np.asarray(ASKED)[(seeded_uniform(key, persons, len(ASKED)) + k // n) % len(ASKED)]
    choice = seeded_uniform(key ^ 2, k, 2)
    clues = np.array([CLUES[f][c % len(CLUES[f])] for f, c in zip(facts.tolist(), choice.tolist())], dtype=np.int64)
    return persons, facts, clues


def questions(world: ToyWorld, split: str, start: int, stop: int) -> list[dict]:
    """Questions start..stop of the split, in the QA format plus `_row` (the gold passage's row)."""
    persons, facts, clues = _plan(world, split, start, stop)
    firsts = [name.split(" ")[0] for name in world.names(persons)]
    wording = seeded_uniform(seeded_key(world.seed, f"described-{split}") ^ 3, np.arange(start, stop), 2).tolist()
    clue_values = {fact: world.fact_strings(persons, fact) for fact in set(clues.tolist())}
    answers = {fact: world.fact_strings(persons, fact) for fact in set(facts.tolist())}
    out = []
    for i, (person, fact, clue) in enumerate(zip(persons.tolist(), facts.tolist(), clues.tolist())):
        described = f"the {firsts[i]} who " + PHRASES[clue][wording[i]].format(v=clue_values[clue][i])
        row = person * SECTIONS + FACTS[fact].section
        out.append({"id": f"described-{split}-{start + i}", "question": FACTS[fact].nq.format(e=described),
                    "answers": [answers[fact][i]], "gold_ids": [f"p{row}"], "_row": row})
    return out


def _keys(world: ToyWorld, persons: np.ndarray, clue: int) -> np.ndarray:
    return world.fact_values(persons, clue) * world.n_first + world.name_parts(persons)[0]


def fitting(world: ToyWorld, split: str, start: int, stop: int) -> np.ndarray:
    """How many people of the whole world fit each question's description (first name and clue value; >= 1)."""
    persons, _, clues = _plan(world, split, start, stop)
    counts = np.zeros(len(persons), dtype=np.int64)
    for clue in set(clues.tolist()):
        idx = np.flatnonzero(clues == clue)
        wanted = _keys(world, persons[idx], clue)
        order = np.argsort(wanted)
        found = np.zeros(len(idx), dtype=np.int64)
        for chunk in world.people_chunks(None):
            keys = np.sort(_keys(world, chunk, clue))
            found += np.searchsorted(keys, wanted[order], side="right") - np.searchsorted(keys, wanted[order])
        counts[idx[order]] = found
    return counts


def ceiling(world: ToyWorld, split: str, count: int) -> float:
    """The best R@1 any retriever can reach on the first `count` questions (percent): one of the people a question
    fits is its gold, and nothing in the question tells them apart."""
    return float(100.0 * np.mean(1.0 / fitting(world, split, 0, count)))


FAMILY_MODULES["described"] = sys.modules[__name__]
