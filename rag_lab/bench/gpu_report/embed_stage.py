"""The `embed` stage: `embed_rows` against `SentenceTransformer.encode`, its corpus pass on eager attention against
FlexAttention side by side (`retriever.encoder_kernel`), `embed_rows` reading token ids from the token cache
(buffer/tokens.py: tokenisation out of the loop), and where `embed_rows`' host time goes."""

from __future__ import annotations

import math
import time

from rag_lab.bench.gpu_report.common import (
    TOY_PASSAGES,
    Context,
    Stage,
    StageCheckError,
    fraction_goal,
    gemm_peak,
    register,
)

# sizes that ran in 142 s on an H100 before the eager / flex passes (about twice the embed_rows passes, and flex's
# compiles: an estimate, not measured); 4x these outran a 300 s budget (ST.encode of 262,144 tiny rows alone takes
# a minute: its tokenisation runs in one process)
EMBED_GPU = {"shapes": ("tiny", "small", "base"), "lengths": (64, 128, 256), "at_128": {"tiny": 32768,
             "small": 4096, "base": 2048}, "batch_size": 1024, "workers": 8, "repeats": 2, "padded_rows": 2000}
EMBED_QUICK = {"shapes": ("tiny",), "lengths": (64, 128, 256), "at_128": {"tiny": 16}, "batch_size": 8,
               "workers": 0, "repeats": 1, "padded_rows": 12}
KERNELS = ("eager", "flex")  # the corpus pass's kernels timed side by side (retriever.encoder_kernel)
MIN_COSINE = 0.99  # flex's vectors against eager's, per row: the bf16 tolerance of the forward stage's checks


def profile_embed(model, corpus, rows, batch_size: int, device) -> dict:
    """One extra `embed_rows` pass with every host step in this process (0 workers) and the device synchronised
    around the forward: seconds in reads, tokenisation, collation, forward, and the rest (host <-> device copies,
    landing the vectors, the loop). Also counts the rows and real tokens the forward saw."""
    import rag_train.buffer.embed as embed_module
    from rag_lab.bench.machine import synchronize
    from rag_train.buffer.embed import PassageTokenizer, embed_rows

    seconds = {"reads": 0.0, "tokenisation": 0.0, "collation": 0.0, "forward": 0.0}
    seen = {"rows": 0, "tokens": 0}

    def timed(part, fn, sync=False):
        def wrapped(*args, **kwargs):
            if sync:
                synchronize(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                synchronize(device)
            seconds[part] += time.perf_counter() - start
            return out
        return wrapped

    forward = model.encode_passage_features

    def counted(features):
        seen["rows"] += int(features["attention_mask"].shape[0])
        seen["tokens"] += int(features["attention_mask"].sum())
        return forward(features)

    saved = [(PassageTokenizer, "encode", PassageTokenizer.encode), (PassageTokenizer, "features",
             PassageTokenizer.features), (embed_module, "plan_batches", embed_module.plan_batches)]
    PassageTokenizer.encode = timed("tokenisation", PassageTokenizer.encode)
    PassageTokenizer.features = timed("collation", PassageTokenizer.features)
    embed_module.plan_batches = timed("collation", embed_module.plan_batches)
    corpus.passages = timed("reads", corpus.passages)
    model.encode_passage_features = timed("forward", counted, sync=True)
    try:
        synchronize(device)
        start = time.perf_counter()
        embed_rows(model, corpus, rows, batch_size, device, num_workers=0)
        synchronize(device)
        total = time.perf_counter() - start
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        del corpus.passages, model.encode_passage_features
    seconds["copies and the rest"] = max(0.0, total - sum(seconds.values()))
    return {"seconds": total, "share": {k: v / total for k, v in seconds.items()}, **seen}


def kernel_pass(model, kernel: str, corpus, rows, cfg: dict, device) -> tuple:
    """(best seconds of `embed_rows` over `rows` with the corpus pass on `kernel`, its vectors); the model's own
    encoder_kernel (auto) is put back after."""
    from rag_lab.bench.machine import synchronize
    from rag_train.buffer.embed import embed_rows

    best, chosen = float("inf"), model.encoder_kernel
    model.encoder_kernel = kernel  # what embed_rows reads: retriever.encoder_kernel
    try:
        for _ in range(cfg["repeats"]):
            synchronize(device)
            start = time.perf_counter()
            vectors = embed_rows(model, corpus, rows, cfg["batch_size"], device, num_workers=cfg["workers"])
            synchronize(device)
            best = min(best, time.perf_counter() - start)
    finally:
        model.encoder_kernel = chosen
    return best, vectors


def min_cosine(a, b) -> float:
    import torch

    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=1).min().item()


def time_cached(model, corpus, rows, batch_size: int, workers: int, device, repeats: int, folder) -> dict:
    """Best seconds of `embed_rows` reading ids from a token cache of `corpus` at `folder` (built there first, or
    reused: every tower of one length shares it), the build's seconds, and the largest difference to the vectors
    of a pass that tokenises (0: the same batches)."""
    from rag_lab.bench.machine import synchronize
    from rag_train.buffer.embed import PassageTokenizer, embed_rows
    from rag_train.buffer.tokens import build_token_cache

    start = time.perf_counter()
    # overwrite: the folder is the stage's own, and a rerun's passages may differ from the last run's
    cache = build_token_cache(corpus, PassageTokenizer.for_passages(model), folder, num_workers=workers, overwrite=True)
    built = time.perf_counter() - start
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        cached = embed_rows(model, corpus, rows, batch_size, device, num_workers=workers, tokens=cache)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    tokenised = embed_rows(model, corpus, rows, batch_size, device, num_workers=workers)
    return {"seconds": best, "passages_per_s": len(rows) / best, "build_seconds": built,
            "max_abs_diff": (cached.float() - tokenised.float()).abs().max().item()}


def stage_embed(ctx: Context) -> dict:
    import numpy as np

    from rag_lab.bench.embed import SHAPES, encoder_flops, long_passages, time_both
    from rag_train.config import RetrieverConfig
    from rag_train.data.corpus import Corpus
    from rag_train.data.toy_files import generate_toy_world
    from rag_train.models.attention import pass_attention
    from rag_train.models.fast_t5 import FLEX
    from rag_train.models.retriever import DualEncoder

    cfg = EMBED_QUICK if ctx.quick else EMBED_GPU
    device = ctx.device
    peak, peak_how = gemm_peak(device)
    toy = ctx.work / "toy"
    generate_toy_world(toy, TOY_PASSAGES[ctx.quick], seed=0, progress=False)
    toy_corpus = Corpus.open(toy / "passages.jsonl")  # passages of varied lengths: padded batches for the flex check
    padded_rows = np.arange(min(cfg["padded_rows"], len(toy_corpus)))
    ours_kernel = "flex" if pass_attention("auto", device) == FLEX else "eager"
    results = []
    for length in cfg["lengths"]:
        counts = {shape: max(8, cfg["at_128"][shape] * 128 // length) for shape in cfg["shapes"]}
        # each passage: enough toy passages (~35 tokens each) glued together to outrun `length` tokens
        corpus = long_passages(toy / "passages.jsonl", ctx.work / f"long-{length}.jsonl", max(counts.values()),
                               join=math.ceil(length / 20) + 1)
        for shape in cfg["shapes"]:
            model_cfg = RetrieverConfig(model="tiny", tiny=SHAPES[shape], shared_towers=True,
                                        max_passage_length=length)
            model = DualEncoder.from_config(model_cfg, tokenizer=str(toy / "tokenizer")).to(device).eval()
            rows = np.arange(counts[shape])
            ours, st, diff = time_both(model, corpus, cfg["batch_size"], cfg["workers"], device, cfg["repeats"], rows)
            profile = profile_embed(model, corpus, rows, cfg["batch_size"], device)
            if profile["rows"] != len(rows) or profile["tokens"] != len(rows) * length:
                raise StageCheckError(f"embed {shape} at {length} tokens: the forward saw {profile['rows']} rows and "
                                      f"{profile['tokens']} tokens, not {len(rows)} rows of exactly {length} tokens")
            cached = time_cached(model, corpus, rows, cfg["batch_size"], cfg["workers"], device, cfg["repeats"],
                                 ctx.work / f"tokens-{length}")
            flops = encoder_flops(model, length) * len(rows)
            cached["fraction_of_peak"] = flops / cached["seconds"] / peak
            kernels, vectors = {}, {}
            for kernel in KERNELS:
                seconds, vectors[kernel] = kernel_pass(model, kernel, corpus, rows, cfg, device)
                kernels[kernel] = {"seconds": seconds, "passages_per_s": len(rows) / seconds,
                                   "fraction_of_peak": flops / seconds / peak}
            agreement = min_cosine(vectors["flex"], vectors["eager"])
            padded = {kernel: kernel_pass(model, kernel, toy_corpus, padded_rows, dict(cfg, repeats=1), device)[1]
                      for kernel in KERNELS}
            padded_agreement = min_cosine(padded["flex"], padded["eager"])
            if not (agreement > MIN_COSINE and padded_agreement > MIN_COSINE):
                raise StageCheckError(f"embed {shape} at {length} tokens: FlexAttention's vectors at cosine "
                                      f"{agreement:.4f} of eager's ({padded_agreement:.4f} on padded toy passages)")
            results.append({"shape": shape, "length": length, "passages": len(rows), "ours_kernel": ours_kernel,
                            "kernels": kernels, "min_cosine_flex_vs_eager": agreement,
                            "padded_passages": len(padded_rows), "padded_min_cosine_flex_vs_eager": padded_agreement,
                            "ours_seconds": ours,
                            "st_seconds": st, "ours_passages_per_s": len(rows) / ours,
                            "st_passages_per_s": len(rows) / st, "ours_fraction_of_peak": flops / ours / peak,
                            "st_fraction_of_peak": flops / st / peak, "flops_per_passage": flops / len(rows),
                            "max_abs_diff": diff, "profile": profile, "cached": cached})
            print(f"embed {shape:>5} {length:>3} tok {len(rows):>7} psg: embed_rows {len(rows) / ours:10.0f} psg/s "
                  f"({flops / ours / peak:.3f} of peak, {ours_kernel}), ST {len(rows) / st:10.0f} psg/s, max|diff| "
                  f"{diff:.1e}; eager {kernels['eager']['passages_per_s']:10.0f} psg/s "
                  f"({kernels['eager']['fraction_of_peak']:.3f}), flex {kernels['flex']['passages_per_s']:10.0f} psg/s "
                  f"({kernels['flex']['fraction_of_peak']:.3f}), min cosine {agreement:.5f} (padded "
                  f"{padded_agreement:.5f}); from the token cache {cached['passages_per_s']:10.0f} psg/s", flush=True)
            del model
    pick = {(r["shape"], r["length"]): r for r in results}
    base = pick.get(("base", 256))
    tiny = [r["ours_passages_per_s"] for r in results if r["shape"] == "tiny"]
    tiny_cached = [r["cached"]["passages_per_s"] for r in results if r["shape"] == "tiny"]
    goals = [fraction_goal("base-shaped tower at 256 tokens: embed_rows >= 0.5 of the bf16 GEMM peak",
                           base and base["ours_fraction_of_peak"], 0.5, device),
             fraction_goal("tiny tower: embed_rows >= 100,000 passages/s (slowest of its lengths)",
                           min(tiny) if tiny else None, 100_000, device),
             fraction_goal("tiny tower, ids from the token cache: embed_rows >= 100,000 passages/s (slowest of its "
                           "lengths)", min(tiny_cached) if tiny_cached else None, 100_000, device)]
    settings = {k: v for k, v in cfg.items() if k != "at_128"}
    return {"gemm_peak_flops": peak, "gemm_peak_how": peak_how, "settings": settings, "results": results,
            "goals": goals}


def render_embed(record: dict) -> list[str]:
    s = record["settings"]
    lines = [f"Towers are random-weight T5 encoders (rag_lab/bench/embed.py: tiny = the toy retriever, small = "
             f"T5-v1.1-small, base = T5-v1.1-base, GTR-base's FLOPs); every passage is truncated to exactly the "
             f"length. Batch {s['batch_size']} rows, `embed_rows` with {s['workers']} DataLoader workers, best of "
             f"{s['repeats']}, both paths under the same autocast; fractions are encoder matmul FLOP/s over the "
             "same-run GEMM peak.", "",
             "| tower | tokens | passages | `embed_rows` psg/s | of peak | `SentenceTransformer.encode` psg/s "
             "| of peak | ratio | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
    for r in record["results"]:
        lines.append(f"| {r['shape']} | {r['length']} | {r['passages']:,} | {r['ours_passages_per_s']:,.0f} | "
                     f"{r['ours_fraction_of_peak']:.3f} | {r['st_passages_per_s']:,.0f} | "
                     f"{r['st_fraction_of_peak']:.3f} | {r['st_seconds'] / r['ours_seconds']:.2f}x | "
                     f"{r['max_abs_diff']:.1e} |")
    lines += kernel_lines(record)
    missing = [x for x in ("tiny", "small", "base") if x not in s["shapes"]]
    if missing:
        lines.append(f"\n(Not run at this size: {', '.join(missing)}.)")
    lines += ["", "Host-side profile of `embed_rows` (one more pass, every host step in the main process, device "
              "synchronised around the forward; shares of that pass's wall time):", "",
              "| tower | tokens | reads | tokenisation | collation | forward | copies and the rest |",
              "|---|---|---|---|---|---|---|"]
    for r in record["results"]:
        share = r["profile"]["share"]
        lines.append(f"| {r['shape']} | {r['length']} | " + " | ".join(
            f"{100 * share[k]:.1f}%" for k in ("reads", "tokenisation", "collation", "forward", "copies and the rest"))
            + " |")
    if not all("cached" in r for r in record["results"]):  # a fragment from before the variant existed
        return lines + ["", "`embed_rows` reading the token ids from a token cache (`buffer/tokens.py`): not measured "
                        "in this fragment (the variant is newer than its run); pending a GPU session."]
    lines += ["", "`embed_rows` reading the token ids from a token cache of the same passages (`buffer/tokens.py`, "
              "built once per length, every tower reusing it; the pass itself tokenises nothing and runs in the main "
              f"process), best of {s['repeats']}; max abs diff against the tokenising pass of the same batches:", "",
              "| tower | tokens | passages | cache build s | from the cache psg/s | of peak | vs tokenising | "
              "max abs diff |", "|---|---|---|---|---|---|---|---|"]
    for r in record["results"]:
        c = r["cached"]
        lines.append(f"| {r['shape']} | {r['length']} | {r['passages']:,} | {c['build_seconds']:.2f} | "
                     f"{c['passages_per_s']:,.0f} | {c['fraction_of_peak']:.3f} | "
                     f"{r['ours_seconds'] / c['seconds']:.2f}x | {c['max_abs_diff']:.1e} |")
    return lines


def kernel_lines(record: dict) -> list[str]:
    """The eager / flex table, for fragments that have it (those of before it do not)."""
    results = [r for r in record["results"] if "kernels" in r]
    if not results:
        return ["", "The corpus pass on eager against FlexAttention: not in this fragment (the stage's side-by-side "
                "came after this run)."]
    lines = ["", f"The corpus pass on each attention kernel, side by side in this run (`embed_rows` with "
             f"`retriever.encoder_kernel` eager, then flex: T5's encoder on FlexAttention, rag_train/models/fast_t5.py;"
             f" the `embed_rows` column above ran `auto`'s choice on this device, {results[0]['ours_kernel']}). The "
             f"cosines are the lowest per row between the two kernels' vectors, on these passages and on "
             f"{results[0]['padded_passages']:,} toy passages of varied lengths (padded batches); the stage fails "
             f"below {MIN_COSINE}.", "",
             "| tower | tokens | eager psg/s | of peak | flex psg/s | of peak | flex / eager | min cosine | "
             "min cosine, padded |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        eager, flex = r["kernels"]["eager"], r["kernels"]["flex"]
        lines.append(f"| {r['shape']} | {r['length']} | {eager['passages_per_s']:,.0f} | "
                     f"{eager['fraction_of_peak']:.3f} | {flex['passages_per_s']:,.0f} | "
                     f"{flex['fraction_of_peak']:.3f} | {eager['seconds'] / flex['seconds']:.2f}x | "
                     f"{r['min_cosine_flex_vs_eager']:.5f} | "
                     f"{r['padded_min_cosine_flex_vs_eager']:.5f} |")
    return lines


STAGE = register(Stage(
    name="embed", order=10, minutes=5,
    what=("embed_rows vs SentenceTransformer.encode (GPU: tiny / small / base towers at 64 / 128 / 256 "
          "tokens), its corpus pass on eager vs FlexAttention attention, host-side profile, embed_rows from the token "
          "cache"),
    run=stage_embed, render=render_embed,
    scales="time linear in the passages per row (32k / 4k / 2k at 128 tokens for tiny / small / base)"))
