"""Generative-retrieval splits of a described world (rag_train/data/toy_splits.py): no question contains its target
title, over every split and against the passages file; the fractions are nested prefixes of the world's own
described-train file; seen-dev asks only people of the smallest fraction about facts never asked in training;
unseen-dev asks only people never asked in training; a folder of other splits is refused."""

import collections
import json
import shutil

import pytest

from rag_train.data.corpus import Corpus
from rag_train.data.supervised import load_retrieval
from rag_train.data.toy_splits import FRACTIONS, main, make_splits

from conftest import read_jsonl

DEV = 40


@pytest.fixture(scope="module")
def splits(described_world, tmp_path_factory):
    return make_splits(described_world["manifest"].parent, tmp_path_factory.mktemp("splits") / "s", dev_questions=DEV)


def person(passage_id):
    return int(passage_id[1:]) // 2  # two passages per person: rows 2e and 2e + 1


def pairs(rows):
    """(person, asked fact) of each question, the fact read as its answer (every fact draws from its own pool)."""
    return [(person(r["positive_ctxs"][0]["passage_id"]), r["answers"][0]) for r in rows]


def test_no_question_contains_its_target_title_in_any_split(described_world, splits):
    titles = {p["id"]: p["title"] for p in read_jsonl(described_world["passages"])}
    checked = 0
    for name, path in splits.items():
        if name == "manifest" or name.startswith("bridge-"):  # the bridge files: their own test below
            continue
        for row in read_jsonl(path):
            gold = row["positive_ctxs"][0]
            assert gold["title"] == titles[gold["passage_id"]]
            assert titles[gold["passage_id"]].lower() not in row["question"].lower(), (name, row)
            checked += 1
    manifest = json.loads(splits["manifest"].read_text())
    assert checked == sum(n for name, n in manifest["counts"].items() if not name.startswith("bridge-"))
    assert manifest["counts"]["seen-dev"] == DEV


def test_chance_is_a_uniform_guess_among_the_people_sharing_the_first_name(described_world, splits):
    """The manifest's chance recall, against a count of first names over the passages file's distinct titles."""
    titles = {p["title"] for p in read_jsonl(described_world["passages"])}
    people = collections.Counter(title.split()[0] for title in titles)
    chance = json.loads(splits["manifest"].read_text())["chance"]
    for name in ("seen-dev", "unseen-dev"):
        firsts = [row["positive_ctxs"][0]["title"].split()[0] for row in read_jsonl(splits[name])]
        for k in (1, 5, 10):
            assert chance[name][str(k)] == pytest.approx(100 * sum(min(1, k / people[f]) for f in firsts) / len(firsts),
                                                          abs=0.006)


def test_trained_chance_is_a_guess_among_the_people_each_fraction_trains_on(splits):
    """The manifest's chance among the trained people, against a count of first names over each training file's gold
    titles (every seen-dev person is among them)."""
    trained_chance = json.loads(splits["manifest"].read_text())["trained_chance"]
    firsts = [row["positive_ctxs"][0]["title"].split()[0] for row in read_jsonl(splits["seen-dev"])]
    for percent in FRACTIONS:
        titles = {row["positive_ctxs"][0]["title"] for row in read_jsonl(splits[f"train-{percent}"])}
        people = collections.Counter(title.split()[0] for title in titles)
        for k in (1, 5, 10):
            expected = 100 * sum(min(1, k / people[f]) for f in firsts) / len(firsts)
            assert trained_chance[f"train-{percent}"][str(k)] == pytest.approx(expected, abs=0.006)
    assert trained_chance["train-10"]["1"] > trained_chance["train-100"]["1"]  # fewer people share a name in 10%


def test_a_manifest_without_a_figure_is_completed_with_the_same_split_files(splits):
    """Splits of the same settings whose manifest an older writer wrote (no trained_chance) are written again: the
    files come out byte for byte as before, the manifest gains the figure; other settings are still refused."""
    folder = splits["manifest"].parent
    before = {name: path.read_bytes() for name, path in splits.items()}
    manifest = json.loads(before["manifest"])
    older = {key: value for key, value in manifest.items() if key != "trained_chance"}
    splits["manifest"].write_text(json.dumps(older))
    world = manifest["world_dir"]
    make_splits(world, folder, dev_questions=DEV)
    assert {name: path.read_bytes() for name, path in splits.items()} == before
    with pytest.raises(FileExistsError, match="--overwrite"):
        make_splits(world, folder, dev_questions=DEV + 1)


def test_fractions_are_nested_prefixes_of_the_worlds_training_questions(described_world, splits):
    world_train = read_jsonl(described_world["described-train"])
    full = read_jsonl(splits["train-100"])
    assert [(r["id"], r["question"], r["answers"], [r["positive_ctxs"][0]["passage_id"]]) for r in full] == \
        [(r["id"], r["question"], r["answers"], r["gold_ids"]) for r in world_train]
    for percent in FRACTIONS:
        part = read_jsonl(splits[f"train-{percent}"])
        assert part == full[: len(world_train) * percent // 100]


def test_seen_dev_asks_new_facts_of_people_in_every_fraction_and_unseen_dev_people_never_asked(described_world, splits):
    seen, unseen = pairs(read_jsonl(splits["seen-dev"])), pairs(read_jsonl(splits["unseen-dev"]))
    every_train_pair = set(pairs(read_jsonl(splits["train-100"])))
    smallest = {p for p, _ in pairs(read_jsonl(splits[f"train-{min(FRACTIONS)}"]))}
    assert len(set(seen)) == len(seen) == DEV
    assert not set(seen) & every_train_pair
    assert {p for p, _ in seen} <= smallest
    assert len(unseen) == DEV and not {p for p, _ in unseen} & {p for p, _ in every_train_pair}
    assert [r["question"] for r in read_jsonl(splits["unseen-dev"])] == \
        [r["question"] for r in read_jsonl(described_world["described-dev"])][:DEV]


def test_split_files_load_as_retrieval_sets_against_the_worlds_corpus(described_world, splits):
    corpus = Corpus.open(described_world["passages"])
    examples = load_retrieval(splits["seen-dev"], corpus=corpus)
    assert [ex.question for ex in examples] == [r["question"] for r in read_jsonl(splits["seen-dev"])]


def test_same_settings_reuse_the_folder_and_other_ones_are_refused(described_world, splits, capsys, tmp_path):
    before = {name: path.read_bytes() for name, path in splits.items()}
    assert make_splits(described_world["manifest"].parent, splits["manifest"].parent, dev_questions=DEV) == splits
    assert {name: path.read_bytes() for name, path in splits.items()} == before
    with pytest.raises(SystemExit):
        main(["--world", str(described_world["manifest"].parent), "--out", str(splits["manifest"].parent),
              "--dev-questions", "7"])
    assert "--overwrite" in capsys.readouterr().err
    assert {name: path.read_bytes() for name, path in splits.items()} == before
    with pytest.raises(FileNotFoundError, match="not a toy world"):
        make_splits(splits["manifest"].parent, splits["manifest"].parent / "x")
    copy = tmp_path / "copy"
    shutil.copytree(splits["manifest"].parent, copy)
    (copy / "notes.txt").write_text("mine")
    replaced = make_splits(described_world["manifest"].parent, copy, dev_questions=7, overwrite=True)
    assert len(read_jsonl(replaced["seen-dev"])) == 7
    assert json.loads(replaced["manifest"].read_text())["dev_questions"] == 7
    assert read_jsonl(replaced["seen-dev"]) == read_jsonl(splits["seen-dev"])[:7]  # the same order, cut shorter
    assert (copy / "notes.txt").read_text() == "mine"  # only the splits' own files are replaced


def test_bridge_files_name_the_first_person_and_never_the_answer_passages_title(described_world, splits):
    """Multi-hop (mentor_bridge): two golds per question, the named person's passage (its title in the question) and
    the mentor's, whose title never is; bridge-train is the world's own file; seen-dev asks new facts of mentors of
    people asked in training, unseen-dev asks about people never asked."""
    titles = {p["id"]: p["title"] for p in read_jsonl(described_world["passages"])}
    for name in ("bridge-train", "bridge-seen-dev", "bridge-unseen-dev"):
        for row in read_jsonl(splits[name]):
            named, answer = (ctx["passage_id"] for ctx in row["positive_ctxs"])
            assert titles[named] in row["question"] and titles[answer] not in row["question"], (name, row)
            assert person(named) != person(answer)
    train = read_jsonl(splits["bridge-train"])
    assert [[c["passage_id"] for c in r["positive_ctxs"]] for r in train] == \
        [r["gold_ids"] for r in read_jsonl(described_world["mentor_bridge-train"])]
    seen, unseen = pairs(read_jsonl(splits["bridge-seen-dev"])), pairs(read_jsonl(splits["bridge-unseen-dev"]))
    assert len(seen) == len(unseen) == DEV and not set(seen) & set(pairs(train))
    assert {p for p, _ in seen} <= {p for p, _ in pairs(train)}
    assert not {p for p, _ in unseen} & {p for p, _ in pairs(train)}
