"""The report's figures (docs/generated/figures/reproduction/*.png): mean over seeds with min-max whiskers or bands."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from rag_lab.experiments import recall, retrieval_curve, seed_mean_curve
from rag_lab.reproduction.metrics import DATASET_LABELS, DATASETS, em_curve, mean_of
from rag_lab.reproduction.plan import INIT_LABELS, INITS

COLORS = {"in_batch": "tab:gray", "stale": "tab:blue", "corrector": "tab:red", "exhaustive": "tab:green",
          "snm": "tab:purple", "negative_cache": "tab:brown", "closed_book": "tab:gray", "frozen": "tab:blue"}


def _axes(ncols: int, width: float = 4.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 3.6), squeeze=False)
    return plt, fig, axes[0]


def _save(plt, fig, path: Path) -> str:
    from rag_train.io import atomic_open

    fig.tight_layout()
    try:
        with atomic_open(path, "wb") as handle:  # a full disk or read-only folder: StorageError naming the file
            fig.savefig(handle, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path.name


def _bars(ax, groups: list[str], series: dict[str, list[list[float]]], ylabel: str) -> None:
    """Grouped bars: x = groups, one bar per series, mean with min-max whiskers over seeds."""
    width = 0.8 / max(1, len(series))
    for i, (name, per_group) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        means = [statistics.mean(v) if v else 0.0 for v in per_group]
        err = [[m - min(v) if v else 0 for m, v in zip(means, per_group)],
               [max(v) - m if v else 0 for m, v in zip(means, per_group)]]
        ax.bar(xs, means, width, yerr=err, capsize=2, label=name, color=COLORS.get(name))
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)


def plot_table1(table1: dict, path: Path) -> Optional[str]:
    inits = [i for i in INITS if any(table1.get(i, {}).values())]
    if not inits:
        return None
    plt, fig, axes = _axes(len(inits))
    for ax, init in zip(axes, inits):
        rows = {s: r for s, r in table1[init].items() if r}
        ks = ["1", "5", "20"]
        _bars(ax, [f"R@{k}" for k in ks], {s: [[100 * recall(m, k) for m in r] for k in ks] for s, r in rows.items()},
              "recall (%)")
        low = min(100 * recall(m, "1") for r in rows.values() for m in r)
        ax.set_ylim(max(0, low - 10), 100.5)
        ax.set_title(INIT_LABELS[init], fontsize=9)
    axes[0].legend(fontsize=7)
    return _save(plt, fig, path)


def plot_table3(table3: dict, path: Path) -> Optional[str]:
    rows = {s: r for s, r in table3.items() if r}
    if not rows:
        return None
    plt, fig, axes = _axes(1, 6.5)
    _bars(axes[0], [DATASET_LABELS[d] for d in DATASETS],
          {s: [[100 * m["em"][d] for m in r] for d in DATASETS] for s, r in rows.items()}, "exact match (%)")
    axes[0].legend(fontsize=7)
    axes[0].set_title("Algorithm 2 on the toy world (dev EM)", fontsize=9)
    return _save(plt, fig, path)


def _curve_panel(ax, runs_by_strategy: dict[str, list[dict]], curve, ylabel: str, title: str) -> None:
    for strategy, runs in runs_by_strategy.items():
        if not runs:
            continue
        steps, mean, low, high = seed_mean_curve(runs, curve)
        ax.plot(steps, [100 * v for v in mean], marker="o", ms=3, label=f"{strategy} ({len(runs)} seeds)",
                color=COLORS.get(strategy))
        if len(runs) > 1:
            ax.fill_between(steps, [100 * v for v in low], [100 * v for v in high], alpha=0.2,
                            color=COLORS.get(strategy))
    ax.set(xlabel="training step", ylabel=ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def plot_curves(table1: dict, table3: dict, path: Path, strategies: tuple[str, ...],
                rlm_strategies: tuple[str, ...]) -> Optional[str]:
    """R@1 over steps of Table 1's `strategies`, one panel per init, and mean EM of Table 3's `rlm_strategies`."""
    panels = [(f"R@1, {INIT_LABELS[i]}", {s: table1[i][s] for s in strategies}, retrieval_curve, "R@1 (%)")
              for i in INITS if any(table1.get(i, {}).get(s) for s in strategies)]
    if any(table3.get(s) for s in rlm_strategies):
        panels.append(("RLM: EM, mean of the 3 datasets", {s: table3[s] for s in rlm_strategies}, em_curve,
                       "EM (%)"))
    if not panels:
        return None
    plt, fig, axes = _axes(len(panels))
    for ax, (title, runs, curve, ylabel) in zip(axes, panels):
        _curve_panel(ax, runs, curve, ylabel, title)
    return _save(plt, fig, path)


def plot_ablation(ablation: dict, references: dict, path: Path) -> Optional[str]:
    rows = {h: r for h, r in sorted(ablation.items()) if r}
    if not rows:
        return None
    plt, fig, axes = _axes(2)
    sizes = list(rows)
    for ax, (label, value) in zip(axes, [("steps/s (training only)", lambda m: m.get("steps_per_second")),
                                         ("R@1 (%)", lambda m: 100 * recall(m, "1"))]):
        means = [mean_of([value(m) for m in rows[h]]) for h in sizes]
        ax.plot(sizes, means, marker="o", color=COLORS["corrector"], label="corrector")
        for name, runs in references.items():
            ref = mean_of([value(m) for m in runs])
            if ref is not None:
                ax.axhline(ref, ls="--", color=COLORS.get(name), label=name)
        ax.set(xscale="log", xlabel="corrector hidden units", ylabel=label)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    axes[0].set_title("corrector size ablation (random init)", fontsize=9)
    return _save(plt, fig, path)


def figure_lines(name: Optional[str], alt: str) -> list[str]:
    """The report's lines for a figure a plot_* function returned (its file name, or None: nothing to plot)."""
    return [f"![{alt}](figures/reproduction/{name})", ""] if name else ["_(no finished runs to plot)_", ""]
