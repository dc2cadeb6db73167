"""How closely a finished Algorithm 1 run's corrector tracked its passage encoder (issue 17).

    python scripts/diagnose_retriever.py --run runs/toy-retriever [--k 4] [--questions 500] [--json out.json]
        [--fit-hidden 256 2048 [--fit-steps 1500]] [--fit-content-hidden 1024]
        [--content ROWS [--content-init MODEL ...]]

It reads the run directory: the saved retriever (`retriever/`), the stale buffer (`buffer/`), the corrector of
the last checkpoint and — when the run recorded it (`strategy.name=corrector`) — how many times each row was in
the corrector's training subset (`seen` in the checkpoint's strategy state). With the final passage encoder g it
embeds the whole corpus afresh (one corpus pass) and compares, for every row y, the stale vector B[y], the
corrected vector h(B[y]) and the fresh g(y):

1. Vectors, on the rows the corrector trained on ("seen"), the rows it never saw ("unseen") and all rows:
   mean cosine with g(y) and mean relative error ||v - g(y)|| / ||g(y)|| of v = B[y] (the drift the corrector must
   undo) and v = h(B[y]); plus, as a ceiling on what any map of B could reach, the least-squares affine map from
   B to g fitted on the seen rows (`lstsq`), measured on both groups.
2. Rankings, for the dev questions and as many training questions: overlap@k of the top-k of <f(x), v> over the
   corpus with the fresh top-k (split by whether the fresh top-k row was seen or not), gold at 1 and gold in top-k,
   for v = g (fresh), h(B) (corrector), B (stale) and the lstsq map.

3. With `--fit-hidden H ...`: a corrector of width H fitted offline, after the fact, on the final (B[y], g(y)) of the
   seen rows with the run's CE loss (`fit_offline`), shown as `offline hH` in both tables: what a corrector of that
   width could reach on this drift if it did not have to follow a moving encoder from one subset per step.
   `--fit-content-hidden H ...` fits the same from each passage's token bag instead of B (`offline bag hH`): what a
   corrector could reach if the buffer held the passages' tokens explicitly.

4. With `--content ROWS`: what each set of passage vectors keeps of the passages themselves (`content_probe`): a ridge
   map from the vectors to each passage's bag of tokens, fitted on half the rows, identifies the held-out passages
   (self@1) - for the stale B, the fresh g and h(B), and with `--content-init MODEL ...` for the buffer another
   init would give. It tells a buffer that lost the passage apart from one that kept
   it in a form no map of the corrector's size turns into g.

Stale and exhaustive runs have no corrector: their rows show the drift (stale) only.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from rag_train.buffer.store import Buffer
from rag_train.config import ConfigError, load_config
from rag_train.data.corpus import Corpus
from rag_train.data.sources import dataset_name, resolve_data
from rag_train.data.supervised import load_retrieval
from rag_train.eval.retrieval import load_eval_set
from rag_train.losses import corrector_ce
from rag_train.models.corrector import Corrector
from rag_train.models.retriever import DualEncoder, format_passage
from rag_train.train.schema import RetrieverTrainConfig


def latest_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["name"]


def final_corrector(run: Path, dim: int) -> Corrector | None:
    """The corrector of the run's last checkpoint (a part of the one prepared module), if it has one."""
    state = {k.removeprefix("corrector."): v for k, v in load_file(str(latest_checkpoint(run) / "model.safetensors")).items()
             if k.startswith("corrector.")}
    if not state:
        return None
    corrector = Corrector(dim, state["first.weight"].shape[0], standardize="input_mean" in state)
    corrector.load_state_dict(state)
    return corrector


def seen_counts(run: Path) -> Optional[torch.Tensor]:
    """Times each corpus row was in the corrector's training subset (saturating at 255), from the last checkpoint's
    strategy state (rank 0: the subset is shared by every process); None when the run did not record it."""
    path = latest_checkpoint(run) / "strategy-rank0.safetensors"
    if not path.is_file():
        return None
    return load_file(str(path)).get("seen")


def embed_corpus(retriever: DualEncoder, corpus: Corpus, batch: int = 256,
                 rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Every passage (or those of `rows`) through `encode_passages` in corpus order (the diagnostics' fresh g(Y))."""
    rows = range(len(corpus)) if rows is None else rows
    return torch.cat([retriever.encode_passages(corpus.passages(rows[s:s + batch])).float()
                      for s in range(0, len(rows), batch)])


def vector_stats(candidate: torch.Tensor, fresh: torch.Tensor) -> dict[str, float]:
    """Mean cosine and mean relative error ||v - g|| / ||g|| of candidate rows against fresh rows."""
    if len(fresh) == 0:
        return {"cosine": float("nan"), "relative_error": float("nan")}
    cosine = torch.nn.functional.cosine_similarity(candidate, fresh, dim=1)
    error = (candidate - fresh).norm(dim=1) / fresh.norm(dim=1).clamp_min(1e-12)
    return {"cosine": cosine.mean().item(), "relative_error": error.mean().item()}


def affine_fit(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[D + 1, D] least-squares affine map W with [source, 1] @ W ~ target (float64 for the solve)."""
    design = torch.cat([source, torch.ones(len(source), 1)], dim=1).double()
    return torch.linalg.lstsq(design, target.double()).solution.float()


def apply_affine(weights: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    return torch.cat([source, torch.ones(len(source), 1)], dim=1) @ weights


@torch.no_grad()
def ranking_stats(queries: torch.Tensor, candidate: torch.Tensor, fresh: torch.Tensor, gold: torch.Tensor,
                  seen: torch.Tensor, k: int) -> dict[str, float]:
    """overlap@k of the candidate's top-k with the fresh top-k (all, and over the fresh top-k rows that were seen /
    unseen), gold at 1 and gold in top-k of the candidate's ranking."""
    top = (queries @ candidate.T).topk(k).indices
    reference = (queries @ fresh.T).topk(k).indices
    shared = (reference.unsqueeze(2) == top.unsqueeze(1)).any(dim=2)  # [Q, k]: fresh top-k row also in candidate's
    was_seen = seen[reference]

    def fraction(mask: torch.Tensor) -> float:
        return (shared & mask).sum().item() / mask.sum().item() if mask.any() else float("nan")

    return {"overlap": shared.float().mean().item(), "overlap_seen": fraction(was_seen),
            "overlap_unseen": fraction(~was_seen), "gold_at_1": (top[:, 0] == gold).float().mean().item(),
            "gold_in_top_k": (top == gold.unsqueeze(1)).any(dim=1).float().mean().item()}


def fit_offline(stale: torch.Tensor, fresh: torch.Tensor, queries: torch.Tensor, hidden: int, steps: int,
                temperature: float, seed: int = 0, moments: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                ) -> torch.nn.Module:
    """A corrector trained after the fact on the final (B[y], g(y)) pairs of the given rows — the target no longer
    moves and every row is available — with the run's loss, CE(P~ || P~_h) at the run's temperature, over 64
    training questions x 512 uniform rows per Adam step (lr 1e-3): how far a corrector of this width can get at all.
    A source of another width than g (the passages' token bags) gets the corrector's two layers without its identity.
    `moments` (the whole buffer's mean and sd): the corrector standardizes its input (strategy.corrector.standardize)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if stale.shape[1] == fresh.shape[1]:
        corrector = Corrector(stale.shape[1], hidden, standardize=moments is not None)
        if moments is not None:
            corrector.set_input_statistics(*moments)
    else:
        corrector = torch.nn.Sequential(torch.nn.Linear(stale.shape[1], hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, fresh.shape[1]))
    optimizer = torch.optim.Adam(corrector.parameters(), lr=1e-3)
    for _ in range(steps):
        picked = queries[torch.randint(len(queries), (64,), generator=generator)]
        rows = torch.randint(len(stale), (512,), generator=generator).unique()
        loss = corrector_ce(picked @ fresh[rows].T, picked @ corrector(stale[rows]).T, temperature)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return corrector.eval()


MAX_BAG_CELLS = 200_000_000  # 800 MB of float32 bags


def token_bags(tokenizer, texts: list[str], max_length: int) -> torch.Tensor:
    """[N, V] rows of 0/1: which tokens each text holds within the tower's `max_length` - the content a passage
    vector can keep (order and counts aside)."""
    ids = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    bags = torch.zeros(len(texts), len(tokenizer))
    for row, sequence in enumerate(ids):
        bags[row, sequence] = 1.0
    return bags


def content_probe(vectors: torch.Tensor, bags: torch.Tensor, seed: int = 0, ridge: float = 1e-3) -> dict[str, float]:
    """What `vectors` keep of each passage: a ridge map from [vectors, 1] to the mean-centred token bags, fitted on a
    random half of the rows; on the other half, the share whose predicted bag is nearest (cosine) to their own among
    the held-out bags (`self_at_1`: 1 / held-out rows for vectors that keep nothing) and the mean cosine with it."""
    order = torch.randperm(len(vectors), generator=torch.Generator().manual_seed(seed))
    fit, held = order[: len(order) // 2], order[len(order) // 2:]
    design = torch.cat([vectors, torch.ones(len(vectors), 1)], dim=1).double()
    target = (bags - bags[fit].mean(dim=0)).double()  # a token every passage holds tells nothing
    gram = design[fit].T @ design[fit]
    penalty = ridge * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
    weights = torch.linalg.solve(gram + penalty, design[fit].T @ target[fit])
    predicted = torch.nn.functional.normalize((design[held] @ weights).float(), dim=1)
    similarity = predicted @ torch.nn.functional.normalize(target[held].float(), dim=1).T
    own = torch.arange(len(held))
    return {"self_at_1": (similarity.argmax(dim=1) == own).float().mean().item(),
            "cosine": similarity[own, own].mean().item()}


@dataclass
class Questions:
    name: str
    texts: list[str]
    gold: torch.Tensor  # [Q] corpus row of each question's first positive


def question_sets(files, corpus: Corpus, limit: int) -> list[Questions]:
    found = []
    for path in files.dev:
        dev = load_eval_set(path, corpus, limit=limit)
        rows = corpus.rows([next(iter(qrels)) for qrels in dev.qrels])
        found.append(Questions(f"{dataset_name(path)} (dev)", dev.questions, torch.as_tensor(np.asarray(rows))))
    for path in files.train:
        train = load_retrieval(path, corpus=corpus, limit=limit)
        rows = corpus.rows([ex.positive_ids[0] for ex in train])
        found.append(Questions(f"{dataset_name(path)} (train)", [ex.question for ex in train],
                               torch.as_tensor(np.asarray(rows))))
    return found


def diagnose(run: Path, k: Optional[int] = None, limit: int = 500, fit_hidden: tuple[int, ...] = (),
             fit_steps: int = 1500, content_rows: int = 0, content_inits: tuple[str, ...] = (),
             fit_content_hidden: tuple[int, ...] = (), fit_standardized: bool = False) -> dict:
    """The tables' numbers as a dict: {"rows": {group: {"n", "stale": {...}, "corrector": {...}, "lstsq": {...}}},
    "rankings": [{"questions", "searched", ...}], "k", "seen_rows"} and, with `content_rows` > 0, "content":
    {vectors: content_probe} over that many rows drawn at random (the bags are dense [rows, vocabulary]), also for
    the stale buffer each of `content_inits` would give (a `retriever.model` value; `tiny`: the run's random init).
    `fit_content_hidden`: offline fits as `fit_hidden`, from every passage's token bag instead of B ("offline bag hH").
    `fit_standardized`: each `fit_hidden` width also fitted with its input standardized ("offline std hH").
    """
    cfg = load_config(RetrieverTrainConfig, run / "config.yaml", [])
    k = k or cfg.strategy.top_k
    files = resolve_data(cfg.data, Accelerator(cpu=True), ["retrieval-train"], ["retrieval-dev"])
    corpus = Corpus.open(files.passages)
    retriever = DualEncoder.load(run / "retriever").eval()
    vocabulary = len(retriever.passage_encoder.tokenizer)
    for option, rows in (("--fit-content-hidden", len(corpus) if fit_content_hidden else 0),
                         ("--content", min(content_rows, len(corpus)))):
        if rows * vocabulary > MAX_BAG_CELLS:  # before the corpus pass, not after it
            raise ConfigError(f"{option} needs a dense [{rows} passages, {vocabulary} tokens] bag matrix, over "
                              f"{MAX_BAG_CELLS:,} cells; {'pass fewer rows' if option == '--content' else 'use --content'}")
    buffer = Buffer.open(run / "buffer")
    stale = buffer.tensor().float()  # bfloat16 decoded from its stored bits
    with torch.no_grad():
        fresh = embed_corpus(retriever, corpus)
    corrector = final_corrector(run, stale.shape[1])
    counts = seen_counts(run)
    seen = counts > 0 if counts is not None else torch.ones(len(corpus), dtype=torch.bool)
    searched = {"fresh": fresh, "stale": stale}
    if corrector is not None:
        with torch.no_grad():
            searched["corrector"] = corrector(stale)
    if seen.sum() > stale.shape[1] + 1:
        searched["lstsq"] = apply_affine(affine_fit(stale[seen], fresh[seen]), stale)
    sets = question_sets(files, corpus, limit)
    with torch.no_grad():
        encoded = [retriever.encode_queries(questions.texts).float() for questions in sets]
    # the offline fits' queries: the training questions; their rows: those the run's corrector saw
    training = (torch.cat([q for q, questions in zip(encoded, sets) if questions.name.endswith("(train)")])
                if fit_hidden or fit_content_hidden else None)
    moments = buffer.moments() if fit_standardized else None  # one pass over the buffer for every width
    for hidden in fit_hidden:
        with torch.enable_grad():
            fitted = fit_offline(stale[seen], fresh[seen], training, hidden, fit_steps, cfg.train.temperature)
        with torch.no_grad():
            searched[f"offline h{hidden}"] = fitted(stale)
        if fit_standardized:
            with torch.enable_grad():
                fitted = fit_offline(stale[seen], fresh[seen], training, hidden, fit_steps, cfg.train.temperature,
                                     moments=moments)
            with torch.no_grad():
                searched[f"offline std h{hidden}"] = fitted(stale)

    def bags_of(rows: Sequence[int]) -> torch.Tensor:
        texts = [format_passage(p) for p in corpus.passages(rows)]
        return token_bags(retriever.passage_encoder.tokenizer, texts, retriever.max_passage_length)

    if fit_content_hidden:
        bags = bags_of(range(len(corpus)))
        for hidden in fit_content_hidden:
            with torch.enable_grad():
                fitted = fit_offline(bags[seen], fresh[seen], training, hidden, fit_steps, cfg.train.temperature)
            with torch.no_grad():
                searched[f"offline bag h{hidden}"] = fitted(bags)
    groups = {"seen": seen, "unseen": ~seen, "all": torch.ones_like(seen)}
    rows = {group: {"n": int(mask.sum()), **{name: vector_stats(v[mask], fresh[mask]) for name, v in searched.items()
                                             if name != "fresh"}}
            for group, mask in groups.items()}
    rankings = []
    for questions, queries in zip(sets, encoded):
        for name, vectors in searched.items():
            rankings.append({"questions": questions.name, "searched": name,
                             **ranking_stats(queries, vectors, fresh, questions.gold, seen, k)})
    report = {"k": k, "seen_rows": int(seen.sum()) if counts is not None else None, "rows": rows, "rankings": rankings}
    if content_rows:
        picked = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(0))[:content_rows].sort().values
        bags = bags[picked] if fit_content_hidden else bags_of(picked.tolist())
        report["content"] = {name: content_probe(searched[name][picked], bags)
                             for name in ("stale", "fresh", "corrector") if name in searched}
        for model in content_inits:
            init = DualEncoder.from_config(load_config(RetrieverTrainConfig, run / "config.yaml",
                                                       [f"retriever.model={model}"]).retriever,
                                           tokenizer=cfg.retriever.tokenizer or files.tokenizer).eval()
            with torch.no_grad():
                vectors = embed_corpus(init, corpus, rows=picked.tolist())
            report["content"][f"init {model}"] = content_probe(vectors, bags)
    return report


def print_tables(report: dict) -> None:
    names = [n for n in report["rows"]["all"] if n != "n"]
    print("| rows | n | " + " | ".join(f"cos({n}, g) | rel. err {n}" for n in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    for group, stats in report["rows"].items():
        cells = " | ".join(f"{stats[n]['cosine']:.3f} | {stats[n]['relative_error']:.3f}" for n in names)
        print(f"| {group} | {stats['n']} | {cells} |")
    k = report["k"]
    print(f"\n| questions | searched | overlap@{k} with fresh | on seen rows | on unseen rows | gold at 1 | gold in top-{k} |")
    print("|---|---|---|---|---|---|---|")
    for r in report["rankings"]:
        print(f"| {r['questions']} | {r['searched']} | {r['overlap']:.3f} | {r['overlap_seen']:.3f} | "
              f"{r['overlap_unseen']:.3f} | {r['gold_at_1']:.3f} | {r['gold_in_top_k']:.3f} |")
    if "content" in report:
        print("\n| passage vectors | content kept: held-out passages identified from their vectors (self@1) | cosine |")
        print("|---|---|---|")
        for name, probe in report["content"].items():
            print(f"| {name} | {probe['self_at_1']:.3f} | {probe['cosine']:.3f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--k", type=int, default=None, help="top-k compared (default: the run's strategy.top_k)")
    parser.add_argument("--questions", type=int, default=500, help="dev and training questions per set")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--fit-hidden", type=int, nargs="*", default=[],
                        help="also fit a corrector of each width offline on the final (B, g) of the seen rows (a ceiling)")
    parser.add_argument("--fit-steps", type=int, default=1500)
    parser.add_argument("--fit-standardized", action="store_true",
                        help="with --fit-hidden: also fit each width with its input standardized by the buffer's moments")
    parser.add_argument("--fit-content-hidden", type=int, nargs="*", default=[],
                        help="also fit a corrector of each width offline from the passages' token bags (what B could hold)")
    parser.add_argument("--content", type=int, default=0, metavar="ROWS",
                        help="also probe what the stale, fresh and corrected vectors keep of ROWS random passages")
    parser.add_argument("--content-init", nargs="*", default=[], metavar="MODEL",
                        help="with --content: also the stale vectors each retriever.model value would give (tiny: the run's random init)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = diagnose(args.run, args.k, args.questions, tuple(args.fit_hidden), args.fit_steps, args.content,
                      tuple(args.content_init), tuple(args.fit_content_hidden), args.fit_standardized)
    print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
