"""Passage-embedding benchmark (scripts/bench_embed.py): `buffer.embed.embed_rows`, the path every corpus pass
uses, against plain `SentenceTransformer.encode` of the same tower on the same passages, side by side in one run.

Per tower shape (tiny / small / base, random-weight T5 encoders; plus a real sentence-transformers folder such
as all-MiniLM-L6-v2 with `--st-model`) and passage length (every passage is longer than the length and is
truncated to it, so each batch is exactly `length` tokens wide):
  * passages/s of both paths and their ratio;
  * the encoder's matmul FLOP/s (projections, feed-forward, attention products, on real tokens) as a fraction
    of the same-run GEMM peak (a large square matmul: fp32 on CPU, bf16 on CUDA);
  * the largest difference between the two paths' vectors (they must agree).
Timings are the best of `--repeats` runs, the two paths alternating, so load on a shared machine distorts the
ratio as little as possible.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rag_train.buffer.embed import autocast_for, embed_rows
from rag_train.config import RetrieverConfig, TinyModelConfig
from rag_train.data.corpus import Corpus
from rag_train.models.retriever import DualEncoder, format_passage

# T5 encoder shapes: the toy retriever, T5-v1.1-small, and T5-v1.1-base (GTR-base's FLOPs: its gated 2048-wide
# feed-forward costs what GTR's 3072-wide ReLU one does)
SHAPES = {
    "tiny": TinyModelConfig(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2),
    "small": TinyModelConfig(d_model=512, d_ff=1024, d_kv=64, num_heads=6, num_layers=8),
    "base": TinyModelConfig(d_model=768, d_ff=2048, d_kv=64, num_heads=12, num_layers=12),
}
PASSAGES_AT_128 = {"tiny": 8192, "small": 512, "base": 128, "st": 1024}  # CPU defaults, scaled by 128 / length


@dataclass
class Result:
    model: str
    length: int
    passages: int
    ours: float  # passages/s
    st: float
    ours_gemm_fraction: float
    st_gemm_fraction: float
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return self.ours / self.st


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--shapes", default="tiny,small,base", help="comma list of tiny, small, base ('' for none)")
    parser.add_argument("--lengths", default="64,128,256", help="passage lengths in tokens")
    parser.add_argument("--st-model", default=None, help="a sentence-transformers folder (e.g. all-MiniLM-L6-v2)")
    parser.add_argument("--toy-dir", default=None, help="toy world for texts + tokenizer (default: a temporary one)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the per-shape passage counts")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per batch (default 128 CPU, 512 CUDA)")
    parser.add_argument("--workers", type=int, default=0, help="embed_rows' DataLoader workers (buffer.embed_workers)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for both paths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def gemm_peak(device: torch.device, repeats: int = 3) -> float:
    """FLOP/s of a large square matmul in the dtype the encoder runs in (fp32 CPU, bf16 CUDA)."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def encoder_flops(model: DualEncoder, tokens: int) -> float:
    """Matmul FLOPs of one passage of `tokens` tokens through the passage tower's transformer."""
    config = model.passage_encoder[0].auto_model.config
    d = config.hidden_size if hasattr(config, "hidden_size") else config.d_model
    layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    inner = heads * (getattr(config, "d_kv", None) or d // heads)
    d_ff = getattr(config, "intermediate_size", None) or config.d_ff
    ff_mats = 3 if getattr(config, "is_gated_act", False) else 2
    per_layer = 2 * tokens * (4 * d * inner + ff_mats * d * d_ff) + 2 * 2 * tokens * tokens * inner
    return float(layers * per_layer)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def long_passages(toy_passages: Path, out: Path, count: int, join: int = 12) -> Corpus:
    """`count` passages, each `join` toy passages glued together (several hundred tokens), as a corpus file."""
    source = Corpus.open(toy_passages)
    with open(out, "w", encoding="utf-8") as handle:
        for i in range(count):
            rows = [(i * join + j) % len(source) for j in range(join)]
            text = " ".join(format_passage(p) for p in source.passages(rows))
            handle.write(json.dumps({"id": f"b{i}", "title": "", "text": text}) + "\n")
    return Corpus.open(out)


def time_both(model: DualEncoder, corpus: Corpus, batch_size: int, workers: int, device: torch.device,
              repeats: int, rows: Optional[np.ndarray] = None) -> tuple[float, float, float]:
    """Best seconds of embed_rows and of SentenceTransformer.encode over `rows` of `corpus` (default all), and
    the largest difference between their vectors."""
    tower = model.passage_encoder
    rows = np.arange(len(corpus)) if rows is None else rows
    texts = [format_passage(p) for p in corpus.passages(rows)]  # ST gets its texts in memory: its reads are free
    tower.max_seq_length = model.max_passage_length
    best_ours = best_st = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        with autocast_for(device):
            theirs = tower.encode(texts, batch_size=batch_size, convert_to_tensor=True, device=str(device))
        _sync(device)
        best_st = min(best_st, time.perf_counter() - start)
        start = time.perf_counter()
        ours = embed_rows(model, corpus, rows, batch_size, device, num_workers=workers)
        _sync(device)
        best_ours = min(best_ours, time.perf_counter() - start)
    return best_ours, best_st, (ours.float() - theirs.float()).abs().max().item()


def run(args: argparse.Namespace) -> list[Result]:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    batch_size = args.batch_size or (512 if device.type == "cuda" else 128)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    shapes = [s for s in args.shapes.split(",") if s]
    peak = gemm_peak(device)
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}"
          f"), torch threads {torch.get_num_threads()}, batch {batch_size}, workers {args.workers}; "
          f"GEMM peak {peak / 1e9:.1f} GFLOP/s")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        toy = Path(args.toy_dir) if args.toy_dir else Path(tmp) / "toy"
        if not (toy / "passages.jsonl").is_file():
            from rag_train.data.toy_files import generate_toy_world

            generate_toy_world(toy, 2000, seed=0, progress=False)
        models = [(s, RetrieverConfig(model="tiny", tiny=SHAPES[s], shared_towers=True)) for s in shapes]
        if args.st_model:
            models.append(("st", RetrieverConfig(model=args.st_model, shared_towers=True)))
        for name, cfg in models:
            for length in lengths:
                count = max(16, int(PASSAGES_AT_128[name] * 128 / length * args.scale))
                corpus = long_passages(toy / "passages.jsonl", Path(tmp) / f"{name}-{length}.jsonl", count)
                cfg.max_passage_length = length
                model = DualEncoder.from_config(cfg, tokenizer=str(toy / "tokenizer")).to(device).eval()
                ours, st, diff = time_both(model, corpus, batch_size, args.workers, device, args.repeats)
                flops = encoder_flops(model, length) * count
                label = Path(args.st_model).name if name == "st" else name
                results.append(Result(label, length, count, count / ours, count / st, flops / ours / peak,
                                      flops / st / peak, diff))
                r = results[-1]
                print(f"{label:>18} {length:>4} tok {count:>6} psg: embed_rows {r.ours:9.1f} psg/s "
                      f"({r.ours_gemm_fraction:.3f} of peak) | ST encode {r.st:9.1f} psg/s ({r.st_gemm_fraction:.3f}) "
                      f"| x{r.speedup:.2f} | max|diff| {r.max_abs_diff:.1e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "threads": args.threads, "batch_size": batch_size,
                                               "workers": args.workers, "gemm_peak_flops": peak,
                                               "results": [dict(vars(r), speedup=r.speedup) for r in results]},
                                              indent=1))
    return results


def main(argv=None) -> None:
    run(parse_args(argv))
