"""How closely a finished Algorithm 1 run's corrector tracked its passage encoder.

    python scripts/diagnose_retriever.py --run runs/toy-retriever [--k 4] [--questions 500] [--json out.json]
        [--fit-hidden 256 2048 [--fit-steps 1500]] [--fit-content-hidden 1024]
        [--content ROWS [--content-init MODEL ...]]
    python scripts/diagnose_retriever.py --run runs/toy-retriever --checkpoints [STEP ...] [--fit-top 16]
        [--drift | --held-out [--fit-hidden H]]
        [--fit-steps 1500] [--k 4] [--questions 500] [--json out.json]

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

3. With `--fit-hidden H ...`: the uniform-row probe, a corrector of width H fitted offline on the final (B[y], g(y))
   of 512 uniform seen rows per step with the run's CE loss (`fit_offline`), shown as `uniform-row probe hH`. Its
   rows rarely hold a question's gold or its near-duplicates, so it under-fits: it is not what a corrector of that
   width can reach (that is `--checkpoints`' achievable fit). `--fit-content-hidden H ...` fits the same from each
   passage's token bag instead of B (`uniform-row probe bag hH`): whether B lost content the bags keep.

4. With `--content ROWS`: what each set of passage vectors keeps of the passages themselves (`content_probe`): a ridge
   map from the vectors to each passage's bag of tokens, fitted on half the rows, identifies the held-out passages
   (self@1) - for the stale B, the fresh g and h(B), and with `--content-init MODEL ...` for the buffer another
   init would give. It tells a buffer that lost the passage apart from one that kept
   it in a form no map of the corrector's size turns into g.

Stale and exhaustive runs have no corrector: their rows show the drift (stale) only.

`--checkpoints` instead measures what the loop feeds the corrector (`diagnose_checkpoints`), at each of the run's
checkpoints (`checkpoints/step-*`; a run keeps its last two unless trained with `train.keep_checkpoints=0` and
`train.save_every=N`): with that checkpoint's towers, the corpus re-embedded (fresh g), gold@1 and overlap@k with the
fresh top-k on training and dev questions of the in-loop corrector h(B), of the achievable fit (a corrector of the
same width fitted offline with the run's corrector loss on every training question's gold + fresh top-`--fit-top`
rows), of fresh g and of stale B. The achievable fit far above the in-loop corrector: the loop's subsets and updates
hold it back, not its width. `--checkpoints ... --drift` (any strategy) gives only the corpus's drift: the mean
cosine of each passage's vectors between the run's stale buffer and every checkpoint, pair by pair (`corpus_drift`).
`--checkpoints ... --held-out` asks what a corrector does to rows it never learned (`held_out_map`): with the last
checkpoint's encoder as g and the stale buffer and each earlier checkpoint as the buffer B, a corrector fitted on
every row but the dev questions' golds, against B as is, on the fitted and the held-out rows.

Long file: every measure here reads the same embedded corpus, questions and corrector, and the printed report
sets them side by side; one module per measure would pass that state between them.
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
from rag_train.losses import corrector_ce, corrector_mse
from rag_train.models.corrector import Corrector
from rag_train.models.retriever import DualEncoder, format_passage
from rag_train.train.run import STEP_FILE
from rag_train.train.schema import RetrieverTrainConfig


def latest_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / json.loads((run / "checkpoints" / "latest.json").read_text())["name"]


def checkpoint_corrector(checkpoint: Path, dim: int) -> Corrector | None:
    """The corrector a checkpoint holds (a part of the one prepared module), if the run had one."""
    state = {k.removeprefix("corrector."): v for k, v in load_file(str(checkpoint / "model.safetensors")).items()
             if k.startswith("corrector.")}
    if not state:
        return None
    corrector = Corrector(dim, state["first.weight"].shape[0], standardize="input_mean" in state)
    corrector.load_state_dict(state)
    return corrector


def final_corrector(run: Path, dim: int) -> Corrector | None:
    """The corrector of the run's last checkpoint, if it has one."""
    return checkpoint_corrector(latest_checkpoint(run), dim)


def checkpoint_retriever(run: Path, checkpoint: Path) -> DualEncoder:
    """The retriever as `checkpoint` holds it: the run's saved towers (architecture, tokenizer) with the checkpoint's
    weights. A checkpoint keeps one name per tied tensor; the other names follow through the tie."""
    retriever = DualEncoder.load(run / "retriever")
    weights = {k.removeprefix("retriever."): v for k, v in load_file(str(checkpoint / "model.safetensors")).items()
               if k.startswith("retriever.")}
    missing, unexpected = retriever.load_state_dict(weights, strict=False)
    own = retriever.state_dict()
    loaded = {own[name].untyped_storage().data_ptr() for name in weights}
    untied = [name for name in missing if own[name].untyped_storage().data_ptr() not in loaded]
    if unexpected or untied:
        raise ConfigError(f"{checkpoint / 'model.safetensors'}: its retriever does not match {run / 'retriever'} "
                          f"(missing {untied[:3]}, unexpected {unexpected[:3]})")
    return retriever.eval()


def seen_at(checkpoint: Path) -> Optional[torch.Tensor]:
    """Times each corpus row was in the corrector's training subset up to `checkpoint` (saturating at 255), from its
    strategy state (rank 0: the subset is shared by every process); None when the run did not record it."""
    path = checkpoint / "strategy-rank0.safetensors"
    return load_file(str(path)).get("seen") if path.is_file() else None


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


UNIFORM_PROBE_ROWS = 512  # the uniform-row probe's rows per Adam step
PROBE = "uniform-row probe"  # how its fits are labelled: not the achievable fit (`diagnose_checkpoints`)


def fit_offline(stale: torch.Tensor, fresh: torch.Tensor, queries: torch.Tensor, hidden: int, steps: int,
                temperature: float, seed: int = 0, moments: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                targets: Optional[torch.Tensor] = None, loss: str = "ce",
                pool: Optional[torch.Tensor] = None) -> torch.nn.Module:
    """A corrector trained after the fact on final (B[y], g(y)) pairs — the target no longer moves — with the run's
    loss (CE(P~ || P~_h) at the run's temperature, or MSE), 64 training questions per Adam step (lr 1e-3).
    `targets` [Q, r]: each question's rows (its gold and fresh top-k: the achievable fit), the union over the step's
    questions shared by them, as the strategy's subset is; None: 512 uniform rows per step (the uniform-row probe,
    which rarely holds a question's gold or its near-duplicates), drawn from `pool` (rows; default every row).
    A source of another width than g (the passages' token bags) gets the corrector's two layers without its identity.
    `moments` (the whole buffer's mean and sd): the corrector standardizes its input
    (strategy.corrector.standardize)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    pool = torch.arange(len(stale)) if pool is None else pool
    if stale.shape[1] == fresh.shape[1]:
        corrector = Corrector(stale.shape[1], hidden, standardize=moments is not None)
        if moments is not None:
            corrector.set_input_statistics(*moments)
    else:
        corrector = torch.nn.Sequential(torch.nn.Linear(stale.shape[1], hidden), torch.nn.ReLU(),
                                        torch.nn.Linear(hidden, fresh.shape[1]))
    optimizer = torch.optim.Adam(corrector.parameters(), lr=1e-3)
    for _ in range(steps):
        picked = torch.randint(len(queries), (64,), generator=generator)
        rows = (pool[torch.randint(len(pool), (UNIFORM_PROBE_ROWS,), generator=generator)] if targets is None
                else targets[picked].flatten()).unique()
        corrected = corrector(stale[rows])
        if loss == "mse":
            value = corrector_mse(fresh[rows], corrected)
        else:
            value = corrector_ce(queries[picked] @ fresh[rows].T, queries[picked] @ corrected.T, temperature)
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    return corrector.eval()


def fit_targets(queries: torch.Tensor, fresh: torch.Tensor, gold: torch.Tensor, top: int) -> torch.Tensor:
    """[Q, top + 1]: each question's gold row and its top rows under the fresh g (the achievable fit's rows)."""
    return torch.cat([gold.unsqueeze(1), (queries @ fresh.T).topk(min(top, len(fresh))).indices], dim=1)


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


def question_sets(files, corpus: Corpus, limit: Optional[int]) -> list[Questions]:
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
    `fit_hidden`: uniform-row probes of those widths ("uniform-row probe hH"); `fit_content_hidden`: the same from
    every passage's token bag instead of B ("... bag hH"); `fit_standardized`: each `fit_hidden` width also fitted
    with its input standardized ("... std hH").
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
            remedy = "pass fewer rows" if option == "--content" else "use --content"
            raise ConfigError(f"{option} needs a dense [{rows} passages, {vocabulary} tokens] bag matrix, over "
                              f"{MAX_BAG_CELLS:,} cells; {remedy}")
    buffer = Buffer.open(run / "buffer")
    stale = buffer.tensor().float()  # bfloat16 decoded from its stored bits
    with torch.no_grad():
        fresh = embed_corpus(retriever, corpus)
    corrector = final_corrector(run, stale.shape[1])
    counts = seen_at(latest_checkpoint(run))
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
            searched[f"{PROBE} h{hidden}"] = fitted(stale)
        if fit_standardized:
            with torch.enable_grad():
                fitted = fit_offline(stale[seen], fresh[seen], training, hidden, fit_steps, cfg.train.temperature,
                                     moments=moments)
            with torch.no_grad():
                searched[f"{PROBE} std h{hidden}"] = fitted(stale)

    def bags_of(rows: Sequence[int]) -> torch.Tensor:
        texts = [format_passage(p) for p in corpus.passages(rows)]
        return token_bags(retriever.passage_encoder.tokenizer, texts, retriever.max_passage_length)

    if fit_content_hidden:
        bags = bags_of(range(len(corpus)))
        for hidden in fit_content_hidden:
            with torch.enable_grad():
                fitted = fit_offline(bags[seen], fresh[seen], training, hidden, fit_steps, cfg.train.temperature)
            with torch.no_grad():
                searched[f"{PROBE} bag h{hidden}"] = fitted(bags)
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


CHECKPOINT_ROWS = ("in-loop", "achievable fit", "fresh g", "stale")


def question_split(sets: list[Questions], split: str) -> Questions:
    """Every set of one split (`train` / `dev`) as one."""
    chosen = [q for q in sets if q.name.endswith(f"({split})")]
    return Questions(split, [t for q in chosen for t in q.texts], torch.cat([q.gold for q in chosen]))


def checkpoint_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / STEP_FILE).read_text())["step"])


def checkpoint_steps(run: Path, steps: Sequence[int] = ()) -> list[Path]:
    """The run's checkpoints (`checkpoints/step-*`), oldest first, or those of `steps`."""
    found = {checkpoint_step(c): c for c in (run / "checkpoints").glob("step-*") if (c / STEP_FILE).is_file()}
    missing = sorted(set(steps) - set(found))
    if missing:
        raise ConfigError(f"{run / 'checkpoints'}: no checkpoint of step {missing} (there are {sorted(found)}; "
                          "train.keep_checkpoints=0 keeps every one train.save_every writes)")
    return [found[s] for s in sorted(steps or found)]


def diagnose_checkpoints(run: Path, steps: Sequence[int] = (), k: Optional[int] = None, limit: int = 500,
                         fit_top: int = 16, fit_steps: int = 1500) -> dict:
    """What the loop feeds the corrector, at each checkpoint: with the checkpoint's towers (the corpus re-embedded:
    fresh g), gold@1 and overlap@k with the fresh top-k of the in-loop corrector h(B), of the achievable fit (a
    corrector of the in-loop one's width and input standardization, fitted offline with the run's corrector loss on
    (B[y], g(y)) of every training question's gold and fresh top-`fit_top` rows), of fresh g and of stale B, on
    `limit` training and dev questions. An achievable fit far above the in-loop corrector says the loop's subsets and
    updates, not the corrector's width, hold it back."""
    cfg = load_config(RetrieverTrainConfig, run / "config.yaml", [])
    if cfg.strategy.name != "corrector":
        raise ConfigError(f"{run}: strategy.name={cfg.strategy.name!r}; the in-loop corrector needs a corrector run")
    k = k or cfg.strategy.top_k
    files = resolve_data(cfg.data, Accelerator(cpu=True), ["retrieval-train"], ["retrieval-dev"])
    corpus = Corpus.open(files.passages)
    checkpoints = checkpoint_steps(run, steps)
    buffer = Buffer.open(run / "buffer")
    stale = buffer.tensor().float()
    trained_on, n = question_split(question_sets(files, corpus, None), "train"), cfg.data.max_train_examples
    fitting = Questions("train", trained_on.texts[:n], trained_on.gold[:n])  # as the recipe cuts its training set
    measured = {split: question_split(question_sets(files, corpus, limit), split) for split in ("train", "dev")}
    report = {"k": k, "fit_top": fit_top, "fit_questions": len(fitting.texts), "checkpoints": []}
    for checkpoint in checkpoints:
        retriever = checkpoint_retriever(run, checkpoint)
        corrector = checkpoint_corrector(checkpoint, stale.shape[1])
        with torch.no_grad():
            fresh = embed_corpus(retriever, corpus)
            queries = {split: retriever.encode_queries(q.texts).float() for split, q in measured.items()}
            training = retriever.encode_queries(fitting.texts).float()
            targets = fit_targets(training, fresh, fitting.gold, fit_top)
        moments = (corrector.input_mean, corrector.input_std) if corrector.standardize else None
        with torch.enable_grad():
            fitted = fit_offline(stale, fresh, training, corrector.hidden, fit_steps, cfg.train.temperature,
                                 moments=moments, targets=targets, loss=cfg.strategy.corrector.loss)
        with torch.no_grad():
            searched = dict(zip(CHECKPOINT_ROWS, (corrector(stale), fitted(stale), fresh, stale)))
        every_row = torch.ones(len(corpus), dtype=torch.bool)  # no seen / unseen split here
        rows = {name: {} for name in searched}
        for name, vectors in searched.items():
            for split, questions in measured.items():
                stats = ranking_stats(queries[split], vectors, fresh, questions.gold, every_row, k)
                rows[name][split] = {"gold_at_1": stats["gold_at_1"], "overlap": stats["overlap"]}
        report["checkpoints"].append({"step": checkpoint_step(checkpoint),
                                      "fit_rows": int(targets.unique().numel()), "rows": rows})
    return report


def corpus_drift(run: Path, steps: Sequence[int] = ()) -> dict:
    """How far the corpus drifts: the mean over passages of cos(g_s(y), g_t(y)) for every pair of the run's stale
    buffer (step 0: the initial encoder's vectors, what a buffer never refreshed holds) and its checkpoints' re-embedded
    corpus, s <= t. Row s, column t is what a buffer refreshed at step s would show at step t; it is what a refresh
    threshold on cos(B[y], g(y)) (`strategy.corrector.refresh_watch=cos_stale`) will cross."""
    cfg = load_config(RetrieverTrainConfig, run / "config.yaml", [])
    corpus = Corpus.open(resolve_data(cfg.data, Accelerator(cpu=True), [], []).passages)
    vectors = {0: Buffer.open(run / "buffer").tensor().float()}
    with torch.no_grad():
        for checkpoint in checkpoint_steps(run, steps):
            vectors[checkpoint_step(checkpoint)] = embed_corpus(checkpoint_retriever(run, checkpoint), corpus)
    order = sorted(vectors)
    unit = {s: torch.nn.functional.normalize(vectors[s].double(), dim=1) for s in order}
    return {"steps": order, "cosine": [[(unit[s] * unit[t]).sum(1).mean().item() if t >= s else None for t in order]
                                       for s in order]}


MAP_ROWS = ("as is", "h fitted by MSE", "h fitted by the run's loss")


def held_out_map(run: Path, steps: Sequence[int] = (), k: Optional[int] = None, limit: int = 500,
                 hidden: Optional[int] = None, fit_steps: int = 1500) -> dict:
    """What a corrector does to rows it never learned, at each amount of drift. The last of the run's checkpoints
    (or of `steps`) is the target encoder g; each source buffer B_s is the run's stale buffer (step 0) or an earlier
    checkpoint's re-embedded corpus (a buffer refreshed at s). For each: B_s as is, and a corrector of the in-loop
    width (or `hidden`) fitted offline on (B_s[y], g(y)) of every row except the dev questions' golds, by MSE and by
    the run's loss over the training questions (`fit_offline` drawing its uniform rows from the kept ones). The dev
    golds stand in for the rows the loop's loss never asks h to get right: the dev people's passages, which no
    training question ranks. Per source: cos with g on the fitted rows and on the held-out ones, dev gold@1 and
    overlap@k with g's top-k. A fit that lifts the fitted rows' cosine far above the held-out rows' ranks corrected
    competitors above unseen golds: gold@1 below the buffer's as-is."""
    cfg = load_config(RetrieverTrainConfig, run / "config.yaml", [])
    k = k or cfg.strategy.top_k
    files = resolve_data(cfg.data, Accelerator(cpu=True), ["retrieval-train"], ["retrieval-dev"])
    corpus = Corpus.open(files.passages)
    checkpoints = checkpoint_steps(run, steps)
    buffer = Buffer.open(run / "buffer")
    if hidden is None:
        in_loop = checkpoint_corrector(checkpoints[-1], buffer.dim)
        if in_loop is None:
            raise ConfigError(f"{run}: strategy.name={cfg.strategy.name!r} has no corrector to take the width "
                              "from; give --fit-hidden H")
        hidden = in_loop.hidden
    target = checkpoint_retriever(run, checkpoints[-1])
    dev = question_split(question_sets(files, corpus, limit), "dev")
    training = question_split(question_sets(files, corpus, None), "train")
    with torch.no_grad():
        fresh = embed_corpus(target, corpus)
        queries = target.encode_queries(dev.texts).float()
        training_queries = target.encode_queries(training.texts[:cfg.data.max_train_examples]).float()
    held = torch.zeros(len(corpus), dtype=torch.bool)
    held[dev.gold] = True
    kept = torch.nonzero(~held).squeeze(1)  # the rows every fit draws from
    every_row = torch.ones(len(corpus), dtype=torch.bool)

    def measured(vectors: torch.Tensor) -> dict[str, float]:
        cosine = torch.nn.functional.cosine_similarity(vectors, fresh, dim=1)
        ranks = ranking_stats(queries, vectors, fresh, dev.gold, every_row, k)
        return {"cos_fitted": cosine[~held].mean().item(), "cos_held_out": cosine[held].mean().item(),
                "dev_gold_at_1": ranks["gold_at_1"], "dev_overlap": ranks["overlap"]}

    report = {"k": k, "hidden": hidden, "target": checkpoint_step(checkpoints[-1]), "held_out_rows": int(held.sum()),
              "fresh": measured(fresh), "sources": []}
    for checkpoint in [None, *checkpoints[:-1]]:
        with torch.no_grad():
            source = (buffer.tensor().float() if checkpoint is None
                      else embed_corpus(checkpoint_retriever(run, checkpoint), corpus))
        fits = [fit_offline(source, fresh, training_queries, hidden, fit_steps, cfg.train.temperature, loss=loss,
                            pool=kept)
                for loss in ("mse", cfg.strategy.corrector.loss)]
        with torch.no_grad():
            rows = dict(zip(MAP_ROWS, (measured(v) for v in (source, *(fit(source) for fit in fits)))))
        report["sources"].append({"step": 0 if checkpoint is None else checkpoint_step(checkpoint), "rows": rows})
    return report


def print_map_table(report: dict) -> None:
    k = report["k"]
    print(f"| buffer of step | vectors | cos with g, fitted rows | cos with g, held-out rows | dev gold@1 "
          f"| dev overlap@{k} |")
    print("|---|---|---|---|---|---|")
    for entry in [{"step": report["target"], "rows": {"fresh g": report["fresh"]}}, *report["sources"]]:
        for name, at in entry["rows"].items():
            print(f"| {entry['step']} | {name} | {at['cos_fitted']:.3f} | {at['cos_held_out']:.3f} | "
                  f"{at['dev_gold_at_1']:.3f} | {at['dev_overlap']:.3f} |")
    print(f"\ng: the encoder of step {report['target']}; h: {report['hidden']} hidden units, fitted on every row but "
          f"the {report['held_out_rows']} dev golds (held out)")


def print_drift_table(report: dict) -> None:
    steps = report["steps"]
    print("| refreshed at \\ now | " + " | ".join(map(str, steps)) + " |")
    print("|---|" + "---|" * len(steps))
    for s, row in zip(steps, report["cosine"]):
        print(f"| {s} | " + " | ".join("" if c is None else f"{c:.3f}" for c in row) + " |")


def print_checkpoint_table(report: dict) -> None:
    k = report["k"]
    print(f"| step | vectors | train gold@1 | train overlap@{k} | dev gold@1 | dev overlap@{k} |")
    print("|---|---|---|---|---|---|")
    for entry in report["checkpoints"]:
        for name, at in entry["rows"].items():
            print(f"| {entry['step']} | {name} | {at['train']['gold_at_1']:.3f} | {at['train']['overlap']:.3f} | "
                  f"{at['dev']['gold_at_1']:.3f} | {at['dev']['overlap']:.3f} |")
    print(f"\nachievable fit: a corrector of the in-loop width fitted on the gold + fresh top-{report['fit_top']} rows "
          f"of {report['fit_questions']} training questions (" + ", ".join(
              f"step {e['step']}: {e['fit_rows']} rows" for e in report["checkpoints"]) + ")")


def print_tables(report: dict) -> None:
    names = [n for n in report["rows"]["all"] if n != "n"]
    print("| rows | n | " + " | ".join(f"cos({n}, g) | rel. err {n}" for n in names) + " |")
    print("|---|---|" + "---|---|" * len(names))
    for group, stats in report["rows"].items():
        cells = " | ".join(f"{stats[n]['cosine']:.3f} | {stats[n]['relative_error']:.3f}" for n in names)
        print(f"| {group} | {stats['n']} | {cells} |")
    k = report["k"]
    print(f"\n| questions | searched | overlap@{k} with fresh | on seen rows | on unseen rows | gold at 1 "
          f"| gold in top-{k} |")
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
                        help="uniform-row probe: also fit a corrector of each width offline on the final (B, g) of "
                             "512 uniform seen rows per step (rarely a question's gold: not the achievable fit)")
    parser.add_argument("--fit-steps", type=int, default=1500, help="Adam steps of each offline fit")
    parser.add_argument("--fit-standardized", action="store_true",
                        help="with --fit-hidden: also fit each width with its input standardized by the buffer's "
                             "moments")
    parser.add_argument("--fit-content-hidden", type=int, nargs="*", default=[],
                        help="uniform-row probe from the passages' token bags instead of B (what B could hold)")
    parser.add_argument("--content", type=int, default=0, metavar="ROWS",
                        help="also probe what the stale, fresh and corrected vectors keep of ROWS random passages")
    parser.add_argument("--content-init", nargs="*", default=[], metavar="MODEL",
                        help="with --content: also the stale vectors each retriever.model value would give "
                             "(tiny: the run's random init)")
    parser.add_argument("--checkpoints", type=int, nargs="*", default=None, metavar="STEP",
                        help="instead: what the loop feeds, at each checkpoint (every checkpoints/step-*, or these "
                             "steps): gold@1 and overlap@k with the fresh top-k of the in-loop corrector, the "
                             "achievable fit, fresh g and stale, on training and dev questions")
    parser.add_argument("--fit-top", type=int, default=16,
                        help="with --checkpoints: the achievable fit trains on each training question's gold + fresh "
                             "top-N rows (--fit-steps Adam steps)")
    parser.add_argument("--drift", action="store_true",
                        help="with --checkpoints: only the corpus's drift between the buffer and the checkpoints "
                             "(mean cos of each passage's vectors; any strategy)")
    parser.add_argument("--held-out", action="store_true",
                        help="with --checkpoints: what a corrector does to rows it never learned, with the last "
                             "checkpoint's encoder as g and the stale buffer and each earlier checkpoint as B "
                             "(--fit-hidden H: its width, default the in-loop one; --fit-steps)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.drift:
        if args.checkpoints is None:
            parser.error("--drift reads the run's checkpoints: give --checkpoints [STEP ...]")
        report = corpus_drift(args.run, args.checkpoints)
        print_drift_table(report)
    elif args.held_out:
        if args.checkpoints is None:
            parser.error("--held-out reads the run's checkpoints: give --checkpoints [STEP ...]")
        report = held_out_map(args.run, args.checkpoints, args.k, args.questions,
                              args.fit_hidden[0] if args.fit_hidden else None, args.fit_steps)
        print_map_table(report)
    elif args.checkpoints is not None:
        report = diagnose_checkpoints(args.run, args.checkpoints, args.k, args.questions, args.fit_top, args.fit_steps)
        print_checkpoint_table(report)
    else:
        report = diagnose(args.run, args.k, args.questions, tuple(args.fit_hidden), args.fit_steps, args.content,
                          tuple(args.content_init), tuple(args.fit_content_hidden), args.fit_standardized)
        print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
