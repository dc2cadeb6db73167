"""The `search` stage: exact and corrector-full search of a buffer held on the device, corrector-full unfused and
fused (`search(fused=True)`) side by side (rag_lab/bench/search.py)."""

from __future__ import annotations

from rag_lab.bench.gpu_report.common import Context, Stage, StageCheckError, fraction_goal, register

SEARCH_GPU = ["--rows", "28000000", "--dim", "768", "--hidden", "8192", "--batch", "64", "--k", "32", "--chunk",
              "262144", "--dtype", "bf16", "--repeats", "3", "--seed", "0"]
SEARCH_QUICK = ["--rows", "4096", "--dim", "16", "--hidden", "32", "--batch", "4", "--k", "5", "--chunk", "1000",
                "--dtype", "fp32", "--repeats", "1", "--seed", "0"]


def stage_search(ctx: Context) -> dict:
    from rag_lab.bench import search as bench_search

    argv = (SEARCH_QUICK if ctx.quick else SEARCH_GPU) + ["--device", ctx.device.type]
    args = bench_search.parse_args(argv)
    figures = bench_search.device_part(args)
    least = 0.999 if args.dtype == "fp32" else 0.95
    for mode in ("exact", "corrector_full"):
        if figures[mode]["same_ids_as_plain"] < least:
            raise StageCheckError(f"search {mode}: top-{args.k} shares only {figures[mode]['same_ids_as_plain']:.4f} "
                                  "of its ids with the plain torch reference")
    if figures["corrector_fused"]["same_ids_as_unfused"] < least:
        raise StageCheckError(f"search corrector_full fused: top-{args.k} shares only "
                              f"{figures['corrector_fused']['same_ids_as_unfused']:.4f} of its ids with the unfused "
                              "search")
    settings = {k: getattr(args, k) for k in ("rows", "dim", "hidden", "batch", "k", "chunk", "dtype", "repeats",
                                              "seed")}
    goals = [fraction_goal("corrector-full search >= 0.8 of the bf16 GEMM peak",
                           figures["corrector_full"]["fraction_of_peak"], 0.8, ctx.device),
             fraction_goal("fused corrector-full search >= 0.8 of the bf16 GEMM peak",
                           figures["corrector_fused"]["fraction_of_peak"], 0.8, ctx.device)]
    return {"gemm_peak_flops": figures["gemm_tflops"] * 1e12,
            "gemm_peak_how": f"{args.dtype} {8192 if ctx.device.type == 'cuda' else 2048}^3 torch.mm",
            "settings": settings, "results": figures, "goals": goals}


def render_search(record: dict) -> list[str]:
    s, f = record["settings"], record["results"]
    e, c, u = f["exact"], f["corrector_full"], f.get("corrector_fused")
    lines = [f"Buffer {s['rows']:,} x {s['dim']} {s['dtype']} on the device ({f['buffer_gib']:.2f} GiB, L2-normalised "
             f"random rows), {s['batch']} queries, k = {s['k']}, corrector hidden {s['hidden']}, chunk {s['chunk']:,} "
             f"rows; best of {s['repeats']} (rag_lab/bench/search.py `device_part`). Copy bandwidth (read + "
             f"written) {f['copy_gbs']:.0f} GB/s.", "",
             "| search | ours | plain torch | ratio | same ids as plain | rate | extra memory ours / plain |",
             "|---|---|---|---|---|---|---|",
             f"| exact `<q, B>` | {1e3 * e['seconds']:.1f} ms | {1e3 * e['plain_seconds']:.1f} ms (`topk(q @ B^T)`) | "
             f"{e['seconds'] / e['plain_seconds']:.2f} | {e['same_ids_as_plain']:.4f} | reads {e['read_gbs']:.0f} GB/s "
             f"= {e['fraction_of_copy_bandwidth']:.2f} of copy bandwidth | {e['extra_gib']:.2f} / "
             f"{e['plain_extra_gib']:.2f} GiB |",
             f"| corrector-full `<q, h(B)>` | {1e3 * c['seconds']:.1f} ms | {1e3 * c['plain_seconds']:.1f} ms (h(B) "
             f"chunks) | {c['seconds'] / c['plain_seconds']:.2f} | {c['same_ids_as_plain']:.4f} | {c['tflops']:.3f} "
             f"TFLOP/s = **{c['fraction_of_peak']:.2f} of peak** | {c['extra_gib']:.2f} / {c['plain_extra_gib']:.2f} "
             "GiB |"]
    if u is None:
        lines += ["", "The fused corrector-full search (`fused=True`) was not part of the stage when this ran."]
    else:
        lines += [f"| corrector-full fused (`fused=True`) | {1e3 * u['seconds']:.1f} ms | {1e3 * c['seconds']:.1f} ms "
                  f"(ours, unfused) | {u['seconds'] / c['seconds']:.2f} | {u['same_ids_as_unfused']:.4f} (identical "
                  f"rows {u['identical_rows_as_unfused']:.4f}) | {u['tflops']:.3f} TFLOP/s = "
                  f"**{u['fraction_of_peak']:.2f} of peak** | {u['extra_gib']:.2f} / {c['extra_gib']:.2f} GiB |", "",
                  f"The fused search's first call took {u['compile_seconds']:.1f} s (it compiles the chunk function; "
                  "max-autotune on CUDA), not counted above."]
    lines += ["", "Corrector-full unfused, per kernel (one chunk timed alone x chunks; share of the search):", "",
              "| kernel | ms | share |", "|---|---|---|"]
    for name, seconds in f["corrector_breakdown_seconds"].items():
        lines.append(f"| {name} | {1e3 * seconds:.1f} | {100 * seconds / c['seconds']:.0f}% |")
    return lines


STAGE = register(Stage(
    name="search", order=30, minutes=2,
    what=("exact and corrector-full search of a buffer held on the device (GPU: 28M x 768 bf16)"),
    run=stage_search, render=render_search,
    scales="time linear in the buffer rows; the buffer takes rows x 768 x 2 bytes"))
