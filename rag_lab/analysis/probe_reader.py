"""How fast does a tiny FiD reader learn to read the toy world? Trains a reader alone (no retrieval) and prints
dev EM every --eval-every steps (`scripts/probe_reader.py` is its entry point).

    python scripts/probe_reader.py --toy-dir data/toy --heads 8 --copy-steps 1000 --passages 2 \
        --distractor same --steps 3000

Phase 1 (--copy-steps): single-hop questions with their gold passage alone. Phase 2: --passages per question,
the gold one(s) plus distractors: `random` passages, `same` (the same person's other passage, same title),
`confusable` (the toy world's hard negatives: that other passage, then the same section of people sharing the
first or the family name, which is what a trained retriever ranks next) or `mixed` (each distractor
confusable or random with equal odds). Evaluation uses --eval-distractor (default: the phase-2 setting) on
--eval-questions dev questions per family. One torch thread.
"""

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from rag_train.config import ReaderConfig, TinyModelConfig
from rag_train.data.collate import answer_labels, fid_inputs
from rag_train.data.corpus import Corpus
from rag_train.data.tokenizer import load_tokenizer
from rag_train.data.toy import ToyWorld
from rag_train.eval.metrics import exact_match
from rag_train.models.reader import FiDReader

FAMILIES = ("nq", "tqa", "hotpotqa")
DISTRACTORS = ("random", "same", "confusable", "mixed")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy-dir", default="data/toy")
    parser.add_argument("--families", default="nq,tqa,hotpotqa", help="training families")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d-kv", type=int, default=None, help="per-head width (default d_model / heads)")
    parser.add_argument("--encoder-layers", type=int, default=2)
    parser.add_argument("--decoder-layers", type=int, default=2)
    parser.add_argument("--init", default=None,
                        help="a T5 folder to start from (e.g. a toy LM of scripts/pretrain_toy_lm.py) instead of "
                             "a random init of the --d-model ... shape")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--optimizer", choices=("adamw", "adafactor"), default="adamw",
                        help="adafactor: T5's own optimizer, steps scaled by each parameter's RMS")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--copy-steps", type=int, default=1000)
    parser.add_argument("--passages", type=int, default=2)
    parser.add_argument("--distractor", choices=DISTRACTORS, default="random")
    parser.add_argument("--eval-distractor", choices=DISTRACTORS, default=None)
    parser.add_argument("--eval-passages", type=int, default=None,
                        help="passages per dev question (default --passages; the run reads top_k=4)")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-questions", type=int, default=100)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = random.Random(0)
    root = Path(args.toy_dir)
    tokenizer = load_tokenizer(str(root / "tokenizer"))
    corpus = Corpus.open(root / "passages.jsonl")
    manifest = json.loads((root / "manifest.json").read_text())
    world = ToyWorld(manifest["passages"], manifest["seed"])
    load = lambda name: [json.loads(line) for line in open(root / f"{name}.jsonl")]  # noqa: E731
    train = [q for family in args.families.split(",") for q in load(f"{family}-train")]
    single_hop = [q for q in train if len(q["gold_ids"]) == 1]
    dev = {family: load(f"{family}-dev")[: args.eval_questions] for family in FAMILIES}
    tiny = TinyModelConfig(d_model=args.d_model, d_ff=2 * args.d_model, d_kv=args.d_kv or args.d_model // args.heads,
                           num_heads=args.heads, num_layers=args.encoder_layers,
                           num_decoder_layers=args.decoder_layers)
    reader = FiDReader.from_config(ReaderConfig(model=args.init or "tiny", tiny=tiny), tokenizer)
    if args.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        optimizer = Adafactor(reader.parameters(), lr=args.lr, scale_parameter=True, relative_step=False)
    else:
        optimizer = torch.optim.AdamW(reader.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))

    def passages(question: dict, k: int, distractor: str) -> list[dict]:
        gold = list(corpus.rows(question["gold_ids"][:k]))
        if distractor == "same":
            hard = [row ^ 1 for row in gold]  # two passages per person
        elif distractor in ("confusable", "mixed"):
            hard = world.hard_negative_rows(np.asarray(gold[-1:]))[0].tolist()
            if distractor == "mixed":
                hard = [row if rng.random() < 0.5 else rng.randrange(len(corpus)) for row in hard]
        else:
            hard = []
        rows = (gold + hard)[:k]
        rows += [rng.randrange(len(corpus)) for _ in range(k - len(rows))]
        rng.shuffle(rows)
        return corpus.passages(rows)

    def batch_tensors(questions: list[dict], k: int, distractor: str) -> dict:
        return fid_inputs(tokenizer, [q["question"] for q in questions],
                          [passages(q, k, distractor) for q in questions], args.max_length)

    eval_passages = args.eval_passages or args.passages
    started = time.time()
    for step in range(args.steps):
        k = 1 if step < args.copy_steps else args.passages
        batch = rng.sample(single_hop if k == 1 else train, args.batch_size)
        labels = answer_labels(tokenizer, [q["answers"] for q in batch], 8)
        loss = reader(**batch_tensors(batch, k, args.distractor), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reader.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if (step + 1) % args.eval_every == 0:
            reader.eval()
            em = {}
            with torch.no_grad():
                for family, questions in dev.items():
                    inputs = batch_tensors(questions, eval_passages, args.eval_distractor or args.distractor)
                    out = reader.generate(**inputs, max_new_tokens=8)
                    predictions = tokenizer.batch_decode(out, skip_special_tokens=True)
                    em[family] = (sum(exact_match(p, q["answers"]) for p, q in zip(predictions, questions))
                                  / len(questions))
            reader.train()
            print(f"step {step + 1} passages {k} loss {loss.item():.3f} dev EM@{eval_passages} "
                  + " ".join(f"{f} {100 * v:.0f}" for f, v in em.items()) + f"  ({time.time() - started:.0f} s)",
                  flush=True)
