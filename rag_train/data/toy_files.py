"""A toy world on disk: its files (passages, QA and retrieval sets, tokenizer; docs/toy_world.md) written by streaming
the world of rag_train/data/toy.py chunk by chunk, and the cache that reuses a complete world of the same parameters and
refuses to replace one of others."""

from __future__ import annotations

import argparse
import fcntl
import functools
import itertools
import json
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
from tqdm.auto import tqdm

from rag_train.config import ConfigError, DataConfig
from rag_train.data.toy import FAMILIES, TOY_VERSION, ToyWorld
from rag_train.io import atomic_open, atomic_write_json, remove_stale_temporaries

CHUNK = 16384  # passages or questions rendered and written at once
TOKENIZER_FAMILIES = ("nq", "tqa", "mentor_bridge")
TOKENIZER_SAMPLE = 50_000  # passages (and questions per file) the tokenizer is trained on


def default_question_counts(passages: int) -> tuple[int, int]:
    """Per family: train = min(passages, 100k), dev = min(max(100, passages // 10), 5k) (then capped by
    the distinct (person, fact) pairs a split has)."""
    return min(passages, 100_000), min(max(100, passages // 10), 5_000)


def _write_jsonl(path: Path, rows: Iterator[list[dict]]) -> None:
    with atomic_open(path, "w") as handle:
        for chunk in rows:
            handle.write("".join(json.dumps(row) + "\n" for row in chunk))


def _passage_lines(world: ToyWorld, start: int, stop: int) -> str:
    """Passage rows start..stop as JSONL text."""
    rows = np.arange(start, stop)
    titles, texts = world.render(rows)
    return "".join(json.dumps({"id": f"p{r}", "title": t, "text": x}) + "\n"
                   for r, t, x in zip(rows.tolist(), titles, texts))


@functools.lru_cache(maxsize=1)
def _worker_world(passages: int, seed: int) -> ToyWorld:
    return ToyWorld(passages, seed)


def _worker_passage_lines(passages: int, seed: int, bounds: tuple[int, int]) -> str:
    return _passage_lines(_worker_world(passages, seed), *bounds)


def _passage_texts(world: ToyWorld, progress: bool, workers: int) -> Iterator[str]:
    """The passages file's text chunk by chunk, in row order. With `workers` > 1 the chunks are rendered in that
    many processes (rendering is a pure function of the rows: the bytes are the same)."""
    bounds = [(start, min(start + CHUNK, world.passages)) for start in range(0, world.passages, CHUNK)]
    with tqdm(total=world.passages, unit="passage", desc="toy passages", disable=not progress) as bar:
        if workers > 1 and len(bounds) > 1:
            render = functools.partial(_worker_passage_lines, world.passages, world.seed)
            with multiprocessing.get_context("spawn").Pool(min(workers, len(bounds))) as pool:
                for (start, stop), text in zip(bounds, pool.imap(render, bounds)):
                    yield text
                    bar.update(stop - start)
            return
        for start, stop in bounds:
            yield _passage_lines(world, start, stop)
            bar.update(stop - start)


def _question_chunks(world: ToyWorld, family: str, split: str, count: int, progress: bool, retrieval: bool):
    for start in tqdm(range(0, count, CHUNK), desc=f"toy {family}-{split}", disable=not progress):
        chunk = world.questions(family, split, start, min(start + CHUNK, count))
        if not retrieval:
            yield [{key: q[key] for key in ("id", "question", "answers", "gold_ids")} for q in chunk]
            continue
        gold = np.array([q["_row"] for q in chunk], dtype=np.int64)
        positives = world.passage_dicts(gold)
        negatives = world.passage_dicts(world.hard_negative_rows(gold).reshape(-1))
        width = len(negatives) // len(chunk)
        yield [{"id": q["id"], "question": q["question"], "answers": q["answers"], "positive_ctxs": [positives[i]],
                "hard_negative_ctxs": negatives[i * width:(i + 1) * width]} for i, q in enumerate(chunk)]


def _tokenizer_texts(paths: dict[str, Path]) -> Iterator[str]:
    with open(paths["passages"], encoding="utf-8") as handle:
        for line in itertools.islice(handle, TOKENIZER_SAMPLE):
            row = json.loads(line)
            yield row["title"]
            yield row["text"]
    for family, split in itertools.product(TOKENIZER_FAMILIES, ("train", "dev")):
        with open(paths[f"{family}-{split}"], encoding="utf-8") as handle:
            for line in itertools.islice(handle, TOKENIZER_SAMPLE):
                row = json.loads(line)
                yield row["question"]
                yield from row["answers"]


def world_families(retrieval: str) -> tuple[str, ...]:
    """The question families a world writes: the `described` family only in a world of described retrieval."""
    return FAMILIES + (("described",) if retrieval == "described" else ())


def toy_paths(out_dir: str | Path, retrieval: str = "named") -> dict[str, Path]:
    out_dir = Path(out_dir)
    names = (["passages"] + [f"{f}-{s}" for f in world_families(retrieval) for s in ("train", "dev")]
             + ["retrieval-train", "retrieval-dev"])
    paths = {name: out_dir / f"{name}.jsonl" for name in names}
    paths["tokenizer"] = out_dir / "tokenizer"
    paths["manifest"] = out_dir / "manifest.json"
    return paths


def generate_toy_world(
    out_dir: str | Path,
    passages: int,
    seed: int,
    questions: Optional[int] = None,
    dev_questions: Optional[int] = None,
    tokenizer_vocab: Optional[int] = 2000,
    progress: bool = True,
    workers: int = 1,
    retrieval: str = "named",
) -> dict[str, Path]:
    """Write a toy world into `out_dir` (files in docs/toy_world.md); manifest.json is written last.

    `questions` / `dev_questions`: questions per family and split (defaults: `default_question_counts`).
    `tokenizer_vocab=None` skips training the tokenizer. `workers` > 1 renders the passages in that many
    processes (the same bytes; the passages are what grows with the world, the questions stop at 100k a family).
    `retrieval`: `named` builds the retrieval files from nq + tqa; `described` also writes the `described` family and
    builds them from it alone (rag_train/data/toy_described.py), recording its R@1 ceiling in the manifest.
    """
    if retrieval not in ("named", "described"):
        raise ValueError(f"retrieval={retrieval!r}: expected 'named' or 'described'")
    world = ToyWorld(passages, seed)
    default_train, default_dev = default_question_counts(passages)
    retrieval_families = ("nq", "tqa") if retrieval == "named" else ("described",)
    counts = {}
    for split, asked, default in (("train", questions, default_train), ("dev", dev_questions, default_dev)):
        for family in world_families(retrieval):
            cap = world.capacity(family, split)
            if asked is not None and asked > cap:
                raise ValueError(f"{asked} {family}-{split} questions requested but a {passages}-passage world has "
                                 f"only {cap} distinct ones; lower the question count or raise passages")
            counts[f"{family}-{split}"] = min(default if asked is None else asked, cap)
    paths = toy_paths(out_dir, retrieval)
    paths["manifest"].unlink(missing_ok=True)  # a half-regenerated world must never look finished
    with atomic_open(paths["passages"], "w") as handle:
        for text in _passage_texts(world, progress, workers):
            handle.write(text)
    for name, count in counts.items():
        family, split = name.split("-")
        _write_jsonl(paths[name], _question_chunks(world, family, split, count, progress, retrieval=False))
    for split in ("train", "dev"):
        chunks = itertools.chain(*(_question_chunks(world, family, split, counts[f"{family}-{split}"], progress,
                                                    retrieval=True) for family in retrieval_families))
        _write_jsonl(paths[f"retrieval-{split}"], chunks)
    if tokenizer_vocab is not None:
        _write_tokenizer(paths, tokenizer_vocab)
    manifest = {"version": TOY_VERSION, "passages": passages, "seed": seed, "questions": questions,
                "dev_questions": dev_questions, "tokenizer_vocab": tokenizer_vocab, "counts": counts,
                "sizes": {name: p.stat().st_size for name, p in paths.items() if p.suffix == ".jsonl"}}
    if retrieval == "described":  # only then, so a named world's manifest (and fingerprint) is version 3's
        from rag_train.data import toy_described

        manifest["retrieval"] = retrieval
        manifest["described_ceiling"] = {split: round(toy_described.ceiling(world, split, counts[f"described-{split}"]),
                                                      2) for split in ("train", "dev")}
    atomic_write_json(paths["manifest"], manifest)
    return paths


def _write_tokenizer(paths: dict[str, Path], vocab_size: int) -> None:
    """Train into a temporary folder and rename it into place, so a crash never leaves half a tokenizer."""
    from rag_train.data.tokenizer import train_tokenizer

    final = paths["tokenizer"]
    staging = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=final.parent))
    try:
        train_tokenizer(_tokenizer_texts(paths), staging, vocab_size=vocab_size)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_current(paths: dict[str, Path], expected: dict) -> bool:
    try:
        manifest = json.loads(paths["manifest"].read_text())
    except (OSError, ValueError):
        return False
    if any(manifest.get(key) != value for key, value in expected.items()):
        return False
    sizes = manifest.get("sizes", {})
    if any(not paths[name].is_file() or paths[name].stat().st_size != size for name, size in sizes.items()):
        return False
    return expected["tokenizer_vocab"] is None or (paths["tokenizer"] / "tokenizer.json").is_file()


def _refuse_to_replace(paths: dict[str, Path], expected: dict, data_cfg: DataConfig) -> None:
    """ConfigError if `paths` hold a toy world (a readable manifest) made with other parameters than `expected`
    and the config does not ask to regenerate it. A damaged world of the same parameters is rebuilt: it is the
    same world."""
    try:
        found = json.loads(paths["manifest"].read_text())
    except (OSError, ValueError):
        return
    differ = [key for key, value in expected.items() if found.get(key) != value]
    if not differ or data_cfg.toy_regenerate:
        return
    asked = {"seed": f"data.toy_seed={expected['seed']}", "passages": f"data.toy_passages={expected['passages']}",
             "version": f"toy world version {expected['version']}", "tokenizer_vocab": "another tokenizer vocabulary",
             "retrieval": f"data.toy_retrieval={expected['retrieval'] or 'named'}"}
    raise ConfigError(
        f"{paths['manifest'].parent} holds the toy world of seed {found.get('seed')}, {found.get('passages')} passages "
        f"(version {found.get('version')}, {found.get('retrieval') or 'named'} retrieval questions); "
        f"{', '.join(asked.get(k, k) for k in differ)} would regenerate it in place, "
        "and the runs, buffers and exports made from it would no longer match their data. Choose another "
        "data.toy_dir, or set data.toy_regenerate=true to replace it.")


def ensure_toy_world(data_cfg: DataConfig, tokenizer_vocab: int = 2000, workers: int = 1) -> dict[str, Path]:
    """Paths of the toy world in `data_cfg.toy_dir`, generating it first if missing or damaged. A complete world
    of other parameters there is replaced only with `data.toy_regenerate=true`. A file lock makes concurrent
    callers (e.g. several ranks) generate it once; `workers` as in `generate_toy_world`."""
    out_dir = Path(data_cfg.toy_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = toy_paths(out_dir, data_cfg.toy_retrieval)
    expected = {"version": TOY_VERSION, "passages": data_cfg.toy_passages, "seed": data_cfg.toy_seed,
                "questions": None, "dev_questions": None, "tokenizer_vocab": tokenizer_vocab,
                "retrieval": None if data_cfg.toy_retrieval == "named" else data_cfg.toy_retrieval}
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_current(paths, expected):
            _refuse_to_replace(paths, expected, data_cfg)
            remove_stale_temporaries(out_dir)  # a killed generation's (the lock keeps other writers out)
            progress = os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"
            generate_toy_world(out_dir, data_cfg.toy_passages, data_cfg.toy_seed, tokenizer_vocab=tokenizer_vocab,
                               progress=progress, workers=workers, retrieval=data_cfg.toy_retrieval)
    return paths


def main(argv: Optional[list[str]] = None) -> None:
    """`scripts/make_toy_data.py`: generate a toy world into --out and print its files."""
    parser = argparse.ArgumentParser(
        description="Generate a toy world: its passages, QA and retrieval files, tokenizer.")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--passages", type=int, required=True, help="number of passages (two per person)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=int, default=None,
                        help="train questions per family (default min(passages, 100000))")
    parser.add_argument("--dev-questions", type=int, default=None,
                        help="dev questions per family (default min(max(100, passages // 10), 5000))")
    parser.add_argument("--tokenizer-vocab", type=int, default=2000, help="0 = do not train a tokenizer")
    parser.add_argument("--workers", type=int, default=1, help="processes rendering the passages (same bytes)")
    parser.add_argument("--retrieval", choices=("named", "described"), default="named",
                        help="what the retrieval files ask (docs/toy_world.md); described: the non-saturating world")
    args = parser.parse_args(argv)
    try:
        paths = generate_toy_world(args.out, args.passages, args.seed, args.questions, args.dev_questions,
                                   tokenizer_vocab=args.tokenizer_vocab or None, workers=args.workers,
                                   retrieval=args.retrieval)
    except ValueError as exc:
        parser.error(str(exc))
    for name, path in paths.items():
        print(f"{name}: {path}")
