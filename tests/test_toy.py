"""Toy world, offline tokenizer and tiny T5 config: determinism, structure, closed world, hard negatives."""

import collections
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from transformers import AutoTokenizer, T5ForConditionalGeneration

import rag_train.data.tokenizer as tokenizer_module
import rag_train.data.toy_files as toy_files
from rag_train.config import ConfigError, DataConfig, TinyModelConfig
from rag_train.data.tokenizer import load_tokenizer, train_tokenizer
from rag_train.data.toy import FAMILIES, ToyWorld
from rag_train.data.toy_files import ensure_toy_world, generate_toy_world, toy_paths
from rag_train.models.tiny import tiny_t5_config

from conftest import read_jsonl

TOY_WORLD_DOC = Path(__file__).resolve().parents[1] / "docs" / "toy_world.md"


def stated_in_the_doc(sentence: str) -> None:
    """docs/toy_world.md states the test world's figures (2000 passages, seed 0) as computed here: a figure that moves
    with the generator, or one edited by hand, fails."""
    assert sentence in " ".join(TOY_WORLD_DOC.read_text().split()), sentence

NAME = re.compile(r"[A-Z][a-z]+ [A-Z][a-z]+")


@pytest.fixture(scope="module")
def passages(toy_world):
    return {p["id"]: p for p in read_jsonl(toy_world["passages"])}


def all_files(paths):
    files = {name: p.read_bytes() for name, p in paths.items() if p.is_file()}
    files.update({f"tokenizer/{f.name}": f.read_bytes() for f in sorted(paths["tokenizer"].glob("*"))})
    return files


def test_same_seed_gives_byte_identical_world_and_chunking_does_not_matter(tmp_path, monkeypatch):
    first = all_files(generate_toy_world(tmp_path / "a", 600, seed=3, progress=False, tokenizer_vocab=600))
    second = all_files(generate_toy_world(tmp_path / "b", 600, seed=3, progress=False, tokenizer_vocab=600))
    assert first.keys() == second.keys() and "tokenizer/tokenizer.json" in first
    assert first == second
    monkeypatch.setattr(toy_files, "CHUNK", 37)  # streaming in small chunks must not change a byte
    chunked = generate_toy_world(tmp_path / "c", 600, seed=3, progress=False, tokenizer_vocab=None)
    assert all(chunked[n].read_bytes() == first[n] for n in chunked if chunked[n].suffix == ".jsonl")
    other = generate_toy_world(tmp_path / "d", 600, seed=4, progress=False, tokenizer_vocab=None)
    assert other["passages"].read_bytes() != first["passages"]


def test_passages_rendered_in_worker_processes_are_the_same_bytes(tmp_path, monkeypatch):
    serial = generate_toy_world(tmp_path / "a", 600, seed=3, progress=False, tokenizer_vocab=None, questions=20,
                                dev_questions=10)
    monkeypatch.setattr(toy_files, "CHUNK", 97)  # 7 chunks over 3 workers: their results must land in row order
    parallel = generate_toy_world(tmp_path / "b", 600, seed=3, progress=False, tokenizer_vocab=None, questions=20,
                                  dev_questions=10, workers=3)
    assert parallel["passages"].read_bytes() == serial["passages"].read_bytes()
    assert len(parallel["passages"].read_text().splitlines()) == 600


def test_passages_are_short_unique_people_two_each(toy_world, passages):
    rows = list(passages.values())
    assert len(rows) == 2000 and [p["id"] for p in rows] == [f"p{i}" for i in range(2000)]
    words = [len(p["text"].split()) for p in rows]
    assert 20 <= min(words) and max(words) <= 50
    stated_in_the_doc(f"{min(words)}-{max(words)} words per passage")
    titles = collections.Counter(p["title"] for p in rows)
    assert len(titles) == 1000 and set(titles.values()) == {2}
    # first and family names are each shared by many people: titles alone are weak evidence
    firsts = collections.Counter(t.split()[0] for t in titles)
    families = collections.Counter(t.split()[1] for t in titles)
    assert max(firsts.values()) >= 5 and max(families.values()) >= 5
    per_name = 2 * len(titles) / (len(firsts) + len(families))
    stated_in_the_doc(f"{len(titles):,} people, {len(firsts)} first names and {len(families)} family names, "
                      f"{per_name:.1f} people per name on average")


MENTOR_SENTENCE = re.compile(r"(?:was trained by|learned everything from) ([A-Z][a-z]+ [A-Z][a-z]+)\.|"
                             r"The mentor of [A-Z][a-z]+(?: [A-Z][a-z]+)? is ([A-Z][a-z]+ [A-Z][a-z]+)\.")


def mentor_in(passage):
    found = MENTOR_SENTENCE.search(passage["text"])
    return found and (found.group(1) or found.group(2))


def test_question_families_gold_passages_state_the_answer(toy_world, passages):
    world = ToyWorld(2000, 0)
    # (mentor, first name of the apprentice) of every section-1 passage
    apprentices = collections.Counter((mentor_in(p), p["title"].split()[0]) for p in passages.values() if mentor_in(p))
    kinds = collections.Counter()
    for family in FAMILIES:
        for split, default in (("train", 2000), ("dev", 200)):
            questions = read_jsonl(toy_world[f"{family}-{split}"])
            expected = min(default, world.capacity(family, split))
            assert len(questions) == expected
            assert len({q["id"] for q in questions}) == expected
            assert len({q["question"] for q in questions}) == expected  # distinct (person, fact) pairs
            for q in questions:
                assert list(q) == ["id", "question", "answers", "gold_ids"]
                assert len(q["answers"]) == 1 and 1 <= len(q["answers"][0].split()) <= 2
                gold = [passages[g] for g in q["gold_ids"]]
                named = NAME.findall(q["question"])
                if family == "mentor_bridge":
                    assert q["question"].count("the mentor of ") == 1 and len(gold) == 2
                    assert gold[0]["title"] == named[0]
                    assert mentor_in(gold[0]) == gold[1]["title"]  # bridge: mentor named in hop 1
                elif family == "hotpotqa" and "who was trained by" in q["question"]:
                    kinds["bridge"] += 1
                    first, mentor = re.search(r"the ([A-Z][a-z]+) who was trained by ([A-Z][a-z]+ [A-Z][a-z]+)",
                                              q["question"]).groups()
                    # the answer passage names the question's mentor, its title the first name, and it is the only
                    # passage that does both: the question names one person
                    assert len(gold) == 1 and mentor_in(gold[0]) == mentor and gold[0]["title"].split()[0] == first
                    assert apprentices[(mentor, first)] == 1
                elif family == "hotpotqa":
                    kinds["comparison"] += 1
                    assert len(named) == 2 and named[0] != named[1] and [p["title"] for p in gold] == named
                    assert "both play" in q["question"] or "share" in q["question"]
                else:
                    assert len(gold) == 1 and gold[0]["title"] == named[0]
                for passage in gold[1:] if family == "mentor_bridge" else gold:
                    assert re.search(rf"\b{re.escape(q['answers'][0])}\b", passage["text"])
    assert kinds["comparison"] == 2000 // 3 + 200 // 3 and kinds["bridge"] == 2200 - kinds["comparison"]  # k % 3 == 2
    # the people a bridge question can name, against a brute-force count over the passages
    for split, dev in (("train", False), ("dev", True)):
        alone = {p["title"] for p in passages.values()
                 if mentor_in(p) and apprentices[(mentor_in(p), p["title"].split()[0])] == 1
                 and (int(p["id"][1:]) // 2 % 10 == 0) == dev}
        assert set(world.names(world.bridge_people(split))) == alone


def test_nq_and_tqa_wordings_differ(toy_world):
    templates = {f: {NAME.sub("E", q["question"]) for q in read_jsonl(toy_world[f"{f}-train"])} for f in FAMILIES}
    assert len(templates["nq"]) == 6 and len(templates["tqa"]) == 12 and len(templates["mentor_bridge"]) == 5
    bridge = {re.sub(r"the [A-Z][a-z]+ who", "the F who", t) for t in templates["hotpotqa"]}
    assert len(bridge) == 4  # two bridge and two comparison wordings
    assert not templates["nq"] & templates["tqa"]


def test_dev_people_never_asked_in_train(toy_world, passages):
    def asked(split):
        """The people whose facts the questions ask (mentor_bridge: the person named, whose mentor is asked)."""
        named = {NAME.search(q["question"]).group(0) for q in read_jsonl(toy_world[f"mentor_bridge-{split}"])}
        return named | {passages[g]["title"] for f in ("nq", "tqa", "hotpotqa")
                        for q in read_jsonl(toy_world[f"{f}-{split}"]) for g in q["gold_ids"]}

    assert not asked("train") & asked("dev")


# sha256 (first 16 hex digits) of the files of generate_toy_world(600 passages, seed 3, tokenizer_vocab=600) as
# toy version 2 wrote them (commit 43342bd), its hotpotqa-* renamed mentor_bridge-* (ids included)
VERSION_2 = {"passages": "6710893f2cf11364", "nq-train": "2724f4668c2b6acc", "nq-dev": "e42717e1b6f7eb4e",
             "tqa-train": "f0b3403c7d0a6157", "tqa-dev": "488898bf21522425", "retrieval-train": "958cfa78917461df",
             "retrieval-dev": "accee5037669316f", "tokenizer": "2eadf89402167d7d",
             "mentor_bridge-train": "0d9ec59b0fc5d919", "mentor_bridge-dev": "c8eb234831a7ec32"}
VERSION_2_TOKENIZER_TEXTS = "ce44dc07aed60ef5"  # sha256 of the texts version 2 trained its tokenizer on, one per line
VERSION_2_TOKENIZERS = "0.23.3"  # the tokenizers release that wrote VERSION_2["tokenizer"]


def test_version_3_keeps_every_version_2_file_but_hotpotqa(tmp_path):
    """The new hotpotqa is the only change: the single-hop files, the tokenizer (trained on version 2's sample)
    and the old bridge family are byte for byte version 2's, so every figure measured on them carries over."""
    import hashlib

    import tokenizers

    paths = generate_toy_world(tmp_path / "v3", 600, seed=3, progress=False, tokenizer_vocab=600)
    texts = hashlib.sha256()
    for text in toy_files._tokenizer_texts(paths):
        texts.update(text.encode() + b"\n")
    assert texts.hexdigest()[:16] == VERSION_2_TOKENIZER_TEXTS
    paths["tokenizer"] = paths["tokenizer"] / "tokenizer.json"
    expected = dict(VERSION_2)
    if tokenizers.__version__ != VERSION_2_TOKENIZERS:  # another trainer may write other bytes from the same texts
        del expected["tokenizer"]
    found = {name: hashlib.sha256(paths[name].read_bytes()).hexdigest()[:16] for name in expected}
    assert found == expected


def test_closed_world_majority_answer_per_template_fails(toy_world):
    em = {}
    for family in FAMILIES:
        by_template = collections.defaultdict(collections.Counter)
        for q in read_jsonl(toy_world[f"{family}-train"]):
            by_template[NAME.sub("E", q["question"])][q["answers"][0]] += 1
        dev = read_jsonl(toy_world[f"{family}-dev"])
        hits = [by_template[NAME.sub("E", q["question"])].most_common(1)[0][0] == q["answers"][0] for q in dev]
        assert np.mean(hits) < 0.1, family
        em[family] = 100 * np.mean(hits)
    stated_in_the_doc(f"baseline gets {em['nq']:.1f}% EM on `nq` dev, {em['tqa']:.1f}% on `tqa`, "
                      f"{em['hotpotqa']:.1f}% on `hotpotqa` and {em['mentor_bridge']:.1f}% on `mentor_bridge`")


def bm25_top1(passages, questions, k1=1.2, b=0.75):
    """Brute-force BM25 over title + text (the lexical baseline hard negatives must defeat)."""
    words = lambda s: re.findall(r"[a-z0-9]+", s.lower())  # noqa: E731
    vocab, rows, cols, counts, lengths = {}, [], [], [], []
    for i, p in enumerate(passages):
        tokens = words(f"{p['title']} {p['text']}")
        lengths.append(len(tokens))
        for w, n in collections.Counter(tokens).items():
            rows.append(i), cols.append(vocab.setdefault(w, len(vocab))), counts.append(n)
    tf = np.array(counts, dtype=float)
    df = np.bincount(cols, minlength=len(vocab))
    idf = np.log(1 + (len(passages) - df + 0.5) / (df + 0.5))
    lengths = np.array(lengths, dtype=float)
    weight = tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[rows] / lengths.mean())) * idf[cols]
    index = sp.csr_matrix((weight, (rows, cols)), shape=(len(passages), len(vocab)))
    query = sp.lil_matrix((len(vocab), len(questions)))
    for j, q in enumerate(questions):
        for w in set(words(q["question"])) & vocab.keys():
            query[vocab[w], j] = 1.0
    scores = (index @ query.tocsr()).toarray()
    return [passages[i]["id"] for i in scores.argmax(axis=0)]


def test_lexical_retrieval_does_not_solve_the_world(toy_world, passages):
    rows, accuracy = list(passages.values()), {}
    for family in ("nq", "tqa"):
        dev = read_jsonl(toy_world[f"{family}-dev"])
        top1 = bm25_top1(rows, dev)
        accuracy[family] = np.mean([pid in q["gold_ids"] for pid, q in zip(top1, dev)])
        assert 0.2 < accuracy[family] < 0.85, (family, accuracy)  # names help, but hard negatives share them
    stated_in_the_doc(f"top-1 accuracy on dev is {100 * accuracy['nq']:.1f}% for `nq` and "
                      f"{100 * accuracy['tqa']:.1f}% for `tqa`")


def test_retrieval_files_are_dpr_with_hard_negatives(toy_world, passages):
    for split, expected in (("train", 4000), ("dev", 400)):
        rows = read_jsonl(toy_world[f"retrieval-{split}"])
        qa = {q["id"]: q for f in ("nq", "tqa") for q in read_jsonl(toy_world[f"{f}-{split}"])}
        assert len(rows) == expected and {r["id"] for r in rows} == qa.keys()
        for r in rows:
            assert r["question"] == qa[r["id"]]["question"] and r["answers"] == qa[r["id"]]["answers"]
            (positive,) = r["positive_ctxs"]
            assert [positive["passage_id"]] == qa[r["id"]]["gold_ids"]
            negatives = r["hard_negative_ctxs"]
            assert len(negatives) == 3 and positive["passage_id"] not in {n["passage_id"] for n in negatives}
            for ctx in [positive] + negatives:
                stored = passages[ctx["passage_id"]]
                assert (ctx["title"], ctx["text"]) == (stored["title"], stored["text"])
            title_words = set(positive["title"].split())
            assert all(title_words & set(n["title"].split()) for n in negatives)


def test_odd_passage_count_and_bad_sizes(tmp_path):
    paths = generate_toy_world(tmp_path / "odd", 401, seed=0, progress=False, tokenizer_vocab=None)
    assert sum(1 for _ in open(paths["passages"])) == 401
    gold = {g for f in FAMILIES for s in ("train", "dev") for q in read_jsonl(paths[f"{f}-{s}"]) for g in q["gold_ids"]}
    assert "p400" not in gold  # the lone last passage is a distractor only
    with pytest.raises(ValueError, match="at least"):
        ToyWorld(10, 0)
    with pytest.raises(ValueError, match="distinct"):
        generate_toy_world(tmp_path / "big", 400, seed=0, dev_questions=10_000, progress=False, tokenizer_vocab=None)


def test_name_bijection_inverts(toy_world):
    world = ToyWorld(2000, 0)
    persons = np.arange(world.persons)
    assert np.array_equal(world.person_with_name(*world.name_parts(persons)), persons)
    assert len(set(world.names(persons))) == world.persons


def test_ensure_toy_world_builds_once_and_refuses_to_replace_another_world(tmp_path):
    cfg = DataConfig(toy_dir=str(tmp_path / "toy"), toy_passages=400, toy_seed=1)
    paths = ensure_toy_world(cfg, tokenizer_vocab=500)
    assert paths == toy_paths(cfg.toy_dir) and (paths["tokenizer"] / "tokenizer.json").is_file()
    stamp = paths["passages"].stat().st_mtime_ns
    ensure_toy_world(cfg, tokenizer_vocab=500)
    assert paths["passages"].stat().st_mtime_ns == stamp  # reused
    with open(paths["nq-dev"], "a") as handle:  # a damaged file is noticed and the world rebuilt
        handle.write("{}\n")
    ensure_toy_world(cfg, tokenizer_vocab=500)
    assert sum(1 for _ in open(paths["nq-dev"])) == 100
    before = paths["passages"].read_bytes()
    # another seed in the same folder would invalidate the runs and exports made from this world: refused
    with pytest.raises(ConfigError, match=r"toy world of seed 1, 400 passages.*data.toy_seed=2.*data.toy_regenerate"):
        ensure_toy_world(DataConfig(toy_dir=cfg.toy_dir, toy_passages=400, toy_seed=2), tokenizer_vocab=500)
    assert paths["passages"].read_bytes() == before and json.loads(paths["manifest"].read_text())["seed"] == 1
    ensure_toy_world(DataConfig(toy_dir=cfg.toy_dir, toy_passages=400, toy_seed=2, toy_regenerate=True),
                     tokenizer_vocab=500)
    assert json.loads(paths["manifest"].read_text())["seed"] == 2 and paths["passages"].read_bytes() != before


def test_tokenizer_is_t5_style_and_round_trips(toy_world, toy_tokenizer, passages):
    tok = AutoTokenizer.from_pretrained(str(toy_world["tokenizer"]))
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "</s>", "<unk>")
    assert tok.convert_tokens_to_ids("<extra_id_0>") == len(tok) - 1
    assert tok.convert_tokens_to_ids("<extra_id_99>") == len(tok) - 100
    assert len(tok) <= 2000
    texts = [p["text"] for p in list(passages.values())[:50]] + ["who is the mentor of Zyx Qwerty?"]
    for text in texts:
        ids = tok(text).input_ids
        assert ids[-1] == 1 and 2 not in ids  # eos appended; no <unk> on ASCII text
        assert tok.decode(ids, skip_special_tokens=True) == text
    batch = toy_tokenizer(["short", texts[0]], padding=True)
    length = sum(batch.attention_mask[0])
    assert length < len(batch.input_ids[0]) and batch.input_ids[0][length - 1] == 1
    assert batch.input_ids[0][length:] == [0] * (len(batch.input_ids[0]) - length)  # padded with id 0


def test_train_tokenizer_checks_inputs(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a b c"], tmp_path / "t", vocab_size=150)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        train_tokenizer(tmp_path / "missing.jsonl", tmp_path / "t")


def test_load_tokenizer_offline_hub_name_fails_fast(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(OSError, match="unreachable.*pass its folder"):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_tiny_t5_config_builds_a_runnable_model(toy_tokenizer):
    tiny = TinyModelConfig(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=1)
    config = tiny_t5_config(toy_tokenizer, tiny)
    assert (config.vocab_size, config.pad_token_id, config.eos_token_id) == (len(toy_tokenizer), 0, 1)
    assert config.decoder_start_token_id == 0 and (config.d_model, config.num_decoder_layers) == (32, 1)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    inputs = toy_tokenizer(["where was Gorar Vegapo born?", "who employs Filas Figinis?"], padding=True,
                           return_tensors="pt")
    labels = toy_tokenizer(["Dapodale", "Givar Foods"], padding=True, return_tensors="pt").input_ids
    labels[labels == 0] = -100
    loss = model(**inputs, labels=labels).loss
    assert torch.isfinite(loss) and abs(loss.item() - math.log(len(toy_tokenizer))) < 2.0  # near uniform at init
    out = model.generate(**inputs, max_new_tokens=3)
    assert out.shape[0] == 2 and bool((out[:, 0] == 0).all())
    # T5 v1.1's activation (gated "gelu_new", six element-wise ops) computed by torch's fused kernel: same function
    assert config.dense_act_fn == "gelu_pytorch_tanh" and config.is_gated_act
    v11 = T5ForConditionalGeneration(tiny_t5_config(toy_tokenizer, tiny, feed_forward_proj="gated-gelu"))
    assert v11.config.dense_act_fn == "gelu_new"
    v11.load_state_dict(model.state_dict())
    torch.testing.assert_close(v11(**inputs, labels=labels).logits, model(**inputs, labels=labels).logits,
                               rtol=0, atol=1e-5)
