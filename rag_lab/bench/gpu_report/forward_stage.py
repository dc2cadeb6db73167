"""The `forward` stage: the passage tower's forward alone (fraction of peak, bf16 weights, device time by kernel
class) and the host's tokenisation rate."""

from __future__ import annotations

import math
import os
import time

from rag_lab.bench.gpu_report.common import TOY_PASSAGES, Context, Stage, StageCheckError, gemm_peak, register

FORWARD_GPU = {"shapes": ("tiny", "small", "base"), "lengths": (64, 256), "batch": 1024, "repeats": 10,
               "tokenise_rows": 32768}
FORWARD_QUICK = {"shapes": ("tiny",), "lengths": (16, 32), "batch": 8, "repeats": 2, "tokenise_rows": 64}
EAGER = "eager"  # the kernel this stage times against SDPA; the embed stage times it against FlexAttention
KERNEL_CLASSES = ("GEMM, 16-bit", "GEMM, fp32", "fused attention", "softmax", "the rest (elementwise, norms, copies)")


def kernel_class(name: str) -> str:
    """The class of one CUDA kernel, or of one aten op on CPU (where every GEMM is fp32), in a forward's profile."""
    low = name.lower()
    if any(k in low for k in ("fmha", "flash", "efficient_attention")):
        return "fused attention"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")):
        return "GEMM, fp32" if low.startswith("aten::") or "f32f32" in low or "sgemm" in low else "GEMM, 16-bit"
    return "softmax" if "softmax" in low else KERNEL_CLASSES[-1]


def forward_profile(fn, device) -> dict:
    """Shares of one call's device time (CUDA kernels; on CPU the leaf ops' own time) per KERNEL_CLASSES."""
    from torch.profiler import ProfilerActivity, profile

    from rag_lab.bench.machine import synchronize

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU], acc_events=True) as prof:
        fn()
        synchronize(device)
    totals = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for event in prof.key_averages():
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if own > 0 and (cuda or event.key.startswith("aten::")):
            totals[kernel_class(event.key)] += own
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}


def stage_forward(ctx: Context) -> dict:
    """The passage tower's forward alone (what `embed_rows` runs per batch: `encode_passage_features` under
    `autocast_for`), on device-resident token ids of exactly each length: how near it comes to the GEMM peak, the
    same with bf16 weights and no autocast, where its device time goes; and how fast the host tokenises."""
    import numpy as np
    import torch

    from rag_lab.bench.embed import SHAPES, encoder_flops, long_passages
    from rag_lab.bench.search import best_time
    from rag_train.buffer.embed import PassageTokenizer, autocast_for
    from rag_train.config import RetrieverConfig
    from rag_train.data.toy_files import generate_toy_world
    from rag_train.models.attention import t5_attention
    from rag_train.models.retriever import DualEncoder, format_passage

    cfg = FORWARD_QUICK if ctx.quick else FORWARD_GPU
    device = ctx.device
    peak, peak_how = gemm_peak(device)
    toy = ctx.work / "toy"
    generate_toy_world(toy, TOY_PASSAGES[ctx.quick], seed=0, progress=False)

    results, tokenise = [], []
    for length in cfg["lengths"]:
        for shape in cfg["shapes"]:
            model = DualEncoder.from_config(RetrieverConfig(model="tiny", tiny=SHAPES[shape], shared_towers=True,
                                                            max_passage_length=length),
                                            tokenizer=str(toy / "tokenizer")).to(device).eval()
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(5, 500, (cfg["batch"], length), generator=generator).to(device)
            features = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            flops = encoder_flops(model, length) * cfg["batch"]
            tokenizer = PassageTokenizer.for_passages(model)  # the towers of one length share the toy tokenizer
            with torch.inference_mode():
                def autocast_forward():
                    with autocast_for(device):
                        return model.encode_passage_features(features)  # noqa: F821 (called before `del model`)

                with t5_attention(model, "sdpa"):  # transformers' default kernel, against eager (flex: `embed`)
                    on_sdpa = autocast_forward().float()
                    sdpa_seconds = best_time(autocast_forward, cfg["repeats"], device=device)
                with t5_attention(model, EAGER):
                    reference = autocast_forward().float()
                    seconds = best_time(autocast_forward, cfg["repeats"], device=device)
                    shares = forward_profile(autocast_forward, device)
                    model.to(torch.bfloat16)
                    low = model.encode_passage_features(features).float()
                    low_seconds = best_time(lambda: model.encode_passage_features(features),  # noqa: F821 (as above)
                                            cfg["repeats"], device=device)
            sdpa_agreement = torch.nn.functional.cosine_similarity(on_sdpa, reference, dim=1).min().item()
            if not sdpa_agreement > 0.99:
                raise StageCheckError(f"forward {shape} at {length} tokens: SDPA gives vectors at cosine "
                                      f"{sdpa_agreement:.4f} of {EAGER} attention's")
            agreement = torch.nn.functional.cosine_similarity(low, reference, dim=1).min().item()
            if not agreement > 0.99:
                raise StageCheckError(f"forward {shape} at {length} tokens: bf16 weights give vectors at cosine "
                                      f"{agreement:.4f} of the autocast ones")
            results.append({"shape": shape, "length": length, "rows": cfg["batch"], "attention": EAGER,
                            "autocast_seconds": seconds, "autocast_fraction_of_peak": flops / seconds / peak,
                            "sdpa_seconds": sdpa_seconds, "min_cosine_sdpa_vs_eager": sdpa_agreement,
                            "bf16_seconds": low_seconds, "bf16_fraction_of_peak": flops / low_seconds / peak,
                            "min_cosine_bf16_vs_autocast": agreement, "device_time_shares": shares})
            print(f"forward {shape:>5} {length:>3} tok x {cfg['batch']}: autocast {seconds * 1e3:8.1f} ms "
                  f"({flops / seconds / peak:.3f} of peak), bf16 weights {low_seconds * 1e3:8.1f} ms "
                  f"({flops / low_seconds / peak:.3f}), SDPA {sdpa_seconds * 1e3:8.1f} ms; "
                  + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()), flush=True)
            del model
        corpus = long_passages(toy / "passages.jsonl", ctx.work / f"long-{length}.jsonl", cfg["tokenise_rows"],
                               join=math.ceil(length / 20) + 1)
        texts = [format_passage(p) for p in corpus.passages(np.arange(len(corpus)))]
        rates, previous = {}, os.environ.get("TOKENIZERS_PARALLELISM")
        for mode, parallel in (("Rust threads", "true"), ("one thread", "false")):
            os.environ["TOKENIZERS_PARALLELISM"] = parallel  # read by each call into the Rust library
            start = time.perf_counter()
            _, lengths = tokenizer.encode(texts)
            rates[mode] = len(texts) / (time.perf_counter() - start)
            if int(lengths.min()) != length:
                raise StageCheckError(f"tokenise at {length}: a passage came out {int(lengths.min())} tokens long")
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
        tokenise.append({"length": length, "rows": len(texts), "rows_per_s": rates, "cpus": os.cpu_count()})
        print(f"tokenise {length:>3} tok {len(texts)} rows: " + ", ".join(f"{k} {v:,.0f} rows/s"
                                                                         for k, v in rates.items()), flush=True)
    return {"gemm_peak_flops": peak, "gemm_peak_how": peak_how, "settings": dict(cfg), "results": results,
            "tokenise": tokenise, "goals": []}


def render_forward(record: dict) -> list[str]:
    s = record["settings"]
    lines = [f"The passage tower's forward alone, as `embed_rows` runs it per batch (`encode_passage_features` under "
             f"`autocast_for`), on {s['batch']} rows of token ids already on the device, exactly the length wide; "
             f"best of {s['repeats']} after one warm-up; then the same with the weights cast to bf16 and no "
             "autocast. Fractions are encoder matmul FLOP/s over the same-run GEMM peak; the shares split one "
             "autocast forward's device time (CPU: the aten ops' own time) by kernel. The SDPA column is the same "
             "autocast forward on transformers' default attention (SDPA, T5's bias as a float mask), the same "
             "model, timed just before.", "",
             "| tower | tokens | attention | autocast ms | of peak | SDPA ms | SDPA / ours | "
             "bf16 weights ms | of peak | "
             + " | ".join(KERNEL_CLASSES) + " |", "|" + "---|" * (9 + len(KERNEL_CLASSES))]
    for r in record["results"]:
        shares = " | ".join(f"{100 * r['device_time_shares'][k]:.0f}%" for k in KERNEL_CLASSES)
        sdpa = (f"{r['sdpa_seconds'] * 1e3:.1f} | {r['sdpa_seconds'] / r['autocast_seconds']:.2f}x"
                if "sdpa_seconds" in r else "not measured | -")  # fragments of before the column
        lines.append(f"| {r['shape']} | {r['length']} | {r['attention']} | {r['autocast_seconds'] * 1e3:.1f} | "
                     f"{r['autocast_fraction_of_peak']:.3f} | {sdpa} | {r['bf16_seconds'] * 1e3:.1f} | "
                     f"{r['bf16_fraction_of_peak']:.3f} | {shares} |")
    lines += ["", "Host tokenisation (`PassageTokenizer.encode`, the Rust batch call `embed_rows` makes; "
              "passages longer than the length, truncated to it) in one process, with the Rust library's threads "
              "and with one thread (as in each `embed_rows` DataLoader worker):", "",
              "| tokens | passages | CPUs | Rust threads rows/s | one thread rows/s |", "|---|---|---|---|---|"]
    for t in record["tokenise"]:
        lines.append(f"| {t['length']} | {t['rows']:,} | {t['cpus']} | {t['rows_per_s']['Rust threads']:,.0f} | "
                     f"{t['rows_per_s']['one thread']:,.0f} |")
    return lines


STAGE = register(Stage(
    name="forward", order=20, minutes=1.5,
    what=("the passage tower's forward alone (GPU: tiny / small / base at 64 / 256 tokens, 1024 rows): "
          "fraction of peak, with bf16 weights, device time by kernel class; host tokenisation rate"),
    run=stage_forward, render=render_forward,
    scales="time linear in the repeats and the rows per forward"))
