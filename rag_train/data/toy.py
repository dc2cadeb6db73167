"""The toy world: a generated closed-world open-domain QA corpus (see docs/toy_world.md).

People with synthetic names have six random facts; each person has two short passages stating three
facts each. Question families mirror NQ (single fact), TriviaQA (paraphrased wording) and HotpotQA (bridge
questions whose answer passage names the question's entity, and comparison questions over two entities);
`mentor_bridge` keeps the first HotpotQA-like family (two hops through the mentor, the second unreachable from
the question). Writing a world to disk, and its cache: rag_train/data/toy_files.py. Every fact is a counter-based
hash of (seed, person, fact), so any passage can be rendered from its row alone: generation streams to disk with
flat memory at any size,
the same seed gives byte-identical files, and answers cannot be guessed without the passage.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

TOY_VERSION = 3  # 2: tokenizer pieces from BPE (whole-word answers); 3: hotpotqa redesigned, old one = mentor_bridge
SECTIONS = 2  # passages per person: 0 = origins and work, 1 = music, taste and mentor
DEV_EVERY = 10  # person e is a dev person iff e % DEV_EVERY == 0: dev facts are never asked in train
FAMILIES = ("nq", "tqa", "hotpotqa", "mentor_bridge")
# question families kept in modules of their own, which build on this one (`toy_described`): each registers itself
# here ({name: module with `capacity(world, split)` and `questions(world, split, start, stop)`}) when
# `rag_train.data` is imported, so this module never imports them
FAMILY_MODULES: dict = {}
RLM_FAMILIES = ("nq", "tqa", "hotpotqa")
TOY_TRAIN_SETS = [f"{family}-train" for family in RLM_FAMILIES]  # the QA files the RLM trains / evaluates on
TOY_DEV_SETS = [f"{family}-dev" for family in RLM_FAMILIES]
# The tokenizer is trained on the passages and these families: the version-2 sample (mentor_bridge was called
# hotpotqa then), so the single-hop data of a world, its tokenizer and every figure measured on them are unchanged.

CONSONANTS = "bdfghklmnprstvz"
VOWELS = "aeiou"
SYLLABLES = [c + v for c in CONSONANTS for v in VOWELS]
ENDINGS = ["", "n", "r", "s", "l"]
INSTRUMENTS = ("violin cello flute oboe clarinet bassoon trumpet trombone tuba harp piano organ guitar banjo mandolin "
               "ukulele sitar lute accordion harmonica saxophone xylophone marimba drums bagpipes zither viola piccolo "
               "harpsichord bugle").split()
COLORS = ("red blue green yellow orange purple pink brown black white gray teal maroon navy olive beige crimson "
          "scarlet indigo violet turquoise amber ivory magenta lavender coral gold silver bronze cyan").split()
CITY_SUFFIXES = ["vik", "burg", "ton", "ford", "port", "dale", "holm", "stad", "mere", "field"]
COMPANY_SUFFIXES = ["Labs", "Works", "Systems", "Foods", "Motors", "Textiles", "Mining", "Shipping", "Press", "Bank"]
FILLERS = ["{f} is well known among the neighbours.", "Little else is recorded about {f}.",
           "Friends describe {f} as a quiet person.", "{f} rarely speaks about the past.",
           "Many stories are told about {f}.", "{f} keeps a small notebook of memories."]


@dataclass(frozen=True)
class Fact:
    """One attribute of a person: where it is stated, how, and how each question family asks for it."""

    name: str
    pool: str  # city | year | company | instrument | color | person
    section: int
    passage: tuple[str, ...]  # sentence templates, {s} = subject, {v} = value
    nq: str  # {e} = the person (or "the mentor of <person>" for hotpotqa)
    tqa: tuple[str, ...]  # paraphrases that avoid the passage wording


FACTS = (
    Fact("birthplace", "city", 0, ("{s} was born in {v}.", "{s} grew up in {v}.", "{s} comes from {v}."),
         "where was {e} born?", ("which town is the hometown of {e}?", "{e} originally hails from what place?")),
    Fact("birth year", "year", 0, ("{s} was born in the year {v}.", "The birth year of {s} is {v}.",
                                   "{s} first saw daylight in {v}."),
         "what year was {e} born?", ("in which year did {e} enter the world?", "{e} arrived on earth in what year?")),
    Fact("employer", "company", 0, ("{s} works for {v}.", "{s} is employed by {v}.", "{s} holds a job at {v}."),
         "who employs {e}?", ("which company pays the salary of {e}?", "{e} earns a living at what firm?")),
    Fact("instrument", "instrument", 1, ("{s} plays the {v}.", "{s} practices the {v} every evening.",
                                         "{s} is a skilled {v} player."),
         "what instrument does {e} play?", ("{e} makes music with which instrument?",
                                            "on what instrument does {e} perform?")),
    Fact("favorite color", "color", 1, ("{s} likes the color {v} most.", "The favorite color of {s} is {v}.",
                                        "{s} always wears {v}."),
         "what is the favorite color of {e}?", ("which hue does {e} prefer?", "{e} is fondest of what shade?")),
    Fact("mentor", "person", 1, ("{s} was trained by {v}.", "{s} learned everything from {v}.",
                                 "The mentor of {s} is {v}."),
         "who is the mentor of {e}?", ("who taught {e}?", "{e} was the apprentice of whom?")),
)
MENTOR = 5
BRIDGE_FACTS = tuple(i for i in range(len(FACTS)) if i != MENTOR)
# hotpotqa asks the facts stated beside the mentor (section 1), so the passage that answers a bridge question
# ("the Vuki who was trained by M") names M, as a Wikipedia page names the entities that link to it.
HOTPOT_FACTS = (3, 4)  # instrument, favorite color
COMPARE = {3: "what instrument do {a} and {b} both play?", 4: "what favorite color do {a} and {b} share?"}
ORDERS = list(itertools.permutations(range(3)))


def seeded_key(seed: int, salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{salt}".encode(), digest_size=8).digest(), "little")


def _hash(key: int, x: np.ndarray) -> np.ndarray:
    """splitmix64 of x keyed by `key`: a stateless random number per element (vectorised, order-free)."""
    z = np.asarray(x, dtype=np.uint64) ^ np.uint64(key)
    for _ in range(2):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def seeded_uniform(key: int, x: np.ndarray, n: int) -> np.ndarray:
    return (_hash(key, x) % np.uint64(n)).astype(np.int64)


def coprime_multiplier(key: int, n: int) -> int:
    a = key % n or 1
    while math.gcd(a, n) != 1:
        a = a % n + 1
    return a


def _unique_words(key: int, count: int, make) -> list[str]:
    """`count` distinct strings built by `make(random_uint64)`, deterministic in `key`."""
    words, seen, start = [], set(), 0
    while len(words) < count:
        for h in _hash(key, np.arange(start, start + 4 * count)).tolist():
            word = make(h)
            if word not in seen:
                seen.add(word)
                words.append(word)
                if len(words) == count:
                    break
        start += 4 * count
    return words


def _syllables(h: int, n: int, ending: bool) -> str:
    parts = [SYLLABLES[(h >> (8 * i)) % len(SYLLABLES)] for i in range(n)]
    return ("".join(parts) + (ENDINGS[(h >> 40) % len(ENDINGS)] if ending else "")).capitalize()


class ToyWorld:
    """Every fact and passage of a world as pure functions of (passages, seed)."""

    def __init__(self, passages: int, seed: int):
        if passages < 2 * SECTIONS * DEV_EVERY:
            raise ValueError(f"toy world needs at least {2 * SECTIONS * DEV_EVERY} passages, got {passages}")
        self.passages, self.seed = passages, seed
        self.persons = passages // SECTIONS  # people with both passages; an odd last row is a lone distractor
        # Names: a bijection person -> (first, family) with ~sqrt(persons) of each, so every first and every
        # family name is shared by many people (lexical hard negatives) while full names stay unique.
        self.n_first = self.n_family = math.isqrt(self.persons) + 1
        self.name_space = self.n_first * self.n_family
        self.name_a = coprime_multiplier(seeded_key(seed, "name-a"), self.name_space)
        self.name_b = seeded_key(seed, "name-b") % self.name_space
        self.first_names = _unique_words(seeded_key(seed, "first"), self.n_first, lambda h: _syllables(h, 2, True))
        self.family_names = _unique_words(seeded_key(seed, "family"), self.n_family, lambda h: _syllables(h, 3, True))
        self.pools = {
            "city": _unique_words(seeded_key(seed, "city"), 300, lambda h: _syllables(h, 2, False)
                                  + CITY_SUFFIXES[(h >> 40) % len(CITY_SUFFIXES)]),
            "company": _unique_words(seeded_key(seed, "company"), 300, lambda h: _syllables(h, 2, True) + " "
                                     + COMPANY_SUFFIXES[(h >> 48) % len(COMPANY_SUFFIXES)]),
            "year": [str(y) for y in range(1800, 2000)],
            "instrument": INSTRUMENTS,
            "color": COLORS,
        }
        self.n_dev = -(-self.persons // DEV_EVERY)
        self.n_train = self.persons - self.n_dev
        self._bridge: dict[str, np.ndarray] = {}  # hotpotqa's eligible people, computed on first use
        self._lone: dict[tuple[str, int], np.ndarray] = {}

    # ---- facts -------------------------------------------------------------------------------------
    def name_parts(self, persons: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        index = (self.name_a * np.asarray(persons, dtype=np.int64) + self.name_b) % self.name_space
        return index % self.n_first, index // self.n_first

    def names(self, persons: np.ndarray) -> list[str]:
        first, family = self.name_parts(persons)
        return [f"{self.first_names[f]} {self.family_names[g]}" for f, g in zip(first.tolist(), family.tolist())]

    def person_with_name(self, first: np.ndarray, family: np.ndarray) -> np.ndarray:
        """Inverse of name_parts; -1 where that name belongs to nobody in this world."""
        a_inv = pow(self.name_a, -1, self.name_space)
        person = (a_inv * ((first + self.n_first * family - self.name_b) % self.name_space)) % self.name_space
        return np.where(person < self.persons, person, -1)

    def fact_values(self, persons: np.ndarray, fact: int) -> np.ndarray:
        """Pool index of the fact (for `mentor`: the mentor's person id, never the person itself)."""
        key = seeded_key(self.seed, f"fact-{fact}")
        if FACTS[fact].pool == "person":
            other = seeded_uniform(key, persons, self.persons - 1)
            return other + (other >= persons)
        return seeded_uniform(key, persons, len(self.pools[FACTS[fact].pool]))

    def fact_strings(self, persons: np.ndarray, fact: int) -> list[str]:
        values = self.fact_values(persons, fact)
        if FACTS[fact].pool == "person":
            return self.names(values)
        pool = self.pools[FACTS[fact].pool]
        return [pool[v] for v in values.tolist()]

    # ---- passages ----------------------------------------------------------------------------------
    def render(self, rows: np.ndarray) -> tuple[list[str], list[str]]:
        """(titles, texts) of passage rows: person row // 2, section row % 2, facts in a random order."""
        rows = np.asarray(rows, dtype=np.int64)
        persons, sections = rows // SECTIONS, rows % SECTIONS
        titles = self.names(persons)
        first = [name.split(" ")[0] for name in titles]
        per_fact = []
        for fact_id, fact in enumerate(FACTS):
            strings = self.fact_strings(persons, fact_id)
            choice = seeded_uniform(seeded_key(self.seed, f"template-{fact_id}"), persons, len(fact.passage)).tolist()
            per_fact.append((strings, choice))
        order = seeded_uniform(seeded_key(self.seed, "order"), rows, len(ORDERS)).tolist()
        filler = seeded_uniform(seeded_key(self.seed, "filler"), rows, len(FILLERS)).tolist()
        texts = []
        for i, section in enumerate(sections.tolist()):
            facts = [j for j, fact in enumerate(FACTS) if fact.section == section]
            sentences = []
            for slot in ORDERS[order[i]]:
                strings, choice = per_fact[facts[slot]]
                subject = titles[i] if not sentences else first[i]
                sentences.append(FACTS[facts[slot]].passage[choice[i]].format(s=subject, v=strings[i]))
            sentences.append(FILLERS[filler[i]].format(f=first[i]))
            texts.append(" ".join(sentences))
        return titles, texts

    def passage_dicts(self, rows: np.ndarray) -> list[dict]:
        titles, texts = self.render(rows)
        return [{"passage_id": f"p{r}", "title": t, "text": x} for r, t, x in zip(rows.tolist(), titles, texts)]

    # ---- questions ---------------------------------------------------------------------------------
    def split_persons(self, split: str, j: np.ndarray) -> np.ndarray:
        """The j-th dev person (multiples of DEV_EVERY) or j-th train person (all others)."""
        if split == "dev":
            return j * DEV_EVERY
        return (j // (DEV_EVERY - 1)) * DEV_EVERY + j % (DEV_EVERY - 1) + 1

    def split_size(self, split: str) -> int:
        return self.n_dev if split == "dev" else self.n_train

    def capacity(self, family: str, split: str) -> int:
        if family in FAMILY_MODULES:
            return FAMILY_MODULES[family].capacity(self, split)
        if family == "hotpotqa":
            return 3 * self._hotpot_triples(split)
        facts = len(BRIDGE_FACTS) if family == "mentor_bridge" else len(FACTS)
        return self.split_size(split) * facts

    def questions(self, family: str, split: str, start: int, stop: int) -> list[dict]:
        """Questions start..stop of a family/split: distinct (person, fact) pairs in a seeded order."""
        if family in FAMILY_MODULES:
            return FAMILY_MODULES[family].questions(self, split, start, stop)
        if family == "hotpotqa":
            return self._hotpot_questions(split, start, stop)
        k = np.arange(start, stop, dtype=np.int64)
        n = self.split_size(split)
        bridge = family == "mentor_bridge"
        key = seeded_key(self.seed, f"{'hotpotqa' if bridge else family}-{split}")  # its version-2 name: same questions
        j = (coprime_multiplier(key, n) * (k % n) + key % n) % n
        persons = self.split_persons(split, j)
        asked = BRIDGE_FACTS if bridge else tuple(range(len(FACTS)))
        slot = (seeded_uniform(key, persons, len(asked)) + k // n) % len(asked)
        facts = np.asarray(asked)[slot]
        names = self.names(persons)
        mentors = self.fact_values(persons, MENTOR)
        subjects = mentors if bridge else persons
        wording = seeded_uniform(key ^ 1, k, 2).tolist()
        out: list[dict] = [{} for _ in range(len(k))]
        for fact_id in range(len(FACTS)):
            idx = np.flatnonzero(facts == fact_id)
            if not len(idx):
                continue
            answers = self.fact_strings(subjects[idx], fact_id)
            gold = subjects[idx] * SECTIONS + FACTS[fact_id].section
            for i, answer, g in zip(idx.tolist(), answers, gold.tolist()):
                fact = FACTS[fact_id]
                if family == "tqa":
                    question = fact.tqa[wording[i]].format(e=names[i])
                else:
                    question = fact.nq.format(e=f"the mentor of {names[i]}" if bridge else names[i])
                gold_ids = [f"p{g}"]
                if bridge:
                    gold_ids.insert(0, f"p{persons[i] * SECTIONS + FACTS[MENTOR].section}")
                out[i] = {"id": f"{family}-{split}-{start + i}", "question": question, "answers": [answer],
                          "gold_ids": gold_ids, "_row": g}
        return out

    # ---- hotpotqa: bridge and comparison questions -------------------------------------------------
    def people_chunks(self, split: Optional[str]) -> Iterator[np.ndarray]:
        """The people of a split (or with split=None, everyone) in chunks of 2**20: flat memory at any size."""
        n = self.persons if split is None else self.split_size(split)
        for begin in range(0, n, 1 << 20):
            j = np.arange(begin, min(begin + (1 << 20), n))
            yield j if split is None else self.split_persons(split, j)

    @functools.cached_property
    def _alone_keys(self) -> np.ndarray:
        """Sorted (mentor, apprentice's first name) keys that exactly one person has."""
        unique, counts = np.unique(np.concatenate([self._apprentice_keys(p) for p in self.people_chunks(None)]),
                                   return_counts=True)
        return unique[counts == 1]

    def _apprentice_keys(self, persons: np.ndarray) -> np.ndarray:
        return self.fact_values(persons, MENTOR) * self.n_first + self.name_parts(persons)[0]

    def bridge_people(self, split: str) -> np.ndarray:
        """The people of a split that "the <first name> who was trained by <mentor>" names alone (no other apprentice
        of their mentor has their first name), in split order; their section-1 passage answers it."""
        if split not in self._bridge:
            alone, found = self._alone_keys, []
            for persons in self.people_chunks(split):
                keys = self._apprentice_keys(persons)
                at = np.minimum(np.searchsorted(alone, keys), len(alone) - 1)
                found.append(persons[alone[at] == keys])
            self._bridge[split] = np.concatenate(found)
        return self._bridge[split]

    def lone_holders(self, split: str, fact: int) -> np.ndarray:
        """Sorted split indices of the people whose value of `fact` nobody else in the split has (at most one per
        value): they cannot be compared with anyone, everyone else can."""
        if (split, fact) not in self._lone:
            values = np.concatenate([self.fact_values(persons, fact) for persons in self.people_chunks(split)])
            lone = np.flatnonzero(np.bincount(values, minlength=len(self.pools[FACTS[fact].pool])) == 1)
            self._lone[(split, fact)] = np.flatnonzero(np.isin(values, lone))
        return self._lone[(split, fact)]

    def _hotpot_triples(self, split: str) -> int:
        shareable = min(self.split_size(split) - len(self.lone_holders(split, fact)) for fact in HOTPOT_FACTS)
        return min(len(self.bridge_people(split)), len(HOTPOT_FACTS) * shareable)

    def _compare_partners(self, split: str, j: np.ndarray, fact: int) -> np.ndarray:
        """Split index of the next person after each j (cyclically, in split order) with the same value of `fact`."""
        n = self.split_size(split)
        values = self.fact_values(self.split_persons(split, j), fact)
        partner = np.full(len(j), -1, dtype=np.int64)
        pending = np.arange(len(j))
        for offset in range(1, n):
            if not len(pending):
                break
            candidate = (j[pending] + offset) % n
            hit = self.fact_values(self.split_persons(split, candidate), fact) == values[pending]
            partner[pending[hit]] = candidate[hit]
            pending = pending[~hit]
        if len(pending):
            raise AssertionError("a person no one shares the value with was chosen for a comparison")
        return partner

    def _hotpot_questions(self, split: str, start: int, stop: int) -> list[dict]:
        """Question k is a bridge question when k % 3 < 2 and a comparison when k % 3 == 2 (2:1; HotpotQA's
        own mix is about 4:1). Bridge: "what instrument does the Vuki who was trained by Binu Hemosas play?",
        answered by that apprentice's section-1 passage, which names both (so a single retrieval from the question
        can reach it, unlike mentor_bridge's second hop; the title is another name). Comparison: "what instrument
        do X and Y both play?" for two people of the split sharing it: both section-1 passages state the answer."""
        key = seeded_key(self.seed, f"hotpotqa-v3-{split}")
        k = np.arange(start, stop, dtype=np.int64)
        t, r = k // 3, k % 3
        people = np.full((len(k), 2), -1, dtype=np.int64)  # [asked person, comparison partner or -1]
        facts = np.zeros(len(k), dtype=np.int64)
        questions = [""] * len(k)

        bridge = np.flatnonzero(r < 2)
        eligible = self.bridge_people(split)
        b = 2 * t[bridge] + r[bridge]
        m = len(eligible)
        person = eligible[(coprime_multiplier(key, m) * (b % m) + key % m) % m]
        facts[bridge] = np.asarray(HOTPOT_FACTS)[(seeded_uniform(key, person, 2) + b // m) % 2]
        people[bridge, 0] = person
        mentors = self.names(self.fact_values(person, MENTOR))
        firsts = [name.split(" ")[0] for name in self.names(person)]
        for i, first, mentor in zip(bridge.tolist(), firsts, mentors):
            questions[i] = FACTS[facts[i]].nq.format(e=f"the {first} who was trained by {mentor}")

        for slot, fact in enumerate(HOTPOT_FACTS):
            idx = np.flatnonzero((r == 2) & (t % len(HOTPOT_FACTS) == slot))
            if not len(idx):
                continue
            lone = self.lone_holders(split, fact)
            n = self.split_size(split) - len(lone)
            c = (coprime_multiplier(key ^ fact, n) * (t[idx] // len(HOTPOT_FACTS) % n) + (key ^ fact) % n) % n
            j = c + np.searchsorted(lone - np.arange(len(lone)), c, side="right")  # the c-th person not lone
            pair = self.split_persons(split, np.stack([j, self._compare_partners(split, j, fact)], axis=1))
            people[idx], facts[idx] = pair, fact
            names = self.names(pair.reshape(-1))
            for row, i in enumerate(idx.tolist()):
                questions[i] = COMPARE[fact].format(a=names[2 * row], b=names[2 * row + 1])

        answers = np.empty(len(k), dtype=object)
        for fact in HOTPOT_FACTS:
            idx = np.flatnonzero(facts == fact)
            answers[idx] = self.fact_strings(people[idx, 0], fact)
        out = []
        for i in range(len(k)):
            gold = [int(p) * SECTIONS + FACTS[facts[i]].section for p in people[i] if p >= 0]
            out.append({"id": f"hotpotqa-{split}-{start + i}", "question": questions[i], "answers": [answers[i]],
                        "gold_ids": [f"p{g}" for g in gold], "_row": gold[0]})
        return out

    def name_sharer(self, persons: np.ndarray, keep_first: bool, step: int) -> np.ndarray:
        """The person named with the same first (or family) name as each of `persons` and the other name part
        `step` places further in its pool; -1 where that name belongs to nobody else."""
        first, family = self.name_parts(persons)
        f = first if keep_first else (first + step) % self.n_first
        g = (family + step) % self.n_family if keep_first else family
        candidate = self.person_with_name(f, g)
        return np.where(candidate != persons, candidate, -1)

    def hard_negative_rows(self, gold_rows: np.ndarray) -> np.ndarray:
        """[B, 3]: the person's other passage, and the same section of a person sharing the first
        name and of one sharing the family name (same title words, same templates, other facts)."""
        persons, sections = gold_rows // SECTIONS, gold_rows % SECTIONS
        negatives = [persons * SECTIONS + (1 - sections)]
        for keep_first in (True, False):
            found = np.full(len(persons), -1, dtype=np.int64)
            for step in range(1, 17):
                candidate = self.name_sharer(persons, keep_first, step)
                found = np.where((found < 0) & (candidate >= 0), candidate, found)
            offset = seeded_uniform(seeded_key(self.seed, "neg"), persons, self.persons - 1)
            fallback = (persons + 1 + offset) % self.persons
            negatives.append(np.where(found >= 0, found, fallback) * SECTIONS + sections)
        return np.stack(negatives, axis=1)
