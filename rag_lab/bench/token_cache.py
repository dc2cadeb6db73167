"""Token cache benchmark (scripts/bench_token_cache.py): one toy retriever run that tokenises on every corpus pass
(`buffer.token_cache=false`) and the same run reading the cache (`true`), side by side in one process: per run the
corpus passes, the seconds spent tokenising (`PassageTokenizer.encode`: every pass, or once for the cache) and reading
cached ids, and the seconds of all passes. Every tokeniser call runs in this process (`buffer.embed_workers=0`), so
it is timed where it happens. The two runs must end with the same metrics (the same vectors each pass)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rag_train.io import CheckError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "toy" / "retriever.yaml"
DEFAULT_OVERRIDES = ("strategy.name=exhaustive", "strategy.refresh_every=25", "train.steps=100",
                     "train.eval_every=50")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a retriever run's YAML")
    parser.add_argument("--out", default=None, help="where the two runs go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", default=list(DEFAULT_OVERRIDES),
                        help=f"key=value for both runs (default: {' '.join(DEFAULT_OVERRIDES)})")
    return parser.parse_args(argv)


def timed_run(config: str, overrides: list[str], out: Path, cached: bool) -> dict:
    """One retriever run with the tokeniser and the cache reads timed."""
    from rag_train.buffer.embed import PassageTokenizer
    from rag_train.buffer.tokens import TokenCache
    from rag_train.config import load_config
    from rag_train.train.retriever import train_retriever
    from rag_train.train.schema import RetrieverTrainConfig

    seconds = {"tokenising": 0.0, "reading cached ids": 0.0}
    saved = [(PassageTokenizer, "encode", "tokenising"), (TokenCache, "lengths", "reading cached ids"),
             (TokenCache, "padded", "reading cached ids")]
    originals = [getattr(owner, name) for owner, name, _ in saved]

    def timer(function, part):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
        return wrapped

    for (owner, name, part), original in zip(saved, originals):
        setattr(owner, name, timer(original, part))
    cfg = load_config(RetrieverTrainConfig, config, [*overrides, f"train.output_dir={out}", "buffer.embed_workers=0",
                                                     f"buffer.token_cache={str(cached).lower()}"])
    try:
        start = time.perf_counter()
        train_retriever(cfg)
        wall = time.perf_counter() - start
    finally:
        for (owner, name, _), original in zip(saved, originals):
            setattr(owner, name, original)
    metrics = json.loads((out / "metrics.json").read_text())
    passes = metrics["corpus_passes"]
    return {"cached": cached, "passes": len(passes), "pass_seconds": sum(p["seconds"] for p in passes),
            "wall_seconds": wall, **seconds, "final": metrics["datasets"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        results = [timed_run(args.config, args.overrides, out / ("cached" if cached else "tokenising"), cached)
                   for cached in (False, True)]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1 / 5 / 15 min), {os.cpu_count()} cores")
    print("| run | corpus passes | tokenising s | reading cached ids s | all passes s | run s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'token cache' if r['cached'] else 'tokenise every pass'} | {r['passes']} | {r['tokenising']:.2f} | "
              f"{r['reading cached ids']:.2f} | {r['pass_seconds']:.1f} | {r['wall_seconds']:.1f} |")
    plain, cached = results
    print(f"tokenising: {plain['tokenising'] / max(cached['tokenising'], 1e-9):.1f}x less time with the cache; all "
          f"passes {plain['pass_seconds'] / max(cached['pass_seconds'], 1e-9):.2f}x")
    if plain["final"] != cached["final"]:
        raise CheckError(f"the runs' final metrics differ: {plain['final']} without the cache, {cached['final']} "
                         "with it")
