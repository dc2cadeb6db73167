"""Synthetic corrector experiment (seed 000, Section 5.3), the grid's driver: drift x corrector size x training
fraction -> KL(P || P_h) against the staleness KL(P || P_g') (the runs themselves: `rag_lab.analysis.synthetic`).
Writes results.json, results.md (the table) and two plots under --out-dir; `scripts/synthetic_corrector.py` is
its entry point. See docs/synthetic_corrector.md for the setup and the findings."""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rag_lab.analysis.synthetic import (
    CorrectorSpec,
    SyntheticConfig,
    aggregate,
    corrector_grid,
    grid_jobs,
    quick_config,
    run_jobs,
)
from rag_train.io import atomic_open, atomic_write_json, atomic_write_text

DEFAULT_DRIFTS = [0.25, 0.5, 1.0, 2.0]
DEFAULT_FRACTIONS = [0.01, 0.1, 0.5, 1.0]
QUICK_DRIFTS = [0.5, 2.0]
QUICK_FRACTIONS = [0.1, 1.0]
QUICK_SPECS = [CorrectorSpec(0, 0), CorrectorSpec(1, 8), CorrectorSpec(2, 16)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/generated/figures/synthetic"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--quick", action="store_true", help="small grid (2 drifts, 3 correctors, 2 fractions)")
    parser.add_argument("--drift-scales", type=float, nargs="+", default=None)
    parser.add_argument("--fractions", type=float, nargs="+", default=None)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="processes, one torch thread each")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if any(s < 0 for s in args.seeds):
        parser.error(f"--seeds must be >= 0, got {args.seeds}")
    for name in ("drift_scales", "fractions"):
        values = getattr(args, name)
        if values is not None and name == "drift_scales" and any(v < 0 for v in values):
            parser.error(f"--drift-scales must be >= 0, got {values}")
        if values is not None and name == "fractions" and any(not 0 < v <= 1 for v in values):
            parser.error(f"--fractions must be in (0, 1], got {values}")
    return args


def markdown_table(agg: dict[tuple, dict], drifts: list[float], fractions: list[float], seeds: int) -> str:
    def cell(key):
        row = agg[key]
        return f"{row['kl_after']:.4f}" + (f" ± {row['kl_after_std']:.4f}" if seeds > 1 else "")

    correctors = sorted({(k[1], k[2]) for k in agg})
    head = ["drift scale", "KL(P‖P_g') before", "corrector", "params"] + [f"after, {f:g} of targets" for f in fractions]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for drift in drifts:
        for layers, width in correctors:
            first = agg[(drift, layers, width, fractions[0])]
            lines.append("| " + " | ".join([f"{drift:g}", f"{first['kl_stale']:.4f}", first["corrector"],
                                            str(first["params"])] +
                                           [cell((drift, layers, width, f)) for f in fractions]) + " |")
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> None:
    with atomic_open(path, "wb") as handle:
        fig.savefig(handle, format="png", dpi=110, bbox_inches="tight")


def plot_kl_vs_params(agg, drifts, fractions, path: Path) -> None:
    """Paper Fig. 3 analogue: one pane per drift level, one line per training fraction and depth."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(drifts), figsize=(4.2 * len(drifts), 3.6), squeeze=False)
    colours = plt.cm.viridis([i / max(1, len(fractions) - 1) for i in range(len(fractions))])
    for ax, drift in zip(axes[0], drifts):
        stale = next(v["kl_stale"] for k, v in agg.items() if k[0] == drift)
        for colour, fraction in zip(colours, fractions):
            for layers, style in ((1, "-"), (2, "--")):
                keys = sorted((k for k in agg if k[0] == drift and k[3] == fraction and k[1] in (0, layers)),
                              key=lambda k: agg[k]["params"])
                ax.plot([agg[k]["params"] for k in keys], [agg[k]["kl_after"] for k in keys], style, marker="o",
                        ms=3, color=colour, label=f"{fraction:g} of targets" if layers == 1 else None)
        ax.axhline(stale, color="grey", ls=":", label="no corrector")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xscale="log", yscale="log", xlabel="corrector parameters |Ψ|",
               title=f"drift {drift:g}: KL(P‖P_g') = {stale:.3f}")
    axes[0][0].set_ylabel("KL(P‖P_h), held-out queries, all targets")
    axes[0][-1].legend(fontsize=7, title="solid: 1 hidden, dashed: 2 hidden", title_fontsize=7)
    _save(fig, path)
    plt.close(fig)


def plot_kl_vs_staleness(agg, fractions, path: Path) -> None:
    """Paper Fig. 4 analogue: KL after vs staleness KL, one line per corrector, one pane per fraction."""
    import matplotlib.pyplot as plt

    shown = [f for f in (0.1, 1.0) if f in fractions] or fractions[-1:]
    correctors = sorted({(k[1], k[2]) for k in agg}, key=lambda c: agg[next(k for k in agg if k[1:3] == c)]["params"])
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
    colours = plt.cm.plasma([i / max(1, len(correctors)) for i in range(len(correctors))])
    for ax, fraction in zip(axes[0], shown):
        lo, hi = float("inf"), 0.0
        for colour, (layers, width) in zip(colours, correctors):
            keys = sorted((k for k in agg if k[1:3] == (layers, width) and k[3] == fraction), key=lambda k: k[0])
            xs, ys = [agg[k]["kl_stale"] for k in keys], [agg[k]["kl_after"] for k in keys]
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
            ax.plot(xs, ys, marker="o", ms=3, color=colour,
                    label=f"{agg[keys[0]]['corrector']} ({agg[keys[0]]['params']})")
        ax.plot([lo, hi], [lo, hi], color="grey", ls=":", label="y = x (no gain)")
        ax.set(xscale="log", yscale="log", xlabel="staleness KL(P‖P_g')", ylabel="KL(P‖P_h) after training",
               title=f"trained on {fraction:g} of targets")
    axes[0][-1].legend(fontsize=7, title="corrector (params)", title_fontsize=7)
    _save(fig, path)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = quick_config() if args.quick else SyntheticConfig()
    drifts = args.drift_scales or (QUICK_DRIFTS if args.quick else DEFAULT_DRIFTS)
    fractions = args.fractions or (QUICK_FRACTIONS if args.quick else DEFAULT_FRACTIONS)
    specs = QUICK_SPECS if args.quick else corrector_grid(cfg.dim)
    jobs = grid_jobs(args.seeds, drifts, specs, fractions)

    import matplotlib

    matplotlib.use("Agg")
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = run_jobs(cfg, jobs, args.workers)
    wall = time.perf_counter() - start
    agg = aggregate(results)
    table = markdown_table(agg, drifts, fractions, len(args.seeds))
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "workers": args.workers,
               "load_before": list(load_before), "load_after": list(os.getloadavg()), "torch": torch.__version__}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out_dir / "results.json", {
        "config": asdict(cfg), "seeds": args.seeds, "drift_scales": drifts, "fractions": fractions,
        "correctors": [s.label for s in specs], "wall_seconds": wall, "machine": machine, "runs": results})
    atomic_write_text(args.out_dir / "results.md", table)
    plot_kl_vs_params(agg, drifts, fractions, args.out_dir / "kl_vs_params.png")
    plot_kl_vs_staleness(agg, fractions, args.out_dir / "kl_after_vs_staleness.png")
    print(table)
    print(f"{len(jobs)} runs in {wall:.1f} s with {args.workers} worker(s); load average before "
          f"{load_before[0]:.2f}, after {machine['load_after'][0]:.2f} on {machine['cpus']} CPUs; "
          f"outputs in {args.out_dir}")
