"""Question splits of a described toy world for generative retrieval, where a target title cannot be copied.

A generative retriever writes its target's title. In the named families every question contains that title (the
person's name), so a model that learns to copy solves them (docs/generative_retrieval_log.md). A described question
names its person by first name and another fact (rag_train/data/toy_described.py): the title is never in it. The
splits, all of the described family, written as DPR JSONL (question, answers, positive_ctxs) into their own folder:

  train-100 / train-30 / train-10  nested prefixes of the world's `described-train` questions (its seeded order):
                                   100%, 30% and 10% of them (seed 003's data-efficiency claim)
  seen-dev                         new (person, asked fact) pairs of people asked in train-10, hence in every fraction
                                   (the question differs from every training one; the person does not)
  unseen-dev                       the world's dev people, whose questions never appear in training (zero-shot)
  bridge-train / bridge-seen-dev / bridge-unseen-dev
                                   multi-hop, the `mentor_bridge` family ("where was the mentor of Gorar Figinis
                                   born?"): two gold passages, the named person's (its title is in the question, as
                                   HotpotQA names its first entity) and the mentor's, which states the answer and whose
                                   title is never in the question; seen-dev asks new facts of the mentors of people
                                   asked in bridge-train, unseen-dev asks about the world's dev people

`python scripts/make_toy_splits.py --world DIR --out DIR` writes them; runs name them with `data.train=` and
`data.dev=[...]` (the world stays the toy world: its passages, tokenizer and LM inits). The folder's manifest records
the world's fingerprint, the sizes, chance (a uniform guess among the world's people sharing the question's first
name; for seen-dev also among the people each fraction trains on) and the description's R@1 ceiling; an existing
folder of other splits is not replaced without --overwrite.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import numpy as np

from rag_train.data import toy_described
from rag_train.data.sources import world_fingerprint
from rag_train.data.toy import SECTIONS, ToyWorld
from rag_train.io import atomic_open, atomic_write_json, read_json

FRACTIONS = (100, 30, 10)  # percent of the world's described-train questions
BRIDGE_FILES = ("train", "seen-dev", "unseen-dev")  # the multi-hop splits of the mentor_bridge family
SPLITS_VERSION = 2  # 2: the bridge files
CHUNK = 16384
# the manifest's figures; a folder of these settings whose manifest lacks one (an older writer's) is written again,
# to the same split files
DERIVED = ("counts", "people", "chance", "ceiling", "trained_chance")


def fraction_count(total: int, percent: int) -> int:
    """Questions in a `percent` prefix of `total` (at least one)."""
    return max(1, total * percent // 100)


def _person(question: dict) -> int:
    """The person a question asks about: its first gold passage's (described: its only one; bridge: the one named)."""
    return int(question["gold_ids"][0][1:]) // SECTIONS


def seen_questions(world: ToyWorld, family: str, start: int, seen: set[int], count: int) -> list[dict]:
    """The first `count` train questions of `family` from `start` on whose person is in `seen`. Questions past the
    training ones are new (person, asked fact) pairs: a family's order never repeats a pair."""
    out, capacity = [], world.capacity(family, "train")
    for begin in range(start, capacity, CHUNK):
        out += [q for q in world.questions(family, "train", begin, min(begin + CHUNK, capacity))
                if _person(q) in seen]
        if len(out) >= count:
            return out[:count]
    raise ValueError(f"{family}: only {len(out)} unasked (person, fact) pairs of the {len(seen)} people asked in "
                     f"training; ask for fewer dev questions than {count}")


def first_name_chance(world: ToyWorld, questions: list[dict], trained: Optional[list[dict]] = None,
                      ks: tuple[int, ...] = (1, 5, 10)) -> dict[str, float]:
    """Recall@k (%) of a uniform guess among the people who share the question's first name (which the question
    states): the mean over questions of min(1, k / that count). The people are the world's, or with `trained` those
    asked there: what a generator that writes only people it was trained on gets without knowing which one (every
    question's person must be among them; the seen-dev people are in every fraction)."""
    people = (np.arange(world.persons) if trained is None
              else np.unique(np.array([_person(q) for q in trained], dtype=np.int64)))
    counts = np.bincount(world.name_parts(people)[0], minlength=world.n_first)
    firsts = world.name_parts(np.array([_person(q) for q in questions], dtype=np.int64))[0]
    if not counts[firsts].all():
        raise ValueError("a question's person was not asked in training: no guess among the trained people fits it")
    return {str(k): round(100.0 * float(np.mean(np.minimum(1.0, k / counts[firsts]))), 2) for k in ks}


def description_ceiling(world: ToyWorld, split: str, questions: list[dict]) -> float:
    """The best R@1 (%) of any retriever: a question fits 1 / (the people its description fits) of its answers."""
    index = np.array([int(q["id"].rsplit("-", 1)[1]) for q in questions], dtype=np.int64)
    # one pass over the world's people for the whole span (a call per question would pass over them per question)
    fits = toy_described.fitting(world, split, int(index.min()), int(index.max()) + 1)[index - index.min()]
    return round(float(100.0 * np.mean(1.0 / fits)), 2)


def _check_no_title(name: str, questions: list[dict], titles: list[str]) -> None:
    for question, title in zip(questions, titles):
        if title.lower() in question["question"].lower():
            raise AssertionError(f"{name}: question {question['id']} contains its target title {title!r}")


def _write(path: Path, world: ToyWorld, questions: list[dict]) -> list[str]:
    """DPR JSONL of the questions (their gold passages as positives, in order); returns the answer passages'
    titles (the passage stating the answer: a bridge question's second gold)."""
    rows = [int(g[1:]) for q in questions for g in q["gold_ids"]]
    gold = dict(zip(rows, world.passage_dicts(np.array(rows, dtype=np.int64))))
    with atomic_open(path, "w") as handle:
        for q in questions:
            handle.write(json.dumps({"id": q["id"], "question": q["question"], "answers": q["answers"],
                                     "positive_ctxs": [gold[int(g[1:])] for g in q["gold_ids"]]}) + "\n")
    return [gold[q["_row"]]["title"] for q in questions]


def split_paths(out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    names = [f"train-{p}" for p in FRACTIONS] + ["seen-dev", "unseen-dev"] + [f"bridge-{n}" for n in BRIDGE_FILES]
    return {**{name: out_dir / f"{name}.jsonl" for name in names}, "manifest": out_dir / "manifest.json"}


def make_splits(world_dir: str | Path, out_dir: str | Path, dev_questions: int = 300,
                overwrite: bool = False) -> dict[str, Path]:
    """Write the splits of the described world in `world_dir` to `out_dir` (see the module doc). The same world
    and settings give the same bytes; a finished folder of the same ones is reused."""
    world_dir, paths = Path(world_dir), split_paths(out_dir)
    world_manifest = world_dir / "manifest.json"
    if not world_manifest.is_file() or not (world_dir / "passages.jsonl").is_file():
        raise FileNotFoundError(f"{world_dir}: not a toy world (no manifest.json and passages.jsonl; make one: "
                                "python scripts/make_toy_data.py --retrieval described ...)")
    info = read_json(world_manifest)
    if info.get("retrieval") != "described":
        raise ValueError(f"{world_manifest}: field 'retrieval' is {info.get('retrieval')!r}; the splits need a "
                         "described world (make_toy_data.py --retrieval described)")
    if dev_questions < 1:
        raise ValueError(f"dev_questions={dev_questions}: must be >= 1")
    world = ToyWorld(info["passages"], info["seed"])
    train_count = info["counts"]["described-train"]
    expected = {"version": SPLITS_VERSION, "world": world_fingerprint(world_manifest),
                "world_dir": str(world_dir.resolve()), "dev_questions": dev_questions, "fractions": list(FRACTIONS)}
    if paths["manifest"].is_file():
        found = read_json(paths["manifest"])
        same = {key: found.get(key) for key in expected} == expected
        if same and all(p.is_file() for p in paths.values()) and all(key in found for key in DERIVED):
            return paths
        if not same and not overwrite:
            raise FileExistsError(f"{paths['manifest']}: splits of other settings or another world are there "
                                  f"(field 'world' {str(found.get('world'))[:12]}...); "
                                  "pass --overwrite to replace them")
    elif Path(out_dir).is_dir() and any(Path(out_dir).iterdir()) and not overwrite:
        raise FileExistsError(f"{out_dir}: not empty and not a splits folder; pass --overwrite or pick another --out")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths["manifest"].unlink(missing_ok=True)  # written last: a folder without it is never taken as finished

    train = toy_described.questions(world, "train", 0, train_count)
    smallest = train[: fraction_count(train_count, min(FRACTIONS))]
    sets = {f"train-{p}": train[: fraction_count(train_count, p)] for p in FRACTIONS}
    sets["seen-dev"] = seen_questions(world, "described", train_count, {_person(q) for q in smallest}, dev_questions)
    sets["unseen-dev"] = toy_described.questions(
        world, "dev", 0, min(dev_questions, toy_described.capacity(world, "dev")))
    bridge_count = info["counts"]["mentor_bridge-train"]
    bridge = world.questions("mentor_bridge", "train", 0, bridge_count)
    sets["bridge-train"] = bridge
    sets["bridge-seen-dev"] = seen_questions(world, "mentor_bridge", bridge_count, {_person(q) for q in bridge},
                                             dev_questions)
    sets["bridge-unseen-dev"] = world.questions(
        "mentor_bridge", "dev", 0, min(dev_questions, world.capacity("mentor_bridge", "dev")))
    counts = {}
    for name, questions in sets.items():
        _check_no_title(name, questions, _write(paths[name], world, questions))
        counts[name] = len(questions)
    dev = {"seen-dev": "train", "unseen-dev": "dev"}  # the family split each dev file's questions come from
    atomic_write_json(paths["manifest"], {
        **expected, "counts": counts, "people": {name: len({_person(q) for q in qs}) for name, qs in sets.items()},
        "chance": {name: first_name_chance(world, sets[name]) for name in dev},
        "trained_chance": {f"train-{p}": first_name_chance(world, sets["seen-dev"], sets[f"train-{p}"])
                           for p in FRACTIONS},
        "ceiling": {name: description_ceiling(world, split, sets[name]) for name, split in dev.items()}})
    return paths


def main(argv: Optional[list[str]] = None) -> None:
    """`scripts/make_toy_splits.py`: write the generative-retrieval splits of a described world and print them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", required=True, help="a described toy world (make_toy_data.py --retrieval described)")
    parser.add_argument("--out", required=True, help="folder for the split files")
    parser.add_argument("--dev-questions", type=int, default=300, help="questions in each dev file")
    parser.add_argument("--overwrite", action="store_true", help="replace a splits folder of other settings")
    args = parser.parse_args(argv)
    try:
        paths = make_splits(args.world, args.out, args.dev_questions, args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        parser.error(str(exc))
    manifest = read_json(paths["manifest"])
    for name, path in paths.items():
        extra = ""
        if name in manifest["counts"]:
            extra = f"  ({manifest['counts'][name]} questions, {manifest['people'][name]} people)"
        print(f"{name}: {path}{extra}")
