"""Why a finished toy RLM run reads as well as it does: how closely its corrector tracked the retriever, and
which distractors its reader was given. Toy world only (it reads names and sections from the passages).

    python scripts/diagnose_rlm.py --run runs/reproduce/table3/corrector-seed0 [--questions 200] [--k 4]

1. Tracking (runs with a stale buffer): for --questions nq train and dev questions, the top-k of the final
   retriever over a freshly embedded corpus (what exhaustive refresh would search), of its queries against
   the stale buffer through the final corrector (what the corrector run searched), and against the stale
   buffer alone. Prints each one's overlap@k with the fresh top-k and where it puts the gold passage.
2. Distractors (any run with predictions/): the run's own nq / tqa dev predictions, each non-gold passage
   classed against the gold one as the same person's other passage, a same-section passage of someone with
   the same first name or the same family name, another same-section passage, or another section; then EM
   by (gold retrieved, how many name-sharing same-section distractors).
3. Reading (--read): the run's reader on --questions nq / tqa / hotpotqa dev questions given the gold passages
   alone, or filled up to k with random passages, or with same-section passages of people sharing the first gold
   passage's first name, or its family name (in shuffled order): which confusions the reader has learned to resolve.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator

from rag_lab.analysis.diagnose_retriever import embed_corpus, final_corrector
from rag_train.buffer.store import Buffer
from rag_train.config import load_config
from rag_train.data.corpus import Corpus
from rag_train.data.qa import load_qa
from rag_train.data.sources import resolve_data
from rag_train.data.toy import TOY_DEV_SETS, TOY_TRAIN_SETS
from rag_train.models.retriever import DualEncoder
from rag_train.train.schema import RLMConfig


@torch.no_grad()
def tracking(run: Path, corpus: Corpus, files, k: int, limit: int) -> list[dict]:
    """Prints the tracking table; returns its rows ({questions, searched, overlap, gold_in_top_k, gold_at_1})."""
    retriever = DualEncoder.load(run / "retriever").eval()
    buffer = Buffer.open(run / "buffer")
    stale = buffer.tensor().float()  # bfloat16 decoded from its stored bits
    fresh = embed_corpus(retriever, corpus)
    corrector = final_corrector(run, stale.shape[1])
    searched = {"fresh": fresh, "stale": stale}
    if corrector is not None:
        searched["corrector"] = corrector(stale)
    print(f"| questions | buffer seen through | overlap@{k} with fresh top-{k} | gold in top-{k} | gold at 1 |")
    print("|---|---|---|---|---|")
    table = []
    for path in [p for p in files.train if "nq" in Path(p).name] + [p for p in files.dev if "nq" in Path(p).name]:
        examples = [ex for ex in load_qa(path, corpus=corpus, limit=limit) if ex.gold_ids]
        queries = retriever.encode_queries([ex.question for ex in examples]).float()
        gold = [int(corpus.rows(ex.gold_ids)[0]) for ex in examples]
        top = {name: (queries @ vectors.T).topk(k).indices.tolist() for name, vectors in searched.items()}
        for name, rows in top.items():
            overlap = sum(len(set(a) & set(b)) for a, b in zip(rows, top["fresh"])) / (k * len(rows))
            hit = sum(g in r for g, r in zip(gold, rows)) / len(rows)
            first = sum(g == r[0] for g, r in zip(gold, rows)) / len(rows)
            print(f"| {Path(path).stem} | {name} | {overlap:.3f} | {hit:.3f} | {first:.3f} |")
            table.append({"questions": Path(path).stem, "searched": name, "overlap": overlap, "gold_in_top_k": hit,
                          "gold_at_1": first})
    return table


def distractor_kind(gold: dict, other: dict, gold_row: int, other_row: int) -> str:
    first, family = gold["title"].split()[:2]
    o_first, o_family = (other["title"].split() + ["", ""])[:2]
    if other["title"] == gold["title"]:
        return "same person"
    if other_row % 2 != gold_row % 2:  # toy rows 2p, 2p + 1: section 0, section 1
        return "other section"
    return {(True, False): "same first name", (False, True): "same family name"}.get(
        (o_first == first, o_family == family), "other person")


def distractors(run: Path, corpus: Corpus, files) -> None:
    print("\n| dataset | distractors (same person / same first name / same family name / other person / other section) "
          "| EM by (gold retrieved, name-sharing distractors): correct / questions |")
    print("|---|---|---|")
    for name in ("nq", "tqa"):
        path = run / "predictions" / f"{name}.jsonl"
        dev = [p for p in files.dev if Path(p).name.startswith(f"{name}-")]
        if not path.is_file() or not dev:
            continue
        gold_of = {ex.id: ex.gold_ids for ex in load_qa(dev[0], corpus=corpus)}
        kinds, by_case = Counter(), defaultdict(lambda: [0, 0])
        for line in path.read_text().splitlines():
            p = json.loads(line)
            rows = corpus.rows(p["passages"]).tolist()
            gold_row = int(corpus.rows(gold_of[p["id"]][:1])[0])
            gold = corpus.passages([gold_row])[0]
            found = [distractor_kind(gold, q, gold_row, r) for r, q in zip(rows, corpus.passages(rows))
                     if r != gold_row]
            kinds.update(found)
            case = (gold_row in rows, sum(k in ("same first name", "same family name") for k in found))
            by_case[case][0] += int(p["em"])
            by_case[case][1] += 1
        order = ("same person", "same first name", "same family name", "other person", "other section")
        cases = ", ".join(f"{'gold' if g else 'no gold'} & {n}: {c}/{t}" for (g, n), (c, t) in sorted(by_case.items()))
        print(f"| {name} | {' / '.join(str(kinds[k]) for k in order)} | {cases} |")


@torch.no_grad()
def reading(run: Path, corpus: Corpus, files, cfg: RLMConfig, k: int, limit: int) -> None:
    from rag_train.data.collate import fid_inputs
    from rag_train.data.tokenizer import load_tokenizer
    from rag_train.data.toy import ToyWorld
    from rag_train.eval.metrics import exact_match
    from rag_train.io import verify_model_files
    from rag_train.models.reader import FiDReader

    world = ToyWorld(cfg.data.toy_passages, cfg.data.toy_seed)
    verify_model_files(run / "reader")
    reader = FiDReader.from_pretrained(run / "reader").eval()
    tokenizer = load_tokenizer(run / "reader")
    generator = torch.Generator().manual_seed(0)

    def sharing(row: int, keep_first: bool) -> list[int]:
        """Same-section rows of other people with the same first (or family) name, nearest name index first."""
        person, section = divmod(row, 2)
        found = []
        for step in range(1, max(world.n_first, world.n_family)):
            other = int(world.name_sharer(np.array([person]), keep_first, step)[0])
            if other >= 0:
                found.append(other * 2 + section)
            if len(found) == k - 1:
                break
        return found

    settings = {"nothing else": lambda g: [],
                "random": lambda g: torch.randint(len(corpus), (k - 1,), generator=generator).tolist(),
                "same first name": lambda g: sharing(g, True), "same family name": lambda g: sharing(g, False)}
    print("\n| dataset | " + " | ".join(f"EM, gold + {name}" for name in settings) + " |")
    print("|---|" + "---|" * len(settings))
    for name in ("nq", "tqa", "hotpotqa"):
        dev = [p for p in files.dev if Path(p).name.startswith(f"{name}-")]
        examples = [ex for ex in load_qa(dev[0], corpus=corpus, limit=limit) if ex.gold_ids] if dev else []
        if not examples:
            continue
        cells = []
        for others in settings.values():
            passages = []
            for ex in examples:
                gold = [int(r) for r in corpus.rows(ex.gold_ids[:k])]  # hotpotqa comparisons: both people's
                rows = gold + others(gold[0])[: k - len(gold)]
                passages.append(corpus.passages([rows[i] for i in torch.randperm(len(rows), generator=generator)]))
            correct = 0
            for count in sorted({len(p) for p in passages}):  # FiD batches need one passage count
                group = [i for i, p in enumerate(passages) if len(p) == count]
                for start in range(0, len(group), 50):
                    batch = group[start:start + 50]
                    inputs = fid_inputs(tokenizer, [examples[i].question for i in batch], [passages[i] for i in batch],
                                        cfg.reader.max_input_length)
                    out = reader.generate(**inputs, max_new_tokens=cfg.reader.max_answer_length)
                    predictions = tokenizer.batch_decode(out, skip_special_tokens=True)
                    correct += sum(exact_match(p, examples[i].answers) for p, i in zip(predictions, batch))
            cells.append(f"{100 * correct / len(examples):.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--questions", type=int, default=200, help="nq train and dev questions for the tracking table")
    parser.add_argument("--read", action="store_true", help="also probe the reader with controlled distractors")
    parser.add_argument("--k", type=int, default=None, help="top-k compared (default: the run's strategy.top_k)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(RLMConfig, args.run / "config.yaml", [])
    files = resolve_data(cfg.data, Accelerator(cpu=True), TOY_TRAIN_SETS, TOY_DEV_SETS)
    corpus = Corpus.open(files.passages)
    if (args.run / "buffer").is_dir():
        tracking(args.run, corpus, files, args.k or cfg.strategy.top_k, args.questions)
    distractors(args.run, corpus, files)
    if args.read:
        reading(args.run, corpus, files, cfg, args.k or cfg.strategy.top_k, args.questions)
