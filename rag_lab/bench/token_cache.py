"""Token cache benchmark (scripts/bench_token_cache.py): one toy retriever run that tokenises on every corpus pass
(`buffer.token_cache=false`) and the same run reading the cache (`true`), side by side in one process: per run the
passages tokenised and the seconds it took (`PassageTokenizer.encode`: every pass, or once for the cache), the rows
read from the cache and the seconds that took, the corpus passes metrics.json lists and the run's wall time. Every
tokeniser call runs in this process (`buffer.embed_workers=0`), so it is timed where it happens. The two runs must
end with the same metrics (the same vectors each pass)."""

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
    counts = {"tokenising": 0, "reading cached ids": 0}  # passages: a text to encode / a row whose lengths are read
    saved = [(PassageTokenizer, "encode", "tokenising"), (TokenCache, "lengths", "reading cached ids"),
             (TokenCache, "padded", "reading cached ids")]
    originals = [getattr(owner, name) for owner, name, _ in saved]

    def timer(function, part):
        def wrapped(self, items, *args, **kwargs):
            start = time.perf_counter()
            try:
                return function(self, items, *args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start
                counts[part] += len(items) if function.__name__ != "padded" else 0
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
            "reembedded": metrics["reembedded_passages"], "wall_seconds": wall, "seconds": seconds, "counts": counts,
            "final": metrics["datasets"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        results = [timed_run(args.config, args.overrides, out / ("cached" if cached else "tokenising"), cached)
                   for cached in (False, True)]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1 / 5 / 15 min), {os.cpu_count()} cores")
    print("| run | passes in metrics.json + passages re-embedded by the strategy | passages tokenised | tokenising s "
          "| cached rows read | reading cached ids s | passes in metrics.json s | run s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'token cache' if r['cached'] else 'tokenise every pass'} | {r['passes']} + {r['reembedded']:,} | "
              f"{r['counts']['tokenising']:,} | {r['seconds']['tokenising']:.2f} | "
              f"{r['counts']['reading cached ids']:,} | {r['seconds']['reading cached ids']:.2f} | "
              f"{r['pass_seconds']:.1f} | {r['wall_seconds']:.1f} |")
    plain, cached = results
    spent = [r["seconds"]["tokenising"] + r["seconds"]["reading cached ids"] for r in results]
    print(f"getting token ids: {spent[0]:.2f} s tokenising every pass, {spent[1]:.2f} s with the cache (its build "
          f"included): {spent[0] / max(spent[1], 1e-9):.1f}x less")
    if plain["final"] != cached["final"]:
        raise CheckError(f"the runs' final metrics differ: {plain['final']} without the cache, {cached['final']} "
                         "with it")
